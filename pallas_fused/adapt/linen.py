"""flax.linen models: `apply` makes a subclass of the model's class whose methods run with the interception on;
params live in the model's own params tree, the adapters beside the weights they adapt.

The sites (which weight, which rule, its layout) are learned when the model is traced (`init` or `apply`) and
kept on the adapted class, where `from_pretrained`, `merge` and `unused_rules` read them.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core import meta

from pallas_fused.adapt import _core
from pallas_fused.adapt.report import no_match
from pallas_fused.adapt.rules import Rule


class _Linen(_core.Frontend):
    """linen's answers: a module's path is its scope's, its params its "params" collection; the sites, and the
    contractions met, are kept on the adapted class."""

    hint = "use the variables of lmodel.init, or adapt.from_pretrained(lmodel, variables, pretrained)"

    def __init__(self, cls):
        super().__init__()
        self.rules, self.dry = cls._pf_rules, cls._pf_dry
        self.sites, self.seen, self.matched, self.warned = cls._pf_sites, cls._pf_seen, cls._pf_matched, cls._pf_warned

    def path(self, module):
        return "/".join(module.scope.path) if isinstance(module, nn.Module) else None

    def params(self, module):
        return {k: v if isinstance(v, _core.QuantizedWeight) else meta.unbox(v)
                for k, v in module.variables.get("params", {}).items() if not isinstance(v, Mapping)}

    def site(self, module, where, name):
        return self.sites.get(where)

    def add_site(self, module, where, site):
        self.sites[where] = site

    def get(self, module, name):
        w = module.get_variable("params", name)
        return w if isinstance(w, _core.QuantizedWeight) else meta.unbox(w)

    def put(self, module, name, value, adapter):
        module.put_variable("params", name, value)

    def has(self, module, name):
        return module.has_variable("params", name)

    def can_create(self, module):
        return module.is_mutable_collection("params")

    def rng(self, module):
        return module.make_rng("params")


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
        method = _core.adapted_method(method, lambda self: _Linen(type(self)))
        fields[name] = nn.module.wrap_method_once(method) if wrapped else method
    cls = type(base.__name__, (base,), fields)
    cls.__qualname__ = base.__qualname__
    adapted = model.clone()
    object.__setattr__(adapted, "__class__", cls)
    return adapted


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
        node.update(site.refreshed(node[name], {k: node[k] for k in site.adapter_shapes()}))
    return rebuild(out)


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
        adapters = {k: node.pop(k) for k in site.adapter_shapes()}
        node[name] = site.merged(node[name], adapters)
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
