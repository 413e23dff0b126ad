"""LoRA and DoRA over an FP8 base (lora_fp8_dense, dora_fp8_dense): the adapters' gradients against jax's through
plain jnp with the dequantized base (x quantized as the op does), the outputs against LoRA / DoRA on the unquantized
weight within the FP8 rounding bound, and the checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_fused.dora import (
    dequantize,
    dora_dense,
    dora_dense_reference,
    dora_fp8_dense,
    lora_dense,
    lora_dense_reference,
    lora_fp8_dense,
    quantize_fp8,
)
from pallas_fused.dora.reference import floored_norm
from tests.fp8.test_frozen import E4M3, fp8_bound, quantized_x
from tests.helpers import rand, rel_err

M, K, N, R, S = 37, 200, 96, 4, 2.0


def operands(dtype, seed=0):
    x, w = rand(seed, (M, K), dtype), rand(seed + 1, (K, N), scale=0.07)
    a, b = rand(seed + 2, (K, R), dtype, scale=0.1), rand(seed + 3, (R, N), dtype, scale=0.1)
    m = (jnp.linalg.norm(w, axis=0) * (1.0 + 0.1 * rand(seed + 4, (N,)))).astype(dtype)
    return x, w, a, b, m, rand(seed + 5, (M, N), dtype)


def reference(x, w8, a, b, m, exact_norm_grad=False):
    """float32 plain jnp: x_q W8 + s (x A) B, x_q the op's quantized x (a constant: the adapters' gradients do not
    pass through it), times m / ||W8 + s A B|| for DoRA (m not None)."""
    w = dequantize(w8, jnp.float32)
    x32, a32, b32 = (v.astype(jnp.float32) for v in (x, a, b))
    z = jnp.asarray(quantized_x(x, w8.recipe), jnp.float32) @ w + S * ((x32 @ a32) @ b32)
    if m is None:
        return z
    n = floored_norm(jnp.sum(jnp.square(w + S * a32 @ b32), axis=0))
    return z * m.astype(jnp.float32) / (n if exact_norm_grad else jax.lax.stop_gradient(n))


@pytest.mark.parametrize("kind, recipe, exact_norm_grad", [
    ("lora", "tensorwise", False), ("lora", "rowwise", False), ("dora", "tensorwise", False),
    ("dora", "rowwise", False), ("dora", "tensorwise", True), ("dora", "rowwise", True)])
def test_adapter_gradients_match_jax_through_the_dequantized_base(kind, recipe, exact_norm_grad):
    x, w, a, b, m, dy = operands(jnp.float32)
    w8 = quantize_fp8(w, recipe)
    if kind == "lora":
        op = lambda a, b, m: lora_fp8_dense(x, w8, a, b, scale=S, implementation="xla")  # noqa: E731
        ref = lambda a, b, m: reference(x, w8, a, b, None)  # noqa: E731
    else:
        op = lambda a, b, m: dora_fp8_dense(x, w8, a, b, m, scale=S, exact_norm_grad=exact_norm_grad,  # noqa: E731
                                            implementation="xla")
        ref = lambda a, b, m: reference(x, w8, a, b, m, exact_norm_grad)  # noqa: E731
    y, vjp = jax.vjp(op, a, b, m)
    y_ref, vjp_ref = jax.vjp(ref, a, b, m)
    assert rel_err(y, y_ref) <= 1e-5
    for name, g, g_ref in zip(("lora_a", "lora_b", "magnitude"), vjp(dy), vjp_ref(dy)):
        if kind == "lora" and name == "magnitude":
            continue
        assert rel_err(g, g_ref) <= 1e-5, (name, rel_err(g, g_ref))


@pytest.mark.parametrize("impl", ["xla", "interpret"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_against_bf16_lora_and_dora_by_fp8_rounding_only(dtype, impl):
    """The outputs, dx and the adapters' gradients of LoRA / DoRA over the FP8 rowwise base against the same layers on
    the unquantized W: the base product carries x's and W's e4m3 rounding (`fp8_bound`), dx dy's and W's, and the
    gradients through it no more."""
    x, w, a, b, m, dy = operands(dtype, seed=10)
    bias = rand(16, (N,), dtype)
    w8 = quantize_fp8(w, "rowwise")
    pairs = {
        "lora": (lambda x, a, b, m: lora_fp8_dense(x, w8, a, b, bias, scale=S, implementation=impl),
                 lambda x, a, b, m: lora_dense_reference(x, w, a, b, bias, scale=S)),
        "dora": (lambda x, a, b, m: dora_fp8_dense(x, w8, a, b, m, bias, scale=S, implementation=impl),
                 lambda x, a, b, m: dora_dense_reference(x, w, a, b, m, bias, scale=S)),
    }
    bound = fp8_bound(E4M3, E4M3)
    for kind, (op, plain) in pairs.items():
        y, vjp = jax.vjp(op, x, a, b, m)
        y_plain, vjp_plain = jax.vjp(plain, x, a, b, m)
        assert y.dtype == dtype
        assert rel_err(y, y_plain) <= bound, (kind, rel_err(y, y_plain))
        for name, g, g_plain in zip(("x", "lora_a", "lora_b", "magnitude"), vjp(dy), vjp_plain(dy)):
            if kind == "lora" and name == "magnitude":
                continue
            assert g.dtype == dtype and rel_err(g, g_plain) <= bound, (kind, name, rel_err(g, g_plain))


def test_checks_name_the_argument():
    x, w, a, b, m, _ = operands(jnp.float32)
    w8 = quantize_fp8(w, "tensorwise")
    with pytest.raises(ValueError, match="kernel must be an Fp8Kernel"):
        lora_fp8_dense(x, w, a, b, scale=S)
    with pytest.raises(ValueError, match="kernel must be an Fp8Kernel"):
        dora_fp8_dense(x, w, a, b, m, scale=S)
    with pytest.raises(ValueError, match="use pallas_fused.dora.dora_fp8_dense"):
        dora_dense(x, w8, a, b, m, scale=S)
    with pytest.raises(ValueError, match="kernel must be a 2-D float"):
        lora_dense(x, w8, a, b, scale=S)
    with pytest.raises(ValueError, match=r"magnitude must have shape \(96,\)"):
        dora_fp8_dense(x, w8, a, b, m[:-1], scale=S)
    with pytest.raises(ValueError, match=r"lora_a must have shape \(200, rank\)"):
        lora_fp8_dense(x, w8, a[1:], b, scale=S)
