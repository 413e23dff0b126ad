"""SwiGLU's gating product: the plain-jnp reference, also the "xla" implementation.

`swiglu_reference(gate, up)` = silu(gate) * up = gate * sigmoid(gate) * up, computed in float32 and rounded once
to the inputs' dtype. Its gradient is whatever autodiff makes of that (float32 inside, cast back to the inputs'
dtype). This file knows nothing of Pallas.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def swiglu_reference(gate, up):
    """silu(gate) * up in float32, rounded to gate's dtype (gate and up: same shape and dtype)."""
    g32, u32 = gate.astype(jnp.float32), up.astype(jnp.float32)
    return (jax.nn.silu(g32) * u32).astype(gate.dtype)
