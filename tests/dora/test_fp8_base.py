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
from pallas_fused.dora.fp8_base import fp8_column_sumsq
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


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("kind, recipe, exact_norm_grad", [
    ("lora", "tensorwise", False), ("lora", "rowwise", False), ("dora", "tensorwise", False),
    ("dora", "rowwise", False), ("dora", "tensorwise", True), ("dora", "rowwise", True)])
def test_adapter_gradients_match_jax_through_the_dequantized_base(kind, recipe, exact_norm_grad, dtype):
    """float32: the same math up to float32 roundings. bfloat16 against the float32 reference: the layer rounds the
    base product, z, y and (backward) dy g and each gradient to bfloat16, a few roundings of at most 2^-8 relative
    in series: 2^-7 (about 3e-3 measured)."""
    x, w, a, b, m, dy = operands(dtype)
    w8 = quantize_fp8(w, recipe)
    if kind == "lora":
        op = lambda a, b, m: lora_fp8_dense(x, w8, a, b, scale=S, implementation="xla")  # noqa: E731
        ref = lambda a, b, m: reference(x, w8, a, b, None)  # noqa: E731
    else:
        op = lambda a, b, m: dora_fp8_dense(x, w8, a, b, m, scale=S, exact_norm_grad=exact_norm_grad,  # noqa: E731
                                            implementation="xla")
        ref = lambda a, b, m: reference(x, w8, a, b, m, exact_norm_grad)  # noqa: E731
    tol = 1e-5 if dtype == jnp.float32 else 2.0 ** -7
    y, vjp = jax.vjp(op, a, b, m)
    y_ref, vjp_ref = jax.vjp(ref, a, b, m)
    assert y.dtype == dtype and rel_err(y, y_ref) <= tol, rel_err(y, y_ref)
    for name, g, g_ref in zip(("lora_a", "lora_b", "magnitude"), vjp(dy), vjp_ref(dy.astype(jnp.float32))):
        if kind == "lora" and name == "magnitude":
            continue
        assert g.dtype == dtype and rel_err(g, g_ref) <= tol, (name, rel_err(g, g_ref))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("k, n, r", [(200, 96, 4), (61, 37, 3)])
def test_column_sumsq_expanded_matches_the_dequantized_weight(recipe, dtype, k, n, r):
    """fp8_column_sumsq (||W8||^2 + 2 s <A^T W8, B> + s^2 B^T A^T A B, W8 never formed) against the squares of the
    formed W8 + s A B in float32 at HIGHEST precision: the value and jax.vjp's gradients to A, B and s.

    Values: both are float32 sums of the same exact products (e4m3 codes times 16-bit adapters), so 1e-5 bounds
    their difference (a few float32 roundings of a sum of squares). Gradients: float32 adapters 1e-5 as well; 16-bit
    adapters get dA and dB in their own dtype, and dA's skinny product over the codes takes the cotangent's
    B diag(c t) rounded to that dtype too: two roundings of at most half a bf16 step (2^-9) each, hence 2^-8."""
    w = rand(20, (k, n), scale=0.05)
    w8 = quantize_fp8(w, recipe)
    a, b, t = rand(21, (k, r), dtype, scale=0.3), rand(22, (r, n), dtype, scale=0.3), rand(23, (n,))
    s = jnp.float32(1.7)

    def formed(a, b, s):
        v = dequantize(w8, jnp.float32) + s * jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32),
                                                      precision=jax.lax.Precision.HIGHEST)
        return jnp.sum(jnp.square(v), axis=0)

    value, vjp = jax.vjp(lambda a, b, s: fp8_column_sumsq(w8, a, b, s, dtype), a, b, s)
    value_ref, vjp_ref = jax.vjp(formed, a, b, s)
    assert value.dtype == jnp.float32 and value.shape == (n,)
    assert rel_err(value, value_ref) <= 1e-5, rel_err(value, value_ref)
    grad_tol = 1e-5 if dtype == jnp.float32 else 2.0 ** -8
    for name, g, g_ref in zip(("lora_a", "lora_b", "scale"), vjp(t), vjp_ref(t)):
        assert g.dtype == g_ref.dtype, name
        assert rel_err(g, g_ref) <= grad_tol, (name, rel_err(g, g_ref))
    # the cross term matters here (the test could not pass with it wrong): s A B is not small against W8
    assert rel_err(formed(a, b, s), formed(a, b, 0.0)) > 0.1


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
