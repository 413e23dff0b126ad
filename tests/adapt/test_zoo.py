"""pallas_fused.adapt on a zoo of architectures we did not write (HF transformers' Flax models, tests/adapt/_zoo.py),
each tiny, random and in float32, with DoRA on its attention and LoRA on its MLP, and on some QDoRA on the attention
and FP8 on the MLP. Each architecture is checked the same five ways: the adapted model starts out computing what
the original does; with random adapters, `merge` then the original model reproduces it (what a wrong or transposed
weight fails); merge changes exactly the weights `inspect` lists as adapted, and the rules' every weight is among
them; five adapters-only Adam steps lower the loss and leave the base bit for bit; a misspelled rule is reported.
One test per architecture runs the five checks (`CHECKS`), so that each model is built once, in one worker."""

from __future__ import annotations

import functools
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pallas_fused import adapt
from pallas_fused.dora.quant import dequantize, quantize_int8, quantize_nf4
from tests.adapt import _zoo
from tests.helpers import rel_err

# The slower architectures (seq2seq, two towers, vision) run on the floor leg only.
SLOW = {"bart", "t5", "vit", "clip"}
CASES = [pytest.param(a, "dora_lora", id=a.name, marks=[pytest.mark.slow] if a.name in SLOW else [])
         for a in _zoo.ARCHS]
CASES += [pytest.param(a, "quantized", id=f"{a.name}-{a.quantize}-fp8",
                       marks=[pytest.mark.slow] if a.name in SLOW else []) for a in _zoo.ARCHS if a.quantize]
QUANTIZERS = {"int8": quantize_int8, "nf4": quantize_nf4}


def typo(arch: _zoo.Arch) -> adapt.Rule:
    """A misspelled rule (one letter too many), which matches nothing."""
    return adapt.LoraRule(module_path=arch.attention + "s", rank=_zoo.RANK)


@functools.cache
def adapted(arch: _zoo.Arch, variant: str):
    """(the adapted module, its variables with the pretrained weights loaded), built once per process; the rules
    end with a misspelled one."""
    module, pretrained, inputs = _zoo.build(arch.name)
    lmodel = adapt.apply(module, [*_zoo.rules(arch, variant), typo(arch)])
    variables = lmodel.init(jax.random.key(1), **inputs)
    return lmodel, adapt.from_pretrained(lmodel, variables, pretrained)


@functools.cache
def inspection(arch: _zoo.Arch, variant: str) -> adapt.Inspection:
    module, _, inputs = _zoo.build(arch.name)
    return adapt.inspect(module, _zoo.rules(arch, variant), **inputs)


@functools.cache
def reference(arch: _zoo.Arch, variant: str):
    """(module, params) computing what the adapted model should at init: the original model, or, for the quantized
    variant, the original with the FP8 rule alone and the QDoRA weights quantized and dequantized."""
    module, pretrained, _ = _zoo.build(arch.name)
    if variant == "dora_lora":
        return module, pretrained
    fp8_only = adapt.apply(module, [r for r in _zoo.rules(arch, variant) if isinstance(r, adapt.Fp8Rule)])
    params = _zoo.flat(pretrained)
    for c in inspection(arch, variant):
        if c.action == "adapted" and getattr(c.rule, "quantize", None):
            params[c.weight_path] = _quantize_dequantize(params[c.weight_path], c)
    return fp8_only, _zoo.unflat(params)


def _quantize_dequantize(w, c: adapt.Contraction):
    """`w` through QDoRA's quantizer and back, as the (K, N) matrix its contraction sees (a Dense kernel is (K, N)
    already)."""
    assert tuple(w.shape) == (c.k, c.n), f"{c.weight_path}: stored {w.shape}, not (K, N) = ({c.k}, {c.n})"
    return dequantize(QUANTIZERS[c.rule.quantize](w), w.dtype)


def random_adapters(params, seed: int = 7):
    """`params` with every lora_b random and non-zero, and every DoRA magnitude scaled by a random 0.7-1.3."""
    def perturb(path, x):
        key = jax.random.fold_in(jax.random.key(seed), zlib.crc32(path.encode()))
        if path.endswith("_lora_b"):
            return 0.05 * jax.random.normal(key, x.shape, x.dtype)
        if path.endswith("_magnitude"):
            return x * jax.random.uniform(key, x.shape, x.dtype, 0.7, 1.3)
        return x
    return _zoo.unflat({p: perturb(p, x) for p, x in _zoo.flat(params).items()})


@pytest.fixture(autouse=True)
def _shims(request, monkeypatch):
    arch = request.node.callspec.params.get("arch") if hasattr(request.node, "callspec") else None
    if arch is not None:
        _zoo.shim(arch.name, monkeypatch)


def check_init_matches_original(arch, variant):
    """Loaded with the pretrained weights (B = 0, m = ||W||), the adapted model computes what the original does."""
    lmodel, variables = adapted(arch, variant)
    got = _zoo.logits(arch, lmodel, variables["params"])
    err = rel_err(got, _zoo.logits(arch, *reference(arch, variant)))
    assert err <= 1e-6, f"{err:.2e} off the original"
    if variant == "quantized":  # the FP8 products did run: not the plain original's output
        module, pretrained, _ = _zoo.build(arch.name)
        fp8_err = rel_err(got, _zoo.logits(arch, module, pretrained))
        assert fp8_err > 1e-4, f"FP8 rounding {fp8_err:.2e}: the Fp8Rule did not run"


def check_merge_reproduces_the_adapted_model(arch, variant):
    """With random adapters, `merge` gives weights with which the original model computes what the adapted one
    does: a weight adapted in the wrong layout, or the wrong weight, cannot pass."""
    lmodel, variables = adapted(arch, variant)
    params = random_adapters(variables["params"])
    original, _ = reference(arch, variant)
    got = _zoo.logits(arch, original, adapt.merge(lmodel, params))
    err = rel_err(got, _zoo.logits(arch, lmodel, params))
    assert err <= 1e-5, f"the merged weights in the original model: {err:.2e} off the adapted model"


def check_merge_changes_exactly_what_inspect_lists(arch, variant):
    """`inspect` lists as adapted every weight of a module the rules name (GPT-2's transposed Conv1D kernels
    too) and refuses none, the adapted model holds adapters for exactly those, and `merge` changes exactly those
    (an FP8 weight stays as it is)."""
    _, pretrained, _ = _zoo.build(arch.name)
    rules = _zoo.rules(arch, variant)
    found = inspection(arch, variant)
    named = {p for p, w in _zoo.flat(pretrained).items()
             if w.ndim >= 2 and any(re.fullmatch(r.module_path, p.rpartition("/")[0]) for r in rules)}
    assert set(found.adapted) == named, str(found)
    assert not [c for c in found if c.action == "refused"], str(found)
    assert all(p in str(found) for p in named)  # the table names them
    trained = named - {c.weight_path for c in found if isinstance(c.rule, adapt.Fp8Rule)}
    lmodel, variables = adapted(arch, variant)
    with_adapters = {p.removesuffix("_lora_a") for p in _zoo.flat(variables["params"]) if p.endswith("_lora_a")}
    assert with_adapters == trained
    merged = _zoo.flat(adapt.merge(lmodel, random_adapters(variables["params"])))
    before = _zoo.flat(pretrained)
    assert merged.keys() == before.keys()
    assert {p for p in before if not np.array_equal(np.asarray(merged[p]), np.asarray(before[p]))} == trained


def _train(arch, lmodel, params, steps: int = 5, lr: float = 1e-2):
    """Adam on the adapters alone (gradients taken for them only, the rest closed over), jitted once; the loss is
    the cross-entropy of the logits against fixed random labels."""
    shape = jax.eval_shape(lambda p: _zoo.logits(arch, lmodel, p), params).shape
    labels = jax.random.randint(jax.random.key(5), shape[:-1], 0, shape[-1])
    adapters, frozen = adapt.split(params, adapt.trainable(params))
    tx = optax.adam(lr)

    def loss_fn(adapters):
        out = _zoo.logits(arch, lmodel, adapt.join(adapters, frozen)).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(out, labels).mean()

    @jax.jit
    def step(adapters, state):
        loss, grads = jax.value_and_grad(loss_fn)(adapters)
        updates, state = tx.update(grads, state, adapters)
        return optax.apply_updates(adapters, updates), state, loss

    state, losses = tx.init(adapters), []
    for _ in range(steps):
        adapters, state, loss = step(adapters, state)
        losses.append(float(loss))
    return adapt.join(adapters, frozen), losses


def check_adapters_only_training(arch, variant):
    """Five Adam steps on the adapters alone lower the loss, move every lora_b (of a weight the model gives a
    gradient), and leave every other param (QDoRA's codes and scales too) bit for bit as loaded."""
    lmodel, variables = adapted(arch, variant)
    trained, losses = _train(arch, lmodel, variables["params"])
    assert losses[-1] < losses[0], losses
    before, after = _zoo.flat(variables["params"]), _zoo.flat(trained)
    mask = _zoo.flat(adapt.trainable(variables["params"]))
    for path, leaf in before.items():
        if path.endswith("_lora_b") and not re.fullmatch(arch.no_gradient, path.removesuffix("_lora_b")):
            assert not np.array_equal(np.asarray(after[path]), np.asarray(leaf)), f"{path} did not train"
        elif not mask[path]:
            same = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)), after[path], leaf)
            assert jax.tree.all(same), f"{path} changed"


def check_misspelled_rule_is_reported(arch, variant):
    """A misspelled rule beside working ones, and one alone (every rule missing: a warning names the nearest
    paths), is reported by unused_rules."""
    lmodel, _ = adapted(arch, variant)
    assert adapt.unused_rules(lmodel) == [typo(arch)]
    if variant == "dora_lora":
        module, _, inputs = _zoo.build(arch.name)
        alone = adapt.apply(module, [typo(arch)])
        alone.init(jax.random.key(0), **inputs)
        with pytest.warns(UserWarning, match=r"no rule matched any of the \d+ contractions(.|\n)*nearest paths"):
            assert adapt.unused_rules(alone) == [typo(arch)]


CHECKS = (check_init_matches_original, check_merge_reproduces_the_adapted_model,
          check_merge_changes_exactly_what_inspect_lists, check_adapters_only_training,
          check_misspelled_rule_is_reported)


@pytest.mark.parametrize("arch,variant", CASES)
def test_architecture(arch, variant):
    """Every check on one architecture (built once, in one worker), each failing check reported."""
    failures = []
    for check in CHECKS:
        try:
            check(arch, variant)
        except AssertionError as e:
            failures.append(f"{check.__name__}: {e}")
    assert not failures, "\n\n".join(failures)
