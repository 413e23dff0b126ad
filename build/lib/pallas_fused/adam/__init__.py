"""Fused Adam / AdamW (one kernel pass per tensor) with optional 8-bit blockwise optimizer states.

See `pallas_fused.adam.api` for the two paths (composable optax transforms and the in-place step).
"""

from pallas_fused.adam.api import (
    FusedAdamState,
    QuantizedMoment,
    adam,
    adam_leaf_direction,
    adam_leaf_update,
    adam_state_bytes,
    adamw,
    adamw_step,
    dequantize_moment,
    init_adam_leaf_state,
    scale_by_adam,
    state_shardings,
)

__all__ = [
    "FusedAdamState",
    "QuantizedMoment",
    "adam",
    "adam_leaf_direction",
    "adam_leaf_update",
    "adam_state_bytes",
    "adamw",
    "adamw_step",
    "dequantize_moment",
    "init_adam_leaf_state",
    "scale_by_adam",
    "state_shardings",
]
