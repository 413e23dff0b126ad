"""Flax drop-ins for FP8 training: a dot_general for nn.Dense / nn.DenseGeneral / nnx.Linear, and
`Float8Dense`.

    nn.Dense(features, dot_general_cls=functools.partial(Float8DotGeneral, config="rowwise"))
    nnx.Linear(din, dout, dot_general=Float8DotGeneral("rowwise"), rngs=rngs)
    Float8Dense(features, config=Float8Config.from_recipe("tensorwise"))

Scales are dynamic (no state), so unlike flax's Fp8DotGeneralOp there are no extra variable
collections to carry through the training step.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from pallas_fused.fp8.api import fp8_linear
from pallas_fused.fp8.config import Float8Config, as_config


@dataclasses.dataclass(frozen=True)
class Float8DotGeneral:
    """A `jax.lax.dot_general` replacement that runs the contraction as an FP8 linear layer.

    Usable as `dot_general_cls=functools.partial(Float8DotGeneral, config=...)` in flax.linen
    (nn.Dense, nn.DenseGeneral) and as an instance `dot_general=Float8DotGeneral(config)` in
    nnx.Linear. The lhs is the activation, the rhs the kernel; free dimensions of each are
    flattened, batch dimensions are vmapped. `precision` is ignored (fp8 sets it).
    """

    config: Float8Config | str = "tensorwise"
    implementation: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "config", as_config(self.config))

    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs: Any):
        del precision, kwargs  # out_sharding etc.: the fp8 path leaves sharding to XLA
        (lc, rc), (lb, rb) = dimension_numbers
        lc, rc, lb, rb = (tuple(int(d) % nd for d in dims) for dims, nd in
                          ((lc, lhs.ndim), (rc, rhs.ndim), (lb, lhs.ndim), (rb, rhs.ndim)))
        dtype = jnp.result_type(lhs, rhs)
        out_dtype = preferred_element_type or dtype
        lhs, rhs = lhs.astype(dtype), rhs.astype(dtype)
        if lb:  # batch dims first, then vmap over them one at a time
            lfree = [d for d in range(lhs.ndim) if d not in lb]
            rfree = [d for d in range(rhs.ndim) if d not in rb]
            lhs = lhs.transpose(*lb, *lfree)
            rhs = rhs.transpose(*rb, *rfree)
            lc = tuple(lfree.index(d) for d in lc)
            rc = tuple(rfree.index(d) for d in rc)
            fn = lambda a, b: self._dot(a, b, lc, rc)  # noqa: E731
            for _ in lb:
                fn = jax.vmap(fn)
            return fn(lhs, rhs).astype(out_dtype)
        return self._dot(lhs, rhs, lc, rc).astype(out_dtype)

    def _dot(self, lhs, rhs, lc, rc):
        lfree = [d for d in range(lhs.ndim) if d not in lc]
        rfree = [d for d in range(rhs.ndim) if d not in rc]
        k = math.prod(lhs.shape[d] for d in lc)
        m, n = math.prod(lhs.shape[d] for d in lfree), math.prod(rhs.shape[d] for d in rfree)
        x = lhs.transpose(*lfree, *lc).reshape(m, k)  # explicit sizes: -1 is ambiguous for an empty batch
        w = rhs.transpose(*rc, *rfree).reshape(k, n)
        y = fp8_linear(x, w, self.config, implementation=self.implementation)
        return y.reshape(*(lhs.shape[d] for d in lfree), *(rhs.shape[d] for d in rfree))


class Float8Dense(nn.Module):
    """nn.Dense whose matmul runs in FP8 per `config` (a Float8Config or a recipe name).

    Same parameters as nn.Dense ('kernel' (in, out), 'bias'), so checkpoints interchange.
    """

    features: int
    config: Float8Config | str = "tensorwise"
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Any = nn.initializers.lecun_normal()
    bias_init: Any = nn.initializers.zeros_init()
    implementation: str | None = None

    @nn.compact
    def __call__(self, inputs):
        kernel = self.param("kernel", self.kernel_init, (jnp.shape(inputs)[-1], self.features), self.param_dtype)
        bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype) if self.use_bias else None
        inputs, kernel, bias = nn.dtypes.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        dot = Float8DotGeneral(self.config, self.implementation)
        y = dot(inputs, kernel, (((inputs.ndim - 1,), (0,)), ((), ())))
        if bias is not None:
            y = y + bias.reshape((1,) * (y.ndim - 1) + (-1,))
        return y
