"""pallas_fused.adapt on layers stacked by a lifted transform, rematerialized, or bridged from NNX into linen: our
own small decoder (tests/adapt/_scan_models.py) under linen `nn.scan` (the params' layer axis at 0 and at 1) with
`nn.remat` inside, NNX layers built by `nnx.vmap` and run by `nnx.scan` (layer axis 0 and 1), NNX layers under
`nnx.remat`, and NNX layers inside linen through `nnx.bridge.ToLinen`, unscanned and scanned.

Adapters of a stacked weight are stacked along the weight's own layer axis: the per-layer (K, r), (r, N) and (N,)
with the layer count L inserted at the index the layer axis has in the weight (axis 1: (K, L, r), (r, L, N),
(N, L)), which is where linen's nn.scan itself puts the params a scanned layer creates."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from pallas_fused import adapt
from pallas_fused.adapt._stacked import layer_axis
from tests.adapt._models import nnx_adapter_steps
from tests.adapt._scan_models import FF, LAYERS, BridgedDecoder, D, LinenDecoder, NnxDecoder, lm_loss, token_batch
from tests.helpers import rel_err

ATTN, MLP = r".*/(q|k|v|o)", r".*/(up|down)"
TYPO = adapt.LoraRule(module_path=r".*/q_porj", rank=2)
RULES = [adapt.DoraRule(module_path=ATTN, rank=2, alpha=4.0), adapt.LoraRule(module_path=MLP, rank=3), TYPO]
ADAPTER_SUFFIXES = ("_lora_a", "_lora_b", "_magnitude")

# (model, the params path of its layer holding q / up, the layer axis of its params: None = not stacked)
LINEN = {
    "scan_axis0_remat": (lambda: LinenDecoder(axis=0), ("layers",), 0),
    "scan_axis1_remat": (lambda: LinenDecoder(axis=1), ("layers",), 1),
    "bridge": (lambda: BridgedDecoder(axis=None), ("layers_1", "nnx"), None),
    "bridge_scan_axis0": (lambda: BridgedDecoder(axis=0), ("layers", "nnx"), 0),
    "bridge_scan_axis1": (lambda: BridgedDecoder(axis=1), ("layers", "nnx"), 1),
}


def _stacked(shape, axis):
    """A per-layer shape with the layer count inserted at `axis` (None: as it is)."""
    return tuple(shape) if axis is None else tuple(shape[:axis]) + (LAYERS,) + tuple(shape[axis:])


def _randomized(params, seed: int = 7):
    """`params` with every adapter leaf random (B = 0 would hide a wrong weight from the merge check)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = []
    for (path, x), key in zip(leaves, keys):
        name = jax.tree_util.keystr(path)  # an NNX state's leaf path ends in the variable's value
        if "_magnitude" in name:
            x = x * (1.0 + 0.2 * jax.random.normal(key, x.shape, x.dtype))
        elif "_lora_a" in name or "_lora_b" in name:
            x = 0.3 * jax.random.normal(key, x.shape, x.dtype)
        out.append(x)
    return jax.tree_util.tree_unflatten(treedef, out)


def _node(tree, path):
    for p in path:
        tree = tree[p]
    return tree


def _linen(case):
    make, layer_path, axis = LINEN[case]
    model = make()
    ids, targets = token_batch()
    pretrained = model.init(jax.random.key(5), ids)["params"]
    lmodel = adapt.apply(model, RULES)
    variables = adapt.from_pretrained(lmodel, lmodel.init(jax.random.key(0), ids), pretrained)
    return model, pretrained, lmodel, variables, ids, targets, layer_path, axis


@pytest.mark.parametrize("case", list(LINEN))
def test_linen_stacked_layers_adapt_and_merge(case):
    """from_pretrained takes the original model's stacked params, and the adapted model then computes what the
    original does; each adapter carries the layer axis where its weight does, each layer's magnitude is its own
    weight's norm; with random adapters, the merged params in the original model compute what the adapted model
    does (a weight merged with another layer's adapters, or along the wrong axis, fails this); a typo is
    reported."""
    model, pretrained, lmodel, variables, ids, _, layer_path, axis = _linen(case)
    assert rel_err(lmodel.apply(variables, ids), model.apply({"params": pretrained}, ids)) < 1e-6
    assert adapt.unused_rules(lmodel) == [TYPO]
    layer = _node(variables["params"], layer_path)
    q, up = layer["q"], layer["up"]
    assert q["kernel"].shape == _stacked((D, 4, D // 4), axis)
    assert q["kernel_lora_a"].shape == _stacked((D, 2), axis)
    assert q["kernel_lora_b"].shape == _stacked((2, D), axis)
    assert q["kernel_magnitude"].shape == _stacked((D,), axis)
    assert up["kernel_lora_a"].shape == _stacked((D, 3), axis) and up["kernel_lora_b"].shape == _stacked((3, FF), axis)
    assert "kernel_magnitude" not in up
    # o: (heads, head_dim, d), contracted over two axes (K = d): a DenseGeneral in linen, a Param of NnxLayer's
    o_lora_a = layer["o_lora_a"] if "o_lora_a" in layer else layer["o"]["kernel_lora_a"]
    assert o_lora_a.shape == _stacked((D, 2), axis)
    w = np.asarray(q["kernel"]) if axis is None else np.moveaxis(np.asarray(q["kernel"]), axis, 0)
    m = np.asarray(q["kernel_magnitude"]) if axis is None else np.moveaxis(np.asarray(q["kernel_magnitude"]), axis, 0)
    np.testing.assert_allclose(m, np.linalg.norm(w.reshape(w.shape[:-3] + (D, D)), axis=-2), rtol=1e-5)
    assert set(layer["ln1"]) == {"scale", "bias"}  # unmatched: untouched

    variables = {"params": _randomized(variables["params"])}
    adapted = lmodel.apply(variables, ids)
    assert rel_err(adapted, model.apply({"params": pretrained}, ids)) > 1e-2
    merged = adapt.merge(lmodel, variables)
    assert jax.tree.map(jnp.shape, merged["params"]) == jax.tree.map(jnp.shape, pretrained)
    assert rel_err(model.apply(merged, ids), adapted) < 1e-5


@pytest.mark.parametrize("case", ["scan_axis1_remat", "bridge_scan_axis0"])
def test_linen_adapters_only_training_lowers_the_loss(case):
    _, pretrained, lmodel, variables, ids, targets, _, _ = _linen(case)
    adapters, frozen = adapt.split(variables["params"], adapt.trainable(variables["params"]))
    tx = optax.adam(3e-2)

    @jax.jit
    def step(adapters, state):
        loss, grads = jax.value_and_grad(
            lambda a: lm_loss(lmodel.apply({"params": adapt.join(a, frozen)}, ids), targets))(adapters)
        updates, state = tx.update(grads, state, adapters)
        return optax.apply_updates(adapters, updates), state, loss

    state, losses = tx.init(adapters), []
    for _ in range(5):
        adapters, state, loss = step(adapters, state)
        losses.append(float(loss))
    assert losses[-1] < losses[0], losses
    base = adapt.join(jax.tree.map(lambda _: None, adapters), frozen)
    kept = {k: v for k, v in jax.tree_util.tree_leaves_with_path(base)}
    for path, v in jax.tree_util.tree_leaves_with_path(pretrained):
        np.testing.assert_array_equal(np.asarray(kept[path]), np.asarray(v))


def test_linen_qdora_under_scan_is_refused_with_the_path():
    ids, _ = token_batch()
    lmodel = adapt.apply(LinenDecoder(axis=0), [adapt.DoraRule(module_path=ATTN, rank=2, quantize="int8")])
    with pytest.raises(ValueError, match=r"at layers/(q|k|v|o)/kernel.*QDoRA.*cannot be stacked"):
        lmodel.init(jax.random.key(0), ids)


# -- NNX -----------------------------------------------------------------------------------------------------------

NNX = {
    "vmap_scan": (dict(scan=True), 0),
    "vmap_scan_remat": (dict(scan=True, remat=True), 0),
    "vmap_scan_axis1": (dict(scan=True, axis=1), 1),
    "remat": (dict(scan=False, remat=True), None),
}


def _nnx(case):
    kwargs, axis = NNX[case]
    model = NnxDecoder(rngs=nnx.Rngs(0), **kwargs)
    ids, targets = token_batch()
    return model, adapt.apply(model, RULES, ids, rngs=nnx.Rngs(1)), ids, targets, axis


def _nnx_layer(nmodel, axis):
    return nmodel.layers if axis is not None else nmodel.layers[1]


@pytest.mark.parametrize("case", list(NNX))
def test_nnx_stacked_layers_adapt_and_merge(case):
    model, nmodel, ids, _, axis = _nnx(case)
    assert rel_err(nmodel(ids), model(ids)) < 1e-6
    assert adapt.unused_rules(nmodel) == [TYPO]
    assert not hasattr(_nnx_layer(model, axis).q, "kernel_lora_a")  # the original is untouched
    layer = _nnx_layer(nmodel, axis)
    assert layer.q.kernel_lora_a[...].shape == _stacked((D, 2), axis)
    assert layer.q.kernel_magnitude[...].shape == _stacked((D,), axis)
    assert layer.o_lora_a[...].shape == _stacked((D, 2), axis) and layer.o_lora_b[...].shape == _stacked((2, D), axis)
    assert layer.up.kernel_lora_b[...].shape == _stacked((3, FF), axis)
    w, m, a = (np.asarray(v[...]) for v in (layer.v.kernel, layer.v.kernel_magnitude, layer.q.kernel_lora_a))
    if axis is not None:  # layers first
        w, m, a = np.moveaxis(w, axis, 0), np.moveaxis(m, axis, 0), np.moveaxis(a, axis, 0)
        assert not np.allclose(a[0], a[1])  # each layer's A drawn on its own
    np.testing.assert_allclose(m, np.linalg.norm(w.reshape(w.shape[:-3] + (D, D)), axis=-2), rtol=1e-5)
    paths = {"/".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(nmodel, nnx.LoRAParam))}
    prefix = "layers" if axis is not None else "layers/1"
    assert f"{prefix}/q/kernel_lora_a" in paths and f"{prefix}/o_magnitude" in paths

    graphdef, adapters, rest = nnx.split(nmodel, nnx.LoRAParam, ...)
    nmodel = nnx.merge(graphdef, _randomized(adapters), rest)
    adapted = nmodel(ids)
    assert rel_err(adapted, model(ids)) > 1e-2
    merged = adapt.merge(nmodel)
    assert type(merged) is NnxDecoder
    assert nnx.state(merged, nnx.LoRAParam) == nnx.State({})
    assert rel_err(merged(ids), adapted) < 1e-5


@pytest.mark.parametrize("case", ["vmap_scan_remat", "remat"])
def test_nnx_adapters_only_training_lowers_the_loss(case):
    _, nmodel, ids, targets, _ = _nnx(case)
    losses = nnx_adapter_steps(nmodel, lambda m: lm_loss(m(ids), targets), steps=5, lr=3e-2)
    assert losses[-1] < losses[0], losses


def test_nnx_qdora_under_vmap_is_refused_with_the_path():
    ids, _ = token_batch()
    with pytest.raises(ValueError, match=r"at layers/(q|k|v|o|up|down)/kernel.*QDoRA.*cannot be stacked"):
        adapt.apply(NnxDecoder(rngs=nnx.Rngs(0)), [adapt.DoraRule(module_path=ATTN, rank=2, quantize="int8")], ids,
                    rngs=nnx.Rngs(1))


def test_layer_axis_is_the_one_that_fits_every_param():
    """The layer axis is read off the shapes of all of a module's params; where two axes fit all of them (equal
    neighbouring sizes everywhere) it cannot be told, which is an error, not a guess."""
    per_layer = {"w": (4, 8, 16), "w_lora_a": (16, 2), "b": (16,)}
    assert layer_axis(per_layer, per_layer, "m/w") is None
    assert layer_axis(per_layer, {"w": (4, 4, 8, 16), "w_lora_a": (4, 16, 2), "b": (4, 16)}, "m/w") == 0
    assert layer_axis(per_layer, {"w": (4, 4, 8, 16), "w_lora_a": (16, 4, 2), "b": (16, 4)}, "m/w") == 1
    with pytest.raises(ValueError, match=r"m/w: the stored params are not one layer's.*axes that fit: \[0, 1\]"):
        layer_axis({"w": (4, 8)}, {"w": (4, 4, 8)}, "m/w")
    with pytest.raises(ValueError, match="m/w: the stored params are not one layer's"):
        layer_axis(per_layer, {"w": (3, 4, 8, 16), "w_lora_a": (16, 2, 3), "b": (3, 16)}, "m/w")


def test_qdora_on_layers_that_are_not_stacked():
    """QDoRA where the layer is not stacked: an NNX layer under nnx.remat, and an NNX layer bridged into linen
    (its quantized weight kept in the linen params, which ToLinen reads as the dequantized array)."""
    ids, _ = token_batch()
    rules = [adapt.DoraRule(module_path=ATTN, rank=2, quantize="int8")]
    model = NnxDecoder(scan=False, remat=True, rngs=nnx.Rngs(0))
    nmodel = adapt.apply(model, rules, ids, rngs=nnx.Rngs(1))
    assert isinstance(nmodel.layers[0].q.kernel.get_value(), adapt.QuantizedWeight)
    assert rel_err(nmodel(ids), model(ids)) < 3e-2  # int8's rounding of W
    assert rel_err(adapt.merge(nmodel)(ids), nmodel(ids)) < 1e-5

    bridged = BridgedDecoder(axis=None)
    pretrained = bridged.init(jax.random.key(5), ids)["params"]
    lmodel = adapt.apply(bridged, rules)
    variables = adapt.from_pretrained(lmodel, lmodel.init(jax.random.key(0), ids), pretrained)
    assert isinstance(variables["params"]["layers_0"]["nnx"]["q"]["kernel"], adapt.QuantizedWeight)
    assert rel_err(lmodel.apply(variables, ids), bridged.apply({"params": pretrained}, ids)) < 3e-2
    variables = {"params": _randomized(variables["params"])}
    assert rel_err(bridged.apply(adapt.merge(lmodel, variables), ids), lmodel.apply(variables, ids)) < 1e-5


def test_fp8_on_stacked_layers():
    """An Fp8Rule on stacked layers: FP8's rounding only, no params added, merge leaves the weights as they are."""
    ids, _ = token_batch()
    rules = [adapt.Fp8Rule(module_path=MLP, recipe="rowwise")]
    model = LinenDecoder(axis=1)
    pretrained = model.init(jax.random.key(5), ids)["params"]
    lmodel = adapt.apply(model, rules)
    variables = adapt.from_pretrained(lmodel, lmodel.init(jax.random.key(0), ids), pretrained)
    assert jax.tree.map(jnp.shape, variables["params"]) == jax.tree.map(jnp.shape, pretrained)
    assert 0 < rel_err(lmodel.apply(variables, ids), model.apply({"params": pretrained}, ids)) < 0.1
    assert jax.tree.map(jnp.shape, adapt.merge(lmodel, variables)["params"]) == jax.tree.map(jnp.shape, pretrained)

    nnx_model = NnxDecoder(rngs=nnx.Rngs(0))
    nmodel = adapt.apply(nnx_model, rules, ids, rngs=nnx.Rngs(1))
    assert adapt.unused_rules(nmodel) == []
    assert 0 < rel_err(nmodel(ids), nnx_model(ids)) < 0.1
    assert rel_err(adapt.merge(nmodel)(ids), nnx_model(ids)) < 1e-6
