"""flax.nnx models: `apply` runs the model once on example inputs to find the adapted weights, creating each
one's adapters (`nnx.LoRAParam`) on the module that owns it from the weights already there; the returned model's
class is a subclass of the original whose method runs with the interception on.

Each module with adapted weights records them in `_pf_sites` (a static attribute): the sites are part of the
model's graph, so `nnx.split` / `nnx.merge`, `nnx.jit` and `nnx.Optimizer` carry them.
"""

from __future__ import annotations

import warnings

from flax import nnx

from pallas_fused.adapt import _core, _stacked
from pallas_fused.adapt.report import no_match
from pallas_fused.adapt.rules import Rule, weight_path


class _Nnx(_core.Frontend):
    """NNX's answers. At call time: the sites each module recorded (`_pf_sites`). While `apply` or `inspect` runs
    (`paths` given): new sites too, with their adapters created on the module (not with `dry`)."""

    hint = "adapters are created by adapt.apply(model, rules, *inputs, rngs=...)"

    def __init__(self, rules=None, paths=None, rngs=None, dry=False):
        super().__init__()
        self.rules, self.paths, self.rngs, self.dry = rules, paths, rngs, dry
        self.lifted: dict[str, tuple[str, _core.Site, dict]] = {}  # sites met inside lifted transforms

    def _lifted(self, module) -> bool:
        """Whether `module` is a copy made inside an NNX transform (nnx.scan, nnx.vmap, nnx.remat split the model
        and merge copies inside): its params are traced slices, its path a static attribute set by `apply`."""
        return self.paths is not None and id(module) not in self.paths

    def path(self, module):
        if not isinstance(module, nnx.Module):
            return None
        if self.paths is None:  # at call time only the modules with sites take part
            return "?" if getattr(module, "_pf_sites", ()) else None
        return self.paths.get(id(module)) or getattr(module, "_pf_path", "?")

    def params(self, module):
        return {k: v.get_value() for k, v in vars(module).items() if isinstance(v, nnx.Param)}

    def site(self, module, where, name):
        return next((s for s in getattr(module, "_pf_sites", ()) if s.name == name), None)

    def add_site(self, module, where, site):
        if self.dry:
            return
        if self._lifted(module):
            self.lifted.setdefault(where, (self.path(module), site, _shapes(module)))
            return
        module._pf_sites = getattr(module, "_pf_sites", ()) + (site,)

    def get(self, module, name):
        return getattr(module, name).get_value()

    def put(self, module, name, value, adapter):
        setattr(module, name, nnx.LoRAParam(value) if adapter else nnx.Param(value))

    def has(self, module, name):
        return name in vars(module)

    def can_create(self, module):
        return self.paths is not None and not self.dry

    def rng(self, module):
        return self.rngs.params()

    def defers(self, module):
        return self._lifted(module)

    def add_lifted(self, modules: dict[str, nnx.Module]) -> None:
        """The variables of the sites met inside lifted transforms, made on the model's own modules: stacked along
        the layer axis of their weight where it is stacked (built by nnx.vmap), each layer's from its slice."""
        for where, (path, site, per_layer) in self.lifted.items():
            module = modules[path]
            if any(s.name == site.name for s in getattr(module, "_pf_sites", ())):
                continue
            axis = _stacked.layer_axis(per_layer, _shapes(module), where)
            w = getattr(module, site.name).get_value()
            _stacked.check_storable(site, w, axis, where)
            stored = site.rule.store(w, site.layout, where)
            if stored is not w:
                setattr(module, site.name, nnx.Param(stored))
            for k, v in _stacked.new_adapters(site, stored, self.rngs.params(), axis).items():
                setattr(module, k, nnx.LoRAParam(v))
            module._pf_sites = getattr(module, "_pf_sites", ()) + (site,)


def _shapes(module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.get_value().shape) for k, v in vars(module).items() if isinstance(v, nnx.Variable)}


def _tag_paths(model) -> dict[str, nnx.Module]:
    """The model's modules by path, each holding its path as a static attribute (`_pf_path`), which the copies
    NNX transforms make inside carry."""
    modules = {"/".join(str(p) for p in path): m for path, m in nnx.iter_modules(model)}
    for path, m in modules.items():
        m._pf_path = path
    return modules


def _untag(modules) -> None:
    for m in modules.values():
        if "_pf_path" in vars(m):
            del m._pf_path


def _paths(model) -> dict[int, str]:
    return {id(m): "/".join(str(p) for p in path) for path, m in nnx.iter_modules(model)}


def apply(model, rules: tuple[Rule, ...], method: str, rngs, args, kwargs):
    if not isinstance(rngs, nnx.Rngs):
        raise ValueError(f"adapt.apply: an NNX model needs rngs=nnx.Rngs(...) for the adapters' initial values, "
                         f"got {type(rngs).__name__}")
    base = getattr(type(model), "_pf_base", type(model))
    if getattr(base, method, None) is None:
        raise ValueError(f"adapt.apply: {base.__name__} has no method {method!r}")
    adapted = nnx.clone(model)
    for _, m in nnx.iter_modules(adapted):
        _core.bind_default_ops(m)
    frontend = _Nnx(rules, _paths(adapted), rngs)
    modules = _tag_paths(adapted)
    try:
        with _core.active(frontend):
            getattr(base, method)(adapted, *args, **kwargs)
    finally:
        _untag(modules)
    frontend.add_lifted(modules)
    frontend.warn_unreached()
    cls = type(base.__name__, (base,), {"_pf_base": base, "_pf_rules": rules, "_pf_seen": frontend.seen,
                                         "_pf_matched": frontend.matched,
                                         method: _core.adapted_method(getattr(base, method), lambda self: _Nnx())})
    cls.__qualname__ = base.__qualname__
    for _, m in nnx.iter_modules(adapted):
        if not getattr(m, "_pf_sites", ()):
            _core.restore_default_ops(m)
    adapted.__class__ = cls
    return adapted


def _adapted_modules(nmodel):
    return [("/".join(str(p) for p in path), m) for path, m in nnx.iter_modules(nmodel) if getattr(m, "_pf_sites", ())]


def _layer_axis(module, path: str, site):
    """The layer axis of a site's weight and adapters on `module` (built by nnx.vmap), None where not stacked."""
    return _stacked.site_axis(site, _shapes(module), weight_path(path, site.name))


def merge(nmodel):
    base = getattr(type(nmodel), "_pf_base", None)
    if base is None:
        raise ValueError(f"expected a model from adapt.apply, got {type(nmodel).__name__}")
    if not _adapted_modules(nmodel) and type(nmodel)._pf_seen:
        raise ValueError(no_match(type(nmodel)._pf_rules, tuple(type(nmodel)._pf_seen.values())))
    merged = nnx.clone(nmodel)
    for path, m in _adapted_modules(merged):
        for site in m._pf_sites:
            axis = _layer_axis(m, path, site)
            adapters = {k: getattr(m, k).get_value() for k in site.adapter_shapes()}
            w = getattr(m, site.name).get_value()
            setattr(m, site.name, nnx.Param(_stacked.merged(site, w, adapters, axis)))
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
    if not used:
        warnings.warn(no_match(rules, tuple(type(nmodel)._pf_seen.values())), stacklevel=3)
    return [r for r in rules if r not in used]


def reset_magnitudes(nmodel) -> None:
    """DoRA magnitudes = ||W + s A B|| again, e.g. after loading other base weights with nnx.update."""
    for path, m in _adapted_modules(nmodel):
        for site in m._pf_sites:
            adapters = {k: getattr(m, k).get_value() for k in site.adapter_shapes()}
            w = getattr(m, site.name).get_value()
            for k, v in _stacked.refreshed(site, w, adapters, _layer_axis(m, path, site)).items():
                setattr(m, k, nnx.LoRAParam(v))


def inspect(model, rules, method: str, args, kwargs) -> tuple:
    """The contractions of `model`'s method, run abstractly on a copy (no adapters created; `model` untouched)."""
    graphdef, state = nnx.split(model)
    frontend = _Nnx(rules, None, None, dry=True)

    def run(state, args, kwargs):
        m = nnx.merge(graphdef, state)
        frontend.paths = _paths(m)
        _tag_paths(m)
        for _, sub in nnx.iter_modules(m):
            _core.bind_default_ops(sub)
        with _core.active(frontend):
            getattr(type(m), method)(m, *args, **kwargs)

    _core.eval_abstract(run, state, args, kwargs)
    return tuple(frontend.seen.values()) + tuple(frontend.unreached())

