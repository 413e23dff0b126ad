"""RMSNorm over the last axis: the plain-jnp reference, also the "xla" implementation.

`reference_rms_norm` computes what `flax.linen.RMSNorm(epsilon, dtype)` computes (reduction and feature axis
-1, no mask), operation for operation: statistics in float32 (at least), y = x * (rsqrt(mean(x^2) + eps) *
scale), rounded once to `dtype` (default: the result type of x and scale). This file knows nothing of Pallas.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def output_dtype(x, scale, dtype):
    """nn.RMSNorm's result dtype: `dtype` if given, else the promotion of x's and scale's dtypes."""
    if dtype is not None:
        return jnp.dtype(dtype)
    return jnp.result_type(x) if scale is None else jnp.result_type(x, scale)


def reference_rms_norm(x, scale=None, epsilon: float = 1e-6, dtype=None):
    stats_dtype = jnp.promote_types(dtype or x.dtype, jnp.float32)
    x32 = x.astype(stats_dtype)
    mul = lax.rsqrt(jnp.mean(lax.square(x32), axis=-1, keepdims=True) + epsilon)
    if scale is not None:
        mul = mul * scale
    return (x32 * mul).astype(output_dtype(x, scale, dtype))
