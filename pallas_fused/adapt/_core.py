"""What linen and NNX share: intercepting a model's contractions, finding the weight among their operands by where
it came from, and running the matched ones as their rule says.

Interception: while an adapted model runs, `jax.lax.dot_general` and `jax.numpy.einsum` are the functions below
(einsum is the library's own with its contractions routed through our dot_general). They hand the call to
`intercept`, the one sequence every contraction goes through: which module issued it, which operand is a param of
that module, which rule matches, the site (weight, rule, layout), its stored weight and adapters, the rule's op.
The front-ends (linen, NNX) answer the framework's questions only: a module's path and params, its sites, reading
and creating a variable. Outside an adapted model, and inside our own ops, the functions are jax's. The module an
operation belongs to is the innermost Flax module whose method is on the call stack: the one whose code issued it
(flax.linen.Dense for an nn.Dense, the user's module for a plain jnp.einsum).

Which operand is the weight is decided by identity, never by shape: while an adapted model runs, the binds of
`convert_element_type`, `transpose` and `reshape` (and `squeeze`) on a param, or on what came of one, are recorded
(`_layout.Lineage`), so an operand is the weight when it is the param itself or a chain of those from it; the
chain is the weight's layout (`_layout.Layout`). Adapters are stored in the 2-D form of the operand: the operand's
contracting axes, in the order they pair with the activation's, flattened into K, its other axes into N:
``<weight>_lora_a`` (K, rank), ``<weight>_lora_b`` (rank, N), ``<weight>_magnitude`` (N,).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import sys
import threading
import warnings
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_fused.adapt import _layout
from pallas_fused.adapt._layout import Layout, Lineage, QuantizedWeight
from pallas_fused.adapt.report import Contraction
from pallas_fused.adapt.rules import Rule, first_match, weight_path

__all__ = ["Frontend", "Layout", "QuantizedWeight", "Site", "active", "adapted_method", "intercept"]

ADAPTER_SUFFIXES = ("_lora_a", "_lora_b", "_magnitude")


@dataclasses.dataclass(frozen=True)
class Site:
    """One adapted weight: the rule that matched it and how its contraction sees it."""

    name: str
    rule: Rule
    layout: Layout

    def adapter_shapes(self) -> dict[str, tuple[int, ...]]:
        return self.rule.adapter_shapes(self.name, self.layout)

    def merged(self, stored, adapters):
        return self.rule.merged(self.name, self.layout, stored, adapters)

    def refreshed(self, stored, adapters):
        return self.rule.refreshed(self.name, self.layout, stored, adapters)


def is_adapter_name(name: str, siblings) -> bool:
    """Whether param `name` is an adapter of a weight among `siblings` (the names in the same module)."""
    return any(name.endswith(s) and name[: -len(s)] in siblings for s in ADAPTER_SUFFIXES)


# -- the contraction -------------------------------------------------------------------------------------------


def _axes(dims, ndim) -> tuple[int, ...]:
    return tuple(int(d) % ndim for d in dims)


def split_operands(lhs, rhs, dimension_numbers, weight_side: str, where: str, stored_shape=None, steps=()):
    """(activation, its contracting axes, the weight's Layout) of a dot_general whose weight is `weight_side`,
    stored with `stored_shape` and turned into the operand by `steps`."""
    (lc, rc), (lb, rb) = dimension_numbers
    lc, rc = _axes(lc, lhs.ndim), _axes(rc, rhs.ndim)
    if tuple(lb) or tuple(rb):
        raise ValueError(f"{where}: the contraction has batch dimensions (lhs {tuple(lb)}, rhs {tuple(rb)}), e.g. one "
                         f"weight per expert; only contractions of an activation with one weight can be adapted")
    x, x_contract, w, w_contract = (lhs, lc, rhs, rc) if weight_side == "rhs" else (rhs, rc, lhs, lc)
    shape = tuple(int(d) for d in w.shape)
    free = tuple(a for a in range(len(shape)) if a not in w_contract)
    layout = Layout(shape, tuple(w_contract), free, tuple(stored_shape) if stored_shape is not None else shape,
                    tuple(steps))
    return x, x_contract, layout


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


def weights(params: Mapping[str, Any]) -> dict[str, Any]:
    """The params of a module that may be adapted: not adapters, not scalars."""
    return {k: v for k, v in params.items() if not is_adapter_name(k, params) and len(getattr(v, "shape", ())) >= 1}


def find_weight(params: Mapping[str, Any], operands) -> tuple[str, int, tuple] | None:
    """(param name, operand index, steps from the stored param to the operand) of the first operand (from the
    last) that is one of `params` or came of one through casts, transposes and reshapes; None if none did."""
    lineage = _layout.current_lineage()
    for i in reversed(range(len(operands))):
        found = lineage.root(operands[i], params) if lineage is not None else next(
            ((k, ()) for k, v in params.items() if v is operands[i]), None)
        if found is not None:
            return found[0], i, found[1]
    return None


# -- interception ------------------------------------------------------------------------------------------------

_JAX_DOT_GENERAL = jax.lax.dot_general
_JAX_EINSUM = jnp.einsum
_state = threading.local()


class Frontend:
    """The framework's answers, for linen and NNX: where a module is, what it holds, how to read and create a
    variable. `rules` (None: only known sites run) are consulted for new sites; `seen` collects the contractions
    met (for `adapt.inspect`, `unused_rules` and the no-match message); with `dry` nothing is created or adapted
    and a contraction that cannot be adapted is recorded as refused instead of raising."""

    rules: tuple[Rule, ...] | None = None
    dry = False
    hint = ""  # how to get params with adapters, for the error when they are missing

    def __init__(self):
        self.seen: dict[tuple, Contraction] = {}
        self.matched: dict[str, Contraction] = {}
        self.warned: set[str] = set()

    def path(self, module) -> str | None:
        """The module's path, or None for a module this front-end does not adapt."""
        raise NotImplementedError

    def params(self, module) -> dict[str, Any]:
        """The module's params as the model reads them (a QuantizedWeight as itself)."""
        raise NotImplementedError

    def site(self, module, where: str, name: str) -> Site | None:
        raise NotImplementedError

    def add_site(self, module, where: str, site: Site) -> None:
        raise NotImplementedError

    def get(self, module, name: str):
        raise NotImplementedError

    def put(self, module, name: str, value, adapter: bool) -> None:
        raise NotImplementedError

    def has(self, module, name: str) -> bool:
        raise NotImplementedError

    def can_create(self, module) -> bool:
        raise NotImplementedError

    def rng(self, module):
        raise NotImplementedError

    def defers(self, module) -> bool:
        """Whether `module`'s variables are created later, outside the lifted transform it runs in (NNX's apply
        meets copies of modules inside nnx.scan / nnx.vmap / nnx.remat): its contraction runs as it is."""
        return False

    def record(self, key, contraction: Contraction) -> None:
        self.seen.setdefault(key, contraction)

    def unreached(self) -> list[Contraction]:
        """The weights a rule matches, in modules that ran contractions but had none adapted, that no contraction
        read as they are (a module with an adapted weight beside, say, a bias is as the rule meant)."""
        adapted = {c.path for c in self.seen.values() if c.action == "adapted"}
        return [c for c in self.matched.values() if c.path not in adapted]

    def warn_unreached(self) -> None:
        """A warning, once per weight, for each matched weight no contraction read: it is not adapted."""
        if self.dry:
            return
        new = [c for c in self.unreached() if c.weight_path not in self.warned]
        if new:
            self.warned.update(c.weight_path for c in new)
            warnings.warn("adapt: weights a rule matches are read by no contraction as they are, and are not adapted:"
                          "\n" + "\n".join(f"  {c.weight_path} ({type(c.rule).__name__}({c.rule.module_path!r}))"
                                            for c in new)
                          + "\n(a weight is followed through casts, transposes and reshapes only; adapt.inspect "
                          "shows every contraction)", stacklevel=4)


def _refuse(frontend, key, path, name, stored_shape, rule, reason):
    if not frontend.dry:
        raise ValueError(f"adapt: {weight_path(path, name)}: {reason}")
    frontend.record(key, Contraction(path, name, stored_shape, None, None, rule, "refused", reason))


def _note_matches(frontend, path, params, reached: str | None) -> None:
    """The params of `path` a rule matches, for the report of those never reached by a contraction."""
    if frontend.rules is None:
        return
    for name, v in weights(params).items():
        where = weight_path(path, name)
        rule = first_match(frontend.rules, path, name)
        if rule is not None and where not in frontend.matched and name != reached and len(v.shape) >= 2:
            frontend.matched[where] = Contraction(
                path, name, tuple(v.shape), None, None, rule, "refused",
                f"{rule.module_path!r} matches it, but no contraction of {path or 'the root module'} reads it "
                f"(adapt follows a weight through casts, transposes and reshapes only)")


def intercept(frontend: Frontend, module, lhs, rhs, dimension_numbers, out_dtype):
    """A contraction of `module`: its adapted result, or None to run it as it is (the one sequence: which
    weight, which rule, which site, its variables, the rule's op)."""
    path = frontend.path(module)
    if path is None:
        return None
    params = weights(frontend.params(module))
    found = find_weight(params, (lhs, rhs))
    if found is None:
        _note_matches(frontend, path, params, None)
        frontend.record((path, None, str(dimension_numbers), lhs.shape, rhs.shape), Contraction(
            path, None, None, None, None, None, "untouched", "no operand is a param of the module"))
        return None
    name, index, steps = found
    side = "rhs" if index == 1 else "lhs"
    _note_matches(frontend, path, params, name)
    where = weight_path(path, name)
    stored_shape = tuple(params[name].shape)
    site = frontend.site(module, where, name)
    rule = site.rule if site is not None else (first_match(frontend.rules, path, name) if frontend.rules else None)
    key = (path, name, str(dimension_numbers))
    if rule is None:
        try:
            layout = split_operands(lhs, rhs, dimension_numbers, side, where, stored_shape, steps)[2]
            k, n = layout.k, layout.n
        except ValueError:  # batch dimensions: no (K, N) view
            k = n = None
        frontend.record(key, Contraction(path, name, stored_shape, k, n, None, "untouched", "no rule matches"))
        return None
    try:
        x, x_contract, layout = split_operands(lhs, rhs, dimension_numbers, side, where, stored_shape, steps)
        rule.check(layout, where)
        if site is not None and layout != site.layout:
            raise ValueError(f"adapt: {where} is contracted in two ways ({site.layout} and {layout}): one weight "
                             f"can be adapted in one layout only")
    except ValueError as e:
        if not frontend.dry:
            raise
        frontend.record(key, Contraction(path, name, stored_shape, None, None, rule, "refused", str(e)))
        return None
    how = layout.describe()
    frontend.record(key, Contraction(path, name, stored_shape, layout.k, layout.n, rule, "adapted",
                                     f"read as w{how}" if how else ""))
    if site is None:
        site = Site(name, rule, layout)
        frontend.add_site(module, where, site)
    if frontend.dry or frontend.defers(module):
        return None
    stored, adapters = _variables(frontend, module, site, where)
    w2 = layout.operand_2d(rhs if side == "rhs" else lhs)
    return contract(x, x_contract, layout, side,
                    lambda x2: rule.product(x2, w2, stored, layout, adapters, name), out_dtype)


def _variables(frontend: Frontend, module, site: Site, where: str):
    """(the stored weight, the adapters) of `site`: put in their rule's form and created on first sight, when the
    front-end may create variables (linen's init, NNX's apply)."""
    rule = site.rule
    w = frontend.get(module, site.name)
    stored = rule.store(w, site.layout, where)
    if stored is not w:
        if not frontend.can_create(module):
            raise ValueError(f"adapt: {where}: {rule!r} keeps its weight in another form than the params hold "
                             f"(QDoRA, an FP8 base: quantized): {frontend.hint}")
        frontend.put(module, site.name, stored, adapter=False)
    shapes = site.adapter_shapes()
    missing = [k for k in shapes if not frontend.has(module, k)]
    if missing:
        if not frontend.can_create(module):
            raise ValueError(f"adapt: {where} matches {rule!r} but the params have no {missing}: {frontend.hint}")
        fresh = rule.init_adapters(site.name, site.layout, stored, frontend.rng(module))
        for k in missing:
            frontend.put(module, k, fresh[k], adapter=True)
    adapters = {k: frontend.get(module, k) for k in shapes}
    for k, shape in shapes.items():
        if tuple(jnp.shape(adapters[k])) != shape:
            raise ValueError(f"adapt: {where}: params[{k!r}] has shape {tuple(jnp.shape(adapters[k]))}, {rule!r} "
                             f"needs {shape}")
    return stored, adapters


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
            y = intercept(frontend, module, lhs, rhs, dimension_numbers, out_dtype)
        if y is not None:
            return y
    return _JAX_DOT_GENERAL(lhs, rhs, dimension_numbers, precision=precision,
                            preferred_element_type=preferred_element_type, **kwargs)


def einsum(subscripts, *operands, **kwargs):
    """`jax.numpy.einsum` while an adapted model runs: a two-operand einsum that is one plain dot_general (each
    index once per operand, none summed away alone, batch axes of equal sizes) runs as that dot_general through
    `dot_general` above, then a transpose; any other einsum is jax's, unchanged, unless a rule matches a param
    among its operands (a ValueError: it cannot be adapted). (jax's own einsum is jitted with its dot_general a
    static argument: a trace cached for one module would serve the next, so contractions are not routed through
    it.)"""
    frontend = _frontend()
    if frontend is None:
        return _JAX_EINSUM(subscripts, *operands, **kwargs)
    spec = _einsum_as_dot_general(subscripts, operands)
    if isinstance(spec, tuple) and set(kwargs) - {"precision", "preferred_element_type", "optimize", "out_sharding"}:
        spec = f"einsum keywords {sorted(kwargs)}"
    if isinstance(spec, tuple) and kwargs.get("out_sharding") is not None and spec[1] != tuple(range(len(spec[1]))):
        spec = "an out_sharding of an output order that is not dot_general's"
    if not isinstance(spec, tuple):
        _einsum_not_adapted(frontend, subscripts, operands, spec)
        return _JAX_EINSUM(subscripts, *operands, **kwargs)
    dims, perm = spec
    extra = {} if kwargs.get("out_sharding") is None else {"out_sharding": kwargs["out_sharding"]}
    y = dot_general(operands[0], operands[1], dims, precision=kwargs.get("precision"),
                    preferred_element_type=kwargs.get("preferred_element_type"), **extra)
    return y if perm == tuple(range(y.ndim)) else jnp.transpose(y, perm)


def _einsum_not_adapted(frontend, subscripts, operands, why: str) -> None:
    """An einsum that runs as jax's: recorded, and refused where a rule matches a param among its operands."""
    module = _current_module()
    with _inactive():
        path = frontend.path(module) if module is not None else None
        if path is None:
            return
        params = weights(frontend.params(module))
        found = find_weight(params, [o for o in operands if hasattr(o, "shape")])
        name = None if found is None else found[0]
        key = (path, name, str(subscripts))
        site = frontend.site(module, weight_path(path, name), name) if name is not None else None
        rule = site.rule if site is not None else (
            first_match(frontend.rules, path, name) if name is not None and frontend.rules else None)
        reason = f"einsum {subscripts!r} is not one contraction of an activation with a weight ({why})"
        if rule is None:
            stored = None if name is None else tuple(params[name].shape)
            frontend.record(key, Contraction(path, name, stored, None, None, None, "untouched",
                                             f"{reason}: jax's einsum runs it"))
            return
        _refuse(frontend, key, path, name, tuple(params[name].shape), rule, f"{rule!r} matches, but {reason}")


def _einsum_as_dot_general(subscripts, operands):
    """(dimension_numbers, output permutation) of a two-operand einsum that is one plain dot_general, else why
    not (a str)."""
    if not isinstance(subscripts, str) or "->" not in subscripts:
        return "no explicit output"
    if len(operands) != 2:
        return f"{len(operands)} operands"
    inputs, out = subscripts.replace(" ", "").split("->")
    specs = inputs.split(",")
    if len(specs) != 2 or not all(hasattr(o, "ndim") for o in operands):
        return "not two array operands"
    spare = iter(sorted(set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ") - set(subscripts)))
    with_ellipsis = [i for i, s in enumerate(specs) if "..." in s]
    if len(with_ellipsis) > 1 or ("..." in out) != bool(with_ellipsis):
        return "an ellipsis that broadcasts"
    if with_ellipsis:
        i = with_ellipsis[0]
        filled = "".join(next(spare) for _ in range(operands[i].ndim - len(specs[i].replace("...", ""))))
        specs[i], out = specs[i].replace("...", filled), out.replace("...", filled)
    a, b = specs
    if any(len(set(s)) != len(s) for s in (a, b, out)):
        return "a repeated index"
    if len(a) != operands[0].ndim or len(b) != operands[1].ndim:
        return "subscripts that do not match the operands' ranks"
    if any(c not in out and c not in (b if s is a else a) for s in (a, b) for c in s) or set(out) - set(a + b):
        return "an index summed within one operand"
    shared = [c for c in a if c in b]
    if any(operands[0].shape[a.index(c)] != operands[1].shape[b.index(c)] for c in shared):
        return "axes that broadcast (sizes " + ", ".join(
            f"{c}: {operands[0].shape[a.index(c)]} vs {operands[1].shape[b.index(c)]}" for c in shared
            if operands[0].shape[a.index(c)] != operands[1].shape[b.index(c)]) + ")"
    contracted = [c for c in shared if c not in out]
    batch = [c for c in shared if c in out]
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


# The primitives a weight may pass through on its way to a contraction, and the step each is.
_FOLLOWED = {
    jax.lax.convert_element_type_p: lambda params, x, out: None,
    jax.lax.transpose_p: lambda params, x, out: ("transpose", tuple(int(a) for a in params["permutation"])),
    jax.lax.reshape_p: lambda params, x, out: ("reshape", tuple(int(d) for d in out.shape))
    if params.get("dimensions") is None else False,
    jax.lax.squeeze_p: lambda params, x, out: ("reshape", tuple(int(d) for d in out.shape)),
}


def _followed_bind(primitive, step_of):
    original = primitive.bind

    @functools.wraps(original)
    def bind(*args, **params):
        out = original(*args, **params)
        frontend, lineage = _frontend(), _layout.current_lineage()
        if frontend is not None and lineage is not None and args and (lineage.known(args[0])
                                                                    or _is_param(frontend, args[0])):
            step = step_of(params, args[0], out)
            if step is not False:
                lineage.note(out, args[0], step)
        return out

    return bind


def _is_param(frontend: Frontend, x) -> bool:
    """Whether `x` is a param of the module running (asked at trace time, or eagerly)."""
    module = _current_module()
    if module is None:
        return False
    with _inactive():
        if frontend.path(module) is None:
            return False
        return any(v is x for v in frontend.params(module).values())


_patch_lock = threading.Lock()
_patch_depth = [0]


@contextlib.contextmanager
def active(frontend: Frontend):
    """Run with `frontend` receiving this thread's contractions (jax.lax.dot_general and jax.numpy.einsum
    patched, and the binds a weight passes through followed; other threads see jax's, through the same functions,
    since the frontend is thread-local). The lineage lives as long as this thread's outermost adapted call."""
    with _patch_lock:
        if _patch_depth[0] == 0:
            jax.lax.dot_general = dot_general
            jnp.einsum = einsum
            for primitive, step_of in _FOLLOWED.items():
                primitive.bind = _followed_bind(primitive, step_of)
            _constructor_defaults(ours=True)
        _patch_depth[0] += 1
    saved = _frontend()
    owns_lineage = _layout.current_lineage() is None
    if owns_lineage:
        _layout.set_lineage(Lineage())
    _state.frontend = frontend
    try:
        yield
    finally:
        _state.frontend = saved
        if owns_lineage:
            _layout.set_lineage(None)
        with _patch_lock:
            _patch_depth[0] -= 1
            if _patch_depth[0] == 0:
                jax.lax.dot_general = _JAX_DOT_GENERAL
                jnp.einsum = _JAX_EINSUM
                for primitive in _FOLLOWED:
                    del primitive.bind
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


def eval_abstract(fn, *trees) -> None:
    """`fn(*trees)` under `jax.eval_shape` with the arrays of `trees` abstract and their other leaves (a flag such
    as ``deterministic=True``) as they are: nothing is computed or allocated."""
    leaves, treedef = jax.tree_util.tree_flatten(trees)
    is_array = [isinstance(x, (jax.Array, np.ndarray)) for x in leaves]

    def run(arrays):
        it = iter(arrays)
        fn(*jax.tree_util.tree_unflatten(treedef, [next(it) if a else x for x, a in zip(leaves, is_array)]))

    jax.eval_shape(run, [x for x, a in zip(leaves, is_array) if a])


def adapted_method(method, make_frontend):
    """`method` running with the frontend `make_frontend(self)` active (its attributes kept: linen's `compact`)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        frontend = make_frontend(self)
        with active(frontend):
            out = method(self, *args, **kwargs)
        frontend.warn_unreached()
        return out

    return wrapper
