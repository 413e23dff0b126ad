"""Every difference between the jax versions we run on, and nothing else.

The floor is jax 0.10.2 and the newest 0.12.1 (both in CPU CI); the GPU machine runs 0.11. Code elsewhere in the
package asks this module (through `_backend`) instead of testing `jax.__version__` or an API's shape itself, so a
new jax version is one file to read.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings

import jax
from jax.experimental.pallas import triton as pl_triton

# The Triton lowering warns on every compile under jax >= 0.11 that it is deprecated. Our kernels are
# all launched through `_launch.triton_call`, so moving one to Mosaic GPU touches one call site.
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning)

# Pallas' fuser registers a config option that is part of every jit's cache key when it is first imported, which
# the interpret mode does lazily under jax >= 0.12 (through the TPU lowering): a jitted step traced before one of
# our kernels first ran would then be traced again on its next call. Imported here, the key is the same from the
# first trace on.
with contextlib.suppress(ImportError):
    import jax.experimental.pallas.fuser  # noqa: F401


def _parse_version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


JAX_VERSION = _parse_version(jax.__version__)
JAX_011 = JAX_VERSION >= (0, 11)


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


def has_mosaic_interpret() -> bool:
    """Whether this jax has Mosaic GPU's interpret mode (jax >= 0.12)."""
    return getattr(mosaic_gpu(), "InterpretGPUParams", None) is not None


def mosaic_load(ref, *, layout):
    """All of a Mosaic GPU ref loaded in `layout`: jax 0.10 takes the index as an argument (`()` for the whole
    ref), jax >= 0.12 takes none (a view is indexed with `ref.at[...]` instead; 0.11 accepts both)."""
    plgpu = mosaic_gpu()
    if "idx" in inspect.signature(plgpu.load).parameters:
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


def trace_time_int(x) -> int | None:
    """The value of a traced integer scalar that is a constant of the trace, else None.

    optax.inject_hyperparams turns every int argument into `jnp.asarray(value)` inside the transformation's init;
    under `jax.jit(init)` that is a tracer of a constant, whose value jit knows while it traces. An argument that
    sets the state's structure (adamw's state_bits, GaLore's rank) is read from it, so a jitted init needs no
    static_args. Reading it goes through the tracer's `get_const`, which jax does not document: where a jax
    version lacks it, or the value is a real input of the traced function, this gives None and the caller's
    error names static_args."""
    if not isinstance(x, jax.core.Tracer) or getattr(x, "ndim", None) != 0:
        return None
    get_const = getattr(x, "get_const", None)
    try:
        value = get_const() if callable(get_const) else None
    except Exception:  # an internal API: any failure means "not known"
        return None
    if value is None or isinstance(value, jax.core.Tracer):
        return None
    try:
        as_int = int(value)
    except (TypeError, ValueError):
        return None
    return as_int if as_int == value else None
