"""jax 0.12's XLA miscompile of the backward pass of grouped-query attention on the GPU, in plain jnp (no
pallas_fused; only the tests' helpers): the reproducer behind `_backend.XLA_GPU_MISCOMPILES` (docs/gpu_tests.md).

A projection feeding attention with 4 key-value heads shared by 8 query heads (the adapt GPU test's HF Llama),
written as a LoRA layer, either differentiated by jax ("plain") or as a custom VJP whose backward is plain dots
(as the adapters' ops are), judged against jax's own autodiff of the plain function in float32 at full precision,
computed on the CPU (a judge compiled by the GPU compiler under test shares its bug). On an H200 with jax 0.12.0.1
and XLA's default options the value projection's dA and dB came out 145-147% off, in bf16 and in float32 alike,
plain or custom VJP; with its Triton GEMM fusions off, or with XLA_FLAGS disabling the reduce-decomposer pass,
within 0.5% in bf16 (0.0% in float32), as on jax 0.11.2.
"""

import functools

import jax
import jax.numpy as jnp

from tests.helpers import float32_judge_on_cpu, rel_err

B, S, HIDDEN, KV_HEADS, HEADS, HEAD_DIM, RANK = 2, 256, 512, 4, 8, 64, 16
NO_TRITON_GEMM = {"xla_gpu_enable_triton_gemm": False}


def _plain(x, w, a, b):
    return x @ w + (x @ a) @ b


_lora = jax.custom_vjp(_plain)  # the same forward, its backward the four dots below


def _lora_fwd(x, w, a, b):
    return _plain(x, w, a, b), (x, w, a, b)


def _lora_bwd(res, dy):
    x, w, a, b = res
    us = dy @ b.T
    return dy @ w.T + us @ a.T, jnp.zeros_like(w), x.T @ us, (x @ a).T @ dy


_lora.defvjp(_lora_fwd, _lora_bwd)


def _loss(a, b, x, w, probs, g, dense):
    """sum(g * attention(probs, v)) with v = dense(x, W, A, B) on (B S, hidden) rows, split into key-value heads
    and repeated over the query heads that share them (HF Llama's repeat_kv)."""
    v = dense(x.reshape(B * S, HIDDEN), w, a, b).reshape(B, S, KV_HEADS, HEAD_DIM)
    v = jnp.repeat(v, HEADS // KV_HEADS, axis=2)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
    return jnp.sum(out.astype(jnp.float32) * g)


def _attention_loss(adapters, x, weights, g, dense):
    """sum(g * attention) with q, k and v each dense(x, W, A, B): 8 query heads, 4 key-value heads repeated over
    them, causal softmax, in x's dtype."""
    x2 = x.reshape(B * S, HIDDEN)
    q, k, v = (dense(x2, w, a, b) for w, (a, b) in zip(weights, adapters))
    q = q.reshape(B, S, HEADS, HEAD_DIM)
    k, v = (jnp.repeat(t.reshape(B, S, KV_HEADS, HEAD_DIM), HEADS // KV_HEADS, axis=2) for t in (k, v))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * HEAD_DIM ** -0.5
    logits = jnp.where(jnp.tril(jnp.ones((S, S), bool)), logits, -1e9)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(x.dtype), v)
    return jnp.sum(out.astype(jnp.float32) * g)


def _inputs():
    keys = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(keys[0], (B, S, HIDDEN))
    w = jax.random.normal(keys[1], (HIDDEN, KV_HEADS * HEAD_DIM)) * HIDDEN ** -0.5
    a = jax.random.normal(keys[2], (HIDDEN, RANK)) * HIDDEN ** -0.5
    b = jax.random.normal(keys[3], (RANK, KV_HEADS * HEAD_DIM)) * 0.05
    probs = jax.nn.softmax(jax.random.normal(keys[4], (B, HEADS, S, S)), axis=-1)
    g = jax.random.normal(keys[5], (B, S, HEADS, HEAD_DIM))
    return a, b, x, w, probs, g


def _float32_on_cpu(grad_fn, *args):
    """grad_fn(*args) in float32 at full precision, on the CPU: the judge."""
    with float32_judge_on_cpu() as cpu:
        return jax.jit(grad_fn)(*jax.device_put(args, cpu))


def attention_gradients(compiler_options=None) -> dict[str, float]:
    """The same with q, k and v projections each such a LoRA layer and the attention computed from them:
    {"q dA": error, ...}."""
    keys = jax.random.split(jax.random.key(1), 8)
    x = jax.random.normal(keys[0], (B, S, HIDDEN))
    outs = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM)
    weights = [jax.random.normal(keys[1 + i], (HIDDEN, n)) * HIDDEN ** -0.5 for i, n in enumerate(outs)]
    adapters = [(jax.random.normal(keys[4 + i], (HIDDEN, RANK)) * HIDDEN ** -0.5,
                 jnp.full((RANK, n), 0.05) * jnp.cos(jnp.arange(n))) for i, n in enumerate(outs)]
    g = jax.random.normal(keys[7], (B, S, HEADS, HEAD_DIM))
    want = _float32_on_cpu(jax.grad(functools.partial(_attention_loss, dense=_plain)), adapters, x, weights, g)
    bf = jax.tree.map(lambda t: t.astype(jnp.bfloat16), (adapters, x, weights))
    grad = jax.jit(jax.grad(functools.partial(_attention_loss, dense=_lora)), compiler_options=compiler_options)
    got = grad(*bf, g)
    return {f"{p} d{m}": rel_err(got[i][j], want[i][j]) for i, p in enumerate("qkv") for j, m in enumerate("AB")}


def value_gradients_float32():
    """(dA, dB) of the value-projection case by float32 autodiff on the CPU: the judge."""
    a, b, x, w, probs, g = _inputs()
    return _float32_on_cpu(jax.grad(functools.partial(_loss, dense=_plain), argnums=(0, 1)), a, b, x, w, probs, g)


def value_gradients(compiler_options=None, *, custom_vjp: bool = True, dtype=jnp.bfloat16):
    """(dA, dB) of the value-projection case on the default device, through the custom VJP or jax's autodiff of
    the plain function, in `dtype` (float32 at full precision), jitted with XLA's `compiler_options`."""
    a, b, x, w, probs, g = _inputs()
    args = [t.astype(dtype) for t in (a, b, x, w, probs)]
    grad = jax.jit(jax.grad(functools.partial(_loss, dense=_lora if custom_vjp else _plain), argnums=(0, 1)),
                   compiler_options=compiler_options)
    with jax.default_matmul_precision("highest" if dtype == jnp.float32 else None):
        return grad(*args, g)


def errors(got, want) -> dict[str, float]:
    return {"dA": rel_err(got[0], want[0]), "dB": rel_err(got[1], want[1])}


def gradients(compiler_options=None, *, custom_vjp: bool = True, dtype=jnp.bfloat16) -> dict[str, float]:
    """{"dA": error, "dB": error} of `value_gradients` against the CPU's float32 autodiff."""
    return errors(value_gradients(compiler_options, custom_vjp=custom_vjp, dtype=dtype), value_gradients_float32())
