"""Blockwise quantize kernel (dev sweep): num_warps per program at the benchmark's shapes, GB/s of HBM traffic
(read x, write q (+ q^T) and the fp32 scales), as bench_fp8's blockwise_quantize section counts it."""
import functools

import jax
import jax.numpy as jnp

from benchmarks.common import bench, rnd
from pallas_fused.fp8 import kernel

E4 = jnp.float8_e4m3fn
act, weight = (1, 128), (128, 128)
for r, c in ((16384, 2048), (16384, 8192)):
    x = rnd(6, (r, c), jnp.bfloat16)
    for name, block_n, block_t, written in (
            ("act q+qT", act, act[::-1], r * c * 2 + 4 * (r * -(-c // 128) + c * -(-r // 128))),
            ("act q", act, None, r * c + 4 * r * -(-c // 128)),
            ("weight q+qT", weight, weight, 2 * r * c + 4 * -(-r // 128) * -(-c // 128))):
        nbytes = r * c * 2 + written
        for warps in (2, 4, 8, 16):
            fn = jax.jit(functools.partial(kernel.quantize_blockwise, dtype=E4, block_n=block_n, block_t=block_t,
                                           num_warps=warps))
            ms = bench(fn, x, n=30, reps=3)
            print(f"{r}x{c} {name:12s} num_warps={warps:2d} {ms:.4f} ms {nbytes / ms / 1e6:7.0f} GB/s", flush=True)
