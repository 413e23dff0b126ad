"""Model code we did not write (HF transformers' Flax Llama, built offline from a small config with random
weights), and an NNX model with einsum projections in every layout the adapt package supports."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

SEQ = 8


def flax_transformers():
    """HF transformers with its Flax models (the test extra pins it below 5, which dropped them), else a skip."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "FlaxLlamaForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no Flax models (they ended with 4.x)")
    return transformers


def hf_llama(dtype=jnp.float32, seed: int = 0):
    """(module, pretrained params, inputs) of a 2-layer FlaxLlamaForCausalLM."""
    transformers = flax_transformers()
    cfg = transformers.LlamaConfig(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    hf = transformers.FlaxLlamaForCausalLM(cfg, seed=seed, dtype=dtype)
    ids = jax.random.randint(jax.random.key(seed + 1), (2, SEQ + 1), 0, cfg.vocab_size)
    inputs = (ids[:, :-1], jnp.ones((2, SEQ), jnp.int32), jnp.broadcast_to(jnp.arange(SEQ), (2, SEQ)))
    return hf.module, hf.params, inputs, ids[:, 1:]


def lm_loss(logits, targets):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


class Block(nnx.Module):
    """Attention-shaped einsum projections: q over heads (d -> h k), o back (h k -> d, two contracting axes), an
    nnx.Einsum whose weight is stored (out, in), and an nnx.Linear."""

    def __init__(self, d: int, heads: int, rngs: nnx.Rngs):
        k = d // heads
        self.wq = nnx.Param(jax.random.normal(rngs.params(), (d, heads, k)) / d ** 0.5)
        self.wo = nnx.Param(jax.random.normal(rngs.params(), (heads, k, d)) / d ** 0.5)
        self.up = nnx.Einsum("btd,fd->btf", (3 * d, d), rngs=rngs)
        self.down = nnx.Linear(3 * d, d, rngs=rngs)

    def __call__(self, x):
        q = jnp.einsum("btd,dhk->bthk", x, self.wq[...])
        y = jnp.einsum("bthk,hkd->btd", q, self.wo[...])
        return x + self.down(jax.nn.silu(self.up(y)))


class EinsumNet(nnx.Module):
    def __init__(self, d: int = 32, heads: int = 4, layers: int = 2, *, rngs: nnx.Rngs):
        self.blocks = nnx.List([Block(d, heads, rngs) for _ in range(layers)])

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x
