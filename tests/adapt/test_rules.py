"""Rules and bad input: each mistake a ValueError that names the rule, the module path or the argument."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_fused import adapt
from tests.adapt._models import hf_llama


def test_rule_matching_is_fullmatch_on_path_or_weight():
    rule = adapt.LoraRule(module_path=r".*/q_proj", rank=2)
    assert rule.matches("model/layers/0/self_attn/q_proj", "kernel")
    assert not rule.matches("model/layers/0/self_attn/q_proj_extra", "kernel")
    by_weight = adapt.LoraRule(module_path=r"blocks/\d+/wq", rank=2)
    assert by_weight.matches("blocks/3", "wq") and not by_weight.matches("blocks/3", "wo")
    assert adapt.LoraRule(module_path="w", rank=1).matches("", "w")  # a root module's own weight


@pytest.mark.parametrize("make, message", [
    (lambda: adapt.LoraRule(module_path="(", rank=2), r"module_path '\(' is not a regular expression"),
    (lambda: adapt.LoraRule(module_path=3, rank=2), "module_path must be a regular expression"),
    (lambda: adapt.DoraRule(module_path=".*", rank=0), "rank must be an int >= 1, got 0"),
    (lambda: adapt.DoraRule(module_path=".*", rank=2.0), "rank must be an int >= 1, got 2.0"),
    (lambda: adapt.DoraRule(module_path=".*", rank=2, quantize="int4"), "quantize must be None, 'int8' or 'nf4'"),
    (lambda: adapt.Fp8Rule(module_path=".*", recipe="fast"), "name must be one of .*got .fast."),
    (lambda: adapt.apply(object(), [adapt.LoraRule(module_path=".*", rank=1)]), "flax.linen.Module or"),
    (lambda: adapt.apply(hf_llama()[0], []), "rules is empty"),
    (lambda: adapt.apply(hf_llama()[0], ["q_proj"]), r"rules\[0\] must be an adapt.LoraRule"),
    (lambda: adapt.apply(hf_llama()[0], adapt.LoraRule(module_path=".*", rank=1), jnp.ones(3)), "takes no example"),
])
def test_bad_rules_and_calls(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_linen_errors_name_the_path():
    module, pretrained, inputs, _ = hf_llama()
    too_big = adapt.apply(module, [adapt.DoraRule(module_path=r".*/k_proj", rank=48)])
    with pytest.raises(ValueError, match=r"rank=48.*at model/layers/0/self_attn/k_proj/kernel: rank 48 is larger than "
                                         r"the layer, whose weight is 64 x 32"):
        too_big.init(jax.random.key(0), *inputs)

    lmodel = adapt.apply(module, [adapt.DoraRule(module_path=r".*/q_proj", rank=4)])
    with pytest.raises(ValueError, match="has not been traced yet"):
        adapt.from_pretrained(lmodel, {"params": pretrained}, pretrained)
    with pytest.raises(ValueError, match=r"q_proj/kernel matches DoraRule.*the params have no \['kernel_lora_a'"):
        lmodel.apply({"params": pretrained}, *inputs)  # the original's params: no adapters
    variables = lmodel.init(jax.random.key(0), *inputs)
    bad = jax.tree_util.tree_map(lambda x: x, pretrained)
    bad["lm_head"]["kernel"] = jnp.zeros((64, 7))
    with pytest.raises(ValueError, match=r"pretrained leaf 'lm_head/kernel' has shape \(64, 7\)"):
        adapt.from_pretrained(lmodel, variables, bad)
    extra = {**pretrained, "vision": {"kernel": jnp.zeros(3)}}
    with pytest.raises(ValueError, match="pretrained leaf 'vision/kernel' is not a param"):
        adapt.from_pretrained(lmodel, variables, extra)
    partial = {k: v for k, v in pretrained.items() if k != "lm_head"}
    with pytest.raises(ValueError, match=r"pretrained params have no \['lm_head/kernel'\]"):
        adapt.from_pretrained(lmodel, variables, partial)
    with pytest.raises(ValueError, match="needs its variables"):
        adapt.merge(lmodel)
    with pytest.raises(ValueError, match="has no method 'generate'"):
        adapt.apply(module, [adapt.LoraRule(module_path=".*", rank=1)], methods=("generate",))


def test_unused_rules_linen():
    module, _, inputs, _ = hf_llama()
    typo = adapt.LoraRule(module_path=r".*/qproj", rank=2)
    lmodel = adapt.apply(module, [adapt.LoraRule(module_path=r".*/v_proj", rank=2), typo])
    lmodel.init(jax.random.key(0), *inputs)
    assert adapt.unused_rules(lmodel) == [typo]


def test_split_join_round_trip():
    params = {"a": {"kernel": jnp.ones((2, 3)), "kernel_lora_a": jnp.full((2, 1), 2.0)}, "b": jnp.arange(3)}
    mask = {"a": {"kernel": False, "kernel_lora_a": True}, "b": False}
    selected, rest = adapt.split(params, mask)
    assert selected["a"]["kernel"] is None and selected["b"] is None
    assert selected["a"]["kernel_lora_a"] is params["a"]["kernel_lora_a"]
    assert rest["a"]["kernel_lora_a"] is None and rest["a"]["kernel"] is params["a"]["kernel"]
    assert rest["b"] is params["b"]
    joined = adapt.join(selected, rest)
    assert jax.tree.structure(joined) == jax.tree.structure(params)
    assert all(x is y for x, y in zip(jax.tree.leaves(joined), jax.tree.leaves(params)))
