"""Flax drop-ins for `rms_norm`: `RMSNorm` (linen) and `NNXRMSNorm` (NNX).

Each subclasses flax's own RMSNorm and adds `implementation`: the param (`scale`, shape (features,), ones),
the epsilon default (1e-6) and the dtype rules are flax's, so checkpoints load unchanged. With implementation
"xla", or a configuration the fused op does not cover (a mask, axis_name, reduction or feature axes other
than the last), the call is flax's own __call__; otherwise `pallas_fused.norm.rms_norm`.
"""

from __future__ import annotations

from flax import linen as nn
from flax import nnx

from pallas_fused import _backend
from pallas_fused.norm.api import rms_norm


def _last_axis_only(module) -> bool:
    return (module.axis_name is None and module.reduction_axes in (-1, (-1,))
            and module.feature_axes in (-1, (-1,)))


class RMSNorm(nn.RMSNorm):
    """`flax.linen.RMSNorm` with `implementation=None | "pallas" | "xla" | "interpret"` (see `rms_norm`)."""

    implementation: str | None = None

    @nn.compact
    def __call__(self, x, *, mask=None):
        impl = _backend.resolve_implementation(self.implementation, op="RMSNorm")
        if impl == "xla" or mask is not None or not _last_axis_only(self):
            return super().__call__(x, mask=mask)
        scale = self.param("scale", self.scale_init, (x.shape[-1],), self.param_dtype) if self.use_scale else None
        return rms_norm(x, scale, epsilon=self.epsilon, dtype=self.dtype, implementation=self.implementation)


class NNXRMSNorm(nnx.RMSNorm):
    """`flax.nnx.RMSNorm` with an `implementation` keyword (see `rms_norm`); same Variables as nnx.RMSNorm."""

    def __init__(self, num_features: int, *, implementation: str | None = None, **kwargs):
        super().__init__(num_features, **kwargs)
        self.implementation = implementation

    def __call__(self, x, mask=None):
        impl = _backend.resolve_implementation(self.implementation, op="NNXRMSNorm")
        if impl == "xla" or mask is not None or not _last_axis_only(self):
            return super().__call__(x, mask=mask)
        scale = self.scale[...] if self.scale else None
        x, scale = self.promote_dtype((x, scale), dtype=self.dtype)  # nnx.RMSNorm casts both to dtype first
        return rms_norm(x, scale, epsilon=self.epsilon, dtype=self.dtype, implementation=self.implementation)
