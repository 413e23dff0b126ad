"""Wrong results XLA's GPU compiler is known to give, and the warning that names the flag avoiding each.

They hit the model around the kernels as much as the kernels, so no choice of implementation avoids them: the
first op resolved on an affected GPU warns once per process (`_resolve.resolve_implementation`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings

import jax

from pallas_fused import _devices, _jax_compat


@dataclasses.dataclass(frozen=True)
class XlaMiscompile:
    """A wrong result XLA's GPU compiler gives in a range of jax versions, and the XLA pass whose disabling avoids
    it."""

    since: tuple[int, ...]  # the first jax version measured wrong
    until: tuple[int, ...] | None  # the first version measured right again (None: none measured yet)
    disable_pass: str  # XLA_FLAGS=--xla_disable_hlo_passes=<this> avoids it
    what: str  # one sentence: what comes out wrong, where it was measured

    def affects(self, version: tuple[int, ...]) -> bool:
        return version >= self.since and (self.until is None or version < self.until)

    def describe(self) -> str:
        return f"jax {jax.__version__}'s XLA on the GPU gets {self.what}"


# jax 0.12.0's XLA (CUDA plugin 0.12.0.1) gets the backward pass of grouped-query attention wrong on the GPU with its
# default options (key and value heads repeated over the query heads, as HF's Flax Llama does), in float32 as in
# bf16, with or without pallas_fused, whichever implementation runs the adapters; with the reduce-decomposer pass
# disabled the gradients agree with the CPU's as on jax 0.11.2. jax 0.12.1 gets the reproducer
# (tests/adapt/_gqa_cotangent.py) right in every case 0.12.0 got wrong. The measurements and the report to XLA are
# in docs/gpu_tests.md.
XLA_GPU_MISCOMPILES = (
    XlaMiscompile(since=(0, 12), until=(0, 12, 1), disable_pass="reduce-decomposer",
                  what="gradients through grouped-query attention (key-value heads repeated over the query heads) "
                       "far off, in float32 too, with or without pallas_fused (docs/gpu_tests.md)"),
)


def xla_disabled_passes(xla_flags: str | None = None) -> frozenset[str]:
    """The passes that `--xla_disable_hlo_passes=a,b` flags in XLA_FLAGS (or `xla_flags`) disable."""
    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    names = set()
    for flag in flags.split():
        key, _, value = flag.partition("=")
        if key.lstrip("-") == "xla_disable_hlo_passes":
            names.update(name for name in value.strip("'\"").split(",") if name)
    return frozenset(names)


def xla_gpu_miscompiles() -> tuple[XlaMiscompile, ...]:
    """The entries of XLA_GPU_MISCOMPILES that apply to this process: a GPU present, the jax version affected,
    the pass not disabled through XLA_FLAGS."""
    if _devices.gpu_device() is None:
        return ()
    disabled, version = xla_disabled_passes(), _jax_compat.JAX_VERSION
    return tuple(m for m in XLA_GPU_MISCOMPILES if m.affects(version) and m.disable_pass not in disabled)


@functools.cache
def warn_xla_miscompiles() -> None:
    """Warns of each XLA miscompile that applies here, naming the flag that avoids it, once per process (XLA reads
    XLA_FLAGS once, when jax first uses a device)."""
    for m in xla_gpu_miscompiles():
        warnings.warn(f"{m.describe()}. Set XLA_FLAGS=--xla_disable_hlo_passes={m.disable_pass} before jax starts "
                      f"to avoid it.", RuntimeWarning, stacklevel=4)
