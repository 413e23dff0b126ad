"""Embedding lookup whose backward pass is a one-hot GEMM (small vocabularies) or a sorted segment sum, not a
colliding scatter; `Embed` / `NNXEmbed` take nn.Embed's / nnx.Embed's params unchanged.

    from pallas_fused.embed import embed, Embed
    x = embed(table, token_ids, dtype=jnp.bfloat16)
"""

from pallas_fused.embed.api import ONEHOT_MAX_VOCAB, embed, use_onehot
from pallas_fused.embed.flax import Embed, NNXEmbed
from pallas_fused.embed.reference import reference_embed

__all__ = ["ONEHOT_MAX_VOCAB", "Embed", "NNXEmbed", "embed", "reference_embed", "use_onehot"]
