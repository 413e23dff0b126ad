"""The one selector of implementation that every public op takes, and its refusals:

    implementation=None                 "pallas" on a CUDA GPU of compute capability >= 8.0 (8.9 for FP8),
                                        else "xla"
    implementation="xla"                the plain-jnp reference, compiled by XLA (runs anywhere)
    implementation="pallas"             the op's Pallas kernels, compiled for the GPU (an error without one);
                                        where an op has several variants, its own rule picks one per call
    implementation="pallas:<variant>"   one named variant of the op's kernels, forced
    implementation="interpret"          the Pallas kernels in interpret mode (runs anywhere, slowly; CI uses it),
                                        the variant picked by the same rule as "pallas"
    implementation="interpret:<variant>" that variant's Pallas kernels in interpret mode: how CI tests each
                                        variant on the CPU (Mosaic GPU variants: with jax >= 0.12, whose
                                        Mosaic GPU interpret mode simulates warpgroups, TMA and barriers)

Each op with variants lists them in one table in its own package, `VARIANTS = {"pallas:<name>": Variant(...)}`
(the model is tokamax's IMPLEMENTATIONS), and passes it to `resolve_implementation`, which validates the name
against that table and the machine, and names every valid choice when it refuses one. Variants are named by the
backend they run on, the same name in every op: "pallas:sm90" is an op's Mosaic GPU kernel for Hopper. An
explicitly requested implementation that cannot run raises `ImplementationError`; nothing falls back silently.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from collections.abc import Mapping

import jax

from pallas_fused import _devices, _jax_compat, _xla_workarounds

IMPLEMENTATIONS = ("pallas", "xla", "interpret")
MIN_COMPUTE_CAPABILITY = (8, 0)


class ImplementationError(ValueError):
    """An implementation was requested that cannot run in this process."""


@dataclasses.dataclass(frozen=True)
class Variant:
    """One "pallas:<name>" entry of an op's `VARIANTS` table: what it needs to run."""

    doc: str  # one line: what the variant does differently
    needs: tuple[int, int] = MIN_COMPUTE_CAPABILITY  # the GPU's compute capability
    min_jax: tuple[int, ...] = (0,)  # the jax version (Mosaic GPU kernels need the 0.11 API)
    interpretable: bool = True  # "interpret:<name>" runs its kernels in interpret mode
    # Mosaic GPU kernels interpret only where jax has Mosaic GPU's interpret mode (`mosaic_interpret`).
    mosaic: bool = False


def valid_implementations(variants: Mapping[str, Variant] | None = None) -> tuple:
    """Every value `implementation=` takes for an op with these variants, None first."""
    variants = variants or {}
    interpreted = tuple("interpret:" + name.partition(":")[2] for name, v in variants.items() if v.interpretable)
    return (None, *IMPLEMENTATIONS, *variants, *interpreted)


def split_implementation(impl: str) -> tuple[str, str | None]:
    """A resolved implementation as (base, variant): "interpret:merged" -> ("interpret", "merged"),
    "pallas" -> ("pallas", None)."""
    base, _, variant = impl.partition(":")
    return base, variant or None


def mosaic_interpret(what: str):
    """Mosaic GPU's interpret mode (`plgpu.kernel(interpret=...)`: the kernel's warpgroups, TMA copies and
    barriers simulated on the CPU), as the parameters to pass; jax >= 0.12 has it. `what` names the caller in the
    error raised where this jax lacks it."""
    if not _jax_compat.has_mosaic_interpret():
        raise ImplementationError(f"{what} runs a Mosaic GPU kernel in interpret mode, which needs jax >= 0.12 "
                                  f"(this is jax {jax.__version__}); on a Hopper GPU use 'pallas'.")
    return _jax_compat.mosaic_gpu().InterpretGPUParams()


def _check_gpu(op: str, implementation: str, needs: tuple[int, int]) -> None:
    cc = _devices.compute_capability()
    if cc is None or cc < needs:
        seen = "no CUDA GPU" if cc is None else f"a GPU of compute capability {cc[0]}.{cc[1]}"
        raise ImplementationError(
            f"{op}: implementation={implementation!r} needs a CUDA GPU of compute capability >= {needs[0]}.{needs[1]}, "
            f"but this process sees {seen}. Use implementation='xla' (the reference) or 'interpret'.")


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _user_stacklevel() -> int:
    """The `stacklevel` that makes a warning raised in the caller name the first frame outside pallas_fused: the
    user's line, where Python shows a DeprecationWarning (in __main__) and where the fix goes."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    return level


def resolve_implementation(implementation: str | None, *, op: str, needs: tuple[int, int] | None = None,
                           variants: Mapping[str, Variant] | None = None,
                           renamed: Mapping[str, str] | None = None) -> str:
    """Turn the user's `implementation=` into the one that will run, or raise.

    `needs` is the compute capability the op's default Pallas kernels require (default 8.0); `variants` the op's
    `VARIANTS` table ("pallas:<name>" -> Variant); `renamed` the old spellings of its variants still accepted for a
    release ("pallas:<old>" -> "pallas:<new>"), each resolved as its new name with a DeprecationWarning. Returns
    "xla", "pallas", "interpret", "pallas:<name>" or "interpret:<name>" (see the module docstring;
    `split_implementation` takes it apart).
    """
    needs = needs or MIN_COMPUTE_CAPABILITY
    variants = variants or {}
    if implementation is None:
        cc = _devices.compute_capability()
        if cc is not None:
            _xla_workarounds.warn_xla_miscompiles()
        return "pallas" if cc is not None and cc >= needs else "xla"
    if renamed and isinstance(implementation, str) and implementation in renamed:
        new = renamed[implementation]
        warnings.warn(f"{op}: implementation={implementation!r} is deprecated and will be removed in the next "
                      f"release; use {new!r}, the same kernel", DeprecationWarning, stacklevel=_user_stacklevel())
        implementation = new
    base, variant = split_implementation(implementation) if isinstance(implementation, str) else ("", None)
    entry = variants.get(f"pallas:{variant}") if variant else None
    known = implementation in IMPLEMENTATIONS or (entry is not None and base == "pallas")
    known = known or (entry is not None and base == "interpret" and entry.interpretable)
    if not known:
        names = ", ".join(repr(name) for name in valid_implementations(variants))
        hint = ""
        if entry is not None and base == "interpret":
            hint = f" ({implementation!r}: a Mosaic GPU kernel, which the Pallas interpreter does not run)"
        raise ValueError(f"{op}: implementation must be None or one of {names}, got {implementation!r}{hint}")
    if base == "interpret" and entry is not None and entry.mosaic:
        mosaic_interpret(f"{op}: implementation={implementation!r}")
    if base == "pallas":
        if entry is not None and _jax_compat.JAX_VERSION < entry.min_jax:
            raise ImplementationError(
                f"{op}: implementation={implementation!r} needs jax >= {'.'.join(map(str, entry.min_jax))}, this is "
                f"jax {jax.__version__}. Use 'pallas' (the Triton kernels).")
        _check_gpu(op, implementation, entry.needs if entry is not None else needs)
        _xla_workarounds.warn_xla_miscompiles()
    return implementation
