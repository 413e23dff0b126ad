"""RMSNorm forward and backward, one fused Pallas kernel each; `RMSNorm` / `NNXRMSNorm` take nn.RMSNorm's /
nnx.RMSNorm's params unchanged.

    from pallas_fused.norm import rms_norm, RMSNorm
    y = rms_norm(x, scale, epsilon=1e-6, dtype=jnp.bfloat16)
"""

from pallas_fused.norm.api import rms_norm
from pallas_fused.norm.flax import NNXRMSNorm, RMSNorm
from pallas_fused.norm.reference import reference_rms_norm

__all__ = ["NNXRMSNorm", "RMSNorm", "reference_rms_norm", "rms_norm"]
