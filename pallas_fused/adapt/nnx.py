"""flax.nnx models: `apply` runs the model once on example inputs to find the adapted weights, creating each
one's adapters (`nnx.LoRAParam`) on the module that owns it from the weights already there; the returned model's
class is a subclass of the original whose method runs with the interception on.

Each module with adapted weights records them in `_pf_sites` (a static attribute): the sites are part of the
model's graph, so `nnx.split` / `nnx.merge`, `nnx.jit` and `nnx.Optimizer` carry them.
"""

from __future__ import annotations

from typing import Any

from flax import nnx

from pallas_fused.adapt import _core
from pallas_fused.adapt.rules import Rule, first_match, weight_path


def _params(module) -> dict[str, Any]:
    return {k: v.get_value() for k, v in vars(module).items() if isinstance(v, nnx.Param)}


class _Nnx(_core.Frontend):
    """At call time: the sites each module recorded. While `apply` traces (`paths` given): new sites too."""

    def __init__(self, rules=None, paths=None, rngs=None):
        self.rules, self.paths, self.rngs = rules, paths, rngs

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
        path = self.paths.get(id(module), "?") if self.paths is not None else "?"
        if _core.raise_if_ambiguous(name, self.rules, path):
            return None
        site = sites.get(name)
        if site is None:
            rule = first_match(self.rules, path, name) if self.paths is not None else None
            if rule is None:
                return None
            site = _core.new_site(rule, path, name, lhs, rhs, dimension_numbers, side)
            self._add(module, site)
        stored = getattr(module, name).get_value()
        adapters = {k: getattr(module, k)[...] for k in _core.adapter_shapes(site)}
        return _core.adapted_product(site, weight_path(path, name), lhs, rhs, dimension_numbers, side, stored,
                                     adapters, out_dtype)

    def _add(self, module, site) -> None:
        """A new site's adapters on `module` (from the weight there; quantized first for QDoRA)."""
        w = getattr(module, site.name).get_value()
        fmt = getattr(site.rule, "quantize", None)
        if fmt is not None:
            w = _core.QuantizedWeight.quantize(w, site.layout, fmt)
            setattr(module, site.name, nnx.Param(w))
        for k, v in _core.new_adapters(site, w, self.rngs.params()).items():
            setattr(module, k, nnx.LoRAParam(v))
        module._pf_sites = getattr(module, "_pf_sites", ()) + (site,)


def apply(model, rules: tuple[Rule, ...], method: str, rngs, args, kwargs):
    if not isinstance(rngs, nnx.Rngs):
        raise ValueError(f"adapt.apply: an NNX model needs rngs=nnx.Rngs(...) for the adapters' initial values, "
                         f"got {type(rngs).__name__}")
    base = getattr(type(model), "_pf_base", type(model))
    if getattr(base, method, None) is None:
        raise ValueError(f"adapt.apply: {base.__name__} has no method {method!r}")
    adapted = nnx.clone(model)
    paths = {id(m): "/".join(str(p) for p in path) for path, m in nnx.iter_modules(adapted)}
    for _, m in nnx.iter_modules(adapted):
        _core.bind_default_ops(m)
    cls = type(base.__name__, (base,), {"_pf_base": base, "_pf_rules": rules,
                                         method: _core.adapted_method(getattr(base, method), lambda self: _Nnx())})
    cls.__qualname__ = base.__qualname__
    with _core.active(_Nnx(rules, paths, rngs)):
        getattr(base, method)(adapted, *args, **kwargs)
    for _, m in nnx.iter_modules(adapted):
        if not getattr(m, "_pf_sites", ()):
            _core.restore_default_ops(m)
    adapted.__class__ = cls
    return adapted


def _adapted_modules(nmodel):
    return [(path, m) for path, m in nnx.iter_modules(nmodel) if getattr(m, "_pf_sites", ())]


def merge(nmodel):
    base = getattr(type(nmodel), "_pf_base", None)
    if base is None:
        raise ValueError(f"expected a model from adapt.apply, got {type(nmodel).__name__}")
    merged = nnx.clone(nmodel)
    for _, m in _adapted_modules(merged):
        for site in m._pf_sites:
            adapters = {k: getattr(m, k)[...] for k in _core.adapter_shapes(site)}
            w = getattr(m, site.name).get_value()
            setattr(m, site.name, nnx.Param(_core.merged_weight(site, w, adapters)))
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
    for _, m in _adapted_modules(nmodel):
        for site in m._pf_sites:
            if f"{site.name}_magnitude" in vars(m):
                a, b = getattr(m, f"{site.name}_lora_a")[...], getattr(m, f"{site.name}_lora_b")[...]
                w = getattr(m, site.name).get_value()
                setattr(m, f"{site.name}_magnitude", nnx.LoRAParam(_core.magnitude(site, w, a, b)))

