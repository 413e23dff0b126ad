"""Adopt without a rewrite: LoRA, DoRA / QDoRA and FP8 applied by rules to a Flax model someone else wrote.

    from pallas_fused import adapt

    rules = [adapt.DoraRule(module_path=r".*/(q_proj|v_proj)", rank=16, alpha=32.0),   # base_fp8="rowwise": FP8 base
             adapt.Fp8Rule(module_path=r".*/(up_proj|down_proj)", recipe="rowwise")]
    lmodel = adapt.apply(model, rules)                       # linen: a new Module, `model` untouched
    variables = lmodel.init(key, *inputs)
    variables = adapt.from_pretrained(lmodel, variables, pretrained_params)
    print(adapt.inspect(model, rules, *inputs))              # every contraction: its weight, rule and fate
    mask = adapt.trainable(variables)                        # True on the adapters
    adapters, frozen = adapt.split(variables["params"], mask["params"])   # train `adapters`, join(adapters, frozen)
    tx = adapt.optimizer(optax.adam(1e-3), variables)        # or: set_to_zero on the frozen params
    base_params = adapt.merge(lmodel, variables)             # params of the original model

    nmodel = adapt.apply(nnx_model, rules, *example_inputs, rngs=nnx.Rngs(0))   # NNX: a new model
    merged = adapt.merge(nmodel)                             # a model of the original class

The matched contractions (`jax.lax.dot_general`, and `jax.numpy.einsum` of two operands) run the library's own
ops: `dora_dense`, `lora_dense`, `fp8_linear`, and over an FP8 base (``base_fp8=``) `dora_fp8_dense`,
`lora_fp8_dense`. See docs/adapt.md.
"""

from pallas_fused.adapt._layout import QuantizedWeight
from pallas_fused.adapt.api import (
    apply,
    from_pretrained,
    inspect,
    join,
    merge,
    optimizer,
    reset_magnitudes,
    split,
    trainable,
    unused_rules,
)
from pallas_fused.adapt.report import Contraction, Inspection
from pallas_fused.adapt.rules import DoraRule, Fp8Rule, LoraRule, Rule

__all__ = ["Contraction", "DoraRule", "Fp8Rule", "Inspection", "LoraRule", "QuantizedWeight", "Rule", "apply",
           "from_pretrained", "inspect", "join", "merge", "optimizer", "reset_magnitudes", "split", "trainable",
           "unused_rules"]
