"""Plain-jnp DoRA: the ground truth for tests and the "xla" implementation.

Flax layout: kernel W (in, out) frozen, lora_a A (in, r), lora_b B (r, out), magnitude m (out,).

    n = ||W + s A B||_2 over the input axis      (one value per output feature)
    g = m / n
    y = (x W + s (x A) B) * g + bias

By default n is a constant in the backward pass (DoRA paper section 4.3, HF peft); with
`exact_norm_grad=True` it is differentiated. W never gets a gradient (it is frozen).

n is floored at NORM_FLOOR (1e-12, as torch.nn.functional.normalize's eps) before g = m / n: a column of W + s A B
that is all zero (a zero column of W while B = 0, which also makes its magnitude 0) gives g = 0 and a zero
output column instead of 0 / 0 = NaN. peft divides by the bare norm and gets NaN there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_fused.dora.quant import dequantize

NORM_FLOOR = 1e-12


def floored_norm(sumsq) -> jax.Array:
    """max(sqrt(sumsq), NORM_FLOOR), floored before the square root so that its gradient stays finite at 0. A
    select, not jnp.maximum: Triton's max would turn a NaN into the floor (here NaN stays NaN, as in XLA)."""
    floor = NORM_FLOOR * NORM_FLOOR
    return jnp.sqrt(jnp.where(sumsq < floor, floor, sumsq))


def column_sumsq_reference(kernel, lora_a, lora_b, scale, dtype=None) -> jax.Array:
    """||W + s A B||^2 over the input axis, float32 (out,). Formed in `dtype` (default W's), summed in fp32."""
    w = dequantize(kernel, dtype or getattr(kernel, "dtype", jnp.float32))
    dt = w.dtype
    v = w + (scale * (lora_a.astype(dt) @ lora_b.astype(dt))).astype(dt)
    return jnp.sum(jnp.square(v.astype(jnp.float32)), axis=0)


def column_norm_reference(kernel, lora_a, lora_b, scale, dtype=None) -> jax.Array:
    """n = ||W + s A B|| over the input axis, float32 (out,) (not floored: the magnitude's initial value)."""
    return jnp.sqrt(column_sumsq_reference(kernel, lora_a, lora_b, scale, dtype))


def column_scale_reference(kernel, lora_a, lora_b, magnitude, scale, dtype=None) -> jax.Array:
    """g = m / max(||W + s A B||, NORM_FLOOR), float32 (out,)."""
    return magnitude.astype(jnp.float32) / floored_norm(column_sumsq_reference(kernel, lora_a, lora_b, scale, dtype))


def _scale_of(x, kernel, lora_a, lora_b, magnitude, scale, exact_norm_grad):
    n = floored_norm(column_sumsq_reference(jax.lax.stop_gradient(kernel), lora_a, lora_b, scale, x.dtype))
    if not exact_norm_grad:
        n = jax.lax.stop_gradient(n)
    return magnitude.astype(jnp.float32) / n


def dora_dense_reference(x, kernel, lora_a, lora_b, magnitude, bias=None, *, scale, exact_norm_grad=False):
    """y = (x W + s (x A) B) * g + bias in x.dtype, x of shape (..., in)."""
    dt = x.dtype
    w = jax.lax.stop_gradient(dequantize(kernel, dt))
    g = _scale_of(x, kernel, lora_a, lora_b, magnitude, scale, exact_norm_grad)
    z = x @ w + scale * ((x @ lora_a.astype(dt)) @ lora_b.astype(dt))
    y = z.astype(jnp.float32) * g
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(dt)


def dora_dense_dropout_reference(x, x_dropped, kernel, lora_a, lora_b, magnitude, bias=None, *, scale,
                                 exact_norm_grad=False):
    """peft's dropout form: y = x W + bias + (g - 1) (x_d W) + g s (x_d A) B, x_d the dropped input."""
    dt = x.dtype
    w = jax.lax.stop_gradient(dequantize(kernel, dt))
    g = _scale_of(x, kernel, lora_a, lora_b, magnitude, scale, exact_norm_grad)
    base = (x @ w).astype(jnp.float32)
    base_d = (x_dropped @ w).astype(jnp.float32)
    low = (scale * ((x_dropped @ lora_a.astype(dt)) @ lora_b.astype(dt))).astype(jnp.float32)
    y = base + (g - 1.0) * base_d + g * low
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(dt)
