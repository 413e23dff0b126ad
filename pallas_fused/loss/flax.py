"""Flax LM heads that return the loss: `LinearCrossEntropy` (linen) and `NNXLinearCrossEntropy` (NNX).

Each holds the head's kernel as `nn.Dense` / `nnx.Linear` do (a param named `kernel`, shape (d, vocab), no bias),
so the params of a Dense `lm_head` load unchanged, and returns `linear_cross_entropy(hidden, kernel, labels)`
instead of the logits. With `tied=True` the head holds no kernel: the call takes the (vocab, d) embedding table
(a tied head, as `nn.Embed.attend` uses it).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import linen as nn
from flax import nnx
from flax.linen.linear import default_kernel_init
from flax.nnx.nn.linear import default_kernel_init as nnx_default_kernel_init

from pallas_fused.loss.api import linear_cross_entropy


def _loss(module, hidden, weight, labels, layout):
    if module.dtype is not None:  # the product's dtype, as nn.Dense's `dtype`
        hidden = hidden.astype(module.dtype)
    return linear_cross_entropy(hidden, weight, labels, weight_layout=layout, ignore_index=module.ignore_index,
                                z_loss=module.z_loss, label_smoothing=module.label_smoothing,
                                reduction=module.reduction, logit_soft_cap=module.logit_soft_cap,
                                implementation=module.implementation)


def _weight(tied: bool, kernel, embedding, who: str):
    if tied and embedding is None:
        raise ValueError(f"embedding: {who}(tied=True) needs the (vocab, d) embedding table in the call")
    if not tied and embedding is not None:
        raise ValueError(f"embedding: {who} holds its own kernel; pass an embedding only with tied=True")
    return (embedding, "vd") if tied else (kernel, "dv")


class LinearCrossEntropy(nn.Module):
    """`linear_cross_entropy(hidden, kernel, labels)` with `kernel` a (d, vocab) param, as `nn.Dense(vocab_size,
    use_bias=False)` holds it; or, with `tied=True`, against the (vocab, d) `embedding` given to the call.

    Attributes:
      vocab_size: the number of classes (the kernel's second axis).
      tied: no kernel of its own: `__call__(hidden, labels, embedding=table)`.
      dtype: the product's dtype (hidden and the weight cast to it; None: hidden's dtype).
      param_dtype, kernel_init: the kernel's, as nn.Dense's.
      ignore_index, z_loss, label_smoothing, reduction, logit_soft_cap, implementation: see `linear_cross_entropy`.
    """

    vocab_size: int
    tied: bool = False
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Any = default_kernel_init
    ignore_index: int = -100
    z_loss: float = 0.0
    label_smoothing: float = 0.0
    reduction: str = "mean"
    logit_soft_cap: float | None = None
    implementation: str | None = None

    @nn.compact
    def __call__(self, hidden, labels, embedding=None):
        kernel = None
        if not self.tied:
            kernel = self.param("kernel", self.kernel_init, (hidden.shape[-1], self.vocab_size), self.param_dtype)
        weight, layout = _weight(self.tied, kernel, embedding, "LinearCrossEntropy")
        return _loss(self, hidden, weight, labels, layout)


class NNXLinearCrossEntropy(nnx.Module):
    """The NNX head: a (in_features, vocab_size) `kernel` Param as `nnx.Linear(use_bias=False)` holds it (none with
    `tied=True`: the call takes the (vocab, d) embedding), returning the loss (see `LinearCrossEntropy`)."""

    def __init__(self, in_features: int, vocab_size: int, *, tied: bool = False, dtype: Any = None,
                 param_dtype: Any = jnp.float32, kernel_init: Any = nnx_default_kernel_init, ignore_index: int = -100,
                 z_loss: float = 0.0, label_smoothing: float = 0.0, reduction: str = "mean",
                 logit_soft_cap: float | None = None, implementation: str | None = None, rngs: nnx.Rngs | None = None):
        self.tied = tied
        if tied:
            self.kernel = None
        elif rngs is None:
            raise ValueError("rngs: NNXLinearCrossEntropy needs rngs to initialise its kernel (or tied=True)")
        else:
            self.kernel = nnx.Param(kernel_init(rngs.params(), (in_features, vocab_size), param_dtype))
        self.dtype, self.ignore_index, self.z_loss = dtype, ignore_index, z_loss
        self.label_smoothing, self.reduction, self.logit_soft_cap = label_smoothing, reduction, logit_soft_cap
        self.implementation = implementation

    def __call__(self, hidden, labels, embedding=None):
        kernel = None if self.kernel is None else self.kernel[...]
        if isinstance(embedding, nnx.Variable):  # an nnx.Embed's `embedding` Param itself
            embedding = embedding[...]
        weight, layout = _weight(self.tied, kernel, embedding, "NNXLinearCrossEntropy")
        return _loss(self, hidden, weight, labels, layout)
