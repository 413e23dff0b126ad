"""Blockwise FP8 on Hopper (dev diagnostic): where the Dense layer's kernels part from implementation="xla".

Compares, at 2048 x 1024 -> 768 bf16: the quantize kernel against the reference (codes, scales) for activations
(1 x 128 / 128 x 1) and weights (128 x 128), then the layer's three GEMMs with operands from either quantizer
and either GEMM, against all-XLA. QIMPL=interpret runs it on a CPU.

Found with it: all-XLA computed with unrounded operands (XLA folded the cast to fp8 and the cast back), so each
mix sat at ~29 dB from it; `reference.dequantize` now keeps the rounding.
"""
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from pallas_fused.fp8 import api
from pallas_fused.fp8.config import Float8Config

E4 = jnp.float8_e4m3fn
QIMPL = os.environ.get("QIMPL", "pallas")


def sqnr(out, exact):
    out, exact = out.astype(jnp.float32), exact.astype(jnp.float32)
    return float(10 * jnp.log10(jnp.sum(exact ** 2) / jnp.sum((out - exact) ** 2)))


def compare(name, a, b):
    a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
    print(f"{name}: shapes {a.shape} {b.shape}; differ {np.mean(a32 != b32):.3g}; "
          f"max|d| {np.nanmax(np.abs(a32 - b32)):.3g}")


def layer(x, w, dy, qimpl, gimpl):
    cfg = Float8Config.from_recipe("blockwise")
    x_n, x_t = api._operands(x, cfg.cast_config_input, cfg.cast_config_input_for_grad_weight, False, qimpl)
    w_t, w_n = api._operands_w(w, cfg, False, qimpl)
    dy_n, dy_t = api._operands(dy, cfg.cast_config_grad_output, cfg.cast_config_grad_output_for_grad_weight,
                               False, qimpl)
    return tuple(api._gemm(a, b, True, gimpl, x.dtype, x.dtype) for a, b in ((x_n, w_t), (dy_n, w_n), (x_t, dy_t)))


x = jax.random.normal(jax.random.key(30), (2048, 1024), jnp.bfloat16)
w = jax.random.normal(jax.random.key(31), (1024, 768), jnp.bfloat16)
dy = jax.random.normal(jax.random.key(32), (2048, 768), jnp.bfloat16)

for name, arr, blocks in (("x", x, ((1, 128), (128, 1))), ("w", w, ((128, 128), (128, 128)))):
    got, want = (jax.jit(functools.partial(api._quantize_blockwise, block_n=blocks[0], block_t=blocks[1], dtype=E4,
                                           pow2=False, impl=impl))(arr) for impl in (QIMPL, "xla"))
    for part, g, f in zip(("q", "s", "qt", "st"), got, want):
        compare(f"{name}.{part}", g, f)

base = jax.jit(functools.partial(layer, qimpl="xla", gimpl="xla"))(x, w, dy)
for qimpl, gimpl in ((QIMPL, "pallas"), (QIMPL, "xla"), ("xla", "pallas")):
    out = jax.jit(functools.partial(layer, qimpl=qimpl, gimpl=gimpl))(x, w, dy)
    print(f"quantize={qimpl} gemm={gimpl}: y/dx/dw sqnr vs xla/xla", [round(sqnr(o, b), 1) for o, b in zip(out, base)])
