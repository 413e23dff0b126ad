"""The one place that knows devices, jax versions and how kernels are launched.

Everything that differs between jax 0.10 (CPU CI) and jax 0.11 (the GPU machine) lives here, as does
the choice of implementation that every public op takes:

    implementation=None        "pallas" on a CUDA GPU of compute capability >= 8.0, else "xla"
    implementation="pallas"    the Pallas kernel, compiled for the GPU (an error without one)
    implementation="xla"       the plain-jnp reference, compiled by XLA (runs anywhere)
    implementation="interpret" the Pallas kernel in interpret mode (runs anywhere, slowly; CI uses it)

An explicitly requested implementation that cannot run raises `ImplementationError`; nothing falls
back silently.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

IMPLEMENTATIONS = ("pallas", "xla", "interpret")
MIN_COMPUTE_CAPABILITY = (8, 0)

# The Triton lowering warns on every compile under jax >= 0.11 that it is deprecated. Our kernels are
# all launched through `triton_call` below, so moving one to Mosaic GPU touches one call site.
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning)


def _parse_version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


JAX_VERSION = _parse_version(jax.__version__)
JAX_011 = JAX_VERSION >= (0, 11)


class ImplementationError(ValueError):
    """An implementation was requested that cannot run in this process."""


@functools.cache
def gpu_device() -> jax.Device | None:
    """The first CUDA device, or None."""
    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        return None
    return devices[0] if devices else None


def compute_capability() -> tuple[int, int] | None:
    device = gpu_device()
    if device is None:
        return None
    text = str(getattr(device, "compute_capability", "0.0"))
    major, _, minor = text.partition(".")
    return int(major), int(minor or 0)


def is_hopper() -> bool:
    cc = compute_capability()
    return cc is not None and cc[0] == 9


def device_name() -> str:
    device = gpu_device() or jax.devices()[0]
    return getattr(device, "device_kind", device.platform)


def resolve_implementation(implementation: str | None, *, op: str, needs: tuple[int, int] | None = None) -> str:
    """Turn the user's `implementation=` into the one that will run, or raise.

    `needs` is the compute capability the op's Pallas kernel requires (default 8.0).
    """
    needs = needs or MIN_COMPUTE_CAPABILITY
    cc = compute_capability()
    if implementation is None:
        return "pallas" if cc is not None and cc >= needs else "xla"
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{op}: implementation must be None or one of {IMPLEMENTATIONS}, got {implementation!r}")
    if implementation == "pallas" and (cc is None or cc < needs):
        seen = "no CUDA GPU" if cc is None else f"a GPU of compute capability {cc[0]}.{cc[1]}"
        raise ImplementationError(
            f"{op}: implementation='pallas' needs a CUDA GPU of compute capability >= {needs[0]}.{needs[1]}, "
            f"but this process sees {seen}. Use implementation='xla' (the reference) or 'interpret'."
        )
    return implementation


def triton_call(
    kernel: Callable[..., None],
    *,
    out_shape: Any,
    grid: Sequence[int] | int,
    name: str,
    interpret: bool,
    in_specs: Any = pl.no_block_spec,
    out_specs: Any = pl.no_block_spec,
    num_warps: int = 4,
    num_stages: int | None = None,
    input_output_aliases: Mapping[int, int] | None = None,
) -> Callable[..., Any]:
    """`pl.pallas_call` with the Triton lowering: the only place our kernels meet Pallas' launcher."""
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        input_output_aliases=dict(input_output_aliases or {}),
        compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=name,
    )


# In-kernel primitives of the Triton lowering. `pl.dot` was removed in jax 0.12; the Triton module's
# `dot` exists in 0.10 and 0.11 alike.
load = pl_triton.load
store = pl_triton.store
dot = pl_triton.dot
atomic_add = pl_triton.atomic_add


def mosaic_gpu():
    """The Mosaic GPU Pallas module (Hopper wgmma/TMA kernels), imported on demand."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    return plgpu


# Mosaic GPU ports of the Triton kernels (implementation="pallas:mosaic"; the Adam step is the pilot). They use
# the API of jax >= 0.11: `plgpu.kernel` + `plgpu.emit_pipeline`, and refs (`jax.new_ref`) that the kernel
# writes in place (how a `plgpu.kernel` aliases its inputs; `pl.pallas_call` no longer lowers to Mosaic GPU
# there). Measured on jax 0.11.2 (H200); it lowers under 0.12 as well.
MOSAIC_VARIANT = "pallas:mosaic"
MOSAIC_MIN_JAX = (0, 11)


def resolve_mosaic(op: str) -> str:
    """Check that `implementation="pallas:mosaic"` can run here (jax >= 0.11, a Hopper or newer GPU), or raise."""
    if JAX_VERSION < MOSAIC_MIN_JAX:
        raise ImplementationError(
            f"{op}: implementation={MOSAIC_VARIANT!r} needs jax >= {'.'.join(map(str, MOSAIC_MIN_JAX))} "
            f"(the Mosaic GPU pallas_call API), this is jax {jax.__version__}. Use 'pallas' (the Triton kernel).")
    resolve_implementation("pallas", op=f"{op} ({MOSAIC_VARIANT})", needs=(9, 0))
    return MOSAIC_VARIANT


def num_sms() -> int:
    device = gpu_device()
    return int(getattr(device, "core_count", 0) or 132) if device is not None else 1
