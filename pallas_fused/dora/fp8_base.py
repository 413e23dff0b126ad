"""LoRA and DoRA over a frozen FP8 base (`Fp8Kernel`): the base product ``x W8`` and its input gradient run as FP8
GEMMs (`pallas_fused.fp8.frozen_fp8_matmul`), the adapters stay in the compute dtype.

    LoRA:  y = x W8 + s (x A) B + bias
    DoRA:  y = (x W8 + s (x A) B) * m / ||W8 + s A B|| + bias

W8 is the dequantized weight the GEMM multiplies by (codes times scales), so the column norm is taken from the
weight the product uses and merging (W8 + s A B, scaled for DoRA) reproduces the adapted layer up to the FP8
rounding of x and dy alone. The small ops around the frozen GEMM are plain jnp (XLA fuses them); the adapters'
gradients are jax's through them, the math of `lora_dense` and of `dora_dense_reference` (the norm a constant in
the backward unless `exact_norm_grad`).
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_fused.dora.api import _check
from pallas_fused.dora.reference import _scale_of
from pallas_fused.fp8.frozen import frozen_fp8_matmul


def _adapted(x, w8, lora_a, lora_b, scale, implementation):
    """z = x W8 + s (x A) B in float32: the FP8 base product plus the low-rank term (x A rounded once to x's dtype,
    s folded into B, as `lora_dense` does). The base product is written in x's dtype: its rounding there (2^-9
    relative in bf16) is far below x's e4m3 rounding (2^-4), and a float32 product would write and read twice the
    bytes of the largest array of the layer."""
    dt = x.dtype
    base = frozen_fp8_matmul(x, w8, implementation=implementation).astype(jnp.float32)
    sb = (lora_b.astype(jnp.float32) * scale).astype(dt)
    return base + jnp.dot(jnp.dot(x, lora_a.astype(dt)), sb, preferred_element_type=jnp.float32)


def _finish(z, bias, dt):
    return (z if bias is None else z + bias.astype(jnp.float32)).astype(dt)


def lora_fp8_dense(x, w8, lora_a, lora_b, bias=None, *, scale, implementation: str | None = None):
    """LoRA over an FP8 base: ``y = x W8 + s (x A) B + bias``, W8 an `Fp8Kernel` (frozen: zero cotangents).

    x: (..., in), the compute dtype. lora_a: A (in, rank); lora_b: B (rank, out); bias: (out,) or None.
    implementation: the FP8 GEMMs' (`frozen_fp8_matmul`): None, "xla", "pallas", "pallas:sm90", "pallas:triton",
    "interpret"."""
    _check(x, w8, lora_a, lora_b, None, bias, scale, op="lora_fp8_dense", fp8_base=True)
    return _finish(_adapted(x, w8, lora_a, lora_b, scale, implementation), bias, x.dtype)


def dora_fp8_dense(x, w8, lora_a, lora_b, magnitude, bias=None, *, scale, exact_norm_grad: bool = False,
                   implementation: str | None = None):
    """DoRA over an FP8 base: ``y = (x W8 + s (x A) B) * m / ||W8 + s A B|| + bias``, the norm per output feature
    over the input axis of the dequantized W8 (in x's dtype, as `dora_dense_reference` forms it), floored as
    DoRA's; W8 an `Fp8Kernel` (frozen). Arguments as `lora_fp8_dense`'s, plus magnitude m (out,) and
    exact_norm_grad (differentiate through the norm; default: a constant, as peft)."""
    _check(x, w8, lora_a, lora_b, magnitude, bias, scale, op="dora_fp8_dense", fp8_base=True)
    g = _scale_of(x, w8, lora_a, lora_b, magnitude, scale, exact_norm_grad)
    return _finish(_adapted(x, w8, lora_a, lora_b, scale, implementation) * g, bias, x.dtype)
