"""flax.nnx models: `apply` runs the model once on example inputs to find the adapted weights, creating each
one's adapters (`nnx.LoRAParam`) on the module that owns it from the weights already there; the returned model's
class is a subclass of the original whose method runs with the interception on.

Each module with adapted weights records them in `_pf_sites` (a static attribute): the sites are part of the
model's graph, so `nnx.split` / `nnx.merge`, `nnx.jit` and `nnx.Optimizer` carry them.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from pallas_fused.adapt import _core
from pallas_fused.adapt._stacked import layer_axis, over_layers, refuse_quantized
from pallas_fused.adapt.rules import Rule, first_match, weight_path


def _params(module) -> dict[str, Any]:
    return {k: v.get_value() for k, v in vars(module).items() if isinstance(v, nnx.Param)}


class _Nnx(_core.Frontend):
    """At call time: the sites each module recorded. While `apply` traces (`paths` given): new sites too."""

    def __init__(self, rules=None, paths=None, rngs=None):
        self.rules, self.paths, self.rngs = rules, paths, rngs
        self.lifted: dict[tuple[str, str], tuple[_core.Site, dict]] = {}  # sites met inside an NNX transform

    def intercept(self, module, lhs, rhs, dimension_numbers, out_dtype):
        if not isinstance(module, nnx.Module):
            return None
        sites = {s.name: s for s in getattr(module, "_pf_sites", ())}
        if not sites and self.paths is None:
            return None
        params = _params(module)
        found = _core.find_weight(params, lhs, rhs)
        if found is None:
            return None
        name, side = found
        path = self.paths.get(id(module)) if self.paths is not None else "?"
        # a module inside nnx.vmap / nnx.scan / nnx.remat is a copy of the model's (made by nnx.merge), which
        # carries its path as a static attribute; its params are traced slices, its adapters are made afterwards
        lifted = path is None
        if lifted:
            path = getattr(module, "_pf_path", "?")
        if _core.raise_if_ambiguous(name, self.rules, path):
            return None
        site = sites.get(name)
        if site is None:
            rule = first_match(self.rules, path, name) if self.paths is not None else None
            if rule is None:
                return None
            site = _core.new_site(rule, path, name, lhs, rhs, dimension_numbers, side)
            if lifted:
                self.lifted[path, name] = site, {k: tuple(v.shape) for k, v in params.items()}
                return None
            self._add(module, site, path)
        stored = getattr(module, name).get_value()
        adapters = {k: getattr(module, k)[...] for k in _core.adapter_shapes(site)}
        return _core.adapted_product(site, weight_path(path, name), lhs, rhs, dimension_numbers, side, stored,
                                     adapters, out_dtype)

    def _add(self, module, site, path: str, per_layer=None) -> None:
        """A new site's adapters on `module` (from the weight there; quantized first for QDoRA). `per_layer`: the
        shapes of the module's params seen inside a lifted transform, where they may be stacked slices."""
        where = weight_path(path, site.name)
        w = getattr(module, site.name).get_value()
        axis = None if per_layer is None else layer_axis(per_layer, _shapes(module), where)
        fmt = getattr(site.rule, "quantize", None)
        if fmt is not None:
            if axis is not None:
                raise refuse_quantized(where, fmt)
            w = _core.QuantizedWeight.quantize(w, site.layout, fmt, where)
            setattr(module, site.name, nnx.Param(w))
        key = self.rngs.params()
        if axis is not None:
            key = jax.random.split(key, w.shape[axis])
        fresh = over_layers(lambda w, key: _core.new_adapters(site, w, key), axis, w, key, in_axes=(axis, 0))
        for k, v in fresh.items():
            setattr(module, k, nnx.LoRAParam(v))
        module._pf_sites = getattr(module, "_pf_sites", ()) + (site,)

    def add_lifted(self, modules: dict[str, Any]) -> None:
        """The adapters of the sites met inside lifted transforms, on the model's modules (stacked there along the
        layer axis of their weights)."""
        for (path, _), (site, per_layer) in self.lifted.items():
            module = modules[path]
            if site not in getattr(module, "_pf_sites", ()):
                self._add(module, site, path, per_layer)


def _shapes(module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.get_value().shape) for k, v in vars(module).items() if isinstance(v, nnx.Variable)}


def _layer_axis(module, site, path: str):
    """The layer axis of a site's weight and adapters on `module`, None where they are not stacked."""
    per_layer = {site.name: site.layout.shape, **_core.adapter_shapes(site)}
    return layer_axis(per_layer, _shapes(module), weight_path(path, site.name))


def apply(model, rules: tuple[Rule, ...], method: str, rngs, args, kwargs):
    if not isinstance(rngs, nnx.Rngs):
        raise ValueError(f"adapt.apply: an NNX model needs rngs=nnx.Rngs(...) for the adapters' initial values, "
                         f"got {type(rngs).__name__}")
    base = getattr(type(model), "_pf_base", type(model))
    if getattr(base, method, None) is None:
        raise ValueError(f"adapt.apply: {base.__name__} has no method {method!r}")
    adapted = nnx.clone(model)
    modules = {"/".join(str(p) for p in path): m for path, m in nnx.iter_modules(adapted)}
    paths = {id(m): path for path, m in modules.items()}
    for path, m in modules.items():
        _core.bind_default_ops(m)
        m._pf_path = path
    cls = type(base.__name__, (base,), {"_pf_base": base, "_pf_rules": rules,
                                         method: _core.adapted_method(getattr(base, method), lambda self: _Nnx())})
    cls.__qualname__ = base.__qualname__
    frontend = _Nnx(rules, paths, rngs)
    try:
        with _core.active(frontend):
            getattr(base, method)(adapted, *args, **kwargs)
    finally:
        for m in modules.values():
            del m._pf_path
    frontend.add_lifted(modules)
    for _, m in nnx.iter_modules(adapted):
        if not getattr(m, "_pf_sites", ()):
            _core.restore_default_ops(m)
    adapted.__class__ = cls
    return adapted


def _adapted_modules(nmodel):
    return [("/".join(str(p) for p in path), m) for path, m in nnx.iter_modules(nmodel) if getattr(m, "_pf_sites", ())]


def merge(nmodel):
    base = getattr(type(nmodel), "_pf_base", None)
    if base is None:
        raise ValueError(f"expected a model from adapt.apply, got {type(nmodel).__name__}")
    merged = nnx.clone(nmodel)
    for path, m in _adapted_modules(merged):
        for site in m._pf_sites:
            axis = _layer_axis(m, site, path)
            adapters = {k: getattr(m, k)[...] for k in _core.adapter_shapes(site)}
            w = getattr(m, site.name).get_value()
            w = over_layers(lambda w, ad, site=site: _core.merged_weight(site, w, ad), axis, w, adapters)
            setattr(m, site.name, nnx.Param(w))
            for k in adapters:
                delattr(m, k)
        del m._pf_sites
        _core.restore_default_ops(m)
    merged.__class__ = base
    return merged


def unused_rules(nmodel) -> list[Rule]:
    rules = getattr(type(nmodel), "_pf_rules", None)
    if rules is None:
        raise ValueError(f"expected a model from adapt.apply, got {type(nmodel).__name__}")
    used = {site.rule for _, m in _adapted_modules(nmodel) for site in m._pf_sites}
    return [r for r in rules if r not in used]


def reset_magnitudes(nmodel) -> None:
    """DoRA magnitudes = ||W + s A B|| again, e.g. after loading other base weights with nnx.update."""
    for path, m in _adapted_modules(nmodel):
        for site in m._pf_sites:
            if f"{site.name}_magnitude" in vars(m):
                a, b = getattr(m, f"{site.name}_lora_a")[...], getattr(m, f"{site.name}_lora_b")[...]
                w = getattr(m, site.name).get_value()
                magnitude = over_layers(lambda w, a, b, site=site: _core.magnitude(site, w, a, b),
                                        _layer_axis(m, site, path), w, a, b)
                setattr(m, f"{site.name}_magnitude", nnx.LoRAParam(magnitude))

