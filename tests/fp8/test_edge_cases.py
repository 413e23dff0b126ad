"""FP8 edge cases: non-finite input never spoils the scale, and empty inputs (zero tokens) work everywhere."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_fused.fp8 import (
    RECIPES,
    Float8Dense,
    Float8DotGeneral,
    fp8_linear,
    quantize,
    scaled_matmul,
    scaled_matmul_nt,
)
from tests.fp8.test_fp8 import skip_blockwise_kernel
from tests.helpers import rand

E4, E5 = jnp.float8_e4m3fn, jnp.float8_e5m2


@pytest.fixture(params=["xla", "kernel"])
def impl(request, kernel_impl):
    return "xla" if request.param == "xla" else kernel_impl


def _f32(q):
    return np.asarray(q.astype(jnp.float32))


@pytest.mark.parametrize("axis", [None, 0, 1])
@pytest.mark.parametrize("dtype", [E4, E5], ids=["e4m3", "e5m2"])
def test_non_finite_values_stay_out_of_the_scale(impl, axis, dtype):
    """One inf, -inf or NaN: the scale is that of the finite values; +-inf saturates to +-fp8_max, NaN stays NaN,
    and every other element is quantized exactly as without them."""
    x = rand(0, (12, 20), jnp.bfloat16)
    bad = x.at[2, 3].set(jnp.inf).at[5, 7].set(-jnp.inf).at[9, 11].set(jnp.nan)
    clean = x.at[2, 3].set(0.0).at[5, 7].set(0.0).at[9, 11].set(0.0)
    q, s = quantize(bad, dtype, axis=axis, implementation=impl)
    q0, s0 = quantize(clean, dtype, axis=axis, implementation=impl)
    np.testing.assert_array_equal(np.asarray(s), np.asarray(s0))
    assert np.all(np.isfinite(np.asarray(s))) and np.all(np.asarray(s) > 0)
    qf, q0f = _f32(q), _f32(q0)
    top = float(jnp.finfo(dtype).max)
    assert qf[2, 3] == top and qf[5, 7] == -top and np.isnan(qf[9, 11])
    others = np.ones(qf.shape, bool)
    others[2, 3] = others[5, 7] = others[9, 11] = False
    np.testing.assert_array_equal(qf[others], q0f[others])


def test_all_non_finite_row_gets_the_floor_scale(impl):
    x = rand(1, (4, 16), jnp.float32).at[1].set(jnp.nan)
    q, s = quantize(x, axis=1, implementation=impl)
    assert np.all(np.isfinite(np.asarray(s))) and np.all(np.isnan(_f32(q)[1]))
    assert np.all(np.isfinite(_f32(q)[[0, 2, 3]]))


@pytest.mark.parametrize("shape,axis", [((0, 8), None), ((0, 8), 1), ((0, 8), 0), ((8, 0), 1), ((2, 0, 8), -1)])
def test_quantize_empty(impl, shape, axis):
    q, s = quantize(jnp.zeros(shape, jnp.bfloat16), axis=axis, implementation=impl)
    ref_q, ref_s = quantize(jnp.zeros(shape, jnp.bfloat16), axis=axis, implementation="xla")
    assert q.shape == shape and q.dtype == E4 and s.shape == ref_s.shape
    assert np.all(np.isfinite(np.asarray(s)))


@pytest.mark.parametrize("m,k,n", [(0, 16, 8), (8, 16, 0), (8, 0, 8), (0, 0, 0)])
def test_scaled_matmul_empty(impl, m, k, n):
    a, sa = quantize(rand(2, (m, k)) if m * k else jnp.zeros((m, k)), implementation="xla")
    b, sb = quantize(rand(3, (k, n)) if k * n else jnp.zeros((k, n)), implementation="xla")
    out = scaled_matmul(a, b, sa, sb, implementation=impl)
    assert out.shape == (m, n) and out.dtype == jnp.bfloat16 and not np.any(_f32(out))
    out_nt = scaled_matmul_nt(a, b.T, sa, sb, out_dtype=jnp.float32, implementation=impl)
    assert out_nt.shape == (m, n) and not np.any(np.asarray(out_nt))


@pytest.mark.parametrize("recipe", RECIPES)
def test_linear_zero_tokens_forward_and_backward(impl, recipe):
    skip_blockwise_kernel(impl, recipe)
    x, w = jnp.zeros((0, 24), jnp.bfloat16), rand(4, (24, 16), jnp.bfloat16)
    y = fp8_linear(x, w, recipe, implementation=impl)
    assert y.shape == (0, 16)
    dx, dw = jax.grad(lambda x, w: jnp.sum(fp8_linear(x, w, recipe, implementation=impl).astype(jnp.float32)),
                      argnums=(0, 1))(x, w)
    assert dx.shape == (0, 24) and dw.shape == w.shape and not np.any(np.asarray(dw, np.float32))
    y3 = fp8_linear(jnp.zeros((3, 0, 24), jnp.bfloat16), w, recipe, implementation=impl)
    assert y3.shape == (3, 0, 16)


def test_flax_zero_tokens_like_nn_dense(impl):
    """Float8Dense and nn.Dense(dot_general_cls=Float8DotGeneral) on a batch of zero tokens, as nn.Dense."""
    x = jnp.zeros((2, 0, 24), jnp.bfloat16)
    dense = nn.Dense(16, dtype=jnp.bfloat16)
    want = dense.apply(dense.init(jax.random.key(0), x), x)
    layers = [Float8Dense(16, config="rowwise", dtype=jnp.bfloat16, implementation=impl),
              nn.Dense(16, dtype=jnp.bfloat16,
                       dot_general_cls=functools.partial(Float8DotGeneral, config="tensorwise", implementation=impl))]
    for layer in layers:
        params = layer.init(jax.random.key(0), x)
        y = layer.apply(params, x)
        assert y.shape == want.shape == (2, 0, 16) and y.dtype == want.dtype
        grads = jax.grad(lambda p, layer=layer: jnp.sum(layer.apply(p, x).astype(jnp.float32)))(params)
        assert all(not np.any(np.asarray(g, np.float32)) for g in jax.tree.leaves(grads))


@pytest.mark.gpu
@pytest.mark.parametrize("axis", [None, 0, 1])
def test_gpu_non_finite_quantize_matches_reference(axis):
    """On the GPU, Triton's min/max drop NaN: the compiled kernel must still keep NaN as NaN and saturate inf,
    bit for bit as the reference."""
    from pallas_fused.fp8 import kernel

    x = rand(5, (300, 520), jnp.bfloat16).at[7, 9].set(jnp.inf).at[100, 3].set(jnp.nan).at[299, 519].set(-jnp.inf)
    q, qt, s = kernel.quantize_2d(x, dtype=E4, axis=axis, power_of_2=False, emit_t=True)
    rq, rs = quantize(x, E4, axis=axis, implementation="xla")
    np.testing.assert_array_equal(np.asarray(s).reshape(-1), np.asarray(rs).reshape(-1))
    np.testing.assert_array_equal(_f32(q), _f32(rq))
    np.testing.assert_array_equal(_f32(qt), _f32(rq).T)


def test_variant_selector():
    """"interpret:triton" is the interpreted Triton matmul (as "interpret"); the sm90 kernel has no interpret form
    and an unknown variant is refused with the valid names."""
    a, b = rand(1, (5, 32)).astype(E4), rand(2, (32, 7)).astype(E4)
    want = scaled_matmul(a, b, 0.5, 2.0, implementation="xla")
    got = scaled_matmul(a, b, 0.5, 2.0, implementation="interpret:triton")
    np.testing.assert_allclose(_f32(got), _f32(want), rtol=1e-2)
    for bad in ("interpret:sm90", "pallas:cublas"):
        with pytest.raises(ValueError, match=f"'pallas:sm90', 'pallas:triton', 'interpret:triton', got '{bad}'"):
            scaled_matmul(a, b, 0.5, 2.0, implementation=bad)
