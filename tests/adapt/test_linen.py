"""pallas_fused.adapt on HF transformers' FlaxLlamaForCausalLM (linen, every projection an nn.Dense), model code we
did not write: init equivalence, gradients on the adapters alone, merge, training, an adapters-only checkpoint."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

from pallas_fused import adapt
from pallas_fused.dora.quant import dequantize, quantize_int8, quantize_nf4
from tests.adapt._models import (
    adapted_params,
    float32_reference,
    grads_against_float32,
    hf_llama,
    lm_loss,
    loss_and_adapter_grads,
)
from tests.helpers import rel_err

QV = r".*/(q_proj|v_proj)"
QV_MLP = r".*/(q_proj|v_proj|gate_proj|up_proj|down_proj)"
RULES = {
    "dora": [adapt.DoraRule(module_path=QV_MLP, rank=4, alpha=8.0)],
    "lora": [adapt.LoraRule(module_path=QV_MLP, rank=4, alpha=8.0)],
    "qdora_int8": [adapt.DoraRule(module_path=QV_MLP, rank=4, alpha=8.0, quantize="int8")],
    "qdora_nf4": [adapt.DoraRule(module_path=QV_MLP, rank=4, alpha=8.0, quantize="nf4")],
    "mixed": [adapt.DoraRule(module_path=QV, rank=4, alpha=8.0),
              adapt.Fp8Rule(module_path=r".*/(up_proj|down_proj)", recipe="rowwise"),
              adapt.LoraRule(module_path=r".*/gate_proj", rank=2)],
}
QUANTIZERS = {"qdora_int8": quantize_int8, "qdora_nf4": quantize_nf4}
# float32: both sides compute x W in fp32 on the CPU; bfloat16: HF's dtype=bf16 rounds every activation once
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


def _adapted(kind, dtype=jnp.float32):
    module, pretrained, inputs, targets = hf_llama(dtype)
    lmodel = adapt.apply(module, RULES[kind])
    variables = lmodel.init(jax.random.key(3), *inputs)
    variables = adapt.from_pretrained(lmodel, variables, pretrained)
    return module, pretrained, lmodel, variables, inputs, targets


def _dequantized(pretrained, fmt):
    """The pretrained params with each QDoRA-matched kernel replaced by its quantize-dequantize round trip."""
    def walk(tree, path=""):
        out = {}
        for k, v in tree.items():
            p = f"{path}/{k}" if path else k
            if isinstance(v, dict):
                out[k] = walk(v, p)
            elif k == "kernel" and any(n in p for n in ("q_proj", "v_proj", "gate_proj", "up_proj", "down_proj")):
                out[k] = dequantize(QUANTIZERS[fmt](v), v.dtype)
            else:
                out[k] = v
        return out
    return walk(pretrained)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("kind", ["dora", "lora", "qdora_int8", "qdora_nf4"])
def test_init_matches_original(kind, dtype):
    """After from_pretrained the adapted model computes what the original does with the same weights (B = 0,
    m = ||W||); QDoRA against the original with its weights quantized and dequantized."""
    module, pretrained, lmodel, variables, inputs, _ = _adapted(kind, dtype)
    reference = _dequantized(pretrained, kind) if kind in QUANTIZERS else pretrained
    want = module.apply({"params": reference}, *inputs).logits
    got = lmodel.apply(variables, *inputs).logits
    assert got.dtype == want.dtype
    assert rel_err(got, want) < TOL[dtype]
    assert adapt.unused_rules(lmodel) == []
    layer = variables["params"]["model"]["layers"]["0"]
    assert set(layer["self_attn"]["k_proj"]) == {"kernel"}  # unmatched: untouched
    q = layer["self_attn"]["q_proj"]
    expected = {"kernel", "kernel_lora_a", "kernel_lora_b"} | ({"kernel_magnitude"} if "dora" in kind else set())
    assert set(q) == expected
    assert q["kernel_lora_a"].shape == (64, 4) and q["kernel_lora_b"].shape == (4, 64)
    assert not np.any(np.asarray(q["kernel_lora_b"]))
    if kind in QUANTIZERS:
        assert isinstance(q["kernel"], adapt.QuantizedWeight)


def test_fp8_rule_runs_fp8():
    """An Fp8Rule changes the MLP's products by FP8's rounding only, and leaves the params tree as it was."""
    module, pretrained, inputs, _ = hf_llama()
    lmodel = adapt.apply(module, [adapt.Fp8Rule(module_path=r".*/(gate_proj|up_proj|down_proj)", recipe="rowwise")])
    variables = adapt.from_pretrained(lmodel, lmodel.init(jax.random.key(0), *inputs), pretrained)
    assert jax.tree_util.tree_structure(variables["params"]) == jax.tree_util.tree_structure(pretrained)
    want = module.apply({"params": pretrained}, *inputs).logits
    got = lmodel.apply(variables, *inputs).logits
    err = rel_err(got, want)
    assert 0 < err < 0.1, err


def _train(lmodel, variables, inputs, targets, steps=8, lr=1e-2):
    """Adam on the adapters alone: gradients are taken for them only (a QDoRA weight's codes are integers)."""
    mask = adapt.trainable(variables["params"])
    adapters, frozen = adapt.split(variables["params"], mask)
    tx = optax.adam(lr)
    state = tx.init(adapters)

    def loss_fn(adapters):
        return lm_loss(lmodel.apply({"params": adapt.join(adapters, frozen)}, *inputs).logits, targets)

    @jax.jit
    def step(adapters, state):
        loss, grads = jax.value_and_grad(loss_fn)(adapters)
        updates, state = tx.update(grads, state, adapters)
        return optax.apply_updates(adapters, updates), state, loss, grads

    losses = []
    for _ in range(steps):
        adapters, state, loss, grads = step(adapters, state)
        losses.append(float(loss))
    return {"params": adapt.join(adapters, frozen)}, losses, adapt.join(grads, frozen), mask


@pytest.mark.parametrize("kind", ["dora", "qdora_nf4", "mixed"])
def test_training_touches_adapters_only_and_merges(kind):
    """A few masked Adam steps: the loss falls, only adapter leaves change, gradients reach every adapter, and
    merge() gives params with which the original model reproduces the adapted model."""
    module, _, lmodel, variables, inputs, targets = _adapted(kind)
    trained, losses, grads, mask = _train(lmodel, variables, inputs, targets)
    assert losses[-1] < losses[0] - 0.05, losses
    flat_mask = jax.tree_util.tree_leaves_with_path(mask)
    before = dict(jax.tree_util.tree_leaves_with_path(variables["params"]))
    after = dict(jax.tree_util.tree_leaves_with_path(trained["params"]))
    grads = dict(jax.tree_util.tree_leaves_with_path(grads))
    assert any(m for _, m in flat_mask)
    for path, m in flat_mask:
        name = jax.tree_util.keystr(path)
        if m:
            assert np.any(np.asarray(before[path]) != np.asarray(after[path])), f"{name} did not train"
            if "lora_a" not in name:  # A's gradient is zero while B = 0 at the first step, not after
                assert np.any(np.asarray(grads[path]) != 0), f"{name} got no gradient"
        else:
            np.testing.assert_array_equal(np.asarray(before[path]), np.asarray(after[path]), err_msg=name)
    merged = adapt.merge(lmodel, trained)
    assert jax.tree_util.tree_structure(merged["params"]) == jax.tree_util.tree_structure(
        jax.tree_util.tree_map(lambda x: x, _adapted_params_shape(module, inputs)))
    got = module.apply(merged, *inputs).logits
    want = lmodel.apply(trained, *inputs).logits
    tol = 0.1 if kind == "mixed" else 1e-4  # the FP8 products stay FP8 in the adapted model, merged run plain
    assert rel_err(got, want) < tol


def _adapted_params_shape(module, inputs):
    return jax.eval_shape(module.init, jax.random.key(0), *inputs)["params"]


@pytest.mark.parametrize("exact", [False, True], ids=["lora", "dora_exact_norm"])
def test_gradients_match_the_merged_weight(exact):
    """Adapter gradients through the adapted model equal jax.grad of the original model run on the weight the
    adapters define (plain LoRA, and DoRA differentiating through its norm), with B != 0."""
    module, pretrained, inputs, targets = hf_llama()
    rule = (adapt.DoraRule(module_path=QV, rank=4, alpha=8.0, exact_norm_grad=True) if exact
            else adapt.LoraRule(module_path=QV, rank=4, alpha=8.0))
    lmodel = adapt.apply(module, [rule])
    variables = adapt.from_pretrained(lmodel, lmodel.init(jax.random.key(1), *inputs), pretrained)
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: x + 0.05 * jax.random.normal(jax.random.key(len(jax.tree_util.keystr(p))), x.shape)
        if "lora_b" in jax.tree_util.keystr(p) else x, variables["params"])

    def loss_adapted(p):
        return lm_loss(lmodel.apply({"params": p}, *inputs).logits, targets)

    def loss_merged(p):
        return lm_loss(module.apply(adapt.merge(lmodel, {"params": p}), *inputs).logits, targets)

    g1 = jax.grad(loss_adapted)(params)
    g2 = jax.grad(loss_merged)(params)
    mask = adapt.trainable(params)
    for (path, a), b, m in zip(jax.tree_util.tree_leaves_with_path(g1), jax.tree_util.tree_leaves(g2),
                               jax.tree_util.tree_leaves(mask)):
        if m:
            assert rel_err(a, b) < 1e-4, jax.tree_util.keystr(path)


def test_adapters_checkpoint_round_trip(tmp_path):
    """The adapters alone go to an orbax checkpoint and come back onto freshly loaded pretrained weights."""
    ocp = pytest.importorskip("orbax.checkpoint")
    module, pretrained, lmodel, variables, inputs, targets = _adapted("qdora_nf4")
    trained, _, _, mask = _train(lmodel, variables, inputs, targets, steps=3)
    adapters, _ = adapt.split(trained["params"], mask)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "adapters", adapters)
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(tmp_path / "adapters", adapters)
    fresh = adapt.from_pretrained(lmodel, lmodel.init(jax.random.key(9), *inputs), pretrained)
    params = adapt.join(restored, fresh["params"])
    np.testing.assert_array_equal(np.asarray(lmodel.apply({"params": params}, *inputs).logits),
                                  np.asarray(lmodel.apply(trained, *inputs).logits))


def test_interpret_kernels_match_xla():
    """The Pallas kernels (interpret mode) and the XLA reference give the same outputs and adapter gradients
    through the adapted HF model."""
    module, pretrained, inputs, targets = hf_llama()
    outs = []
    for impl in ("xla", "interpret"):
        rules = [adapt.DoraRule(module_path=r".*/q_proj", rank=4, alpha=8.0, implementation=impl),
                 adapt.LoraRule(module_path=r".*/v_proj", rank=4, implementation=impl)]
        lmodel = adapt.apply(module, rules)
        variables = adapt.from_pretrained(lmodel, lmodel.init(jax.random.key(1), *inputs), pretrained)
        params = jax.tree_util.tree_map_with_path(
            lambda p, x: x + 0.05 if "lora_b" in jax.tree_util.keystr(p) else x, variables["params"])
        loss, grads = jax.value_and_grad(
            lambda p, lmodel=lmodel: lm_loss(lmodel.apply({"params": p}, *inputs).logits, targets))(params)
        outs.append((loss, jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(adapt.trainable(params))))
    (l1, g1, mask), (l2, g2, _) = outs
    assert rel_err(l2, l1) < 1e-5
    for a, b, m in zip(g1, g2, mask):
        if m:
            assert rel_err(b, a) < 1e-4


@pytest.mark.parametrize("kind", ["lora", "dora", "qdora_nf4"])
def test_interpret_bf16_grads_against_float32(kind):
    """In bf16 the kernels (interpret mode) are judged as tests/adapt/test_gpu.py judges them on a GPU: each adapter
    gradient against the model in float32, within twice bf16 XLA's error (2% at least, 6% at most). Here both are
    0.5-1.6% off per leaf."""
    module, pretrained, inputs, targets = hf_llama(jnp.bfloat16)
    pretrained = jax.tree.map(lambda x: x.astype(jnp.bfloat16), pretrained)
    grads = {}
    for impl in ("interpret", "xla"):
        rules = [dataclasses.replace(r, implementation=impl) for r in RULES[kind]]
        lmodel, params = adapted_params(module, rules, inputs, pretrained)
        loss, grads[impl] = loss_and_adapter_grads(lmodel, params, inputs, targets)
    loss32, grads32 = float32_reference(module, rules, params, inputs, targets)
    assert rel_err(loss, loss32) < 1e-2
    failures = grads_against_float32(grads["interpret"], grads["xla"], grads32)
    assert not failures, "\n".join(failures)


def test_merge_and_trainable_keep_other_collections():
    module, pretrained, inputs, _ = hf_llama()
    lmodel = adapt.apply(module, RULES["lora"])
    variables = adapt.from_pretrained(lmodel, lmodel.init(jax.random.key(0), *inputs), {"params": pretrained})
    assert set(adapt.merge(lmodel, variables)) == {"params"}
    bare = adapt.merge(lmodel, variables["params"])
    assert "model" in bare and "kernel_lora_a" not in bare["model"]["layers"]["0"]["self_attn"]["q_proj"]
    assert module.apply({"params": bare}, *inputs).logits.shape == (2, 8, 160)
    mask = adapt.trainable(variables)
    assert jax.tree_util.tree_structure(mask) == jax.tree_util.tree_structure(variables)


def test_original_model_untouched():
    module, pretrained, inputs, _ = hf_llama()
    before = type(module)
    lmodel = adapt.apply(module, RULES["dora"])
    assert type(module) is before and isinstance(lmodel, before)
    lmodel.init(jax.random.key(0), *inputs)
    assert set(module.init(jax.random.key(0), *inputs)["params"]["model"]["layers"]["0"]["self_attn"]["q_proj"]) \
        == {"kernel"}
    # outside an adapted model jax's functions are back
    assert jax.lax.dot_general.__module__.startswith("jax")
    assert jnp.einsum.__module__.startswith("jax")


class CompactMLP(nn.Module):
    """A model written with @nn.compact (HF's uses setup): submodules defined inline, a DenseGeneral over two axes."""

    @nn.compact
    def __call__(self, x):
        h = nn.DenseGeneral((4, 8), name="up")(x)                       # (b, 16) -> (b, 4, 8)
        return nn.DenseGeneral(16, axis=(-2, -1), name="down")(nn.gelu(h))  # contracts both axes


def test_compact_model_and_dense_general():
    x = jax.random.normal(jax.random.key(0), (3, 16))
    model = CompactMLP()
    pretrained = model.init(jax.random.key(1), x)["params"]
    lmodel = adapt.apply(model, [adapt.DoraRule(module_path="(up|down)", rank=2)])
    variables = adapt.from_pretrained(lmodel, lmodel.init(jax.random.key(2), x), pretrained)
    assert variables["params"]["down"]["kernel_lora_a"].shape == (32, 2)  # both contracting axes in K
    assert variables["params"]["up"]["kernel_magnitude"].shape == (32,)   # both output axes in N
    assert rel_err(lmodel.apply(variables, x), model.apply({"params": pretrained}, x)) < 1e-5
    bumped = jax.tree_util.tree_map_with_path(
        lambda p, v: v + 0.1 if "lora_b" in jax.tree_util.keystr(p) else v, variables)
    merged = adapt.merge(lmodel, bumped)
    assert merged["params"]["down"]["kernel"].shape == (4, 8, 16)
    assert rel_err(model.apply(merged, x), lmodel.apply(bumped, x)) < 1e-5


class RematBlocks(nn.Module):
    """Blocks under nn.remat (a lifted transform): the adapters live in the blocks' own scopes."""

    @nn.compact
    def __call__(self, x):
        for i in range(2):
            x = nn.remat(CompactMLP)(name=f"block_{i}")(x) + x
        return x


def test_remat_blocks():
    x = jax.random.normal(jax.random.key(0), (3, 16))
    model = RematBlocks()
    pretrained = model.init(jax.random.key(1), x)["params"]
    lmodel = adapt.apply(model, [adapt.LoraRule(module_path=r"block_\d+/up", rank=2)])
    variables = adapt.from_pretrained(lmodel, lmodel.init(jax.random.key(2), x), pretrained)
    assert set(variables["params"]["block_1"]["up"]) == {"kernel", "bias", "kernel_lora_a", "kernel_lora_b"}
    assert rel_err(lmodel.apply(variables, x), model.apply({"params": pretrained}, x)) < 1e-6
    grads = jax.jit(jax.grad(lambda p: jnp.sum(lmodel.apply({"params": p}, x) ** 2)))(variables["params"])
    assert np.any(np.asarray(grads["block_0"]["up"]["kernel_lora_b"]) != 0)
