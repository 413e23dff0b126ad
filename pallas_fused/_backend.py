"""The one import point for what the ops need of the machine, jax and Pallas: `from pallas_fused import _backend`.

It re-exports, and owns nothing. Each concern lives in its own module:

    _jax_compat.py        every difference between the jax versions we run on (0.10.2 to 0.12.1), and only there:
                          JAX_VERSION, the Triton in-kernel primitives (load, store, dot, atomic_add), mosaic_gpu,
                          has_mosaic_interpret, mosaic_load, trace_time_int; the Triton-deprecation warning filter
    _devices.py           the GPU implementations are chosen and kernels lowered for: gpu_device,
                          compute_capability, is_hopper, device_name, num_sms, gpu_target (and its TARGETS)
    _xla_workarounds.py   XLA's known GPU miscompiles and the warning naming the flag that avoids each:
                          XLA_GPU_MISCOMPILES, xla_gpu_miscompiles, xla_disabled_passes
    _resolve.py           the `implementation=` selector (its values are documented there): resolve_implementation,
                          Variant, ImplementationError, valid_implementations, split_implementation,
                          mosaic_interpret (the refusal of a Mosaic GPU interpret run where jax lacks it)
    _launch.py            how kernels are launched: triton_call, mosaic_rcp_rn, cdiv, grouped_pid, next_pow2
    _tuning.py            tuning data, read by `tuned` and `tuning_table` (its docstring has the lookup order)

A test that monkeypatches one of these names patches it here only for the code that looks it up here (the ops do,
as `_backend.tuned(...)`); to change what the owning module's own functions see (`resolve_implementation` asks
`_devices.compute_capability`), patch the owning module.
"""

from pallas_fused._devices import (
    TARGETS,
    compute_capability,
    device_name,
    gpu_device,
    gpu_target,
    is_hopper,
    num_sms,
)
from pallas_fused._jax_compat import (
    JAX_011,
    JAX_VERSION,
    atomic_add,
    dot,
    has_mosaic_interpret,
    load,
    mosaic_gpu,
    mosaic_load,
    pl_triton,
    store,
    trace_time_int,
)
from pallas_fused._launch import cdiv, grouped_pid, mosaic_rcp_rn, next_pow2, triton_call
from pallas_fused._resolve import (
    IMPLEMENTATIONS,
    MIN_COMPUTE_CAPABILITY,
    ImplementationError,
    Variant,
    mosaic_interpret,
    resolve_implementation,
    split_implementation,
    valid_implementations,
)
from pallas_fused._tuning import TUNING_DIR, device_slug, tuned, tuning_table
from pallas_fused._xla_workarounds import XLA_GPU_MISCOMPILES, XlaMiscompile, xla_disabled_passes, xla_gpu_miscompiles

__all__ = [
    "IMPLEMENTATIONS", "JAX_011", "JAX_VERSION", "MIN_COMPUTE_CAPABILITY", "TARGETS", "TUNING_DIR",
    "XLA_GPU_MISCOMPILES", "ImplementationError", "Variant", "XlaMiscompile", "atomic_add", "cdiv",
    "compute_capability", "device_name", "device_slug", "dot", "gpu_device", "gpu_target", "grouped_pid",
    "has_mosaic_interpret", "is_hopper", "load", "mosaic_gpu", "mosaic_interpret", "mosaic_load", "mosaic_rcp_rn",
    "next_pow2", "num_sms", "pl_triton", "resolve_implementation", "split_implementation", "store", "trace_time_int",
    "triton_call", "tuned", "tuning_table", "valid_implementations", "xla_disabled_passes", "xla_gpu_miscompiles",
]
