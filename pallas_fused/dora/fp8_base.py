"""LoRA and DoRA over a frozen FP8 base (`Fp8Kernel`): the base product ``x W8`` and its input gradient run as FP8
GEMMs (`pallas_fused.fp8.frozen_fp8_matmul`), the adapters stay in the compute dtype.

    LoRA:  y = x W8 + s (x A) B + bias
    DoRA:  y = (x W8 + s (x A) B) * m / ||W8 + s A B|| + bias

W8 is the dequantized weight the GEMM multiplies by (codes times scales), so the column norm is taken from the
weight the product uses and merging (W8 + s A B, scaled for DoRA) reproduces the adapted layer up to the FP8
rounding of x and dy alone. The norm is expanded so that neither W8 nor A B (in x out each) is ever formed
(`fp8_column_sumsq`). The small ops around the frozen GEMM are plain jnp (XLA fuses them); the adapters' gradients
are the math of `lora_dense` and of `dora_dense_reference` (the norm a constant in the backward unless
`exact_norm_grad`), with two vjps of their own so that the backward keeps no more than the forward had to write:
the column norm's (no in x out array) and DoRA's column scaling's (z in the compute dtype, not float32).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_fused.dora.api import _check
from pallas_fused.dora.reference import floored_norm
from pallas_fused.fp8.frozen import frozen_fp8_matmul

F32, HIGHEST = jnp.float32, jax.lax.Precision.HIGHEST


def _codes_dot(lhs, rhs):
    """lhs @ rhs in float32, one of them the (in, out) e4m3 codes cast to the other's (16- or 32-bit) dtype: exact
    products, float32 sums (HIGHEST for float32 operands: no TF32 rounding of them)."""
    return jnp.dot(lhs, rhs, precision=HIGHEST if lhs.dtype == F32 else None, preferred_element_type=F32)


def fp8_column_sumsq(w8, lora_a, lora_b, scale, dtype):
    """||W8_n + s (A B)_n||^2 per output feature n, float32 (out,), without forming W8 or A B (in x out each):

        ||W8_n||^2 + 2 s sum_r (A^T W8)_rn B_rn + s^2 B_n^T (A^T A) B_n.

    W8 = Q diag(c) (c one scale per output feature, rowwise; the same one for all, tensorwise), so
    ||W8_n||^2 = c_n^2 sum_k Q_kn^2 is one reduction over the codes, and A^T W8 = (A^T Q) diag(c) a skinny product
    reading them once. A and B are taken in `dtype` (the layer's compute dtype, as it multiplies by them); e4m3 codes
    and 16-bit adapters multiply exactly in float32, which every sum runs in (float32 adapters: HIGHEST precision).
    The codes and scales are constants (the base is frozen); A, B and s get gradients (`_sumsq_bwd`)."""
    codes, c = jax.lax.stop_gradient(w8.codes), jax.lax.stop_gradient(w8.scale)
    return _sumsq(codes, c, lora_a.astype(dtype), lora_b.astype(dtype), jnp.asarray(scale, F32))


@jax.custom_vjp
def _sumsq(codes, c, a, b, scale):
    return _sumsq_fwd(codes, c, a, b, scale)[0]


def _sumsq_fwd(codes, c, a, b, scale):
    a32, b32 = a.astype(F32), b.astype(F32)
    sumsq_w = jnp.sum(jnp.square(codes.astype(F32)), axis=0) * (c * c)
    atw = _codes_dot(a.T, codes.astype(a.dtype)) * c  # (r, out)
    gb = jnp.dot(jnp.dot(a32.T, a32, precision=HIGHEST), b32, precision=HIGHEST)  # (A^T A) B, (r, out)
    cross, low = jnp.sum(atw * b32, axis=0), jnp.sum(b32 * gb, axis=0)
    return sumsq_w + 2.0 * scale * cross + scale * scale * low, (codes, c, a, b, scale, atw, gb, cross, low)


def _sumsq_bwd(res, ct):
    """With t the cotangent per output feature: dA = 2 s Q (c t B)^T + 2 s^2 A (B diag(t) B^T) (the codes read once
    more, in a skinny product: no in x out array), dB = t (2 s A^T W8 + 2 s^2 A^T A B), ds = sum t (2 cross + 2 s
    low). The residuals are the forward's (r, out) products; the codes are the frozen parameter itself."""
    codes, c, a, b, scale, atw, gb, cross, low = res
    a32, b32 = a.astype(F32), b.astype(F32)
    bt = b32 * ct  # B diag(t)
    da = 2.0 * scale * _codes_dot(codes.astype(a.dtype), (bt * c).T.astype(a.dtype)) \
        + 2.0 * scale * scale * jnp.dot(a32, jnp.dot(bt, b32.T, precision=HIGHEST), precision=HIGHEST)
    db = ct * (2.0 * scale * atw + 2.0 * scale * scale * gb)
    dscale = jnp.sum(ct * (2.0 * cross + 2.0 * scale * low))
    return jnp.zeros_like(codes), jnp.zeros_like(c), da.astype(a.dtype), db.astype(b.dtype), dscale


_sumsq.defvjp(_sumsq_fwd, _sumsq_bwd)


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
    over the input axis of the dequantized W8 (`fp8_column_sumsq`: in float32, from the codes), floored as DoRA's;
    W8 an `Fp8Kernel` (frozen). z = x W8 + s (x A) B is rounded once to x's dtype before the column scale, as
    `dora_dense_reference` forms it. Arguments as `lora_fp8_dense`'s, plus magnitude m (out,) and exact_norm_grad
    (differentiate through the norm; default: a constant, as peft)."""
    _check(x, w8, lora_a, lora_b, magnitude, bias, scale, op="dora_fp8_dense", fp8_base=True)
    # a constant norm (the default) is one of constant inputs: nothing is kept for a backward that never runs
    a, b, s = (lora_a, lora_b, scale) if exact_norm_grad else jax.lax.stop_gradient((lora_a, lora_b, scale))
    g = magnitude.astype(F32) / floored_norm(fp8_column_sumsq(w8, a, b, s, x.dtype))
    z = _adapted(x, w8, lora_a, lora_b, scale, implementation).astype(x.dtype)
    return _finish(_column_scaled(z, g), bias, x.dtype)


@jax.custom_vjp
def _column_scaled(z, g):
    """z * g in float32, z (tokens, out) in the compute dtype, g (out,) float32. Its own vjp so that the backward
    keeps z as it is (16-bit), where jax's would keep z's float32 copy: (tokens, out) float32 per layer, held from
    the forward to the backward."""
    return z.astype(jnp.float32) * g


def _column_scaled_fwd(z, g):
    return _column_scaled(z, g), (z, g)


def _column_scaled_bwd(res, dy):
    z, g = res
    return (dy * g).astype(z.dtype), jnp.sum(dy * z.astype(jnp.float32), axis=0)


_column_scaled.defvjp(_column_scaled_fwd, _column_scaled_bwd)
