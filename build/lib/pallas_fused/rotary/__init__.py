"""Fused rotary position embeddings: q and k in one Pallas kernel, forward and backward.

    from pallas_fused.rotary import apply_rotary, RotaryScaling
    q_rot, k_rot = apply_rotary(q, k, positions, scaling=RotaryScaling.llama3(8.0))
"""

from pallas_fused.rotary.api import apply_rotary
from pallas_fused.rotary.flax import NNXRotaryEmbedding, RotaryEmbedding
from pallas_fused.rotary.reference import RotaryScaling, inv_frequencies, reference_rotary

__all__ = ["apply_rotary", "RotaryScaling", "RotaryEmbedding", "NNXRotaryEmbedding", "inv_frequencies",
           "reference_rotary"]
