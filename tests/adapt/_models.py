"""Model code we did not write (HF transformers' Flax Llama, built offline from a small config with random
weights), an NNX model with einsum projections in every layout the adapt package supports, and the comparison of
an adapted model's adapter gradients in 16 bits with a float32 reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from pallas_fused import adapt
from tests.helpers import float32_judge_on_cpu, rel_err

SEQ = 8


def flax_transformers():
    """HF transformers with its Flax models (the test extra pins it below 5, which dropped them), else a skip."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "FlaxLlamaForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no Flax models (they ended with 4.x)")
    return transformers


def hf_llama(dtype=jnp.float32, seed: int = 0):
    """(module, pretrained params, inputs) of a 2-layer FlaxLlamaForCausalLM."""
    transformers = flax_transformers()
    cfg = transformers.LlamaConfig(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    hf = transformers.FlaxLlamaForCausalLM(cfg, seed=seed, dtype=dtype)
    ids = jax.random.randint(jax.random.key(seed + 1), (2, SEQ + 1), 0, cfg.vocab_size)
    inputs = (ids[:, :-1], jnp.ones((2, SEQ), jnp.int32), jnp.broadcast_to(jnp.arange(SEQ), (2, SEQ)))
    return hf.module, hf.params, inputs, ids[:, 1:]


def lm_loss(logits, targets):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def adapted_params(module, rules, inputs, pretrained, lora_b: float = 0.01):
    """(adapted module, its params): `pretrained` loaded, every lora_b set to `lora_b` (B = 0 would give A no
    gradient)."""
    lmodel = adapt.apply(module, rules)
    variables = adapt.from_pretrained(lmodel, lmodel.init(jax.random.key(0), *inputs), pretrained)
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x + lora_b if "lora_b" in jax.tree_util.keystr(path) else x, variables["params"])
    return lmodel, params


def loss_and_adapter_grads(lmodel, params, inputs, targets):
    """The LM loss and its gradient with respect to the adapters alone (the frozen params closed over), jitted."""
    adapters, frozen = adapt.split(params, adapt.trainable(params))

    def loss_fn(adapters):
        return lm_loss(lmodel.apply({"params": adapt.join(adapters, frozen)}, *inputs).logits, targets)

    return jax.jit(jax.value_and_grad(loss_fn))(adapters)


def upcast_float32(tree):
    """`tree` with its floating-point leaves in float32 (exact from 16 bits), the others as they are."""
    return jax.tree.map(lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def float32_reference(module, rules, params, inputs, targets):
    """`loss_and_adapter_grads` of the same params (adapters and frozen weights, 16-bit values upcast exactly)
    through the model computing in float32 with full-precision dots (a GPU's default fp32 dot is TF32): what a
    16-bit run approximates, on the CPU (`float32_judge_on_cpu`)."""
    up = upcast_float32(params)
    lmodel = adapt.apply(module.clone(dtype=jnp.float32), rules)
    with float32_judge_on_cpu() as cpu:
        return loss_and_adapter_grads(lmodel, *jax.device_put((up, inputs, targets), cpu))


# Adapter gradients, relative error against float32: bf16 XLA is 0.5-2.3% off per leaf on the HF Llama of these
# tests (on the CPU; the kernels in interpret mode 0.4-2.3%, at most 1.8x XLA's error on the same leaf), so a kernel
# may be twice XLA's error, 2% at least; 6% at most, so that a wrong kernel fails even where XLA's own bf16 run is
# far off.
GRAD_FACTOR, GRAD_FLOOR, GRAD_CAP = 2.0, 2e-2, 6e-2


def grads_against_float32(out, baseline, ref, *, factor: float = GRAD_FACTOR, floor: float = GRAD_FLOOR,
                          cap: float = GRAD_CAP) -> list[str]:
    """The adapter gradients of `out` (the kernels) that are further from the float32 reference `ref` than
    min(cap, max(floor, factor * the error of `baseline`, XLA in the same 16 bits)), one line each (empty: all
    pass), every leaf named.

    Judged against float32, not against the 16-bit XLA run: the two 16-bit runs round differently, and a gradient
    that sums many rounded terms differs between them by both their errors. The cap keeps a kernel whose result is
    wrong failing even where the 16-bit XLA run is itself far off."""
    failures = []
    got = jax.tree_util.tree_flatten_with_path(out)[0]
    base, exact = jax.tree.leaves(baseline), jax.tree.leaves(ref)
    assert len(got) == len(base) == len(exact)
    for (path, g), b, e in zip(got, base, exact):
        err, base_err = rel_err(g, e), rel_err(b, e)
        allowed = min(cap, max(floor, factor * base_err))
        if not err <= allowed:
            failures.append(f"{jax.tree_util.keystr(path)}: {err:.4f} off float32 (allowed {allowed:.4f}; "
                            f"XLA in 16 bits {base_err:.4f}, kernels vs XLA {rel_err(g, b):.4f})")
    return failures


class Block(nnx.Module):
    """Attention-shaped einsum projections: q over heads (d -> h k), o back (h k -> d, two contracting axes), an
    nnx.Einsum whose weight is stored (out, in), and an nnx.Linear."""

    def __init__(self, d: int, heads: int, rngs: nnx.Rngs):
        k = d // heads
        self.wq = nnx.Param(jax.random.normal(rngs.params(), (d, heads, k)) / d ** 0.5)
        self.wo = nnx.Param(jax.random.normal(rngs.params(), (heads, k, d)) / d ** 0.5)
        self.up = nnx.Einsum("btd,fd->btf", (3 * d, d), rngs=rngs)
        self.down = nnx.Linear(3 * d, d, rngs=rngs)

    def __call__(self, x):
        q = jnp.einsum("btd,dhk->bthk", x, self.wq[...])
        y = jnp.einsum("bthk,hkd->btd", q, self.wo[...])
        return x + self.down(jax.nn.silu(self.up(y)))


class EinsumNet(nnx.Module):
    def __init__(self, d: int = 32, heads: int = 4, layers: int = 2, *, rngs: nnx.Rngs):
        self.blocks = nnx.List([Block(d, heads, rngs) for _ in range(layers)])

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def nnx_adapter_steps(nmodel, loss_fn, steps: int, lr: float) -> list[float]:
    """The losses of `steps` jitted Adam steps on an adapted NNX model's adapters (nnx.LoRAParam) alone, checking
    that the rest of its state is unchanged bit for bit."""
    frozen = jax.tree.leaves(nnx.state(nmodel, nnx.Not(nnx.LoRAParam)))
    opt = nnx.Optimizer(nmodel, optax.adam(lr), wrt=nnx.LoRAParam)

    @nnx.jit
    def step(m, opt):
        loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))(m)
        opt.update(m, grads)
        return loss

    losses = [float(step(nmodel, opt)) for _ in range(steps)]
    for a, b in zip(frozen, jax.tree.leaves(nnx.state(nmodel, nnx.Not(nnx.LoRAParam)))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    return losses
