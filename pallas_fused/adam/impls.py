"""The Adam leaf step's implementations, one object per backend, and the choice of `implementation=None`.

One leaf is one tensor's step: g, m, v (and p) in, the update (or the new p), m, v out (see api.py). Each
implementation answers the same four questions, as the FP8 GEMM's do (fp8/gemm.py), so that the api asks them in one
place and a tuner has something to time:

- `supported(args, device)`: None where it steps this leaf on this device, else why not (a sentence);
- `candidates(args, device)`: the configs worth timing, by name, its default first;
- `default_config(args, device)`: the launch it runs without a tuned one (this device kind's tuning table, else the
  kernel's heuristic);
- `__call__(args, config)`: run it; config None runs the default launch.

`XLA` (the jnp reference, reference.py: XLA's fused elementwise step) runs every leaf. `TRITON` (kernel.py) steps
fp32/bf16 and 8-bit states on a GPU of compute capability 8.0 or newer; `INTERPRET` is the same kernels in the Pallas
interpreter (CPU tests). `SM90` (kernel_mosaic.py, the Mosaic GPU port, "pallas:sm90") steps fp32/bf16 states on a
Hopper GPU with jax >= 0.11.

`implementation=None` on a GPU chooses per leaf (`choose`): XLA's fused step for fp32/bf16 states, the Triton kernel
for 8-bit ones (see `default_choice` for the measurements). A named implementation runs every leaf unless `refuses`
names a reason (its GPU and jax were checked when the name was resolved, `_backend.resolve_implementation`).

The Pallas kernels run on each device's shard of a tensor under jit (`fp32_sharded`, `q8_sharded`): the step is
elementwise, so params, grads and fp32 states sharded alike never move.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from pallas_fused import _backend, _impl, _sharding, _tuning
from pallas_fused._impl import current_device as current_device  # the device the objects answer for
from pallas_fused.adam import kernel as _kernel
from pallas_fused.adam import reference as _ref


@dataclasses.dataclass(frozen=True)
class LeafArgs:
    """One leaf's step: grad; mu, nu (arrays, or `api.QuantizedMoment`s for 8-bit states); param (None: no weight
    decay, and not in place); s, the kernel's scalar operand (`kernel.scalar_operand`); inplace: write the new param
    (else the update, in u_dtype) over its inputs."""

    grad: Any
    mu: Any
    nu: Any
    param: Any
    s: Any
    inplace: bool
    u_dtype: Any = None

    @property
    def quantized(self) -> bool:
        """Whether the moments are 8-bit (`QuantizedMoment`s: codes and absmax)."""
        return hasattr(self.mu, "codes")


class Implementation(_impl.Implementation):
    """One backend of the leaf step (see the module docstring). Returns (update or new param, mu, nu), the moments
    as the args' (arrays, or (codes, absmax) pairs for 8-bit states: the api wraps them)."""

    op = "adam leaf"


class Xla(Implementation):
    """The jnp reference: elementwise on the tensor's own shape (8-bit states on its flattening), so XLA fuses and
    partitions it like any elementwise op."""

    name = "xla"

    def __call__(self, args, config=None):
        if not args.quantized:
            return _ref.adam_leaf_reference(args.grad, args.mu, args.nu, args.s, args.param, inplace=args.inplace,
                                            u_dtype=args.u_dtype)
        flat = lambda x: None if x is None else x.reshape(-1)  # noqa: E731
        mu, nu = args.mu, args.nu
        out, mc, ma, vc, va = _ref.adam_leaf_reference_q8(
            flat(args.grad), mu.codes, mu.absmax, nu.codes, nu.absmax, args.s, flat(args.param),
            inplace=args.inplace, u_dtype=args.u_dtype)
        return out.reshape(args.grad.shape), (mc, ma), (vc, va)


class Triton(Implementation):
    """The Triton kernels (kernel.py): `adam_fp32` for fp32/bf16 states, `adam_q8` for 8-bit ones; in the Pallas
    interpreter where `interpret` (named "interpret" then, and running on any device). Config: a `kernel.Launch`."""

    def __init__(self, interpret: bool):
        self.interpret = interpret
        self.name = "interpret" if interpret else "pallas"

    def supported(self, args, device):
        if self.interpret or (device.compute_capability or (0, 0)) >= _backend.MIN_COMPUTE_CAPABILITY:
            return None
        need = ".".join(map(str, _backend.MIN_COMPUTE_CAPABILITY))
        return f"needs a GPU of compute capability {need} or newer, this device has {device.compute_capability}"

    def default_config(self, args, device):
        return _kernel.default_launch("q8" if args.quantized else "fp32")

    def __call__(self, args, config=None):
        if args.quantized:
            out, mc, ma, vc, va = q8_sharded(args, interpret=self.interpret, launch=config)
            return out, (mc, ma), (vc, va)

        def step(s, *flat):
            return _kernel.adam_fp32(s, *flat, inplace=args.inplace, interpret=self.interpret, u_dtype=args.u_dtype,
                                     launch=config)

        return fp32_sharded(args, step)


class Sm90(Implementation):
    """The Mosaic GPU port of the fp32/bf16-state kernel (kernel_mosaic.py). Config: a `kernel_mosaic.MosaicLaunch`."""

    name = "pallas:sm90"

    def supported(self, args, device):
        if device.compute_capability is None or device.compute_capability[0] != 9:
            return f"needs a Hopper GPU (compute capability 9.0), this device has {device.compute_capability}"
        if _backend.JAX_VERSION < (0, 11):
            return f"needs jax >= 0.11 (plgpu.kernel writing refs in place), this is jax {jax.__version__}"
        return self.refuses(args)

    def refuses(self, args):
        if args.quantized:
            return ("steps fp32/bf16 states only (the 8-bit kernel has no Mosaic GPU port yet); use 'pallas' for "
                    "state_bits=8")
        return None

    def default_config(self, args, device):
        from pallas_fused.adam import kernel_mosaic

        return kernel_mosaic.default_launch()

    def __call__(self, args, config=None):
        def step(s, *flat):
            from pallas_fused.adam import kernel_mosaic

            return kernel_mosaic.adam_fp32(s, *flat, inplace=args.inplace, u_dtype=args.u_dtype, launch=config)

        return fp32_sharded(args, step)


XLA, TRITON, INTERPRET, SM90 = Xla(), Triton(interpret=False), Triton(interpret=True), Sm90()
IMPLEMENTATIONS = {impl.name: impl for impl in (XLA, TRITON, INTERPRET, SM90)}  # by resolved implementation name


def default_choice(args: LeafArgs, device: _tuning.Device) -> Implementation:
    """What `implementation=None` runs on a GPU. fp32/bf16 states take XLA's fused elementwise step: both are at the
    HBM ceiling in place, and on the composable path XLA also fuses the update with optax.apply_updates, which a
    kernel cannot. 8-bit states take the Triton kernel. The timings: docs/performance.md, "Fused AdamW"."""
    return TRITON if args.quantized else XLA


def choose(args: LeafArgs, device: _tuning.Device) -> tuple[Implementation, Any]:
    """(implementation, config) for `implementation=None` on a GPU: `default_choice`, with its default launch
    (config None)."""
    return default_choice(args, device), None


# ----------------------------------------------------------------------------------------------
# sharding (see pallas_fused._sharding): the step is elementwise, so every operand keeps its sharding


def fp32_sharded(args: LeafArgs, step: Callable):
    """An fp32/bf16-state kernel on each shard of the tensor (any sharding of any axis: each device steps its own
    elements). `step(s, g, m, v[, p])` takes a flat view of the shard (as `kernel.adam_fp32`) and returns flat (out, m,
    v)."""
    grad, mu, nu, param = args.grad, args.mu, args.nu, args.param
    shape = grad.shape

    def local(s, g, m, v, *p):
        flat = [x.reshape(-1) for x in (g, m, v, *p)]
        out, m, v = step(s, *flat)
        return out.reshape(g.shape), m.reshape(g.shape), v.reshape(g.shape)

    t = " ".join(f"d{i}" for i in range(len(shape)))
    arrays = (grad, mu, nu) + (() if param is None else (param,))
    rule = ", ".join(["hp"] + [t] * len(arrays)) + f" -> {t}, {t}, {t}"
    return _sharding.partitioned(local, rule, replicated=("hp",))(args.s, *arrays)


def q8_sharded(args: LeafArgs, *, interpret: bool, launch):
    """The 8-bit kernel on each device's quantization blocks. Returns (out, mu codes, mu absmax, nu codes, nu
    absmax).

    The state is the row-major flattening cut into blocks of 256, so it shards along blocks: the (n,)
    gradient and (n,) codes are seen as (blocks, 256) and the (blocks,) absmaxes follow. A shard of a
    weight maps to whole blocks of the state when the weight is split along its leading axis and each
    shard holds a multiple of 256 elements (e.g. (M, N) over D devices with (M / D) * N % 256 == 0): then
    nothing moves. Otherwise (another axis split, or a shard boundary inside a block) XLA reshards the
    gradient/param into the state's block layout around the kernel: correct, at the cost of that traffic.
    A tensor whose size is not a multiple of 256 (a padded last block) is not partitioned at all.
    """
    grad, mu, nu, param = args.grad, args.mu, args.nu, args.param
    n, shape = grad.size, grad.shape

    def local(s, g, mc, ma, vc, va, *p):
        flat = lambda x: x.reshape(-1)  # noqa: E731
        out, mc2, ma, vc2, va = _kernel.adam_q8(s, flat(g), flat(mc), ma, flat(vc), va, *map(flat, p),
                                                inplace=args.inplace, interpret=interpret, u_dtype=args.u_dtype,
                                                launch=launch)
        return out.reshape(g.shape), mc2.reshape(mc.shape), ma, vc2.reshape(vc.shape), va

    if n % _ref.QBLOCK:  # padded: the kernel masks the tail of the flat tensor, run it whole
        out, mc, ma, vc, va = local(args.s, grad, mu.codes, mu.absmax, nu.codes, nu.absmax,
                                    *(() if param is None else (param,)))
        return out.reshape(shape), mc, ma, vc, va
    blocks = lambda x: x.reshape(-1, _ref.QBLOCK)  # noqa: E731
    arrays = [blocks(grad), blocks(mu.codes), mu.absmax, blocks(nu.codes), nu.absmax]
    terms = ["hp", "b q", "b q", "b", "b q", "b"]
    if param is not None:
        arrays.append(blocks(param))
        terms.append("b q")
    rule = ", ".join(terms) + " -> b q, b q, b, b q, b"
    out, mc, ma, vc, va = _sharding.partitioned(local, rule, replicated=("hp", "q"))(args.s, *arrays)
    return out.reshape(shape), mc.reshape(-1), ma, vc.reshape(-1), va
