"""The zoo of tests/adapt/test_zoo.py: third-party architectures (HF transformers' Flax models, code we did not write),
each built offline from a tiny config with random weights, with the inputs its linen module takes and the rules
that adapt it (DoRA on the attention projections, LoRA on the MLP).

All are linen models: no package the test venvs install ships NNX models that build offline (orbax's NNX example
model imports grain and tensorflow_datasets, which are not installed)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from pallas_fused import adapt
from tests.adapt._models import flax_transformers

BATCH, SEQ, VOCAB, IMAGE = 2, 8, 100, 16
RANK, ALPHA = 4, 8.0


@dataclasses.dataclass(frozen=True)
class Arch:
    """One architecture: `build(transformers)` -> (its linen module, the module's inputs as keywords);
    `attention` / `mlp` the module paths (regular expressions) of its attention and MLP projections; `quantize` the
    QDoRA format of its "quantized" variant (QDoRA on the attention, an Fp8Rule on the MLP), None for none;
    `logits` picks the output the loss and the comparisons read; `no_gradient` (a regular expression) the adapted
    weights that the model itself gives no gradient, which training leaves as they are."""

    name: str
    build: Callable[[Any], tuple[Any, dict]]
    attention: str
    mlp: str
    quantize: str | None = None
    logits: Callable[[Any], jax.Array] = lambda out: out.logits
    no_gradient: str = "^$"


def _ids(seed: int, n: int = SEQ):
    return jax.random.randint(jax.random.key(seed), (BATCH, n), 0, VOCAB)


def _positions(offset: int = 0):
    return jnp.broadcast_to(jnp.arange(SEQ) + offset, (BATCH, SEQ))


def _causal(t, config: str, model: str, with_positions: bool = True, **cfg):
    """A decoder-only LM: ids, mask and positions."""
    module = getattr(t, model)(getattr(t, config)(vocab_size=VOCAB, **cfg), _do_init=False).module
    inputs = dict(input_ids=_ids(1), attention_mask=jnp.ones((BATCH, SEQ), jnp.int32))
    if with_positions:
        inputs["position_ids"] = _positions()
    return module, inputs


def _seq2seq(t, config: str, model: str, positions: bool = True, **cfg):
    module = getattr(t, model)(getattr(t, config)(vocab_size=VOCAB, **cfg), _do_init=False).module
    ones = jnp.ones((BATCH, SEQ), jnp.int32)
    inputs = dict(input_ids=_ids(1), attention_mask=ones, decoder_input_ids=_ids(2), decoder_attention_mask=ones)
    if positions:
        inputs.update(position_ids=_positions(), decoder_position_ids=_positions())
    return module, inputs


def _encoder(t, config: str, model: str, position_offset: int = 0, **cfg):
    """A BERT-style masked LM: ids, mask, token types, positions, head mask (what its wrapper fills in)."""
    c = getattr(t, config)(vocab_size=VOCAB, **cfg)
    module = getattr(t, model)(c, _do_init=False).module
    inputs = dict(input_ids=_ids(1), attention_mask=jnp.ones((BATCH, SEQ), jnp.int32),
                  token_type_ids=jnp.zeros((BATCH, SEQ), jnp.int32),
                  position_ids=_positions(position_offset),
                  head_mask=jnp.ones((c.num_hidden_layers, c.num_attention_heads)))
    return module, inputs


def _pixels(seed: int = 3):
    """Images as the linen modules take them, channels last (the wrappers transpose NCHW)."""
    return jax.random.normal(jax.random.key(seed), (BATCH, IMAGE, IMAGE, 3))


def _vit(t):
    cfg = t.ViTConfig(image_size=IMAGE, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=64, num_labels=10)
    return t.FlaxViTForImageClassification(cfg, _do_init=False).module, dict(pixel_values=_pixels())


def _clip(t):
    cfg = t.CLIPConfig(text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, max_position_embeddings=16),
                       vision_config=dict(image_size=IMAGE, patch_size=8, hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=2, num_attention_heads=4),
                       projection_dim=16)
    # the text tower pools at the end-of-text token, the largest id: put one last, as a tokenizer does
    ids = jnp.concatenate([_ids(1, SEQ - 1) % (VOCAB - 1), jnp.full((BATCH, 1), VOCAB - 1)], axis=1)
    inputs = dict(input_ids=ids, pixel_values=_pixels(), attention_mask=jnp.ones((BATCH, SEQ), jnp.int32),
                  position_ids=_positions())
    return t.FlaxCLIPModel(cfg, _do_init=False).module, inputs


LLAMA_LIKE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=32)
BERT_LIKE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96)
BART_LIKE = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                 encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32)
GATED_MLP = r".*/mlp/(gate_proj|up_proj|down_proj)"
QKVO = r".*/self_attn/(q_proj|k_proj|v_proj|o_proj)"
BERT_ATTENTION = r".*/attention/(self/(query|key|value)|output/dense)"
BERT_MLP = r".*/layer/\d+/(intermediate|output)/dense"

ARCHS = (
    Arch("gpt2", functools.partial(_causal, config="GPT2Config", model="FlaxGPT2LMHeadModel", n_embd=32, n_layer=2,
                                   n_head=4, n_positions=32),
         attention=r".*/attn/(c_attn|c_proj)", mlp=r".*/mlp/(c_fc|c_proj)"),
    Arch("gptj", functools.partial(_causal, config="GPTJConfig", model="FlaxGPTJForCausalLM", n_embd=32, n_layer=2,
                                   n_head=4, n_positions=32, rotary_dim=4),
         attention=r".*/attn/(q_proj|k_proj|v_proj|out_proj)", mlp=r".*/mlp/(fc_in|fc_out)"),
    Arch("gpt_neo", functools.partial(_causal, config="GPTNeoConfig", model="FlaxGPTNeoForCausalLM", hidden_size=32,
                                      num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
                                      max_position_embeddings=32, window_size=4),
         attention=r".*/attn/attention/(q_proj|k_proj|v_proj|out_proj)", mlp=r".*/mlp/(c_fc|c_proj)"),
    Arch("opt", functools.partial(_causal, config="OPTConfig", model="FlaxOPTForCausalLM", hidden_size=64,
                                  num_hidden_layers=2, ffn_dim=96, num_attention_heads=4, max_position_embeddings=32,
                                  word_embed_proj_dim=64),
         attention=r".*/self_attn/(q_proj|k_proj|v_proj|out_proj)", mlp=r".*/(fc1|fc2)", quantize="int8"),
    Arch("bloom", functools.partial(_causal, config="BloomConfig", model="FlaxBloomForCausalLM", hidden_size=32,
                                    n_layer=2, n_head=4, with_positions=False),
         attention=r".*/self_attention/(query_key_value|dense)", mlp=r".*/mlp/(dense_h_to_4h|dense_4h_to_h)"),
    Arch("bart", functools.partial(_seq2seq, config="BartConfig", model="FlaxBartForConditionalGeneration",
                                   **BART_LIKE),
         attention=r".*/(self_attn|encoder_attn)/(q_proj|k_proj|v_proj|out_proj)", mlp=r".*/(fc1|fc2)"),
    Arch("t5", functools.partial(_seq2seq, config="T5Config", model="FlaxT5ForConditionalGeneration",
                                 positions=False, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4),
         attention=r".*/(SelfAttention|EncDecAttention)/(q|k|v|o)", mlp=r".*/DenseReluDense/(wi|wo)"),
    Arch("llama", functools.partial(_causal, config="LlamaConfig", model="FlaxLlamaForCausalLM",
                                    num_key_value_heads=2, **LLAMA_LIKE),
         attention=QKVO, mlp=GATED_MLP, quantize="nf4"),
    Arch("mistral", functools.partial(_causal, config="MistralConfig", model="FlaxMistralForCausalLM",
                                      num_key_value_heads=2, sliding_window=4, **LLAMA_LIKE),
         attention=QKVO, mlp=GATED_MLP, quantize="int8"),
    # multi-query attention: one key-value head for four query heads
    Arch("gemma_mqa", functools.partial(_causal, config="GemmaConfig", model="FlaxGemmaForCausalLM",
                                        num_key_value_heads=1, head_dim=16, hidden_activation="gelu_pytorch_tanh",
                                        **LLAMA_LIKE),
         attention=QKVO, mlp=GATED_MLP),
    Arch("bert", functools.partial(_encoder, config="BertConfig", model="FlaxBertForMaskedLM",
                                   max_position_embeddings=32, **BERT_LIKE),
         attention=BERT_ATTENTION, mlp=BERT_MLP, quantize="nf4"),
    # RoBERTa's positions start after its padding index, 1
    Arch("roberta", functools.partial(_encoder, config="RobertaConfig", model="FlaxRobertaForMaskedLM",
                                      position_offset=2, max_position_embeddings=40, **BERT_LIKE),
         attention=BERT_ATTENTION, mlp=BERT_MLP),
    Arch("vit", _vit, attention=r".*/attention/(attention/(query|key|value)|output/dense)",
         mlp=r".*/layer/\d+/(intermediate|output)/dense"),
    Arch("clip", _clip, attention=r".*/self_attn/(q_proj|k_proj|v_proj|out_proj)", mlp=r".*/mlp/(fc1|fc2)",
         quantize="nf4", logits=lambda out: out.logits_per_image,
         # the text tower's query and key projections get a zero gradient in HF's model as it is
         no_gradient=r"text_model/.*/(q_proj|k_proj)/kernel"),
)


def rules(arch: Arch, variant: str) -> list[adapt.Rule]:
    """"dora_lora": DoRA on the attention, LoRA on the MLP. "quantized": QDoRA (`arch.quantize`) on the attention,
    an Fp8Rule on the MLP."""
    if variant == "dora_lora":
        return [adapt.DoraRule(module_path=arch.attention, rank=RANK, alpha=ALPHA),
                adapt.LoraRule(module_path=arch.mlp, rank=RANK, alpha=ALPHA)]
    assert variant == "quantized" and arch.quantize is not None
    return [adapt.DoraRule(module_path=arch.attention, rank=RANK, alpha=ALPHA, quantize=arch.quantize),
            adapt.Fp8Rule(module_path=arch.mlp, recipe="rowwise", implementation="xla")]


class _NumpyWithClipBounds:
    """jax.numpy with `clip`'s `a_min` / `a_max` keywords, which jax removed and HF's Flax T5 still passes."""

    def __getattr__(self, name):
        return getattr(jnp, name)  # looked up at each use: adapt's einsum while an adapted model runs

    @staticmethod
    def clip(x, a_min=None, a_max=None):
        return jnp.clip(x, min=a_min, max=a_max)


def shim(name: str, monkeypatch) -> None:
    """What architecture `name` needs to run on the installed jax, patched for the test only."""
    if name == "t5":
        flax_transformers()  # a skip where they are not installed
        from transformers.models.t5 import modeling_flax_t5
        monkeypatch.setattr(modeling_flax_t5, "jnp", _NumpyWithClipBounds())


@functools.cache
def build(name: str):
    """(linen module, pretrained params, inputs as keywords) of architecture `name`, built once per process."""
    module, inputs = arch(name).build(flax_transformers())
    return module, module.init(jax.random.key(0), **inputs)["params"], inputs


def arch(name: str) -> Arch:
    return next(a for a in ARCHS if a.name == name)


def logits(arch: Arch, module, params) -> jax.Array:
    """The output of `arch` that the checks compare, from `module` (original or adapted) run on `params` and the
    architecture's inputs."""
    _, _, inputs = build(arch.name)
    return arch.logits(module.apply({"params": params}, **inputs))


def flat(tree) -> dict[str, Any]:
    """A params tree's leaves by their `/`-joined path (the paths `adapt.inspect` names)."""
    return {"/".join(str(k.key) for k in path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(
        tree, is_leaf=lambda x: isinstance(x, adapt.QuantizedWeight))}


def unflat(leaves: dict[str, Any]) -> dict:
    """`flat`'s inverse."""
    out: dict = {}
    for path, leaf in leaves.items():
        *parents, name = path.split("/")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[name] = leaf
    return out
