"""Backs docs/performance.md: scaled_matmul_nt and the benchmark's direct FP8 row take the same GPU time.

Development probe: `scaled_matmul_nt` from `quantize` outputs (the user's call) against the Hopper kernel fed the
same fp8 operands with pre-broadcast scale vectors (the benchmark's pallas:sm90 row), at one shape: GPU kernels per
call from a trace, and each program's optimized HLO written to OUT_DIR.

    python benchmarks/probes/fp8_user_path_probe.py OUT_DIR [MxKxN ...]
"""

import functools
import os
import sys

import jax
import jax.numpy as jnp

from benchmarks.common import probe_recorder, rnd
from benchmarks.trace import trace_kernels
from pallas_fused.fp8 import api, quantize, scaled_matmul_nt

OUT = sys.argv[1]
os.makedirs(OUT, exist_ok=True)
record = probe_recorder(f"{OUT}/fp8_user_path_probe.json")
E4 = jnp.float8_e4m3fn
for spec in sys.argv[2:] or ["16384x2048x2048", "16384x2048x5504"]:
    m, k, n = (int(d) for d in spec.split("x"))
    a, wt = rnd(1, (m, k), jnp.bfloat16), rnd(2, (n, k), jnp.bfloat16)
    for gran, axis in (("rowwise", -1), ("tensorwise", None)):
        a8, sa = quantize(a, E4, axis)
        bt8, sb = quantize(wt, E4, axis)
        vec = (a8, bt8, jnp.broadcast_to(sa.reshape(-1), (m,)), jnp.broadcast_to(sb.reshape(-1), (n,)))
        sm90 = functools.partial(api._mm_nt, out_dtype=jnp.bfloat16, fast_accum=True, impl="pallas:sm90")
        for name, fn, args in (("user", scaled_matmul_nt, (a8, bt8, sa, sb)), ("sm90", sm90, vec)):
            f = jax.jit(fn)
            with open(f"{OUT}/{spec}_{gran}_{name}.hlo.txt", "w") as fh:
                fh.write(f.lower(*args).compile().as_text())
            jax.block_until_ready(f(*args))
            with trace_kernels() as kt:
                for _ in range(20):
                    out = f(*args)
                jax.block_until_ready(out)
            record(case=f"{spec} {gran}", impl=name, kernel_us_per_call=round(kt.total_us / 20, 2),
                   top=[(nm, round(us / 20, 2), c // 20) for nm, us, c in kt.top(6)])
