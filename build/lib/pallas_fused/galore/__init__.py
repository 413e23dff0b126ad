"""GaLore Adam: optax transforms and an in-place step with fused Pallas projection-update kernels."""

from pallas_fused.galore.api import (
    GALORE_STATIC_ARGS,
    GaLoreAdamState,
    GaLoreInplace,
    choose_kernel,
    galore_adam,
    galore_adamw,
    galore_adamw_inplace,
    scale_by_galore_adam,
    state_shardings,
)
from pallas_fused.galore.projector import captured_energy, low_rank_plus_noise, randomized_projector
from pallas_fused.galore.reference import svd_projector

__all__ = [
    "GALORE_STATIC_ARGS",
    "GaLoreAdamState",
    "GaLoreInplace",
    "captured_energy",
    "choose_kernel",
    "galore_adam",
    "galore_adamw",
    "galore_adamw_inplace",
    "low_rank_plus_noise",
    "randomized_projector",
    "scale_by_galore_adam",
    "state_shardings",
    "svd_projector",
]
