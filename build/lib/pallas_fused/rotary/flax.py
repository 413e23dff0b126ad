"""Flax drop-ins for rotary embeddings: a linen module and an NNX module.

Neither stores anything: cos/sin are computed inside the op from the positions, so there is no table
parameter or cache to checkpoint, shard or recompute when the context length changes.
"""

from __future__ import annotations

from flax import linen as nn
from flax import nnx

from pallas_fused.rotary.api import apply_rotary
from pallas_fused.rotary.reference import RotaryScaling


class RotaryEmbedding(nn.Module):
    """Linen module: `RotaryEmbedding(...)(q, k, positions=None) -> (q_rot, k_rot)`.

    Attributes mirror `apply_rotary`'s keyword arguments (rotary_dim, interleaved, base, scaling, layout,
    implementation). The module has no parameters; `init` returns empty variables.
    """

    rotary_dim: int | None = None
    interleaved: bool = False
    base: float = 10000.0
    scaling: RotaryScaling | None = None
    layout: str = "bshd"
    implementation: str | None = None

    @nn.compact
    def __call__(self, q, k=None, positions=None):
        return apply_rotary(q, k, positions, rotary_dim=self.rotary_dim, interleaved=self.interleaved,
                            base=self.base, scaling=self.scaling, layout=self.layout,
                            implementation=self.implementation)


class NNXRotaryEmbedding(nnx.Module):
    """NNX module: `NNXRotaryEmbedding(...)(q, k, positions=None) -> (q_rot, k_rot)`.

    Takes `apply_rotary`'s keyword arguments at construction and holds them as static configuration
    (no Variables, so `nnx.state` of it is empty).
    """

    def __init__(self, *, rotary_dim: int | None = None, interleaved: bool = False, base: float = 10000.0,
                 scaling: RotaryScaling | None = None, layout: str = "bshd", implementation: str | None = None):
        self.rotary_dim = rotary_dim
        self.interleaved = interleaved
        self.base = base
        self.scaling = scaling
        self.layout = layout
        self.implementation = implementation

    def __call__(self, q, k=None, positions=None):
        return apply_rotary(q, k, positions, rotary_dim=self.rotary_dim, interleaved=self.interleaved,
                            base=self.base, scaling=self.scaling, layout=self.layout,
                            implementation=self.implementation)
