"""pallas_fused.adapt on an NNX model whose projections are einsums in several layouts (a plain jnp.einsum over
heads, one contracting two axes, an nnx.Einsum stored (out, in)) and an nnx.Linear."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallas_fused import adapt
from tests.adapt._models import EinsumNet, nnx_adapter_steps
from tests.helpers import rel_err

ALL = r"blocks/\d+/(wq|wo|up|down)"


def _model_and_input(dtype=jnp.float32):
    model = EinsumNet(rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 5, 32), dtype)
    return model, x


RULES = {
    "dora": [adapt.DoraRule(module_path=ALL, rank=4, alpha=8.0)],
    "lora": [adapt.LoraRule(module_path=ALL, rank=4)],
    "qdora_int8": [adapt.DoraRule(module_path=r".*/(up|down)", rank=4, quantize="int8"),
                   adapt.DoraRule(module_path=ALL, rank=4)],
    "fp8": [adapt.Fp8Rule(module_path=r".*/(up|down)", recipe="tensorwise")],
}


@pytest.mark.parametrize("kind", ["dora", "lora", "qdora_int8", "fp8"])
def test_apply_trains_adapters_and_merges(kind):
    model, x = _model_and_input()
    want = model(x)
    nmodel = adapt.apply(model, RULES[kind], x, rngs=nnx.Rngs(1))
    assert type(model) is EinsumNet and isinstance(nmodel, EinsumNet)
    assert not hasattr(model.blocks[0], "wq_lora_a")  # the original is untouched
    assert adapt.unused_rules(nmodel) == []
    adapters = nnx.state(nmodel, nnx.LoRAParam)
    names = {"/".join(map(str, p)) for p, _ in nnx.to_flat_state(adapters)}
    if kind == "fp8":
        assert names == set()
        assert 0 < rel_err(nmodel(x), want) < 0.1
        return
    assert "blocks/0/wo_lora_a" in names and "blocks/1/up/kernel_lora_b" in names
    b = nmodel.blocks[0]
    assert b.wo_lora_a[...].shape == (32, 4)  # (heads * head_dim, rank): both contracting axes in K
    assert b.up.kernel_lora_a[...].shape == (32, 4) and b.up.kernel_lora_b[...].shape == (4, 96)
    if kind == "qdora_int8":
        assert isinstance(b.up.kernel.get_value(), adapt.QuantizedWeight)
        assert rel_err(nmodel(x), want) < 2e-2  # int8's rounding of W
    else:
        assert rel_err(nmodel(x), want) < 2e-6

    target = jax.random.normal(jax.random.key(2), want.shape)
    losses = nnx_adapter_steps(nmodel, lambda m: jnp.mean((m(x) - target) ** 2), steps=6, lr=1e-2)
    assert losses[-1] < losses[0], losses

    merged = adapt.merge(nmodel)
    assert type(merged) is EinsumNet
    assert nnx.state(merged, nnx.LoRAParam) == nnx.State({})
    assert merged.blocks[0].wq[...].shape == (32, 4, 8) and merged.blocks[0].up.kernel[...].shape == (96, 32)
    assert rel_err(merged(x), nmodel(x)) < 1e-5


def test_split_merge_and_jit_keep_the_sites():
    model, x = _model_and_input()
    nmodel = adapt.apply(model, RULES["dora"], x, rngs=nnx.Rngs(1))
    graphdef, state = nnx.split(nmodel)
    again = nnx.merge(graphdef, state)
    np.testing.assert_array_equal(np.asarray(again(x)), np.asarray(nmodel(x)))
    assert rel_err(nnx.jit(lambda m, x: m(x))(nmodel, x), nmodel(x)) < 1e-6


def test_new_base_weights_then_reset_magnitudes():
    model, x = _model_and_input()
    nmodel = adapt.apply(model, RULES["dora"], x, rngs=nnx.Rngs(1))
    other = EinsumNet(rngs=nnx.Rngs(7))
    nmodel.blocks[0].wq = nnx.Param(other.blocks[0].wq[...])
    adapt.reset_magnitudes(nmodel)
    np.testing.assert_allclose(np.asarray(nmodel.blocks[0].wq_magnitude[...]),
                               np.linalg.norm(np.asarray(other.blocks[0].wq[...]).reshape(32, 32), axis=0),
                               rtol=1e-5)


def test_unused_rules_and_bad_calls():
    model, x = _model_and_input()
    unused = adapt.LoraRule(module_path=r".*/nothing", rank=2)
    nmodel = adapt.apply(model, [adapt.LoraRule(module_path=r".*/wq", rank=2), unused], x, rngs=nnx.Rngs(0))
    assert adapt.unused_rules(nmodel) == [unused]
    with pytest.raises(ValueError, match="example inputs"):
        adapt.apply(model, [unused], rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="rngs=nnx.Rngs"):
        adapt.apply(model, [unused], x)
    with pytest.raises(ValueError, match="holds its own weights"):
        adapt.merge(nmodel, {})
    with pytest.raises(ValueError, match="at blocks/0/wq: rank 40 is larger than the layer"):
        adapt.apply(model, [adapt.LoraRule(module_path=r".*/wq", rank=40)], x, rngs=nnx.Rngs(0))


class Experts(nnx.Module):
    def __init__(self, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (3, 8, 8)))

    def __call__(self, x):  # one weight per expert: a batch dimension
        return jnp.einsum("ebd,edf->ebf", x, self.w[...])


class TwinWeights(nnx.Module):
    """Two params of one shape, the first read through two casts: which one is the operand is known by where it
    came from."""

    def __init__(self, rngs):
        self.a = nnx.Param(jax.random.normal(rngs.params(), (8, 8)))
        self.b = nnx.Param(jax.random.normal(rngs.params(), (8, 8)))

    def __call__(self, x):
        return jnp.einsum("td,df->tf", x, self.a[...].astype(jnp.bfloat16).astype(jnp.float32))


def test_contractions_that_cannot_be_adapted_raise():
    with pytest.raises(ValueError, match="w: the contraction has batch dimensions"):
        adapt.apply(Experts(nnx.Rngs(0)), [adapt.LoraRule(module_path=".*", rank=2)], jnp.ones((3, 4, 8)),
                    rngs=nnx.Rngs(0))



def test_casts_are_followed_to_the_right_twin():
    nmodel = adapt.apply(TwinWeights(nnx.Rngs(0)), [adapt.LoraRule(module_path=".*", rank=2)], jnp.ones((4, 8)),
                         rngs=nnx.Rngs(0))
    assert hasattr(nmodel, "a_lora_a") and not hasattr(nmodel, "b_lora_a")
