"""Adoption without a rewrite, timed as a user trains: HF transformers' Flax Llama (linen, random weights from a
config, bf16) with adapters on every block projection, one jitted training step of the adapters alone (Adam,
donated state), each candidate in turn in one process:

    adapt:dora / adapt:lora / adapt:qdora_nf4   pallas_fused.adapt.apply(model, [DoraRule(...)]) etc.
    dropin:dora / dropin:lora                   the same model with DoRADense / LoRADense written in place of its
                                                projections' nn.Dense (the hand-rewritten model)
    peer:qwix_lora / peer:qwix_qlora_nf4        qwix.apply_lora_to_model(model, LoraProvider(...)) (QLoRA: NF4,
                                                blocks of 64, as qwix's docs)
    full / adapt:fp8_mlp_<recipe>               every weight trained: bf16, and the MLP's projections in FP8 by rule

`peak_gb` is XLA's memory analysis of the compiled step (arguments + temporaries + outputs not aliased to
arguments): what one step holds at most, params and optimizer state included.
"""

from __future__ import annotations

import contextlib
import functools
import os

import jax
import jax.numpy as jnp
import optax

from benchmarks.common import Recorder, error_text

RANK, ALPHA = 16, 32.0
PROJ = r".*/(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
MLP = r".*/(gate_proj|up_proj|down_proj)"


def llama_config(size: str):
    from transformers import LlamaConfig

    if size == "1b":  # Llama 3.2 1B's shape: 1.24B parameters
        return LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                           num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048,
                           tie_word_embeddings=False)
    return LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def hf_module(cfg):
    from transformers import FlaxLlamaForCausalLM

    return FlaxLlamaForCausalLM(cfg, dtype=jnp.bfloat16, _do_init=False).module


@contextlib.contextmanager
def dropin(cfg, kind: str):
    """HF's Llama with `kind`'s drop-in written in place of each block projection's nn.Dense (the module-level
    `nn` its source names, swapped for one whose Dense is the drop-in; the LM head, vocab wide, stays nn.Dense)."""
    import flax.linen as nn
    from transformers.models.llama import modeling_flax_llama as src

    from pallas_fused.dora import DoRADense, LoRADense

    layer = {"dora": DoRADense, "lora": LoRADense}[kind]

    def dense(features, **kw):
        if features == cfg.vocab_size:
            return nn.Dense(features, **kw)
        return layer(features, RANK, alpha=ALPHA, **kw)

    class Namespace:
        def __getattr__(self, name):
            return dense if name == "Dense" else getattr(nn, name)

    saved = src.nn
    src.nn = Namespace()
    try:
        yield
    finally:
        src.nn = saved


def _bf16(tree):
    return jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                                  tree)


def _split(params, mask):
    keep = jax.tree_util.tree_map(lambda p, m: p if m else None, params, mask)
    rest = jax.tree_util.tree_map(lambda p, m: None if m else p, params, mask)
    return keep, rest


def _join(a, b):
    return jax.tree_util.tree_map(lambda x, y: y if x is None else x, a, b, is_leaf=lambda x: x is None)


def _names_mask(params, suffixes):
    """True on the leaves whose param name ends with one of `suffixes` (a boxed param's leaves share its name)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: any(str(getattr(k, "key", "")).endswith(suffixes) for k in path), params)


def make_step(model, params, mask, batch, seq):
    """(step, state): one Adam step of the params `mask` selects, the rest frozen; the state is donated."""
    ids = jax.random.randint(jax.random.key(1), (batch, seq + 1), 0, 512)
    attention = jnp.ones((batch, seq), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(seq), (batch, seq))
    train, frozen = _split(params, mask)
    tx = optax.adam(1e-4)

    def loss_fn(train, frozen, ids):
        logits = model.apply({"params": _join(train, frozen)}, ids[:, :-1], attention, positions).logits
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), ids[:, 1:]).mean()

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(train, opt_state, frozen, ids):
        loss, grads = jax.value_and_grad(loss_fn)(train, frozen, ids)
        updates, opt_state = tx.update(grads, opt_state, train)
        return optax.apply_updates(train, updates), opt_state, frozen, ids

    state = (train, tx.init(train), frozen, ids)
    mem = step.lower(*state).compile().memory_analysis()
    peak = None
    if mem is not None:
        peak = (mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes
                - mem.alias_size_in_bytes) / 1e9
    return step, step(*state), peak


def candidates(cfg, names):
    """(name, build) for the ones in `names`; build() -> (model, params, trainable mask, the context its trace
    needs)."""
    from pallas_fused import adapt

    base = hf_module(cfg)
    batch_in = (jnp.zeros((1, 8), jnp.int32), jnp.ones((1, 8), jnp.int32), jnp.arange(8)[None])
    key = jax.random.key(0)

    def adapted(rules):
        lm = adapt.apply(base, rules)
        v = lm.init(key, *batch_in)
        return lm, _bf16(v["params"]), adapt.trainable(v["params"]), contextlib.nullcontext

    def drop(kind, suffixes):
        # linen runs setup (where HF builds its projections) when the model is traced: init and the step's
        # compile both run inside the swap
        m = hf_module(cfg)
        with dropin(cfg, kind):
            v = m.init(key, *batch_in)
        return m, _bf16(v["params"]), _names_mask(v["params"], suffixes), functools.partial(dropin, cfg, kind)

    def qwix_lora(**kw):
        import qwix

        lm = qwix.apply_lora_to_model(base, qwix.LoraProvider(module_path=PROJ, rank=RANK, alpha=ALPHA, **kw))
        v = lm.init(key, *batch_in)
        return lm, _bf16(v["params"]), _names_mask(v["params"], ("_lora_a", "_lora_b")), contextlib.nullcontext

    def full():
        v = base.init(key, *batch_in)
        return base, _bf16(v["params"]), jax.tree_util.tree_map(lambda _: True, v["params"]), contextlib.nullcontext

    def fp8(recipe):
        lm = adapt.apply(base, [adapt.Fp8Rule(module_path=MLP, recipe=recipe)])
        v = lm.init(key, *batch_in)
        return lm, _bf16(v["params"]), jax.tree_util.tree_map(lambda _: True, v["params"]), contextlib.nullcontext

    build = {
        "adapt:dora": lambda: adapted([adapt.DoraRule(module_path=PROJ, rank=RANK, alpha=ALPHA)]),
        "dropin:dora": lambda: drop("dora", ("lora_a", "lora_b", "magnitude")),
        "adapt:lora": lambda: adapted([adapt.LoraRule(module_path=PROJ, rank=RANK, alpha=ALPHA)]),
        "dropin:lora": lambda: drop("lora", ("lora_a", "lora_b")),
        "peer:qwix_lora": qwix_lora,
        "adapt:qdora_nf4": lambda: adapted([adapt.DoraRule(module_path=PROJ, rank=RANK, alpha=ALPHA, quantize="nf4")]),
        "peer:qwix_qlora_nf4": lambda: qwix_lora(weight_qtype="nf4", tile_size=64),
        "full": full,
        "adapt:fp8_mlp_tensorwise": lambda: fp8("tensorwise"),
        "adapt:fp8_mlp_rowwise": lambda: fp8("rowwise"),
    }
    for name in names:
        yield name, build[name]


GROUPS = {
    "adapters": ["adapt:dora", "dropin:dora", "adapt:lora", "dropin:lora", "peer:qwix_lora"],
    "quantized": ["adapt:qdora_nf4", "peer:qwix_qlora_nf4"],
    "fp8": ["full", "adapt:fp8_mlp_tensorwise", "adapt:fp8_mlp_rowwise"],
}


def run(rec: Recorder, quick: bool) -> None:
    size = os.environ.get("ADAPT_MODEL", "1b" if jax.default_backend() == "gpu" else "tiny")
    batch, seq = (8, 1024) if size == "1b" else (2, 16)
    cfg = llama_config(size)
    case = f"hf_llama_{size}_{batch}x{seq}_r{RANK}"
    n, reps = (5, 3) if quick else (10, 5)
    wanted = os.environ.get("ADAPT_GROUPS", ",".join(GROUPS)).split(",")
    for group in wanted:
        steps = {}
        for name, build in candidates(cfg, GROUPS[group]):
            try:
                model, params, mask, context = build()
                with context():
                    step, state, peak = make_step(model, params, mask, batch, seq)
                steps[name] = (step, state, {"peak_gb": round(peak, 3) if peak else None, "group": group,
                                             "tokens": batch * seq})
            except Exception as e:  # noqa: BLE001 - a candidate that fails is a result
                rec.add("adapt", case, name, None, error=error_text(e), group=group)
        rec.time_interleaved("adapt", case, steps, n=n, reps=reps, carried=True)
        del steps
