"""Plain-jnp DoRA: the ground truth for tests and the "xla" implementation.

Flax layout: kernel W (in, out) frozen, lora_a A (in, r), lora_b B (r, out), magnitude m (out,).

    n = ||W + s A B||_2 over the input axis      (one value per output feature)
    g = m / n
    y = (x W + s (x A) B) * g + bias

By default n is a constant in the backward pass (DoRA paper section 4.3, HF peft); with
`exact_norm_grad=True` it is differentiated. W never gets a gradient (it is frozen).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_fused.dora.quant import dequantize


def column_norm_reference(kernel, lora_a, lora_b, scale, dtype=None) -> jax.Array:
    """n = ||W + s A B|| over the input axis, float32 (out,). Computed in `dtype` (default W's), summed in fp32."""
    w = dequantize(kernel, dtype or getattr(kernel, "dtype", jnp.float32))
    dt = w.dtype
    v = w + (scale * (lora_a.astype(dt) @ lora_b.astype(dt))).astype(dt)
    return jnp.sqrt(jnp.sum(jnp.square(v.astype(jnp.float32)), axis=0))


def column_scale_reference(kernel, lora_a, lora_b, magnitude, scale, dtype=None) -> jax.Array:
    """g = m / ||W + s A B||, float32 (out,)."""
    return magnitude.astype(jnp.float32) / column_norm_reference(kernel, lora_a, lora_b, scale, dtype)


def _scale_of(x, kernel, lora_a, lora_b, magnitude, scale, exact_norm_grad):
    n = column_norm_reference(jax.lax.stop_gradient(kernel), lora_a, lora_b, scale, x.dtype)
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
