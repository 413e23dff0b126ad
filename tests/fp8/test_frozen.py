"""frozen_fp8_matmul: y = x W8 and dx = dy W8^T as FP8 GEMMs against a frozen Fp8Kernel, checked against plain jnp
that quantizes x and dy the same way and multiplies the dequantized operands exactly, and against the unquantized
product within the bound that e4m3's (e5m2's) rounding gives."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_fused.dora import Fp8Kernel, dequantize, quantize_fp8
from pallas_fused.fp8 import frozen_fp8_matmul
from pallas_fused.fp8.reference import quantize_reference
from tests.helpers import rand, rel_err, to64

M, K, N = 37, 200, 96  # none a multiple of a tile

# The relative rounding error of one element cast to an fp8 format with p mantissa bits is at most 2^-(p+1) (half a
# step); for values whose significands spread as random data's do (log-uniform on [1, 2)) it is uniform within that,
# so its root mean square is 2^-(p+1) * sqrt(E[1/m^2] / 3), E[1/m^2] = 3 / (8 ln 2). A product of independently
# rounded operands has the root of the sum of their squares as its relative Frobenius error. The tests allow 1.25x
# that: e4m3 x e4m3 0.0374 expected (0.0369 measured), e5m2 dy x e4m3 W 0.0591 (0.0559 measured).
RMS = {jnp.dtype(jnp.float8_e4m3fn): 2.0 ** -4 * np.sqrt(3 / (8 * np.log(2)) / 3),
       jnp.dtype(jnp.float8_e5m2): 2.0 ** -3 * np.sqrt(3 / (8 * np.log(2)) / 3)}
E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)


def fp8_bound(*formats) -> float:
    """The relative Frobenius error allowed for a product of operands rounded to `formats` (see RMS)."""
    return 1.25 * float(np.sqrt(sum(RMS[jnp.dtype(f)] ** 2 for f in formats)))


def quantized_x(x, recipe):
    """x as the op quantizes it for the forward GEMM, dequantized (float64)."""
    rowwise = recipe == "rowwise"
    q, s = quantize_reference(x, jnp.float8_e4m3fn, 1 if rowwise else None, rowwise)
    return to64(q) * np.asarray(s, np.float64)


def quantized_grad(dy, w8: Fp8Kernel):
    """The cotangent c with c W8^T what the op's dx GEMM computes: rowwise dy diag(s) quantized per row (e4m3,
    power-of-2 scales) then diag(s) divided out again; tensorwise dy quantized per tensor to e5m2."""
    if w8.recipe == "rowwise":
        s = np.asarray(w8.scale, np.float64)
        q, sq = quantize_reference(dy.astype(jnp.float32) * w8.scale[None, :], jnp.float8_e4m3fn, 1, True)
        return to64(q) * np.asarray(sq, np.float64) / s[None, :]
    q, sq = quantize_reference(dy, jnp.float8_e5m2, None, False)
    return to64(q) * float(sq)


def reference_vjp(x, w8, dy):
    """(y, dx) of the plain product x_q W8 (float64), its vjp at the quantized cotangent."""
    w = to64(dequantize(w8))
    y, vjp = jax.vjp(lambda xq: xq @ w, quantized_x(x, w8.recipe))
    return np.asarray(y), np.asarray(vjp(quantized_grad(dy, w8))[0])


def test_quantize_fp8_storage_and_rounding():
    w = rand(0, (K, N), scale=0.05)
    for recipe, scale_shape in (("tensorwise", ()), ("rowwise", (N,))):
        w8 = quantize_fp8(w, recipe)
        assert w8.codes.dtype == E4M3 and w8.codes.shape == (K, N) and w8.codes.dtype.itemsize == 1
        assert w8.scale.shape == scale_shape and w8.scale.dtype == jnp.float32 and w8.recipe == recipe
        err = np.abs(to64(dequantize(w8)) - to64(w))
        # every element within half an e4m3 step of itself (2^-4 relative), or of the subnormal step near zero
        tiny = 2.0 ** -9 * np.broadcast_to(np.asarray(w8.scale, np.float64), (K, N))
        assert np.all(err <= np.maximum(2.0 ** -4 * np.abs(to64(w)), tiny / 2)), recipe
        assert not np.any(np.signbit(to64(w8.codes)) & (to64(w8.codes) == 0))  # no -0 codes
    s = quantize_fp8(w, "rowwise").scale
    np.testing.assert_array_equal(np.log2(np.asarray(s)), np.round(np.log2(np.asarray(s))))  # powers of 2
    with pytest.raises(ValueError, match="recipe must be one of"):
        quantize_fp8(w, "blockwise")
    with pytest.raises(ValueError, match="kernel must be a 2-D float"):
        quantize_fp8(w[0], "rowwise")


@pytest.mark.parametrize("impl", ["xla", "interpret"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_matches_the_dequantized_reference(recipe, dtype, impl):
    x, w, dy = rand(1, (M, K), dtype), rand(2, (K, N), scale=0.07), rand(3, (M, N), dtype)
    w8 = quantize_fp8(w, recipe)
    y, vjp = jax.vjp(lambda x, w8: frozen_fp8_matmul(x, w8, implementation=impl), x, w8)
    dx, dw8 = vjp(dy)
    y_ref, dx_ref = reference_vjp(x, w8, dy)
    assert y.dtype == dtype and dx.dtype == dtype and y.shape == (M, N) and dx.shape == (M, K)
    # fp8 x fp8 products are exact in float32: only the order of the sums and the output's rounding differ
    tol = 1e-5 if dtype == jnp.float32 else 2.0 ** -8
    assert rel_err(y, y_ref) <= tol and rel_err(dx, dx_ref) <= tol, (rel_err(y, y_ref), rel_err(dx, dx_ref))
    assert not np.any(to64(dw8.codes)) and not np.any(np.asarray(dw8.scale))  # frozen: zero cotangents
    # against the unquantized product: FP8 rounding only (x and W in e4m3; dy in e4m3 rowwise, e5m2 tensorwise)
    exact_y, exact_dx = to64(x) @ to64(w), to64(dy) @ to64(w).T
    assert rel_err(y, exact_y) <= fp8_bound(E4M3, E4M3), rel_err(y, exact_y)
    grad_format = E4M3 if recipe == "rowwise" else E5M2
    assert rel_err(dx, exact_dx) <= fp8_bound(grad_format, E4M3), rel_err(dx, exact_dx)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_pallas_kernels_are_the_gemms_alone(recipe):
    """Under a Pallas implementation x and dy are quantized by XLA, fusible with their producers (dy diag(s) included),
    never by the Pallas quantize kernel, whose operand would have to be in memory (rowwise dy diag(s) written in
    float32 first): the forward and backward run no Pallas kernel but the GEMMs."""
    import re

    w8 = quantize_fp8(rand(8, (K, N)), recipe)
    step = lambda x, dy: jax.vjp(lambda x: frozen_fp8_matmul(x, w8, implementation="interpret"), x)[1](dy)  # noqa
    jaxpr = str(jax.make_jaxpr(step)(rand(9, (M, K), jnp.bfloat16), rand(10, (M, N), jnp.bfloat16)))
    names = set(re.findall(r"pallas_fused_\w+", jaxpr))
    assert names and all(n.startswith("pallas_fused_fp8_scaled_matmul") for n in names), names


def test_leading_axes_jit_and_out_dtype():
    x, w8 = rand(4, (2, 5, K), jnp.bfloat16), quantize_fp8(rand(5, (K, N)), "rowwise")
    y = jax.jit(lambda x: frozen_fp8_matmul(x, w8, out_dtype=jnp.float32))(x)
    assert y.shape == (2, 5, N) and y.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y).reshape(10, N), np.asarray(frozen_fp8_matmul(
        x.reshape(10, K), w8, out_dtype=jnp.float32)), rtol=1e-6)
    dx = jax.grad(lambda x: jnp.sum(frozen_fp8_matmul(x, w8, out_dtype=jnp.float32)))(x)
    assert dx.dtype == jnp.bfloat16 and dx.shape == x.shape


def test_bad_input_names_the_argument():
    w8 = quantize_fp8(rand(6, (K, N)), "tensorwise")
    with pytest.raises(ValueError, match="w8 must be an Fp8Kernel"):
        frozen_fp8_matmul(rand(7, (M, K)), rand(6, (K, N)))
    with pytest.raises(ValueError, match=r"x must be \(\.\.\., 200\)"):
        frozen_fp8_matmul(rand(7, (M, K + 1)), w8)
    with pytest.raises(ValueError, match="x must be float32/bfloat16/float16"):
        frozen_fp8_matmul(jnp.ones((M, K), jnp.int32), w8)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["pallas", "pallas:sm90", "pallas:triton"])
@pytest.mark.parametrize("m,k,n", [(1024, 512, 2048), (1000, 600, 700)])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_gpu_matches_the_dequantized_reference(recipe, m, k, n, impl):
    """The Pallas GEMMs (sm90 for same-dtype e4m3 operands: rowwise both ways, tensorwise's forward; XLA's fp8 dot
    for tensorwise's e5m2 x e4m3 dx under plain "pallas") against the dequantized reference, in bf16."""
    from pallas_fused import _backend

    if impl == "pallas:sm90" and (recipe == "tensorwise" or not _backend.is_hopper()):
        pytest.skip("one fp8 dtype for both operands on Hopper (tensorwise's dx is e5m2 x e4m3)")
    x, w, dy = rand(40, (m, k), jnp.bfloat16), rand(41, (k, n), scale=0.05), rand(42, (m, n), jnp.bfloat16)
    w8 = quantize_fp8(w, recipe)
    y, vjp = jax.vjp(lambda x: frozen_fp8_matmul(x, w8, implementation=impl), x)
    y_ref, dx_ref = reference_vjp(x, w8, dy)
    # fast accumulation on the tensor cores, then bf16 output: a few bf16 steps at most
    assert rel_err(y, y_ref) <= 2.0 ** -7 and rel_err(vjp(dy)[0], dx_ref) <= 2.0 ** -7
