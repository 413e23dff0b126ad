"""Flax drop-ins for a Llama-style SwiGLU MLP: `SwiGLUMLP` (linen) and `NNXSwiGLUMLP` (NNX).

Each computes down(swiglu(gate(x), up(x))) with three plain dense layers named `gate`, `up` and `down`
(`nn.Dense` / `nnx.Linear`), so the params are those of the usual Llama MLP written with them: a checkpoint of
one loads into the other unchanged, and whatever applies to a Dense applies to these projections (an FP8
`dot_general_cls` / `dot_general`, `pallas_fused.adapt` rules matching `.*/gate`, ...). Only the gating
product between the projections is `pallas_fused.swiglu.swiglu`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax.numpy as jnp
from flax import linen as nn
from flax import nnx
from flax.linen.linear import default_kernel_init
from flax.nnx.nn.linear import default_kernel_init as nnx_default_kernel_init

from pallas_fused.swiglu.api import swiglu

zeros_init = nn.initializers.zeros_init()  # the bias default of nn.Dense and nnx.Linear


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), three `nn.Dense` submodules `gate`, `up`, `down` (see `swiglu`).

    Attributes:
      hidden_features: the width of gate and up (d_ff).
      out_features: down's width (None: x's last axis).
      use_bias, dtype, param_dtype, kernel_init, bias_init, dot_general_cls: passed to each `nn.Dense`.
      implementation: the gating product's (see `swiglu`); the projections are nn.Dense's whatever it is.
    """

    hidden_features: int
    out_features: int | None = None
    use_bias: bool = False
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Any = default_kernel_init
    bias_init: Any = zeros_init
    dot_general_cls: Any = None
    implementation: str | None = None

    @nn.compact
    def __call__(self, x):
        dense = functools.partial(nn.Dense, use_bias=self.use_bias, dtype=self.dtype, param_dtype=self.param_dtype,
                                  kernel_init=self.kernel_init, bias_init=self.bias_init,
                                  dot_general_cls=self.dot_general_cls)
        gate = dense(self.hidden_features, name="gate")(x)
        up = dense(self.hidden_features, name="up")(x)
        hidden = swiglu(gate, up, implementation=self.implementation)
        return dense(self.out_features or x.shape[-1], name="down")(hidden)


class NNXSwiGLUMLP(nnx.Module):
    """down(silu(gate(x)) * up(x)), three `nnx.Linear` attributes `gate`, `up`, `down` (see `swiglu`).

    Args:
      in_features: x's last axis.
      hidden_features: the width of gate and up (d_ff).
      out_features: down's width (None: in_features).
      use_bias, dtype, param_dtype, kernel_init, bias_init: passed to each `nnx.Linear`.
      dot_general: each `nnx.Linear`'s (None: its default, `lax.dot_general`).
      implementation: the gating product's (see `swiglu`).
      rngs: the params' initialisation.
    """

    def __init__(self, in_features: int, hidden_features: int, out_features: int | None = None, *,
                 use_bias: bool = False, dtype: Any = None, param_dtype: Any = jnp.float32,
                 kernel_init: Any = nnx_default_kernel_init, bias_init: Any = zeros_init,
                 dot_general: Any = None, implementation: str | None = None, rngs: nnx.Rngs):
        kw: dict[str, Any] = dict(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init,
                                  bias_init=bias_init, rngs=rngs)
        if dot_general is not None:
            kw["dot_general"] = dot_general
        self.gate = nnx.Linear(in_features, hidden_features, **kw)
        self.up = nnx.Linear(in_features, hidden_features, **kw)
        self.down = nnx.Linear(hidden_features, out_features or in_features, **kw)
        self.implementation = implementation

    def __call__(self, x):
        return self.down(swiglu(self.gate(x), self.up(x), implementation=self.implementation))
