"""Backs docs/fp8.md's Hopper quantize kernel sweep (fp8_dev/2026-11-26h/i_h200_sm90_quantize_*.json).

Blockwise quantize, both copies, of activations (1 x 128 blocks) or weights (128 x 128 tiles) (development
probe): the sm90 Mosaic GPU kernel (`kernel_sm90_quantize.quantize_blockwise_sm90`) over a sweep of its launch knobs
against the Triton kernel (`kernel.quantize_blockwise` with the same blocks, at its tuned launch), at 16384x8192 and
16384x2048 bf16. Each launch is first checked bit for bit against the Triton kernel's outputs (each row says whether
it is exact, and how many elements of q, q_scales, q^T, qt_scales differ); times are amortized over distinct inputs
(`bench_amortized`), in GB/s of HBM traffic (read x, write q, q^T and the fp32 scales, as blockwise_quantize_probe
counts "both"; a weight's one scale per tile) and % of the HBM ceiling measured in the same process and of the
H200's 4039 GB/s.

    python -m benchmarks.probes.sm90_quantize_probe OUT_DIR [act,weight]
"""

import functools
import os
import sys
import time

import jax
import jax.numpy as jnp

from benchmarks.common import Ceilings, bench_amortized, error_text, probe_recorder, rnd
from pallas_fused.fp8 import kernel
from pallas_fused.fp8 import kernel_sm90_quantize as sm90

E4 = jnp.float8_e4m3fn
H200_CEILING = 4039  # GB/s, the H200's measured copy ceiling
C = sm90.QuantizeConfig
CONFIGS = (  # (steps, stages, out_slots, chunk, key_amax); shared memory sets the programs per SM (sm90.smem_bytes)
    C(1, 1, 1, 64, False), C(1, 1, 1, 128, False), C(1, 1, 1, 64, True),  # a plain grid: 3 programs per SM
    C(4, 1, 1, 64, False), C(8, 2, 1, 64, False), C(16, 2, 1, 64, False), C(32, 2, 1, 64, False),  # 2 per SM
    C(8, 2, 1, 128, False), C(8, 2, 1, 64, True), C(16, 2, 1, 64, True),
    C(8, 3, 1, 64, False), C(16, 4, 1, 64, False), C(16, 2, 2, 64, False),  # 1 per SM, deeper rings
    C(32, 3, 2, 64, False),
)
WEIGHT_CONFIGS = (  # a weight tile's amax comes before its cast, one tile at a time: fewer knobs matter
    C(1, 1, 1, 64, True), C(1, 1, 1, 128, True), C(1, 1, 1, 64, False), C(1, 1, 1, 128, False),
    C(4, 2, 1, 64, True), C(8, 2, 1, 128, True),
)


def _bits(a):
    return jax.lax.bitcast_convert_type(a, jnp.uint8) if a.dtype.itemsize == 1 else a


def probe_shape(record, r, c, hbm, square):
    # elements that differ from the Triton kernel's (NaN codes compare as bits)
    differ = jax.jit(lambda a, b: jnp.sum(_bits(a) != _bits(b)))
    # distinct inputs that together pass the 50 MB L2
    xs = [(rnd(6 + i, (r, c), jnp.bfloat16),) for i in range(2 if c > 4096 else 4)]
    scales = (r // 128) * (c // 128) if square else r * (c // 128) + c * (r // 128)
    moved = r * c * 2 + r * c * 2 + 4 * scales
    mode = "weight" if square else "act"
    blocks = ((128, 128), (128, 128)) if square else ((1, 128), (128, 1))

    def row(impl, ms, **launch):
        gbps = moved / ms / 1e6
        record(shape=f"{r}x{c}", mode=mode, impl=impl, **launch, ms=round(ms, 4), gbps=round(gbps),
               pct_hbm=round(100 * gbps / hbm, 1), pct_h200=round(100 * gbps / H200_CEILING, 1))

    triton = functools.partial(kernel.quantize_blockwise, dtype=E4, block_n=blocks[0], block_t=blocks[1])
    want = jax.block_until_ready(triton(*xs[0]))
    tile, warps, chunk, packed = kernel._blockwise_launch(r, *blocks)
    row("triton", bench_amortized(triton, xs), tile=list(tile), num_warps=warps, rows=chunk, packed=packed)
    for config in WEIGHT_CONFIGS if square else CONFIGS:
        launch = dict(steps=config.steps, stages=config.stages, out_slots=config.out_slots, chunk=config.chunk,
                      key_amax=config.key_amax, smem_kib=sm90.smem_bytes(config) // 1024)
        fn = functools.partial(sm90.quantize_blockwise_sm90, dtype=E4, config=config, square=square)
        try:
            # q, q_scales, qt, qt_scales; timed even where they differ, which the row then says
            differing = [int(differ(g, w)) for g, w in zip(fn(*xs[0]), want)]
            row("sm90", bench_amortized(fn, xs), **launch, exact=not any(differing), differing=differing)
        except Exception as e:  # noqa: BLE001 - a launch that fails to compile is a result too
            record(shape=f"{r}x{c}", mode=mode, impl="sm90", **launch, error=error_text(e))


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    record = probe_recorder(os.path.join(out, "sm90_quantize_probe.json"))
    t_start = time.perf_counter()
    hbm = Ceilings.measure(quick=True).hbm_gbps
    record(what="ceiling", hbm_gbps=round(hbm), device=jax.devices()[0].device_kind, jax=jax.__version__)
    modes = (sys.argv[2] if len(sys.argv) > 2 else "act,weight").split(",")
    for mode in modes:
        for r, c in ((16384, 8192), (16384, 2048)):
            probe_shape(record, r, c, hbm, square=mode == "weight")
    record(what="done", seconds=round(time.perf_counter() - t_start))


if __name__ == "__main__":
    main()
