"""Flax drop-ins for `embed`: `Embed` (linen) and `NNXEmbed` (NNX).

Each subclasses flax's own embedding and adds `implementation`: the params (`embedding`, shape
(num_embeddings, features), `default_embed_init`), `attend` and the index semantics are flax's, so a
checkpoint of nn.Embed / nnx.Embed loads unchanged. With implementation "xla" the call is flax's own
__call__; otherwise `pallas_fused.embed.embed`, whose table gradient is a one-hot GEMM, not a scatter.
"""

from __future__ import annotations

from flax import linen as nn
from flax import nnx

from pallas_fused import _backend
from pallas_fused.embed.api import embed


class Embed(nn.Embed):
    """`flax.linen.Embed` with `implementation=None | "pallas" | "xla" | "interpret"` (see `embed`)."""

    implementation: str | None = None

    def __call__(self, inputs):
        if _backend.resolve_implementation(self.implementation, op="Embed") == "xla":
            return super().__call__(inputs)
        return embed(self.embedding, inputs, dtype=self.dtype, implementation=self.implementation)


class NNXEmbed(nnx.Embed):
    """`flax.nnx.Embed` with an `implementation` keyword (see `embed`); same Variables as nnx.Embed."""

    def __init__(self, num_embeddings: int, features: int, *, implementation: str | None = None, **kwargs):
        super().__init__(num_embeddings, features, **kwargs)
        self.implementation = implementation

    def __call__(self, inputs, out_sharding=None):
        if out_sharding is not None or _backend.resolve_implementation(self.implementation, op="NNXEmbed") == "xla":
            return super().__call__(inputs, out_sharding=out_sharding)
        return embed(self.embedding[...], inputs, dtype=self.dtype, implementation=self.implementation)
