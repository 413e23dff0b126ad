"""Weights stacked by a lifted transform: a layer under linen's `nn.scan` / `nn.vmap` (``variable_axes={"params":
k}``) or an NNX module built by `nnx.vmap` and run by `nnx.scan` sees each of its params as one layer's slice,
while the params tree stores them with a layer axis at index k.

The contraction runs per layer, so a site (its layout, its op) is the per-layer one. Only what works on the stored
leaves needs the axis: creating adapters outside the lift (NNX), DoRA magnitudes, merging. There the per-layer
function is mapped over the layer axis (`jax.vmap` in and out at that axis). The adapters are stacked where their
weight is: the per-layer (K, r), (r, N), (N,) with the layer count inserted at index k, which is where linen's own
lift puts the params a scanned layer creates, and where `nnx.scan` slices a module's state.

The axis is read off the shapes: the one index k at which removing an axis from every stored param of the module
(the weight, its adapters, its siblings) gives the per-layer shape seen inside the lift. Where two indices fit all
of them (equal neighbouring sizes everywhere), which one the lift used cannot be told, and it is a ValueError.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp


def layer_axis(per_layer: Mapping[str, tuple[int, ...]], stored: Mapping[str, tuple[int, ...]], where: str):
    """The layer axis of a module's params (`stored` shapes) whose per-layer shapes are `per_layer` (by name), or
    None where they are not stacked."""
    names = [k for k in per_layer if k in stored]
    if all(tuple(stored[k]) == tuple(per_layer[k]) for k in names):
        return None
    fits = None
    for k in names:
        s, p = tuple(stored[k]), tuple(per_layer[k])
        here = {a for a in range(len(s)) if len(s) == len(p) + 1 and s[:a] + s[a + 1:] == p}
        fits = here if fits is None else fits & here
    lengths = {tuple(stored[k])[a] for k in names for a in (fits or ())}
    if not fits or len(fits) > 1 or len(lengths) != 1:
        seen = {k: (tuple(per_layer[k]), tuple(stored[k])) for k in names}
        raise ValueError(f"adapt: {where}: the stored params are not one layer's params stacked along one axis "
                         f"(per layer -> stored: {seen}); axes that fit: {sorted(fits or ())}")
    return fits.pop()


def over_layers(fn, axis, *args, in_axes=None):
    """`fn(*args)` on each layer: mapped over `axis` of every argument (or `in_axes`), results stacked at `axis`
    (`fn(*args)` itself where `axis` is None)."""
    if axis is None:
        return fn(*args)
    return jax.vmap(fn, in_axes=axis if in_axes is None else in_axes, out_axes=axis)(*args)


def site_axis(site, shapes: Mapping[str, tuple[int, ...]], where: str):
    """The layer axis of a site's weight and adapters, whose stored shapes are `shapes` (by name); None for a rule
    without adapters (FP8), which keeps its weight as it is."""
    adapters = site.adapter_shapes()
    return layer_axis({site.name: site.layout.stored, **adapters}, shapes, where) if adapters else None


def merged(site, stored, adapters, axis):
    """`site.merged`, layer by layer."""
    return over_layers(site.merged, axis, stored, adapters)


def refreshed(site, stored, adapters, axis):
    """`site.refreshed` (DoRA's magnitudes), layer by layer."""
    return over_layers(site.refreshed, axis, stored, adapters)


def new_adapters(site, stored, key, axis):
    """The rule's initial adapters: for a stacked weight, each layer's from its own slice and its own key."""
    def init(w, key):
        return site.rule.init_adapters(site.name, site.layout, w, key)

    if axis is None:
        return init(stored, key)
    return over_layers(init, axis, stored, jax.random.split(key, stored.shape[axis]), in_axes=(axis, 0))


def check_storable(site, stored, axis, where: str) -> None:
    """A ValueError where the rule keeps a stacked weight in another form than the array (QDoRA, an FP8 base:
    quantized)."""
    if axis is None:
        return
    one = jnp.take(stored, 0, axis=axis)
    if site.rule.store(one, site.layout, where) is not one:
        raise refuse_quantized(where)


def refuse_quantized(where: str) -> ValueError:
    return ValueError(f"adapt: at {where or 'a quantized weight'}, a rule with quantize= (QDoRA) or base_fp8= matched "
                      f"a weight stacked by a lifted transform (nn.scan / nn.vmap / nnx.vmap): a QDoRA or FP8 base's "
                      f"quantized weight cannot be stacked. Use the rule without quantize / base_fp8 for stacked "
                      f"layers, or unroll them")
