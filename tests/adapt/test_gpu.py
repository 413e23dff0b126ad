"""On a GPU: the adapted HF Llama runs the Pallas kernels (the default implementation there) and agrees with the
XLA reference, outputs and adapter gradients, in bf16 at tile-multiple shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_fused import adapt
from tests.adapt._models import flax_transformers, lm_loss
from tests.helpers import rel_err

PROJ = r".*/(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
CASES = {
    "dora": lambda impl: [adapt.DoraRule(module_path=PROJ, rank=16, alpha=32.0, implementation=impl)],
    "lora": lambda impl: [adapt.LoraRule(module_path=PROJ, rank=16, alpha=32.0, implementation=impl)],
    "qdora_nf4": lambda impl: [adapt.DoraRule(module_path=PROJ, rank=16, quantize="nf4", implementation=impl)],
    "fp8_rowwise": lambda impl: [adapt.Fp8Rule(module_path=r".*/(gate_proj|up_proj|down_proj)", recipe="rowwise",
                                               implementation=impl)],
}


@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(CASES))
def test_gpu_kernels_match_xla(kind):
    transformers = flax_transformers()
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256)
    hf = transformers.FlaxLlamaForCausalLM(cfg, seed=0, dtype=jnp.bfloat16)
    ids = jax.random.randint(jax.random.key(1), (2, 257), 0, 512)
    inputs = (ids[:, :-1], jnp.ones((2, 256), jnp.int32), jnp.broadcast_to(jnp.arange(256), (2, 256)))
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), hf.params)
    results = {}
    for impl in ("pallas", "xla"):
        lmodel = adapt.apply(hf.module, CASES[kind](impl))
        variables = adapt.from_pretrained(lmodel, lmodel.init(jax.random.key(0), *inputs), params)
        p = jax.tree_util.tree_map_with_path(
            lambda path, x: x + 0.01 if "lora_b" in jax.tree_util.keystr(path) else x, variables["params"])
        mask = adapt.trainable(p)
        adapters, frozen = adapt.split(p, mask)

        def loss_fn(adapters, frozen=frozen, lmodel=lmodel):
            return lm_loss(lmodel.apply({"params": adapt.join(adapters, frozen)}, *inputs).logits, ids[:, 1:])

        results[impl] = jax.jit(jax.value_and_grad(loss_fn))(adapters)
    (l1, g1), (l2, g2) = results["pallas"], results["xla"]
    assert rel_err(l1, l2) < 2e-2, (float(l1), float(l2))
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        assert rel_err(a, b) < 6e-2
