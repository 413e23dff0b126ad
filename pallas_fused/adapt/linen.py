"""flax.linen models: `apply` makes a subclass of the model's class whose methods run with the interception on;
params live in the model's own params tree, the adapters beside the weights they adapt.

The sites (which weight, which rule, its layout) are learned when the model is traced (`init` or `apply`) and
kept on the adapted class, where `from_pretrained`, `merge` and `unused_rules` read them.
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import meta

from pallas_fused.adapt import _core, _stacked
from pallas_fused.adapt.report import no_match
from pallas_fused.adapt.rules import Rule


class _Linen(_core.Frontend):
    """linen's answers: a module's path is its scope's, its params its "params" collection; the sites, and the
    contractions met, are kept on the adapted class. An NNX module that linen runs through `nnx.bridge.ToLinen`
    is answered for too: its params are a sub-tree of the ToLinen module's (`_Store`)."""

    hint = "use the variables of lmodel.init, or adapt.from_pretrained(lmodel, variables, pretrained)"

    def __init__(self, cls):
        super().__init__()
        self.rules, self.dry = cls._pf_rules, cls._pf_dry
        self.sites, self.seen, self.matched, self.warned = cls._pf_sites, cls._pf_seen, cls._pf_matched, cls._pf_warned
        self._bridges: dict[int, tuple[Any, _Store | None]] = {}

    def _store(self, module) -> _Store | None:
        if isinstance(module, nn.Module):
            return _Store(module, ())
        if not isinstance(module, nnx.Module):
            return None
        entry = self._bridges.get(id(module))
        if entry is not None and entry[0] is module:
            return entry[1]
        store = _bridged(module)
        if store is not None:  # not yet found while its parent's constructor runs (ToLinen builds it)
            self._bridges[id(module)] = (module, store)
        return store

    def path(self, module):
        store = self._store(module)
        return None if store is None else "/".join(store.module.scope.path + store.sub)

    def params(self, module):
        if isinstance(module, nnx.Module):  # what the bridged module's code reads: its own variables
            return {k: v.get_value() for k, v in vars(module).items() if isinstance(v, nnx.Param)}
        return {k: v if isinstance(v, _core.QuantizedWeight) else meta.unbox(v)
                for k, v in module.variables.get("params", {}).items() if not isinstance(v, Mapping)}

    def site(self, module, where, name):
        return self.sites.get(where)

    def add_site(self, module, where, site):
        self.sites[where] = site

    def get(self, module, name):
        w = self._store(module).get(name)
        return w if isinstance(w, _core.QuantizedWeight) else meta.unbox(w)

    def put(self, module, name, value, adapter):
        self._store(module).put(name, value)

    def has(self, module, name):
        return self._store(module).has(name)

    def can_create(self, module):
        return self._store(module).module.is_mutable_collection("params")

    def rng(self, module):
        return self._store(module).module.make_rng("params")


class _Store:
    """Where a module's params live: a linen module's own, or, for an NNX module run by linen through
    `nnx.bridge.ToLinen`, the sub-tree at `sub` (the NNX module's path) of the ToLinen module's params."""

    def __init__(self, module: nn.Module, sub: tuple[str, ...]):
        self.module, self.sub = module, sub

    def _node(self):
        node = self.module.get_variable("params", self.sub[0], {})
        for part in self.sub[1:]:
            node = node.get(part, {})
        return node

    def has(self, name: str) -> bool:
        return self.module.has_variable("params", name) if not self.sub else name in self._node()

    def get(self, name: str):
        return self.module.get_variable("params", name) if not self.sub else self._node()[name]

    def put(self, name: str, value) -> None:
        if not self.sub:
            self.module.put_variable("params", name, value)
            return
        top = _copy(self.module.get_variable("params", self.sub[0]))
        node = top
        for part in self.sub[1:]:
            node = node[part]
        node[name] = value
        self.module.put_variable("params", self.sub[0], top)


def _bridged(module) -> _Store | None:
    """Where the params of NNX `module` are when linen runs it through `nnx.bridge.ToLinen`: the linen module
    nearest on the call stack (ToLinen, which keeps its NNX module's state as its own params, by the NNX paths),
    under the path of `module` in the outermost NNX module running between the two; None elsewhere."""
    root, frame = module, sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, nnx.Module):
            root = owner
        elif isinstance(owner, nn.Module) and owner.scope is not None:
            sub = next((p for p, m in nnx.iter_modules(root) if m is module), None)
            return None if sub is None else _Store(owner, tuple(str(p) for p in sub))
        frame = frame.f_back
    return None


def apply(model: nn.Module, rules: tuple[Rule, ...], methods, dry: bool = False) -> nn.Module:
    base = getattr(type(model), "_pf_base", type(model))
    fields: dict[str, Any] = {"_pf_base": base, "_pf_rules": rules, "_pf_sites": {}, "_pf_seen": {},
                              "_pf_matched": {}, "_pf_warned": set(), "_pf_dry": dry}
    for name in methods:
        method = getattr(base, name, None)
        if method is None:
            raise ValueError(f"adapt.apply: {base.__name__} has no method {name!r}")
        wrapped = False
        # flax wraps module methods (nn.module.wrap_method_once) to enter the module's scope; intercepting the
        # inner method keeps the interception inside that scope
        while hasattr(method, "method_handler_wrapped"):
            method, wrapped = method.__wrapped__, True
        method = _quiet_bridge(_core.adapted_method(method, lambda self: _Linen(type(self))))
        fields[name] = nn.module.wrap_method_once(method) if wrapped else method
    cls = type(base.__name__, (base,), fields)
    cls.__qualname__ = base.__qualname__
    adapted = model.clone()
    object.__setattr__(adapted, "__class__", cls)
    return adapted


def _quiet_bridge(method):
    """`method` without nnx.bridge.ToLinen's warning that its params hold paths its NNX module lacks, where those
    are adapters only (they sit beside the bridged weights, and are read from the params, not the NNX module)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_BRIDGE_WARNING)
            return method(self, *args, **kwargs)

    return wrapper


_BRIDGE_WARNING = r"Found unknown module paths in incoming state:(\n  - \S*(_lora_a|_lora_b|_magnitude))+\Z"


def _sites(lmodel) -> dict[str, _core.Site]:
    cls = type(lmodel)
    sites = getattr(cls, "_pf_sites", None)
    if sites is None:
        raise ValueError(f"expected a model from adapt.apply, got {type(lmodel).__name__}")
    if not sites and not cls._pf_seen:
        raise ValueError("adapt: the model has not been traced yet, so no weight is known to be adapted: call "
                         "lmodel.init(key, *inputs) first")
    if not sites:
        raise ValueError(no_match(cls._pf_rules, tuple(cls._pf_seen.values())))
    return sites


def _split(variables):
    """(params tree, rebuild: params tree -> the same form as `variables`)."""
    if isinstance(variables, Mapping) and "params" in variables:
        return variables["params"], lambda p: {**variables, "params": p}
    return variables, lambda p: p


def _get(tree, path: str, what: str):
    node = tree
    for part in path.split("/"):
        if not isinstance(node, Mapping) or part not in node:
            raise ValueError(f"adapt: {what} has no params at {path!r}")
        node = node[part]
    return node


def _copy(tree):
    return {k: _copy(v) if isinstance(v, Mapping) else v for k, v in tree.items()}


def _module(tree, where: str):
    path, _, name = where.rpartition("/")
    return (_get(tree, path, "the variables") if path else tree), name


def from_pretrained(lmodel, variables, pretrained):
    sites = _sites(lmodel)
    params, rebuild = _split(variables)
    pre, _ = _split(pretrained)
    out = _copy(params)
    flat_pre = _flatten(pre)
    flat_out = _flatten(out)
    for path, value in flat_pre.items():
        if path not in flat_out:
            raise ValueError(f"adapt.from_pretrained: pretrained leaf {path!r} is not a param of the adapted model")
        have = flat_out[path]
        if tuple(jnp.shape(value)) != tuple(have.shape):
            raise ValueError(f"adapt.from_pretrained: pretrained leaf {path!r} has shape {tuple(jnp.shape(value))}, "
                             f"the adapted model's has {tuple(have.shape)}")
        node, name = _module(out, path)
        site = sites.get(path)
        node[name] = value if site is None else site.rule.store(jnp.asarray(value), site.layout, path)
    adapters = _adapter_paths(out)
    missing = [p for p in flat_out if p not in flat_pre and p not in adapters]
    if missing:
        raise ValueError(f"adapt.from_pretrained: the pretrained params have no {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''} (the adapted model's params other than adapters)")
    for where, site in sites.items():
        node, name = _module(out, where)
        node.update(_stacked.refreshed(site, node[name], {k: node[k] for k in site.adapter_shapes()},
                                       _layer_axis(site, node, where)))
    return rebuild(out)


def _layer_axis(site, node, where: str):
    """The layer axis (a lifted transform's, nn.scan's) of a site's weight and adapters in `node`, its module's
    params; None where they are not stacked."""
    return _stacked.site_axis(site, {k: tuple(v.shape) for k, v in node.items() if not isinstance(v, Mapping)}, where)


def _flatten(tree, prefix="") -> dict[str, Any]:
    out = {}
    for k, v in tree.items():
        path = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flatten(v, path + "/"))
        else:
            out[path] = v
    return out


def _adapter_paths(tree, prefix="") -> set[str]:
    """The `/`-joined paths of the adapter leaves (`_core.is_adapter_name` among each module's names)."""
    out = set()
    for k, v in tree.items():
        if isinstance(v, Mapping):
            out |= _adapter_paths(v, f"{prefix}{k}/")
        elif _core.is_adapter_name(k, tree):
            out.add(f"{prefix}{k}")
    return out


def trainable(variables):
    def mask(tree):
        return {k: mask(v) if isinstance(v, Mapping) else _fill(v, _core.is_adapter_name(k, tree))
                for k, v in tree.items()}

    if isinstance(variables, Mapping) and "params" in variables:
        return {k: mask(v) if k == "params" else _fill(v, False) for k, v in variables.items()}
    return mask(variables)


def _fill(tree, value: bool):
    return jax.tree_util.tree_map(lambda _: value, tree)


def merge(lmodel, variables):
    sites = _sites(lmodel)
    params, rebuild = _split(variables)
    out = _copy(params)
    for where, site in sites.items():
        node, name = _module(out, where)
        axis = _layer_axis(site, node, where)
        adapters = {k: node.pop(k) for k in site.adapter_shapes()}
        node[name] = _stacked.merged(site, node[name], adapters, axis)
    return rebuild(out)


def unused_rules(lmodel) -> list[Rule]:
    cls = type(lmodel)
    if getattr(cls, "_pf_sites", None) is not None and not cls._pf_sites and cls._pf_seen:
        warnings.warn(no_match(cls._pf_rules, tuple(cls._pf_seen.values())), stacklevel=3)
        return list(cls._pf_rules)
    used = {site.rule for site in _sites(lmodel).values()}
    return [r for r in cls._pf_rules if r not in used]


def report(lmodel) -> tuple:
    """The contractions met while tracing, then the matched weights no contraction reached."""
    frontend = _Linen(type(lmodel))
    return tuple(frontend.seen.values()) + tuple(frontend.unreached())
