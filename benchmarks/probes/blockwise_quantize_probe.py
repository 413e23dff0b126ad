"""Backs docs/fp8.md's blockwise quantize launch numbers (fp8_dev/2026-11-26_h200_blockwise_quantize_probe.json).

Blockwise quantize (development probe): `kernel.quantize_blockwise` at its tuned launch per mode (both activation
copies, q alone, a weight's square tiles) at the benchmark's shapes, amortized over distinct inputs
(`bench_amortized`), in GB/s of HBM traffic (read x bf16, write q (+ q^T) and the fp32 scales, as bench_fp8's
blockwise_quantize section counts it) and % of the HBM ceiling measured in the same process. Each row names the
launch it timed (the tuning table's "fp8_blockwise" entry for this GPU).

    python -m benchmarks.probes.blockwise_quantize_probe OUT_DIR
"""

import functools
import os
import sys
import time

import jax
import jax.numpy as jnp

from benchmarks.common import Ceilings, bench_amortized, probe_recorder, rnd
from pallas_fused.fp8 import kernel

E4 = jnp.float8_e4m3fn
ACT, WEIGHT = (1, 128), (128, 128)
MODES = (  # (mode, block_n, block_t, bytes written for an (r, c) x)
    ("both", ACT, ACT[::-1], lambda r, c: r * c * 2 + 4 * (r * -(-c // 128) + c * -(-r // 128))),
    ("one", ACT, None, lambda r, c: r * c + 4 * r * -(-c // 128)),
    ("square", WEIGHT, WEIGHT, lambda r, c: 2 * r * c + 4 * -(-r // 128) * -(-c // 128)))


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    record = probe_recorder(os.path.join(out, "blockwise_quantize_probe.json"))
    t_start = time.perf_counter()
    hbm = Ceilings.measure().hbm_gbps
    record(what="ceiling", hbm_gbps=round(hbm), device=jax.devices()[0].device_kind)
    for r, c in ((16384, 2048), (16384, 8192)):
        # two distinct inputs (64 MiB each at 16384x2048: together past the 50 MB L2)
        xs = [(rnd(6 + i, (r, c), jnp.bfloat16),) for i in range(2)]
        for mode, block_n, block_t, written in MODES:
            tile, warps, chunk, packed = kernel._blockwise_launch(r, block_n, block_t)
            fn = functools.partial(kernel.quantize_blockwise, dtype=E4, block_n=block_n, block_t=block_t)
            ms = bench_amortized(fn, xs, n=20, reps=5)
            gbps = (r * c * 2 + written(r, c)) / ms / 1e6
            record(shape=f"{r}x{c}", mode=mode, tile=list(tile), num_warps=warps, rows=chunk, packed=packed,
                   ms=round(ms, 4), gbps=round(gbps), pct_hbm=round(100 * gbps / hbm, 1))
    record(what="done", seconds=round(time.perf_counter() - t_start))


if __name__ == "__main__":
    main()
