"""What linen and NNX share: intercepting a model's contractions, finding the weight among their operands, and
running the matched ones as LoRA, DoRA / QDoRA or FP8.

Interception: while an adapted model runs, `jax.lax.dot_general` and `jax.numpy.einsum` are the functions below
(einsum is the library's own with its contractions routed through our dot_general). They hand the call to the
active front-end (linen or NNX), which knows where params live; outside an adapted model, and inside our own ops,
they are jax's. The module an operation belongs to is the innermost Flax module whose method is on the call stack:
the one whose code issued it (flax.linen.Dense for an nn.Dense, the user's module for a plain jnp.einsum).

A contraction is adapted when one operand is a param of that module (the same array, or the only param of its
shape: a param cast to the compute dtype is a new array) and a rule matches the module's path. The weight is
viewed as a (K, N) matrix: its contracting axes, in the order they pair with the activation's, flattened into K,
its other axes into N. Adapters are stored in that 2-D form: ``<weight>_lora_a`` (K, rank), ``<weight>_lora_b``
(rank, N), ``<weight>_magnitude`` (N,).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import sys
import threading
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import meta

from pallas_fused.adapt._stacked import refuse_quantized
from pallas_fused.adapt.rules import DoraRule, Fp8Rule, LoraRule, Rule, weight_path
from pallas_fused.dora.api import dora_dense
from pallas_fused.dora.flax import _merged
from pallas_fused.dora.lora import lora_dense
from pallas_fused.dora.quant import dequantize, quantize_int8, quantize_nf4
from pallas_fused.dora.reference import column_norm_reference
from pallas_fused.fp8.api import fp8_linear

ADAPTER_SUFFIXES = ("_lora_a", "_lora_b", "_magnitude")
_QUANTIZERS = {"int8": quantize_int8, "nf4": quantize_nf4}


@dataclasses.dataclass(frozen=True)
class Layout:
    """A weight of `shape` seen as (K, N): axes `contract` (paired in order with the activation's) then `free`."""

    shape: tuple[int, ...]
    contract: tuple[int, ...]
    free: tuple[int, ...]

    @property
    def k(self) -> int:
        return math.prod(self.shape[a] for a in self.contract)

    @property
    def n(self) -> int:
        return math.prod(self.shape[a] for a in self.free)

    @property
    def _perm(self) -> tuple[int, ...]:
        return self.contract + self.free

    def to_2d(self, w):
        if self._perm != tuple(range(len(self.shape))):
            w = jnp.transpose(w, self._perm)
        return w.reshape(self.k, self.n)

    def from_2d(self, w2):
        w = w2.reshape(tuple(self.shape[a] for a in self._perm))
        inverse = tuple(self._perm.index(a) for a in range(len(self.shape)))
        return w if inverse == tuple(range(len(self.shape))) else jnp.transpose(w, inverse)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight(meta.AxisMetadata):
    """A frozen weight stored quantized (QDoRA): `kernel` is the (K, N) `Int8Kernel` / `NF4Kernel` of the weight
    seen through `layout`. Read as a plain array (linen unboxes it, NNX indexes it with ``[...]``) it is the
    dequantized weight in its own shape and `dtype`: the model's own code runs unchanged, and the DoRA op reads the
    packed codes instead, so the dequantized copy is dead code under jit."""

    kernel: Any
    layout: Layout = dataclasses.field(metadata=dict(static=True))
    dtype: Any = dataclasses.field(metadata=dict(static=True))
    where: str = dataclasses.field(default="", metadata=dict(static=True))  # its path, for error messages
    fmt: str = dataclasses.field(default="", metadata=dict(static=True))

    @classmethod
    def quantize(cls, w, layout: Layout, fmt: str, where: str = "") -> QuantizedWeight:
        return cls(_QUANTIZERS[fmt](layout.to_2d(jnp.asarray(w))), layout, jnp.dtype(w.dtype), where, fmt)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.layout.shape

    @property
    def ndim(self) -> int:
        return len(self.layout.shape)

    def dense(self, dtype=None) -> jax.Array:
        return self.layout.from_2d(dequantize(self.kernel, dtype or self.dtype))

    def __getitem__(self, key):
        return self.dense()[key]

    # flax.core.meta.AxisMetadata
    def unbox(self):
        return self.dense()

    def replace_boxed(self, val):
        raise ValueError("a QuantizedWeight (QDoRA's frozen weight) cannot be replaced by a transformed value")

    # a lifted transform stacking (nn.scan, nn.vmap) the params of the module that holds it
    def add_axis(self, index, params):
        raise refuse_quantized(self.where, self.fmt)

    def remove_axis(self, index, params):
        raise refuse_quantized(self.where, self.fmt)


@dataclasses.dataclass(frozen=True)
class Site:
    """One adapted weight: the rule that matched it and how its contraction sees it."""

    name: str
    rule: Rule
    layout: Layout


def adapter_shapes(site: Site) -> dict[str, tuple[int, ...]]:
    """The adapter params a site adds, by name."""
    rule, k, n, name = site.rule, site.layout.k, site.layout.n, site.name
    if isinstance(rule, Fp8Rule):
        return {}
    shapes = {f"{name}_lora_a": (k, rule.rank), f"{name}_lora_b": (rule.rank, n)}
    if isinstance(rule, DoraRule):
        shapes[f"{name}_magnitude"] = (n,)
    return shapes


def is_adapter_name(name: str, siblings) -> bool:
    """Whether param `name` is an adapter of a weight among `siblings` (the names in the same module)."""
    return any(name.endswith(s) and name[: -len(s)] in siblings for s in ADAPTER_SUFFIXES)


def new_adapters(site: Site, w, key) -> dict[str, jax.Array]:
    """Fresh adapters for `w` (the stored weight, or its QuantizedWeight): B = 0, so the adapted op computes what
    the original does; the DoRA magnitude is the column norm of W, the starting point of the DoRA paper."""
    rule = site.rule
    if isinstance(rule, Fp8Rule):
        return {}
    assert isinstance(rule, LoraRule)
    dtype = w.dtype
    a = rule.lora_a_init(key, (site.layout.k, rule.rank), dtype)
    out = {f"{site.name}_lora_a": a, f"{site.name}_lora_b": jnp.zeros((rule.rank, site.layout.n), dtype)}
    if isinstance(rule, DoraRule):
        out[f"{site.name}_magnitude"] = magnitude(site, w, a, out[f"{site.name}_lora_b"])
    return out


def magnitude(site: Site, w, a, b) -> jax.Array:
    """||W + s A B|| per output feature, in the adapters' dtype."""
    rule = site.rule
    assert isinstance(rule, DoraRule)
    return column_norm_reference(weight_2d(site, w), a, b, rule.scale, jnp.float32).astype(a.dtype)


def weight_2d(site: Site, w):
    """The stored weight as its (K, N) kernel: the packed kernel of a QuantizedWeight, else the 2-D view."""
    return w.kernel if isinstance(w, QuantizedWeight) else site.layout.to_2d(w)


def merged_weight(site: Site, w, adapters: Mapping[str, Any]):
    """The plain weight, in its own shape and dtype, that computes what the adapted contraction does."""
    rule, name = site.rule, site.name
    dtype = w.dtype
    if isinstance(rule, Fp8Rule):
        return w
    assert isinstance(rule, LoraRule)
    a, b = adapters[f"{name}_lora_a"], adapters[f"{name}_lora_b"]
    if isinstance(rule, DoraRule):
        w2 = _merged(weight_2d(site, w), a, b, adapters[f"{name}_magnitude"], None, rule.scale)["kernel"]
    else:
        w2 = dequantize(weight_2d(site, w), jnp.float32) + rule.scale * (a.astype(jnp.float32) @ b.astype(jnp.float32))
    return site.layout.from_2d(w2).astype(dtype)


def check_site(site: Site, where: str) -> None:
    rule = site.rule
    if isinstance(rule, LoraRule) and rule.rank > min(site.layout.k, site.layout.n):
        raise ValueError(f"{rule!r} at {where}: rank {rule.rank} is larger than the layer, whose weight is "
                         f"{site.layout.k} x {site.layout.n} (K x N); the rank must be at most "
                         f"{min(site.layout.k, site.layout.n)}")


def run_site(site: Site, x2, w2, stored, adapters: Mapping[str, Any]):
    """The adapted (M, K) x (K, N) product: `w2` is the operand in the compute dtype, `stored` the stored weight
    (a QuantizedWeight for QDoRA, whose packed kernel the op reads instead)."""
    rule, name = site.rule, site.name
    if isinstance(rule, Fp8Rule):
        return fp8_linear(x2, w2, rule.config, implementation=rule.implementation)
    a, b = adapters[f"{name}_lora_a"], adapters[f"{name}_lora_b"]
    if isinstance(rule, DoraRule):
        kernel = stored.kernel if isinstance(stored, QuantizedWeight) else w2
        return dora_dense(x2, kernel, a, b, adapters[f"{name}_magnitude"], None, scale=rule.scale,
                          exact_norm_grad=rule.exact_norm_grad, implementation=rule.implementation,
                          save_merged=rule.save_merged)
    assert isinstance(rule, LoraRule)
    return lora_dense(x2, w2, a, b, None, scale=rule.scale, implementation=rule.implementation)


# -- the contraction -------------------------------------------------------------------------------------------


def _axes(dims, ndim) -> tuple[int, ...]:
    return tuple(int(d) % ndim for d in dims)


def layout_of(weight_shape, weight_contract) -> Layout:
    free = tuple(a for a in range(len(weight_shape)) if a not in weight_contract)
    return Layout(tuple(int(d) for d in weight_shape), tuple(weight_contract), free)


def split_operands(lhs, rhs, dimension_numbers, weight_side: str, where: str):
    """(activation, its contracting axes, the weight's Layout) of a dot_general whose weight is `weight_side`."""
    (lc, rc), (lb, rb) = dimension_numbers
    lc, rc = _axes(lc, lhs.ndim), _axes(rc, rhs.ndim)
    if tuple(lb) or tuple(rb):
        raise ValueError(f"{where}: the contraction has batch dimensions (lhs {tuple(lb)}, rhs {tuple(rb)}), e.g. one "
                         f"weight per expert; only contractions of an activation with one weight can be adapted")
    if weight_side == "rhs":
        return lhs, lc, layout_of(rhs.shape, rc)
    return rhs, rc, layout_of(lhs.shape, lc)


def contract(x, x_contract, layout: Layout, weight_side: str, product, out_dtype):
    """dot_general's result through `product` ((M, K) -> (M, N)): x flattened to (M, K), the output unflattened
    and ordered as dot_general orders it (lhs free axes, then rhs free axes)."""
    x_free = tuple(a for a in range(x.ndim) if a not in x_contract)
    perm = x_free + tuple(x_contract)
    xt = x if perm == tuple(range(x.ndim)) else jnp.transpose(x, perm)
    m = math.prod(x.shape[a] for a in x_free)
    y2 = product(xt.reshape(m, layout.k))
    x_free_shape = tuple(x.shape[a] for a in x_free)
    w_free_shape = tuple(layout.shape[a] for a in layout.free)
    y = y2.reshape(x_free_shape + w_free_shape)
    if weight_side == "lhs":
        nx = len(x_free_shape)
        y = jnp.transpose(y, tuple(range(nx, y.ndim)) + tuple(range(nx)))
    return y.astype(out_dtype)


def find_weight(params: Mapping[str, Any], lhs, rhs) -> tuple[str, str] | None:
    """(param name, "lhs" | "rhs") of the operand that is one of `params`, or None.

    The same array object first (a param used as stored), then the one param of the operand's shape (a param
    cast to the compute dtype, or a QuantizedWeight read as an array, is a new array). Several params of that
    shape and no identity: their names joined by commas, for `raise_if_ambiguous`."""
    candidates = {k: v for k, v in params.items()
                  if not is_adapter_name(k, params) and len(getattr(v, "shape", ())) >= 1}
    for side, op in (("rhs", rhs), ("lhs", lhs)):
        for k, v in candidates.items():
            if v is op:
                return k, side
    for side, op in (("rhs", rhs), ("lhs", lhs)):
        same = [k for k, v in candidates.items() if tuple(v.shape) == tuple(op.shape)]
        if len(same) == 1:
            return same[0], side
        if len(same) > 1:
            return ",".join(sorted(same)), side
    return None


def raise_if_ambiguous(name: str, rules, path: str) -> bool:
    """Whether `find_weight` found no single weight (`name` lists several); a ValueError where a rule matches one
    of them, since adapting the wrong one would be silently wrong."""
    if "," not in name:
        return False
    if rules is not None and any(r.matches(path, n) for r in rules for n in name.split(",")):
        raise ValueError(f"adapt: at {path}, a contraction's operand has the shape of several params ({name}) and "
                         f"is none of them as stored: which one to adapt is ambiguous")
    return True


def new_site(rule: Rule, path: str, name: str, lhs, rhs, dimension_numbers, side: str) -> Site:
    """The site of weight `name` of the module at `path`, matched by `rule`, checked against the layer."""
    where = weight_path(path, name)
    _, _, layout = split_operands(lhs, rhs, dimension_numbers, side, where)
    site = Site(name, rule, layout)
    check_site(site, where)
    return site


def adapted_product(site: Site, where: str, lhs, rhs, dimension_numbers, side: str, stored, adapters, out_dtype):
    """The intercepted dot_general's result, computed by `site`'s op (the contraction's layout must be the
    site's: one weight is adapted in one layout)."""
    x, x_contract, layout = split_operands(lhs, rhs, dimension_numbers, side, where)
    if layout != site.layout:
        raise ValueError(f"adapt: {where} is contracted in two ways ({site.layout} and {layout}): one weight can "
                         f"be adapted in one layout only")
    w2 = layout.to_2d(rhs if side == "rhs" else lhs)
    return contract(x, x_contract, layout, side, lambda x2: run_site(site, x2, w2, stored, adapters), out_dtype)


# -- interception ------------------------------------------------------------------------------------------------

_JAX_DOT_GENERAL = jax.lax.dot_general
_JAX_EINSUM = jnp.einsum
_state = threading.local()


class Frontend:
    """What linen and NNX each provide: the adapted result of a contraction inside `module`, or None to run it
    as it is."""

    def intercept(self, module, lhs, rhs, dimension_numbers, out_dtype):  # pragma: no cover - interface
        raise NotImplementedError


def _frontend() -> Frontend | None:
    return getattr(_state, "frontend", None)


def _current_module():
    frame = sys._getframe(2)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, nnx.Module) or (isinstance(owner, nn.Module) and owner.scope is not None):
            return owner
        frame = frame.f_back
    return None


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
    """`jax.lax.dot_general` while an adapted model runs."""
    frontend = _frontend()
    module = _current_module() if frontend is not None else None
    if module is not None:
        out_dtype = preferred_element_type or jnp.result_type(lhs, rhs)
        with _inactive():
            y = frontend.intercept(module, lhs, rhs, dimension_numbers, out_dtype)
        if y is not None:
            return y
    return _JAX_DOT_GENERAL(lhs, rhs, dimension_numbers, precision=precision,
                            preferred_element_type=preferred_element_type, **kwargs)


def einsum(subscripts, *operands, **kwargs):
    """`jax.numpy.einsum` while an adapted model runs: a two-operand einsum that is one dot_general (each index
    once per operand, none summed away alone) runs as that dot_general through `dot_general` above, then a
    transpose; any other einsum is jax's. (jax's own einsum is jitted with its dot_general a static argument: a
    trace cached for one module would serve the next, so contractions are not routed through it.)"""
    spec = _einsum_as_dot_general(subscripts, operands) if _frontend() is not None else None
    if spec is None or set(kwargs) - {"precision", "preferred_element_type", "optimize", "out_sharding"}:
        return _JAX_EINSUM(subscripts, *operands, **kwargs)
    dims, perm = spec
    extra = {} if kwargs.get("out_sharding") is None else {"out_sharding": kwargs["out_sharding"]}
    if extra and perm != tuple(range(len(perm))):
        return _JAX_EINSUM(subscripts, *operands, **kwargs)  # the sharding is of einsum's output order
    y = dot_general(operands[0], operands[1], dims, precision=kwargs.get("precision"),
                    preferred_element_type=kwargs.get("preferred_element_type"), **extra)
    return y if perm == tuple(range(y.ndim)) else jnp.transpose(y, perm)


def _einsum_as_dot_general(subscripts, operands):
    """(dimension_numbers, output permutation) of a two-operand einsum that is one dot_general, else None."""
    if not isinstance(subscripts, str) or len(operands) != 2 or "->" not in subscripts:
        return None
    inputs, out = subscripts.replace(" ", "").split("->")
    specs = inputs.split(",")
    if len(specs) != 2 or not all(hasattr(o, "ndim") for o in operands):
        return None
    spare = iter(sorted(set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ") - set(subscripts)))
    with_ellipsis = [i for i, s in enumerate(specs) if "..." in s]
    if len(with_ellipsis) > 1 or ("..." in out) != bool(with_ellipsis):
        return None
    if with_ellipsis:
        i = with_ellipsis[0]
        filled = "".join(next(spare) for _ in range(operands[i].ndim - len(specs[i].replace("...", ""))))
        specs[i], out = specs[i].replace("...", filled), out.replace("...", filled)
    a, b = specs
    if any(len(set(s)) != len(s) for s in (a, b, out)) or len(a) != operands[0].ndim or len(b) != operands[1].ndim:
        return None
    if any(c not in out and c not in (b if s is a else a) for s in (a, b) for c in s) or set(out) - set(a + b):
        return None  # an index summed within one operand
    contracted = [c for c in a if c in b and c not in out]
    batch = [c for c in a if c in b and c in out]
    dims = ((tuple(a.index(c) for c in contracted), tuple(b.index(c) for c in contracted)),
            (tuple(a.index(c) for c in batch), tuple(b.index(c) for c in batch)))
    result = batch + [c for c in a if c not in b] + [c for c in b if c not in a]
    return dims, tuple(result.index(c) for c in out)


@contextlib.contextmanager
def _inactive():
    saved = _frontend()
    _state.frontend = None
    try:
        yield
    finally:
        _state.frontend = saved


_patch_lock = threading.Lock()
_patch_depth = [0]


@contextlib.contextmanager
def active(frontend: Frontend):
    """Run with `frontend` receiving this thread's contractions (jax.lax.dot_general and jax.numpy.einsum
    patched; other threads see jax's, through the same functions, since the frontend is thread-local)."""
    with _patch_lock:
        if _patch_depth[0] == 0:
            jax.lax.dot_general = dot_general
            jnp.einsum = einsum
            _constructor_defaults(ours=True)
        _patch_depth[0] += 1
    saved = _frontend()
    _state.frontend = frontend
    try:
        yield
    finally:
        _state.frontend = saved
        with _patch_lock:
            _patch_depth[0] -= 1
            if _patch_depth[0] == 0:
                jax.lax.dot_general = _JAX_DOT_GENERAL
                jnp.einsum = _JAX_EINSUM
                _constructor_defaults(ours=False)


# nnx.Linear and nnx.Einsum keep jax's function from their constructor's default: (attribute, jax's, ours).
_DEFAULT_OPS = (("dot_general", _JAX_DOT_GENERAL, dot_general), ("einsum_op", _JAX_EINSUM, einsum))


def _constructor_defaults(ours: bool) -> None:
    """nnx.Linear / nnx.Einsum built while an adapted model runs (an NNX module inside linen through
    nnx.bridge.ToLinen is built on every call) get ours as their default op, or jax's again."""
    for cls in (nnx.Linear, nnx.Einsum):
        defaults = cls.__init__.__kwdefaults__
        for attr, original, mine in _DEFAULT_OPS:
            if defaults.get(attr) is (original if ours else mine):
                defaults[attr] = mine if ours else original


def bind_default_ops(module) -> None:
    """Point a module's stored `dot_general` / `einsum_op`, where it is jax's, at ours (`restore_default_ops`
    undoes it)."""
    for attr, original, ours in _DEFAULT_OPS:
        if getattr(module, attr, None) is original:
            setattr(module, attr, ours)


def restore_default_ops(module) -> None:
    for attr, original, ours in _DEFAULT_OPS:
        if getattr(module, attr, None) is ours:
            setattr(module, attr, original)


def adapted_method(method, make_frontend):
    """`method` running with the frontend `make_frontend(self)` active (its attributes kept: linen's `compact`)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with active(make_frontend(self)):
            return method(self, *args, **kwargs)

    return wrapper
