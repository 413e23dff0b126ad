"""Optax-facing optimizers: `optax.chain(galore_adamw(...))`, `adamw(...)`, and the in-place steps."""

from pallas_fused.adam import adam, adamw, adamw_step, scale_by_adam
from pallas_fused.galore import galore_adam, galore_adamw, galore_adamw_inplace, scale_by_galore_adam

__all__ = [
    "adam",
    "adamw",
    "adamw_step",
    "galore_adam",
    "galore_adamw",
    "galore_adamw_inplace",
    "scale_by_adam",
    "scale_by_galore_adam",
]
