"""A Llama-style decoder in Flax linen, built from pallas_fused's drop-ins.

RMSNorm -> attention (rotary from `pallas_fused.rotary`, grouped-query heads) -> RMSNorm -> SwiGLU MLP,
with residuals, then a final RMSNorm and an untied output head over the 256 byte values. Given the labels, the
model returns the mean loss; with `fused_loss` the head is `pallas_fused.loss.LinearCrossEntropy`, which never
writes the logits (the same `head/kernel` param as the nn.Dense head, so params and checkpoints are shared).

Every projection inside the blocks comes from one factory, `ModelConfig.dense(features, name)`, so a
flag decides what a linear layer is without touching the model:

    plain           nn.Dense
    fp8=<recipe>    nn.Dense with pallas_fused.fp8.Float8DotGeneral ("tensorwise", "rowwise", ...)

The DoRA fine-tune does not change the model: train_llama.py adapts it by rules (`pallas_fused.adapt`), as a
user adapts a model someone else wrote.

`implementation` is handed to every pallas_fused op ("xla" is the plain-jnp reference: the baseline).
The embedding (`pallas_fused.embed.Embed`: nn.Embed's params, a one-hot GEMM for its gradient instead of a
scatter) and the norms (`pallas_fused.norm.RMSNorm`: nn.RMSNorm's params, one fused kernel each way) are
flax's own layers under implementation "xla". The embedding and the output head stay high-precision layers
(as FP8 recipes usually do).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import traverse_util


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    d_ff: int = 384
    rope_base: float = 10000.0
    dtype: Any = jnp.float32  # compute dtype; params stay float32
    implementation: str | None = None  # for every pallas_fused op
    fp8: str | None = None  # an FP8 recipe name for the block projections
    attention: str | None = None  # jax.nn.dot_product_attention's implementation (None: XLA)
    fused_loss: bool = False  # the loss from pallas_fused.loss (False: logits, then optax's cross-entropy)

    def __post_init__(self):
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be a multiple of n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def norm(self, name: str) -> nn.Module:
        from pallas_fused.norm import RMSNorm

        return RMSNorm(dtype=self.dtype, implementation=self.implementation, name=name)

    def dense(self, features: int, name: str) -> nn.Module:
        """The factory for every projection in the blocks (see the module docstring)."""
        if self.fp8 is not None:
            from pallas_fused.fp8 import Float8Config, Float8DotGeneral

            config = Float8Config.from_recipe(self.fp8)
            return nn.Dense(
                features,
                use_bias=False,
                dtype=self.dtype,
                dot_general_cls=functools.partial(Float8DotGeneral, config=config, implementation=self.implementation),
                name=name,
            )
        return nn.Dense(features, use_bias=False, dtype=self.dtype, name=name)


class Attention(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x):
        from pallas_fused.rotary import apply_rotary

        cfg = self.config
        b, s, _ = x.shape
        q = cfg.dense(cfg.n_heads * cfg.head_dim, "q")(x).reshape(b, s, cfg.n_heads, cfg.head_dim)
        k = cfg.dense(cfg.n_kv_heads * cfg.head_dim, "k")(x).reshape(b, s, cfg.n_kv_heads, cfg.head_dim)
        v = cfg.dense(cfg.n_kv_heads * cfg.head_dim, "v")(x).reshape(b, s, cfg.n_kv_heads, cfg.head_dim)
        q, k = apply_rotary(q, k, base=cfg.rope_base, implementation=cfg.implementation)
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=cfg.attention)
        return cfg.dense(cfg.d_model, "o")(out.reshape(b, s, cfg.n_heads * cfg.head_dim))


class MLP(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x):
        from pallas_fused.swiglu import swiglu

        cfg = self.config
        gate = cfg.dense(cfg.d_ff, "gate")(x)
        up = cfg.dense(cfg.d_ff, "up")(x)
        return cfg.dense(cfg.d_model, "down")(swiglu(gate, up, implementation=cfg.implementation))


class Block(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        x = x + Attention(cfg, name="attn")(cfg.norm("attn_norm")(x))
        return x + MLP(cfg, name="mlp")(cfg.norm("mlp_norm")(x))


class Llama(nn.Module):
    """Byte-level decoder: int tokens (B, S) -> float32 logits (B, S, vocab); given `labels` (B, S), the mean
    next-token cross-entropy instead."""

    config: ModelConfig

    @nn.compact
    def __call__(self, tokens, labels=None):
        from pallas_fused.embed import Embed

        cfg = self.config
        embed = Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, implementation=cfg.implementation, name="embed")
        x = embed(tokens)
        for i in range(cfg.n_layers):
            x = Block(cfg, name=f"block_{i}")(x)
        x = cfg.norm("final_norm")(x)
        if labels is not None and cfg.fused_loss:
            from pallas_fused.loss import LinearCrossEntropy

            return LinearCrossEntropy(cfg.vocab_size, dtype=cfg.dtype, implementation=cfg.implementation,
                                      name="head")(x, labels)
        logits = nn.Dense(cfg.vocab_size, use_bias=False, dtype=cfg.dtype, name="head")(x).astype(jnp.float32)
        if labels is None:
            return logits
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def count_params(params) -> int:
    """Weights in a params tree; a quantized kernel (QDoRA) counts as its (in, out) weight, not its packed codes
    and scales, so the count (and the MFU from it) is the model's whatever the storage."""
    from pallas_fused.dora.quant import is_quantized

    return sum(math.prod(x.shape) if is_quantized(x) else int(x.size)
               for x in jax.tree.leaves(params, is_leaf=is_quantized))


def block_kernel_mask(params, rank: int):
    """True for the block projection kernels GaLore can project at `rank` (both dims larger), else False."""
    flat = traverse_util.flatten_dict(params)
    return traverse_util.unflatten_dict(
        {k: k[0].startswith("block_") and k[-1] == "kernel" and min(v.shape) > rank for k, v in flat.items()}
    )
