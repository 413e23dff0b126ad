"""LoRA / DoRA over an FP8 base by rule (`base_fp8=`): HF's Flax Llama (linen, code we did not write) and the NNX
einsum model of tests/adapt/_models.py. The base is stored once as e4m3 codes with its scales; the adapted model
starts out computing the original up to FP8 rounding, trains its adapters with the codes unchanged bit for bit, and
merges into the dequantized base plus adapters, which the original model runs to the adapted output (exactly where
x's rounding is exact)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from pallas_fused import adapt
from pallas_fused.dora import Fp8Kernel, dequantize, quantize_fp8
from pallas_fused.fp8.config import Float8Config
from tests.adapt._models import EinsumNet, hf_llama, lm_loss, nnx_adapter_steps
from tests.adapt._scan_models import LinenDecoder, token_batch
from tests.fp8.test_frozen import E4M3, fp8_bound
from tests.helpers import rel_err

ATTN, MLP = r".*/self_attn/(q|v)_proj", r".*/mlp/(up|down)_proj"
LLAMA_RULES = [adapt.DoraRule(module_path=ATTN, rank=4, alpha=8.0, base_fp8="rowwise"),
               adapt.LoraRule(module_path=MLP, rank=4, base_fp8="tensorwise")]
# Each adapted contraction rounds its input (and its weight) to e4m3 once; the model's output carries the rounding
# of the 4 contractions per layer, in series through 2 layers: their errors add as independent noise, so at most
# sqrt(2) times one contraction's (the residual stream carries them through unscaled). At init: x and W rounded.
# After merge the weights are the dequantized ones, so only x's rounding separates merged from adapted.
INIT_BOUND = np.sqrt(2) * fp8_bound(E4M3, E4M3)
MERGE_BOUND = np.sqrt(2) * fp8_bound(E4M3)


def _leaves(tree, cls):
    return [v for v in jax.tree_util.tree_leaves(tree, is_leaf=lambda v: isinstance(v, cls)) if isinstance(v, cls)]


def _codes(params):
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(params)
            if getattr(v, "dtype", None) == E4M3}


@pytest.mark.slow  # an HF model: the floor leg only
def test_linen_hf_llama_inits_trains_merges_and_reloads():
    module, pretrained, inputs, targets = hf_llama()
    lmodel = adapt.apply(module, LLAMA_RULES)
    variables = adapt.from_pretrained(lmodel, jax.jit(lmodel.init)(jax.random.key(0), *inputs), pretrained)
    run_adapted = jax.jit(lambda p: lmodel.apply({"params": p}, *inputs).logits)  # one compile, not one per op
    run_original = jax.jit(lambda p: module.apply({"params": p}, *inputs).logits)
    params = variables["params"]
    stored = _leaves(params, adapt.QuantizedWeight)
    assert len(stored) == 2 * 4 and all(isinstance(q.kernel, Fp8Kernel) for q in stored)
    q = params["model"]["layers"]["0"]["self_attn"]["q_proj"]["kernel"]
    assert q.kernel.recipe == "rowwise" and q.kernel.codes.dtype == E4M3 and q.kernel.scale.shape == (64,)
    assert q.kernel.codes.nbytes == 64 * 64  # one byte per weight: no second copy
    w_q = pretrained["model"]["layers"]["0"]["self_attn"]["q_proj"]["kernel"]
    np.testing.assert_array_equal(np.asarray(q.kernel.codes), np.asarray(quantize_fp8(w_q, "rowwise").codes))

    # init computes the original up to FP8 rounding (and the FP8 GEMMs did run)
    want, got = run_original(pretrained), run_adapted(params)
    assert 1e-4 < rel_err(got, want) <= INIT_BOUND, rel_err(got, want)

    # inspect names the composition
    table = str(adapt.inspect(module, LLAMA_RULES, *inputs))
    assert "DoRA r4 over an FP8 rowwise base" in table and "LoRA r4 over an FP8 tensorwise base" in table

    # adapters-only Adam steps lower the loss; the codes stay as they are, bit for bit
    params = jax.tree_util.tree_map_with_path(
        lambda p, v: v + 0.01 if "lora_b" in jax.tree_util.keystr(p) else v, params)
    before = _codes(params)
    tx = adapt.optimizer(optax.adam(3e-3), params)
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        loss, grads = jax.value_and_grad(lambda p: lm_loss(lmodel.apply({"params": p}, *inputs).logits, targets))(
            params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    for _ in range(3):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    assert losses[-1] < losses[0], losses
    after = _codes(params)
    assert before.keys() == after.keys() and len(before) == 8
    for k in before:
        np.testing.assert_array_equal(before[k].view(np.uint8), after[k].view(np.uint8), err_msg=k)

    # merge: the dequantized base plus adapters, which the original model runs to the adapted output
    merged = adapt.merge(lmodel, params)
    assert jax.tree.map(lambda v: (v.shape, v.dtype), merged) == jax.tree.map(lambda v: (v.shape, v.dtype), pretrained)
    err = rel_err(run_original(merged), run_adapted(params))
    assert err <= MERGE_BOUND, err
    up = params["model"]["layers"]["1"]["mlp"]["up_proj"]
    a, b = up["kernel_lora_a"], up["kernel_lora_b"]
    np.testing.assert_allclose(np.asarray(merged["model"]["layers"]["1"]["mlp"]["up_proj"]["kernel"]),
                               np.asarray(dequantize(up["kernel"].kernel) + LLAMA_RULES[1].scale * a @ b),
                               rtol=1e-6, atol=1e-7)

    # new pretrained weights are quantized again, and DoRA's magnitudes follow them
    other = jax.tree.map(lambda w: -0.7 * w[::-1], pretrained)
    reloaded = adapt.from_pretrained(lmodel, variables, other)["params"]
    layer = reloaded["model"]["layers"]["0"]["self_attn"]["q_proj"]
    w_other = other["model"]["layers"]["0"]["self_attn"]["q_proj"]["kernel"]
    np.testing.assert_array_equal(np.asarray(layer["kernel"].kernel.codes),
                                  np.asarray(quantize_fp8(w_other, "rowwise").codes))
    np.testing.assert_allclose(np.asarray(layer["kernel_magnitude"]),
                               np.linalg.norm(np.asarray(dequantize(layer["kernel"].kernel)), axis=0), rtol=1e-6)


def test_nnx_einsum_model_trains_with_frozen_codes_and_merges():
    model = EinsumNet(rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 5, 32))
    want = model(x)
    rules = [adapt.DoraRule(module_path=r"blocks/\d+/(wq|wo)", rank=4, base_fp8="tensorwise"),
             adapt.LoraRule(module_path=r"blocks/\d+/(up|down)", rank=4, base_fp8="rowwise")]
    nmodel = adapt.apply(model, rules, x, rngs=nnx.Rngs(1))
    b = nmodel.blocks[0]
    for w in (b.wq, b.wo, b.up.kernel, b.down.kernel):
        assert isinstance(w.get_value(), adapt.QuantizedWeight) and isinstance(w.get_value().kernel, Fp8Kernel)
    assert b.wo.get_value().kernel.codes.shape == (32, 32)  # (heads * head_dim, d): both contracting axes in K
    assert 1e-4 < rel_err(nmodel(x), want) <= 2 * fp8_bound(E4M3, E4M3)  # 4 contractions per block, 2 blocks

    target = jax.random.normal(jax.random.key(2), want.shape)
    losses = nnx_adapter_steps(nmodel, lambda m: jnp.mean((m(x) - target) ** 2), steps=3, lr=1e-2)
    assert losses[-1] < losses[0], losses  # nnx_adapter_steps checks the rest of the state bit for bit

    merged = adapt.merge(nmodel)
    assert type(merged) is EinsumNet and merged.blocks[0].up.kernel[...].shape == (96, 32)
    assert rel_err(merged(x), nmodel(x)) <= 2 * fp8_bound(E4M3)


class Dense(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(48, name="proj")(x)


@pytest.mark.parametrize("rule", [adapt.LoraRule(module_path="proj", rank=3, base_fp8="rowwise"),
                                  adapt.DoraRule(module_path="proj", rank=3, base_fp8="rowwise")])
def test_merge_is_exact_where_x_rounds_exactly(rule):
    """Rows of x that e4m3 holds exactly under their power-of-2 rowwise scale (codes times 2^k, each row's amax
    448 * 2^k): the adapted layer then computes exactly what the original computes with the merged weight."""
    key = jax.random.split(jax.random.key(0), 3)
    codes = jax.random.normal(key[0], (9, 40)).astype(jnp.float8_e4m3fn).astype(jnp.float32)
    codes = codes.at[:, 0].set(448.0)
    x = codes * 2.0 ** jax.random.randint(key[1], (9, 1), -12, -6)
    lmodel = adapt.apply(Dense(), rule)
    params = lmodel.init(jax.random.key(1), x)["params"]
    params = jax.tree_util.tree_map_with_path(
        lambda p, v: jax.random.normal(key[2], v.shape) * 0.1 if "lora_b" in jax.tree_util.keystr(p) else v, params)
    adapted = lmodel.apply({"params": params}, x)
    merged = Dense().apply({"params": adapt.merge(lmodel, params)}, x)
    assert rel_err(merged, adapted) <= 1e-6
    plain = adapt.apply(Dense(), type(rule)(module_path="proj", rank=3))  # the same adapters on the unquantized base
    assert rel_err(adapted, plain.apply({"params": params | {"proj": params["proj"] | {
        "kernel": dequantize(params["proj"]["kernel"].kernel)}}}, x)) <= 1e-6


@pytest.mark.parametrize("make, message", [
    (lambda: adapt.LoraRule(module_path=".*", rank=2, base_fp8="bogus"), "base_fp8 must be None, 'tensorwise' or"),
    (lambda: adapt.DoraRule(module_path=".*", rank=2, base_fp8="blockwise"), "base_fp8 must be None"),
    (lambda: adapt.LoraRule(module_path=".*", rank=2, base_fp8=Float8Config()), "base_fp8 must be None"),
    (lambda: adapt.DoraRule(module_path=".*", rank=2, base_fp8="rowwise", quantize="nf4"),
     "quantize and base_fp8 both set"),
])
def test_bad_rules_name_base_fp8(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_a_stacked_layer_is_refused_naming_base_fp8():
    ids, _ = token_batch()
    lmodel = adapt.apply(LinenDecoder(axis=0), [adapt.LoraRule(module_path=r".*/(q|k|v|o)", rank=2,
                                                                base_fp8="rowwise")])
    with pytest.raises(ValueError, match=r"at layers/(q|k|v|o)/kernel.*base_fp8.*cannot be stacked"):
        lmodel.init(jax.random.key(0), ids)
