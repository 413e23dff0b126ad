"""The one place that knows devices, jax versions and how kernels are launched.

Everything that differs between the jax versions we run on (0.10 and 0.12 in CPU CI, 0.11 on the GPU machine)
lives here, as does the one selector of implementation that every public op takes:

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
against that table and the machine, and names every valid choice when it refuses one. An explicitly requested
implementation that cannot run raises `ImplementationError`; nothing falls back silently.

Tuning is data: the measured launch parameters of a GPU kind live in pallas_fused/tuning/<device>.json (from the
benchmark sweeps, citing the results file behind them), read by `tuned`; a GPU without a table gets each op's own
heuristic. The choice is a pure function of shapes, dtypes and the device kind, the same on every host of a
multi-host job of one GPU kind (nothing is autotuned at run time).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from pallas_fused._tuning import TUNING_DIR, device_slug, tuned, tuning_table  # noqa: F401 - the ops' lookups

IMPLEMENTATIONS = ("pallas", "xla", "interpret")
MIN_COMPUTE_CAPABILITY = (8, 0)

# The Triton lowering warns on every compile under jax >= 0.11 that it is deprecated. Our kernels are
# all launched through `triton_call` below, so moving one to Mosaic GPU touches one call site.
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


class ImplementationError(ValueError):
    """An implementation was requested that cannot run in this process."""


@dataclasses.dataclass(frozen=True)
class XlaMiscompile:
    """A wrong result XLA's GPU compiler gives from a jax version on (no upper bound until a fixed one is measured),
    and the XLA pass whose disabling avoids it."""

    since: tuple[int, ...]  # the first jax version measured wrong
    disable_pass: str  # XLA_FLAGS=--xla_disable_hlo_passes=<this> avoids it
    what: str  # one sentence: what comes out wrong, where it was measured

    def describe(self) -> str:
        return f"jax {jax.__version__}'s XLA on the GPU gets {self.what}"


# On an H200 with jax 0.12.0.1, XLA's default options get the backward pass of grouped-query attention wrong (key
# and value heads repeated over the query heads, as HF's Flax Llama does): a plain HF Llama's weight gradients came
# out up to 111% away from the same model's on the CPU, in float32 at full precision as in bf16, with no
# pallas_fused in it, and so do a LoRA model's adapter gradients, whichever implementation runs the adapters. With
# the reduce-decomposer pass disabled they agree with the CPU as on jax 0.11.2 (to 0.0% in float32; 1.3% in bf16).
# The reproducer is tests/adapt/_gqa_cotangent.py, the account docs/gpu_tests.md.
XLA_GPU_MISCOMPILES = (
    XlaMiscompile(since=(0, 12), disable_pass="reduce-decomposer",
                  what="gradients through grouped-query attention (key-value heads repeated over the query heads) "
                       "up to 150% off, in float32 too, with or without pallas_fused (docs/gpu_tests.md)"),
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
    if gpu_device() is None:
        return ()
    disabled = xla_disabled_passes()
    return tuple(m for m in XLA_GPU_MISCOMPILES if JAX_VERSION >= m.since and m.disable_pass not in disabled)


@functools.cache
def _warn_xla_miscompiles() -> None:
    """Warns of each XLA miscompile that applies here, naming the flag that avoids it, once per process (XLA reads
    XLA_FLAGS once, when jax first uses a device): it hits the model around the kernels as much as the kernels, so
    no choice of implementation avoids it."""
    for m in xla_gpu_miscompiles():
        warnings.warn(f"{m.describe()}. Set XLA_FLAGS=--xla_disable_hlo_passes={m.disable_pass} before jax starts "
                      f"to avoid it.", RuntimeWarning, stacklevel=4)


@functools.cache
def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for launch grids."""
    return -(-a // b)


def grouped_pid(pid, num_m: int, num_n: int, group_m: int):
    """Map a 1-D program id to (pid_m, pid_n), walking group_m rows of tiles at a time: the programs that run at
    once share a few row tiles and a few column tiles (L2 reuse of both operands of a GEMM)."""
    width = group_m * num_n
    group = pid // width
    first_m = group * group_m
    size = jnp.minimum(num_m - first_m, group_m)
    pid_m = first_m + (pid % width) % size
    pid_n = (pid % width) // size
    return pid_m, pid_n


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): Triton's block shapes are powers of two."""
    return 1 << max(0, int(n) - 1).bit_length()


def gpu_device() -> jax.Device | None:
    """The first CUDA device, or None."""
    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        return None
    return devices[0] if devices else None


# A GPU to choose implementations and lower kernels for, in a process that may have none (see `gpu_target`).
_TARGET: list[tuple[tuple[int, int], str, int]] = []
# The GPUs `gpu_target` can stand for: compute capability -> (device kind, SM count).
TARGETS = {(8, 0): ("NVIDIA A100-SXM4-80GB", 108), (9, 0): ("NVIDIA H100 80GB HBM3", 132)}


@contextlib.contextmanager
def gpu_target(compute_capability: tuple[int, int]):
    """Choose implementations and lower kernels as for a CUDA GPU of `compute_capability` ((8, 0) or (9, 0)).

    For a process without that GPU: exporting a step for one (`jax.export.export(..., platforms=["cuda"])`) or
    checking that every kernel lowers for it on a CPU (tests/test_lowering.py). Inside, `implementation=None`
    and "pallas" pick that GPU's kernels and the shape rules use its SM count; running them still needs the GPU.
    jax's Triton lowering reads the GPU from the abstract mesh's device when the process has none."""
    if tuple(compute_capability) not in TARGETS:
        raise ValueError(f"gpu_target: compute_capability must be one of {sorted(TARGETS)}, got {compute_capability}")
    kind, sms = TARGETS[tuple(compute_capability)]
    device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=sms, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("gpu_target",), (jax.sharding.AxisType.Auto,), abstract_device=device)
    _TARGET.append((tuple(compute_capability), kind, sms))
    try:
        with jax.sharding.use_abstract_mesh(mesh):
            yield
    finally:
        _TARGET.pop()


def compute_capability() -> tuple[int, int] | None:
    if _TARGET:
        return _TARGET[-1][0]
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
    if _TARGET:
        return _TARGET[-1][1]
    device = gpu_device() or jax.devices()[0]
    return getattr(device, "device_kind", device.platform)


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


def _check_gpu(op: str, implementation: str, needs: tuple[int, int]) -> None:
    cc = compute_capability()
    if cc is None or cc < needs:
        seen = "no CUDA GPU" if cc is None else f"a GPU of compute capability {cc[0]}.{cc[1]}"
        raise ImplementationError(
            f"{op}: implementation={implementation!r} needs a CUDA GPU of compute capability >= {needs[0]}.{needs[1]}, "
            f"but this process sees {seen}. Use implementation='xla' (the reference) or 'interpret'.")


def resolve_implementation(implementation: str | None, *, op: str, needs: tuple[int, int] | None = None,
                           variants: Mapping[str, Variant] | None = None) -> str:
    """Turn the user's `implementation=` into the one that will run, or raise.

    `needs` is the compute capability the op's default Pallas kernels require (default 8.0); `variants` the op's
    `VARIANTS` table ("pallas:<name>" -> Variant). Returns "xla", "pallas", "interpret", "pallas:<name>" or
    "interpret:<name>" (see the module docstring; `split_implementation` takes it apart).
    """
    needs = needs or MIN_COMPUTE_CAPABILITY
    variants = variants or {}
    if implementation is None:
        cc = compute_capability()
        if cc is not None:
            _warn_xla_miscompiles()
        return "pallas" if cc is not None and cc >= needs else "xla"
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
        if entry is not None and JAX_VERSION < entry.min_jax:
            raise ImplementationError(
                f"{op}: implementation={implementation!r} needs jax >= {'.'.join(map(str, entry.min_jax))}, this is "
                f"jax {jax.__version__}. Use 'pallas' (the Triton kernels).")
        _check_gpu(op, implementation, entry.needs if entry is not None else needs)
        _warn_xla_miscompiles()
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


def has_mosaic_interpret() -> bool:
    """Whether this jax has Mosaic GPU's interpret mode (jax >= 0.12)."""
    return getattr(mosaic_gpu(), "InterpretGPUParams", None) is not None


def mosaic_interpret(what: str):
    """Mosaic GPU's interpret mode (`plgpu.kernel(interpret=...)`: the kernel's warpgroups, TMA copies and
    barriers simulated on the CPU), as the parameters to pass; jax >= 0.12 has it. `what` names the caller in the
    error raised where this jax lacks it."""
    if not has_mosaic_interpret():
        raise ImplementationError(f"{what} runs a Mosaic GPU kernel in interpret mode, which needs jax >= 0.12 "
                                  f"(this is jax {jax.__version__}); on a Hopper GPU use 'pallas'.")
    return mosaic_gpu().InterpretGPUParams()


def mosaic_load(ref, *, layout):
    """All of a Mosaic GPU ref loaded in `layout`: jax 0.10 takes the index as an argument (`()` for the whole
    ref), jax >= 0.12 takes none (a view is indexed with `ref.at[...]` instead; 0.11 accepts both)."""
    plgpu = mosaic_gpu()
    if "idx" in inspect.signature(plgpu.load).parameters:
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


def mosaic_rcp_rn(v, *, layout):
    """1 / v, correctly rounded (PTX rcp.rn.f32), of an fp32 Mosaic GPU array in `layout`: Mosaic GPU's own fp32
    division is not correctly rounded. Through Mosaic GPU's own arrays (`plgpu.inline_mgpu`), which its interpret
    mode does not run: there divide, as XLA's division is correctly rounded."""
    plgpu = mosaic_gpu()

    @plgpu.inline_mgpu(arg_types=(layout,), return_type=plgpu.ShapeDtypeStruct(v.shape, v.dtype, layout=layout))
    def rcp(_, array):
        return array._pointwise(array._lift_fast_instr("rcp.rn.f32"))

    return rcp(v)


# The Mosaic GPU ports of Triton kernels (the Adam step is the pilot) are the "pallas:mosaic" variant of their op.
# They use the API of jax >= 0.11: `plgpu.kernel` + `plgpu.emit_pipeline`, and refs (`jax.new_ref`) that the kernel
# writes in place (how a `plgpu.kernel` aliases its inputs; `pl.pallas_call` no longer lowers to Mosaic GPU there).
MOSAIC_VARIANT = "pallas:mosaic"
MOSAIC = Variant("the Mosaic GPU port of the Triton kernel", needs=(9, 0), min_jax=(0, 11), interpretable=False)


def num_sms() -> int:
    if _TARGET:
        return _TARGET[-1][2]
    device = gpu_device()
    return int(getattr(device, "core_count", 0) or 132) if device is not None else 1
