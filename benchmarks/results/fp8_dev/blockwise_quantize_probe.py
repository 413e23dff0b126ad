"""Blockwise quantize candidates (development probe): every candidate of `kernel.quantize_blockwise` (its private
keywords) x num_warps at the benchmark's shapes, amortized over distinct inputs (`bench_amortized`), in GB/s of HBM
traffic (read x bf16, write q (+ q^T) and the fp32 scales, as bench_fp8's blockwise_quantize section counts it) and
% of the HBM ceiling measured in the same process. Each candidate's outputs are checked bit for bit against the
current kernel's (no keywords) once per shape and case, on data with +-inf, NaN and values near the fp32 max.

    python -m benchmarks.results.fp8_dev.blockwise_quantize_probe OUT_DIR

Candidates (combinations of `quantize_blockwise`'s private keywords):
  narrow   the tile stays bf16 in registers until the cast (abs, compare and max are exact in bf16)
  chunkN   the tile N rows at a time, unrolled: q cast per chunk, column amax accumulated, q^T from a second read
  loopN    the same chunks in a loop: one chunk's registers (more programs per SM)
  packed   q^T's codes packed four to a uint32 (x viewed as (R/4, 4C)): the transpose moves words, not bytes
  hwsat    no clamp before the cast: Triton's cvt.rn.satfinite saturates (+-inf -> +-max, NaN stays NaN)
  intmax   the amax over uint32 keys (one integer multiply-add per element for abs, the finite test and select)
"""

import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import Ceilings, bench_amortized, probe_recorder, rnd
from pallas_fused.fp8 import kernel

E4 = jnp.float8_e4m3fn
ACT, WEIGHT = (1, 128), (128, 128)
OUT = sys.argv[1]
os.makedirs(OUT, exist_ok=True)
BUDGET_S = 225  # the probe stays under 4 minutes: what is left past this is recorded as skipped
record = probe_recorder(os.path.join(OUT, "blockwise_quantize_probe.json"))

H, IH = dict(_hwsat=True), dict(_intmax=True, _hwsat=True)
ROW_CANDIDATES = {  # q alone and weights (packed is the two-copy activation pass only)
    "current": {}, "hwsat": H, "intmax+hwsat": IH, "loop32+intmax+hwsat": dict(IH, _chunk=32, _loop=True),
    "loop64+intmax+hwsat": dict(IH, _chunk=64, _loop=True)}
ACT_CANDIDATES = {
    "current": {}, "narrow": dict(_narrow=True), "chunk64+narrow": dict(_chunk=64, _narrow=True), "hwsat": H,
    "intmax+hwsat": IH, "intmax+hwsat+narrow": dict(IH, _narrow=True),
    "loop16+intmax+hwsat": dict(IH, _chunk=16, _loop=True), "loop32+intmax+hwsat": dict(IH, _chunk=32, _loop=True),
    "loop64+intmax+hwsat": dict(IH, _chunk=64, _loop=True), "packed+intmax+hwsat": dict(IH, _packed=True),
    "packed+chunk32+intmax+hwsat": dict(IH, _packed=True, _chunk=32),
    "packed+loop32+intmax+hwsat": dict(IH, _packed=True, _chunk=32, _loop=True),
    "packed+loop64+intmax+hwsat": dict(IH, _packed=True, _chunk=64, _loop=True)}


def check_input(shape):
    """Random normal, magnitudes 2^-6 .. 2^6 by row and column (every block its own scale), with specials."""
    r, c = shape
    k1, k2 = jax.random.split(jax.random.key(7))
    mag = jnp.exp2(jax.random.randint(k1, (r, 1), -6, 7) + jax.random.randint(k2, (1, c), -6, 7) // 2)
    x = rnd(8, shape, jnp.float32, 3.0) * mag
    x = x.at[7, 9].set(jnp.inf).at[300, 10].set(-jnp.inf).at[8, 700].set(jnp.nan).at[1000, 3].set(3e38)
    return x.astype(jnp.bfloat16)


def bits(outs):
    return [None if o is None else np.asarray(jax.lax.bitcast_convert_type(o, jnp.uint8) if o.dtype == E4 else o)
            for o in outs]


def main():
    t_start = time.perf_counter()
    ceil = Ceilings.measure()
    hbm = ceil.hbm_gbps
    record(what="ceiling", hbm_gbps=round(hbm), device=jax.devices()[0].device_kind)
    shapes = [(16384, 2048), (16384, 8192)]
    data = {}
    for r, c in shapes:
        # two distinct inputs (at 64 MiB each, together past the 50 MB L2): each candidate compiles its kernel once
        # per call in the amortizing jit, and the probe has to stay under 4 minutes
        data[r, c] = [(rnd(6 + i, (r, c), jnp.bfloat16),) for i in range(2)], check_input((r, c))
    cases = (("act q+qT", ACT, ACT[::-1], lambda r, c: r * c * 2 + 4 * (r * -(-c // 128) + c * -(-r // 128)),
              ACT_CANDIDATES),
             ("act q", ACT, None, lambda r, c: r * c + 4 * r * -(-c // 128), ROW_CANDIDATES),
             ("weight q+qT", WEIGHT, WEIGHT, lambda r, c: 2 * r * c + 4 * -(-r // 128) * -(-c // 128), ROW_CANDIDATES))
    for name, block_n, block_t, written, candidates in cases:  # the two-copy activation pass first: the target
        for r, c in shapes:
            xs, xc = data[r, c]
            nbytes = r * c * 2 + written(r, c)
            fn = functools.partial(kernel.quantize_blockwise, dtype=E4, block_n=block_n, block_t=block_t)
            want = bits(jax.jit(fn)(xc))
            for cand, kw in candidates.items():
                try:
                    got = bits(jax.jit(functools.partial(fn, **kw))(xc))
                except Exception as e:  # noqa: BLE001 - a candidate that fails to compile is a result
                    record(shape=f"{r}x{c}", case=name, cand=cand, error=str(e)[:300])
                    continue
                exact = all((g is None and w is None) or np.array_equal(g, w) for g, w in zip(got, want))
                for warps in ((4, 8, 16) if name == "weight q+qT" and cand == "current" else (4, 8)):
                    if time.perf_counter() - t_start > BUDGET_S:
                        record(shape=f"{r}x{c}", case=name, cand=cand, warps=warps, skipped="time budget")
                        continue
                    ms = bench_amortized(functools.partial(fn, num_warps=warps, **kw), xs, n=20, reps=5)
                    gbps = nbytes / ms / 1e6
                    record(shape=f"{r}x{c}", case=name, cand=cand, warps=warps, ms=round(ms, 4), gbps=round(gbps),
                           pct_hbm=round(100 * gbps / hbm, 1), bit_exact=exact)
    record(what="done", seconds=round(time.perf_counter() - t_start))


if __name__ == "__main__":
    main()
