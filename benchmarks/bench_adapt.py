"""Adoption without a rewrite, timed as a user trains: HF transformers' Flax Llama, or with ADAPT_ARCH=gemma_mqa a
Gemma-shaped model with one key-value head (linen, random weights from a config, bf16) with adapters on every block
projection, one jitted training step of the adapters alone (Adam, donated state), each candidate in turn in one
process:

    adapt:dora / adapt:lora / adapt:qdora_nf4   pallas_fused.adapt.apply(model, [DoraRule(...)]) etc.
    adapt:dora_fp8 / adapt:lora_fp8             the same over an FP8 base (base_fp8="rowwise"; "_tensorwise": that
                                                recipe): the frozen weights stored as e4m3 codes, their GEMMs in FP8
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
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from benchmarks.common import Recorder, error_text
from benchmarks.trace import trace_kernels
from pallas_fused import adapt
from pallas_fused.dora import Fp8Kernel

RANK, ALPHA = 16, 32.0
PROJ = r".*/(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
MLP = r".*/(gate_proj|up_proj|down_proj)"
BLOCKS = {"1b": (4096, 11008), "tiny": (128, 256)}  # the Dense blocks' d_model, d_ff beside each Llama size


def model_config(arch: str, size: str):
    """The HF config of `arch` ("llama" or "gemma_mqa") at `size` ("1b" or "tiny")."""
    from transformers import GemmaConfig, LlamaConfig

    if arch == "gemma_mqa":  # Gemma's shape (one key-value head, head_dim 256, GeGLU, tied 256k vocab) at ~1B
        if size == "1b":
            return GemmaConfig(vocab_size=256000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=8,
                               num_attention_heads=8, num_key_value_heads=1, head_dim=256,
                               max_position_embeddings=2048)
        return GemmaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=32, max_position_embeddings=128)
    if size == "1b":  # Llama 3.2 1B's shape: 1.24B parameters
        return LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                           num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048,
                           tie_word_embeddings=False)
    return LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def hf_module(cfg):
    import transformers

    cls = {"gemma": transformers.FlaxGemmaForCausalLM, "llama": transformers.FlaxLlamaForCausalLM}[cfg.model_type]
    return cls(cfg, dtype=jnp.bfloat16, _do_init=False).module


@contextlib.contextmanager
def dropin(cfg, kind: str):
    """HF's Llama with `kind`'s drop-in written in place of each block projection's nn.Dense (the module-level
    `nn` its source names, swapped for one whose Dense is the drop-in; the LM head, vocab wide, stays nn.Dense)."""
    import importlib

    import flax.linen as nn

    src = importlib.import_module(f"transformers.models.{cfg.model_type}.modeling_flax_{cfg.model_type}")

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
    """The floating-point params in bf16; an FP8 base as it was quantized (e4m3 codes, float32 scales)."""
    def cast(x):
        if _fp8_base(x) or not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        return x.astype(jnp.bfloat16)

    return jax.tree_util.tree_map(cast, tree, is_leaf=_fp8_base)


def _fp8_base(x) -> bool:
    return isinstance(x, adapt.QuantizedWeight) and isinstance(x.kernel, Fp8Kernel)


def _names_mask(params, suffixes):
    """True on the leaves whose param name ends with one of `suffixes` (a boxed param's leaves share its name)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: any(str(getattr(k, "key", "")).endswith(suffixes) for k in path), params)


def hf_loss(model, batch: int, seq: int):
    """(loss(params, data), data): HF's causal LM loss on random tokens."""
    ids = jax.random.randint(jax.random.key(1), (batch, seq + 1), 0, 512)
    attention = jnp.ones((batch, seq), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(seq), (batch, seq))

    def loss(params, ids):
        logits = model.apply({"params": params}, ids[:, :-1], attention, positions).logits
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), ids[:, 1:]).mean()

    return loss, ids


def blocks_loss(model, tokens: int):
    x = jax.random.normal(jax.random.key(1), (tokens, model.dims[0]), jnp.bfloat16)
    return (lambda params, x: jnp.mean(jnp.square(model.apply({"params": params}, x).astype(jnp.float32)))), x


def make_step(loss, data, params, mask):
    """(step, state after one step, peak GB): one Adam step of the params `mask` selects, the rest frozen; the
    state (trainable params, optimizer state) is donated. Compiled once, ahead of time."""
    train, frozen = adapt.split(params, mask)
    tx = optax.adam(1e-4)

    def step(train, opt_state, frozen, data):
        value, grads = jax.value_and_grad(lambda t: loss(adapt.join(t, frozen), data))(train)
        updates, opt_state = tx.update(grads, opt_state, train)
        return optax.apply_updates(train, updates), opt_state, frozen, data

    state = (train, tx.init(train), frozen, data)
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(*state).compile()
    mem = compiled.memory_analysis()
    peak = None
    if mem is not None:
        peak = (mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes
                - mem.alias_size_in_bytes) / 1e9
    return compiled, compiled(*state), peak


class DenseBlocks(nn.Module):
    """`blocks` (4) blocks of d_model -> d_ff -> d_model Dense (gelu, residual), bf16: the projections alone, where
    the adapters' cost is not diluted by attention and the LM head."""

    dims: tuple[int, int]  # d_model, d_ff
    dense: Any = nn.Dense
    blocks: int = 4

    @nn.compact
    def __call__(self, x):
        d, f = self.dims
        for i in range(self.blocks):
            h = self.dense(f, use_bias=False, dtype=jnp.bfloat16, name=f"up_{i}")(x)
            x = x + self.dense(d, use_bias=False, dtype=jnp.bfloat16, name=f"down_{i}")(nn.gelu(h))
        return x


def candidates(cfg, names, batch: int, seq: int, dims: tuple[int, int]):
    """(name, build) for the ones in `names`; build() -> (loss, data, params, trainable mask, the context its trace
    needs). The HF Llama's candidates, and the Dense blocks' ("blocks:..."), at batch * seq tokens."""
    from pallas_fused.dora import DoRADense, LoRADense

    base = hf_module(cfg)
    batch_in = (jnp.zeros((1, 8), jnp.int32), jnp.ones((1, 8), jnp.int32), jnp.arange(8)[None])
    key = jax.random.key(0)
    everything = lambda params: jax.tree_util.tree_map(lambda _: True, params)  # noqa: E731
    none = contextlib.nullcontext

    def hf(model, params, mask, context=none):
        with context():
            loss, data = hf_loss(model, batch, seq)
        return loss, data, _bf16(params), mask, context

    def adapted(rules, trained=adapt.trainable):
        lm = adapt.apply(base, rules)
        params = lm.init(key, *batch_in)["params"]
        return hf(lm, params, trained(params))

    def drop(kind, suffixes):
        # linen runs setup (where HF builds its projections) when the model is traced: init and the step's
        # compile both run inside the swap
        with dropin(cfg, kind):
            params = base.init(key, *batch_in)["params"]
        return hf(base, params, _names_mask(params, suffixes), functools.partial(dropin, cfg, kind))

    def qwix_lora(model=base, example=batch_in, loss=None, **kw):
        import qwix

        lm = qwix.apply_lora_to_model(model, qwix.LoraProvider(module_path=PROJ if loss is None else ".*", rank=RANK,
                                                               alpha=ALPHA, **kw))
        params = lm.init(key, *example)["params"]
        mask = _names_mask(params, ("_lora_a", "_lora_b"))
        if loss is None:
            return hf(lm, params, mask)
        return (*loss(lm), _bf16(params), mask, none)

    tokens = batch * seq
    x0 = (jnp.zeros((8, dims[0]), jnp.bfloat16),)

    def blocks(dense=nn.Dense, rules=None, suffixes=None, trained=adapt.trainable):
        model = DenseBlocks(dims, dense)
        if rules is not None:
            model = adapt.apply(model, rules)
        params = model.init(key, *x0)["params"]
        mask = trained(params) if rules else everything(params) if suffixes is None else \
            _names_mask(params, suffixes)
        return (*blocks_loss(model, tokens), _bf16(params), mask, none)

    build = {
        "adapt:dora": lambda: adapted([adapt.DoraRule(module_path=PROJ, rank=RANK, alpha=ALPHA)]),
        "dropin:dora": lambda: drop("dora", ("lora_a", "lora_b", "magnitude")),
        "adapt:lora": lambda: adapted([adapt.LoraRule(module_path=PROJ, rank=RANK, alpha=ALPHA)]),
        "dropin:lora": lambda: drop("lora", ("lora_a", "lora_b")),
        "peer:qwix_lora": qwix_lora,
        "adapt:qdora_nf4": lambda: adapted([adapt.DoraRule(module_path=PROJ, rank=RANK, alpha=ALPHA, quantize="nf4")]),
        "peer:qwix_qlora_nf4": lambda: qwix_lora(weight_qtype="nf4", tile_size=64),
        **{f"adapt:{kind}_fp8{'' if recipe == 'rowwise' else '_' + recipe}":
           functools.partial(lambda rule, recipe: adapted([rule(module_path=PROJ, rank=RANK, alpha=ALPHA,
                                                                 base_fp8=recipe)]), rule, recipe)
           for kind, rule in (("lora", adapt.LoraRule), ("dora", adapt.DoraRule))
           for recipe in ("rowwise", "tensorwise")},
        "full": lambda: (lambda p: hf(base, p, everything(p)))(base.init(key, *batch_in)["params"]),
        "adapt:fp8_mlp_tensorwise": lambda: adapted([adapt.Fp8Rule(module_path=MLP, recipe="tensorwise")], everything),
        "adapt:fp8_mlp_rowwise": lambda: adapted([adapt.Fp8Rule(module_path=MLP, recipe="rowwise")], everything),
        "blocks:adapt:dora": lambda: blocks(rules=[adapt.DoraRule(module_path=".*", rank=RANK, alpha=ALPHA)]),
        "blocks:dropin:dora": lambda: blocks(functools.partial(DoRADense, rank=RANK, alpha=ALPHA),
                                             suffixes=("lora_a", "lora_b", "magnitude")),
        "blocks:adapt:lora": lambda: blocks(rules=[adapt.LoraRule(module_path=".*", rank=RANK, alpha=ALPHA)]),
        "blocks:dropin:lora": lambda: blocks(functools.partial(LoRADense, rank=RANK, alpha=ALPHA),
                                             suffixes=("lora_a", "lora_b")),
        "blocks:peer:qwix_lora": lambda: qwix_lora(DenseBlocks(dims), x0, lambda m: blocks_loss(m, tokens)),
        "blocks:full": lambda: blocks(),
        **{f"blocks:adapt:{kind}_fp8{'' if recipe == 'rowwise' else '_' + recipe}":
           functools.partial(lambda rule, recipe: blocks(rules=[rule(module_path=".*", rank=RANK, alpha=ALPHA,
                                                                     base_fp8=recipe)]), rule, recipe)
           for kind, rule in (("lora", adapt.LoraRule), ("dora", adapt.DoraRule))
           for recipe in ("rowwise", "tensorwise")},
        "blocks:adapt:fp8_tensorwise": lambda: blocks(rules=[adapt.Fp8Rule(module_path=".*", recipe="tensorwise")],
                                                      trained=everything),
        "blocks:adapt:fp8_rowwise": lambda: blocks(rules=[adapt.Fp8Rule(module_path=".*", recipe="rowwise")],
                                                   trained=everything),
    }
    for name in names:
        yield name, build[name]


FP8_BASE = ["adapt:lora_fp8", "adapt:dora_fp8", "adapt:lora_fp8_tensorwise", "adapt:dora_fp8_tensorwise"]
GROUPS = {
    "adapters": ["adapt:dora", "dropin:dora", "adapt:lora", "dropin:lora", "peer:qwix_lora", *FP8_BASE],
    "quantized": ["adapt:qdora_nf4", "peer:qwix_qlora_nf4"],
    "fp8": ["full", "adapt:fp8_mlp_tensorwise", "adapt:fp8_mlp_rowwise"],
    "blocks": ["blocks:adapt:dora", "blocks:dropin:dora", "blocks:adapt:lora", "blocks:dropin:lora",
               "blocks:peer:qwix_lora", "blocks:full", *(f"blocks:{k}" for k in FP8_BASE)],
    "blocks_fp8": ["blocks:full", "blocks:adapt:fp8_tensorwise", "blocks:adapt:fp8_rowwise"],
}


def _traced(step, state, steps: int = 3, top: int = 8):
    """(state after `steps` more steps, GPU kernel ms per step and the `top` kernels' ms per step): where a
    candidate's step time goes."""
    with trace_kernels() as kt:
        for _ in range(steps):
            state = step(*state)
        jax.block_until_ready(state)
    return state, dict(kernel_ms=round(kt.total_us / steps / 1e3, 3),
                       top_kernels=[(name[:80], round(us / steps / 1e3, 3), c // steps) for name, us, c in kt.top(top)])


def run(rec: Recorder, quick: bool) -> None:
    size = os.environ.get("ADAPT_MODEL", "1b" if jax.default_backend() == "gpu" else "tiny")
    batch, seq = (8, 1024) if size == "1b" else (2, 16)
    dims = BLOCKS[size]
    arch = os.environ.get("ADAPT_ARCH", "llama")
    cfg = model_config(arch, size)
    n, reps = (5, 3) if quick else (10, 5)
    trace = os.environ.get("ADAPT_TRACE", "1" if jax.default_backend() == "gpu" else "0") == "1"
    wanted = os.environ.get("ADAPT_GROUPS", ",".join(GROUPS)).split(",")
    # ADAPT_IMPLS (comma-separated candidate names; unset: all) times a subset of each group, e.g. a pair of record.
    only = os.environ.get("ADAPT_IMPLS")
    for group in wanted:
        case = (f"dense_blocks_4x{dims[0]}x{dims[1]}_{batch * seq}tok_r{RANK}" if group.startswith("blocks")
                else f"hf_{arch}_{size}_{batch}x{seq}_r{RANK}")
        steps = {}
        names = [k for k in GROUPS[group] if only is None or k in only.split(",")]
        for name, build in candidates(cfg, names, batch, seq, dims):
            impl = name.removeprefix("blocks:")
            try:
                loss, data, params, mask, context = build()
                with context():
                    step, state, peak = make_step(loss, data, params, mask)
                extra = {"peak_gb": round(peak, 3) if peak else None, "group": group, "tokens": batch * seq}
                if trace:
                    state, profile = _traced(step, state)
                    extra.update(profile)
                steps[impl] = (step, state, extra)
            except Exception as e:  # noqa: BLE001 - a candidate that fails is a result
                rec.add("adapt", case, impl, None, error=error_text(e), group=group)
        rec.time_interleaved("adapt", case, steps, n=n, reps=reps, carried=True)
        del steps
