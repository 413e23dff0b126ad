"""How a weight is seen by its contraction, and where an operand comes from.

`Layout`: the stored weight, the transposes and reshapes the model applies to it before the contraction, and that
operand seen as a (K, N) matrix. `QuantizedWeight`: a frozen weight stored quantized (QDoRA's, or an FP8 base's),
readable as the dequantized array.
`Lineage`: while an adapted model runs, the casts, transposes and reshapes applied to params (and to their
results), so that an operand is known to be a param by identity, never by its shape.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import Any

import jax
import jax.numpy as jnp
from flax.core import meta

from pallas_fused.adapt._stacked import refuse_quantized
from pallas_fused.dora.quant import FP8_RECIPES, Fp8Kernel, dequantize, quantize_fp8, quantize_int8, quantize_nf4

# The formats a frozen weight is stored in: QDoRA's, and an FP8 base's ("fp8_<recipe>").
_QUANTIZERS = {"int8": quantize_int8, "nf4": quantize_nf4,
               **{f"fp8_{r}": lambda w, r=r: quantize_fp8(w, r) for r in FP8_RECIPES}}

# A step from a stored weight towards an operand: ("transpose", permutation) or ("reshape", new shape). Casts are
# not steps: the weight is the same values in another dtype.
Step = tuple[str, tuple[int, ...]]


def _apply(w, steps: tuple[Step, ...]):
    for op, arg in steps:
        w = jnp.transpose(w, arg) if op == "transpose" else w.reshape(arg)
    return w


def _shapes(stored: tuple[int, ...], steps: tuple[Step, ...]) -> list[tuple[int, ...]]:
    """The shape before each step, then the operand's."""
    shapes = [stored]
    for op, arg in steps:
        shapes.append(tuple(shapes[-1][a] for a in arg) if op == "transpose" else tuple(arg))
    return shapes


@dataclasses.dataclass(frozen=True)
class Layout:
    """A weight stored with shape `stored`, turned into the operand (shape `shape`) by `steps`, the operand seen
    as (K, N): its axes `contract` (paired in order with the activation's) then `free`."""

    shape: tuple[int, ...]
    contract: tuple[int, ...]
    free: tuple[int, ...]
    stored: tuple[int, ...] = None
    steps: tuple[Step, ...] = ()

    def __post_init__(self):
        if self.stored is None:
            object.__setattr__(self, "stored", self.shape)

    @property
    def k(self) -> int:
        return math.prod(self.shape[a] for a in self.contract)

    @property
    def n(self) -> int:
        return math.prod(self.shape[a] for a in self.free)

    @property
    def _perm(self) -> tuple[int, ...]:
        return self.contract + self.free

    def operand_2d(self, w):
        """The operand (shape `shape`) as (K, N)."""
        if self._perm != tuple(range(len(self.shape))):
            w = jnp.transpose(w, self._perm)
        return w.reshape(self.k, self.n)

    def to_2d(self, w):
        """The stored weight (shape `stored`) as (K, N)."""
        return self.operand_2d(_apply(w, self.steps))

    def from_2d(self, w2):
        """`to_2d`'s inverse: the (K, N) matrix as a weight of the stored shape."""
        w = w2.reshape(tuple(self.shape[a] for a in self._perm))
        inverse = tuple(self._perm.index(a) for a in range(len(self.shape)))
        w = w if inverse == tuple(range(len(self.shape))) else jnp.transpose(w, inverse)
        shapes = _shapes(self.stored, self.steps)
        for (op, arg), before in reversed(list(zip(self.steps, shapes))):
            w = jnp.transpose(w, tuple(arg.index(a) for a in range(len(arg)))) if op == "transpose" else \
                w.reshape(before)
        return w

    def describe(self) -> str:
        """The steps as the model wrote them, e.g. ``.T`` or ``reshape(64, 4, 16)``; "" for the weight as stored."""
        return " ".join(f".transpose{arg}" if op == "transpose" else f".reshape{arg}" for op, arg in self.steps)


class Lineage:
    """Where arrays came from while an adapted model runs: each output of a cast, transpose or reshape of a param
    (or of such an output) maps to its input and the step. Strong references to both keep their ids valid; only
    params and what derives from them are held, never activations, and the table lives as long as the
    outermost adapted call."""

    def __init__(self):
        self._from: dict[int, tuple[Any, Any, Step | None]] = {}

    def known(self, x) -> bool:
        entry = self._from.get(id(x))
        return entry is not None and entry[0] is x

    def note(self, out, source, step: Step | None) -> None:
        if out is not source:
            self._from[id(out)] = (out, source, step)

    def root(self, x, params: dict[str, Any]) -> tuple[str, tuple[Step, ...]] | None:
        """(name of the param `x` derives from, the steps from it to `x`), or None."""
        steps = []
        while True:
            for name, p in params.items():
                if _same(p, x):
                    return name, tuple(s for s in reversed(steps) if s is not None)
            entry = self._from.get(id(x))
            if entry is None or entry[0] is not x:
                return None
            _, x, step = entry
            steps.append(step)


def _same(param, x) -> bool:
    """Whether `x` is `param`: the same array, or a QuantizedWeight holding the same arrays (NNX's get_value()
    hands out a new container of the same leaves on each read)."""
    if param is x:
        return True
    if not (isinstance(param, QuantizedWeight) and isinstance(x, QuantizedWeight)):
        return False
    a, b = jax.tree_util.tree_leaves(param), jax.tree_util.tree_leaves(x)
    return len(a) == len(b) and all(u is v for u, v in zip(a, b))


_local = threading.local()


def current_lineage() -> Lineage | None:
    """This thread's lineage while an adapted model runs, else None."""
    return getattr(_local, "lineage", None)


def set_lineage(lineage: Lineage | None) -> None:
    _local.lineage = lineage


# jax.Array methods a model may call on a weight that a QuantizedWeight does not offer: a ValueError names them
_ARRAY_READS = frozenset({"mT", "sum", "mean", "max", "min", "prod", "std", "var", "flatten", "ravel", "squeeze",
                          "swapaxes", "dot", "clip", "take", "at", "conj", "real", "imag", "view", "round", "all",
                          "any", "argmax", "argmin", "cumsum", "item", "tolist"})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight(meta.AxisMetadata):
    """A frozen weight stored quantized (QDoRA, or an FP8 base): `kernel` is the (K, N) `Int8Kernel` /
    `NF4Kernel` / `Fp8Kernel` of the weight seen through `layout`. Read the way a model reads a weight (linen
    unboxes it; NNX's ``w[...]``, ``w.value``, ``w.get_value()``, then ``.T``, ``.astype``, ``.reshape``,
    ``jnp.asarray``) it is the dequantized weight in its stored shape and `dtype`: the model's own code runs
    unchanged, and the rule's op reads the codes instead, so the dequantized copy is dead code under jit. Any other
    read is a ValueError naming the weight (`where`)."""

    kernel: Any
    layout: Layout = dataclasses.field(metadata=dict(static=True))
    dtype: Any = dataclasses.field(metadata=dict(static=True))
    where: str = dataclasses.field(default="", metadata=dict(static=True))

    @classmethod
    def quantize(cls, w, layout: Layout, fmt: str, where: str = "") -> QuantizedWeight:
        return cls(_QUANTIZERS[fmt](layout.to_2d(jnp.asarray(w))), layout, jnp.dtype(w.dtype), where)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.layout.stored

    @property
    def ndim(self) -> int:
        return len(self.layout.stored)

    @property
    def size(self) -> int:
        return math.prod(self.layout.stored)

    def dense(self, dtype=None) -> jax.Array:
        """The dequantized weight, in its stored shape (known to the lineage as this weight)."""
        w = self.layout.from_2d(dequantize(self.kernel, dtype or self.dtype))
        lineage = current_lineage()
        if lineage is not None:
            lineage.note(w, self, None)
        return w

    def __jax_array__(self):
        return self.dense()

    def __getitem__(self, key):
        return self.dense() if key is Ellipsis or key == () else self.dense()[key]

    @property
    def T(self):  # noqa: N802 - the array attribute
        return self.dense().T

    def astype(self, dtype, **kwargs):
        return self.dense().astype(dtype, **kwargs)

    def reshape(self, *shape, **kwargs):
        return self.dense().reshape(*shape, **kwargs)

    def transpose(self, *axes):
        return self.dense().transpose(*axes)

    def __getattr__(self, name):
        if name not in _ARRAY_READS:  # probes (hasattr) by jax and flax must see an AttributeError
            raise AttributeError(name)
        kind = "FP8 base" if isinstance(self.kernel, Fp8Kernel) else "QDoRA weight"
        raise ValueError(f"adapt: the {kind} {self.where or '(quantized)'} was read as `.{name}`: a quantized "
                         f"weight reads as an array through [...], .value / get_value(), .T, .transpose, .astype, "
                         f".reshape, jnp.asarray or .shape / .ndim / .dtype only")

    # flax.core.meta.AxisMetadata
    def unbox(self):
        return self.dense()

    def replace_boxed(self, val):
        raise ValueError("a QuantizedWeight (a frozen weight stored quantized) cannot be replaced by a transformed "
                         "value")

    # a lifted transform stacking the params of the module that holds it (nn.scan, nn.vmap)
    def add_axis(self, index, params):
        raise refuse_quantized(self.where)

    def remove_axis(self, index, params):
        raise refuse_quantized(self.where)


def weight_2d(layout: Layout, w):
    """The stored weight as its (K, N) kernel: the packed kernel of a QuantizedWeight, else the 2-D view."""
    return w.kernel if isinstance(w, QuantizedWeight) else layout.to_2d(w)
