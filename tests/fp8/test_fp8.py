"""FP8: quantize, scaled matmul, the three-GEMM linear layer and the Flax drop-ins.

On the CPU the Pallas kernels run interpreted (kernel_impl="interpret"); the Mosaic GPU kernel is
tested against the reference under @pytest.mark.gpu.
"""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from pallas_fused import _backend
from pallas_fused.fp8 import (
    RECIPES,
    CastConfig,
    Float8Config,
    Float8Dense,
    Float8DotGeneral,
    GemmConfig,
    fp8_linear,
    quantize,
    scaled_matmul,
    scaled_matmul_nt,
)
from pallas_fused.fp8 import reference as ref
from tests.helpers import rand

E4, E5 = jnp.float8_e4m3fn, jnp.float8_e5m2


def sqnr(out, exact) -> float:
    out, exact = np.asarray(jnp.asarray(out, jnp.float32), np.float64), np.asarray(jnp.asarray(exact, jnp.float32),
                                                                                    np.float64)
    assert np.all(np.isfinite(out)), "non-finite output"
    noise = np.sum((out - exact) ** 2)
    return float("inf") if noise == 0 else float(10 * np.log10(np.sum(exact**2) / noise))


@pytest.fixture(params=["xla", "kernel"])
def impl(request, kernel_impl):
    return "xla" if request.param == "xla" else kernel_impl


def skip_blockwise_kernel(impl, recipe):
    """Blockwise recipes run here only on the Hopper GEMM kernel; their other paths are test_blockwise.py's and
    test_blockwise_kernel.py's."""
    from pallas_fused import _backend

    on_kernel = impl == "pallas" and _backend.is_hopper()
    if impl != "xla" and Float8Config.from_recipe(recipe).blockwise and not on_kernel:
        pytest.skip("blockwise: test_blockwise.py and test_blockwise_kernel.py cover this path")


# ---------------------------------------------------------------------------------------------- config


def test_recipes():
    tw = Float8Config.from_recipe("tensorwise")
    assert tw.cast_config_input == CastConfig("tensorwise", E4)
    assert tw.cast_config_grad_output.dtype == jnp.dtype(E5)
    assert not tw.round_scales_to_power_of_2
    # torchao's accumulation: tensorwise accumulates its gradient GEMMs in fp32, the axiswise recipes do not
    fast = lambda c: tuple(getattr(c, f"gemm_config_{g}").fast_accum for g in ("output", "grad_input", "grad_weight"))  # noqa: E731
    assert fast(tw) == (True, False, False)
    rw = Float8Config.from_recipe("rowwise")
    assert fast(rw) == fast(Float8Config.from_recipe("rowwise_with_gw_hp")) == (True, True, True)
    assert all(getattr(rw, f).scaling == "axiswise" and getattr(rw, f).dtype == jnp.dtype(E4)
               for f in rw.__dataclass_fields__ if f.startswith("cast_config"))
    assert rw.round_scales_to_power_of_2
    lw = Float8Config.from_recipe("rowwise_with_gw_hp")
    assert lw.cast_config_input.scaling == lw.cast_config_weight.scaling == lw.cast_config_grad_output.scaling \
        == "axiswise"
    assert lw.cast_config_weight_for_grad_input.scaling == "tensorwise"
    assert lw.cast_config_input_for_grad_weight.disabled and lw.cast_config_grad_output_for_grad_weight.disabled
    assert hash(lw) == hash(Float8Config.from_recipe("rowwise_with_gw_hp"))


def test_bad_config():
    with pytest.raises(ValueError, match="name must be one of"):
        Float8Config.from_recipe("columnwise")
    with pytest.raises(ValueError, match="scaling"):
        CastConfig("rowwise")
    with pytest.raises(ValueError, match="dtype"):
        CastConfig("axiswise", jnp.bfloat16)
    with pytest.raises(ValueError, match="gemm_config_output"):
        Float8Config(gemm_config_output=True)
    with pytest.raises(ValueError, match="name must be one of"):
        fp8_linear(jnp.ones((2, 3)), jnp.ones((3, 4)), "nope")
    with pytest.raises(ValueError, match="config must be"):
        fp8_linear(jnp.ones((2, 3)), jnp.ones((3, 4)), 3)


# ---------------------------------------------------------------------------------------------- quantize


@pytest.mark.parametrize("shape", [(37, 53), (1, 7)])
@pytest.mark.parametrize("axis", [None, 0, 1])
@pytest.mark.parametrize("dtype", [E4, E5])
def test_quantize_kernel_matches_reference(kernel_impl, shape, axis, dtype):
    x = rand(1, shape, jnp.bfloat16, scale=3.0)
    for pow2 in (False, True) if dtype == E4 else (True,):
        q, s = jax.jit(quantize, static_argnums=(1, 2, 3), static_argnames="implementation")(
            x, dtype, axis, pow2, implementation=kernel_impl)
        qr, sr = ref.quantize_reference(x, dtype, axis, pow2)
        assert q.dtype == jnp.dtype(dtype) and s.dtype == jnp.float32 and s.shape == sr.shape
        # XLA may turn the division by fp8_max into a reciprocal multiply: allow 1 ulp in the scale and
        # the rare element that then rounds to the neighbouring fp8 value
        np.testing.assert_allclose(np.asarray(s), np.asarray(sr), rtol=2e-7)
        qf, qrf = np.asarray(q.astype(jnp.float32)), np.asarray(qr.astype(jnp.float32))
        assert np.mean(qf != qrf) <= 0.01
        np.testing.assert_allclose(qf, qrf, rtol=0.13)


def test_quantize_3d_and_scale_shapes(kernel_impl):
    x = rand(2, (3, 5, 24), jnp.float32)
    for axis, shape in [(None, ()), (-1, (3, 5, 1)), (0, (1, 5, 24)), (1, (3, 1, 24))]:
        q, s = quantize(x, axis=axis, implementation=kernel_impl)
        assert q.shape == x.shape and s.shape == shape
        assert sqnr(q.astype(jnp.float32) * s, x) >= 25


@pytest.mark.parametrize("axis", [None, 0, 1])
@pytest.mark.parametrize("pow2", [False, True])
def test_quantize_round_trip_sqnr(impl, axis, pow2):
    x = rand(3, (96, 80), jnp.float32)
    q, s = quantize(x, E4, axis, pow2, implementation=impl)
    assert sqnr(q.astype(jnp.float32) * s, x) >= 25
    if pow2:  # scales are exact powers of two, and rounding up never overflows
        m, e = np.frexp(np.asarray(s))
        assert np.all(m == 0.5)
    assert float(jnp.max(jnp.abs(q.astype(jnp.float32)))) <= 448.0


def test_quantize_amax_zero_and_saturation(impl):
    z = jnp.zeros((16, 24), jnp.bfloat16)
    for axis in (None, 0, 1):
        q, s = quantize(z, axis=axis, implementation=impl)
        assert np.all(np.isfinite(np.asarray(s))) and np.all(np.asarray(s) > 0)
        assert not np.any(np.asarray(q.astype(jnp.float32)))
    # one row of zeros among non-zero rows: its scale is finite, the others unaffected
    x = rand(4, (16, 24), jnp.float32).at[3].set(0.0)
    q, s = quantize(x, axis=1, implementation=impl)
    assert np.all(np.isfinite(np.asarray(s))) and not np.any(np.asarray(q[3].astype(jnp.float32)))
    # huge values: the element at the amax maps to +-fp8_max, never inf/NaN
    big = jnp.asarray(rand(5, (8, 32), jnp.float32) * 3e37)
    for dtype in (E4, E5):
        q, s = quantize(big, dtype, implementation=impl)
        qf = np.asarray(q.astype(jnp.float32))
        assert np.all(np.isfinite(qf)) and np.max(np.abs(qf)) == float(jnp.finfo(dtype).max)
    # the cast itself saturates when the scale is too small
    sat = ref.saturating_cast(jnp.asarray([1e6, -1e6, 1.0]), jnp.float32(1.0), E4)
    np.testing.assert_array_equal(np.asarray(sat.astype(jnp.float32)), [448.0, -448.0, 1.0])


def test_quantize_bad_input():
    with pytest.raises(ValueError, match="dtype must be"):
        quantize(jnp.ones((4, 4)), dtype=jnp.int8)
    with pytest.raises(ValueError, match="x must be"):
        quantize(jnp.ones((4, 4), jnp.int32))
    with pytest.raises(ValueError, match="axis must be"):
        quantize(jnp.ones((4, 4)), axis=2)


# ---------------------------------------------------------------------------------------------- scaled matmul


def _ints(seed, shape, lo=-4, hi=5):
    return jax.random.randint(jax.random.key(seed), shape, lo, hi).astype(jnp.float32)


@pytest.mark.parametrize("m,k,n", [(16, 32, 24), (37, 45, 29)])
def test_scaled_matmul_exact_small_ints(impl, m, k, n):
    a, b = _ints(0, (m, k)), _ints(1, (k, n))
    sa = jnp.exp2(_ints(2, (m, 1), -2, 3))  # power-of-two scales keep everything exact
    sb = jnp.exp2(_ints(3, (1, n), -2, 3))
    exact = (np.asarray(a) * np.asarray(sa)) @ (np.asarray(b) * np.asarray(sb))
    a8, b8 = a.astype(E4), b.astype(E4)
    for sa_, sb_ in ((sa, sb), (jnp.float32(0.5), jnp.float32(4.0))):
        want = exact if sa_ is sa else np.asarray(a) @ np.asarray(b) * 2.0
        out = scaled_matmul(a8, b8, sa_, sb_, out_dtype=jnp.float32, implementation=impl)
        np.testing.assert_array_equal(np.asarray(out), want)
        out = scaled_matmul_nt(a8, b8.T, sa_, jnp.reshape(sb_, (-1, 1)), out_dtype=jnp.float32, implementation=impl)
        np.testing.assert_array_equal(np.asarray(out), want)
    # mixed e4m3 x e5m2
    out = scaled_matmul(a8, b.astype(E5), sa, sb, out_dtype=jnp.float32, implementation=impl)
    np.testing.assert_array_equal(np.asarray(out), exact)


@pytest.mark.parametrize("m,k,n,out_dtype",
                         [(64, 96, 48, jnp.bfloat16), (33, 70, 17, jnp.float32), (1, 40, 9, jnp.bfloat16)])
@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise"])
def test_scaled_matmul_sqnr(impl, m, k, n, granularity, out_dtype):
    a, b = rand(4, (m, k), jnp.float32, scale=2.0), rand(5, (k, n), jnp.float32, scale=0.1)
    axes = (None, None) if granularity == "tensorwise" else (1, 0)
    a8, sa = quantize(a, E4, axes[0])
    b8, sb = quantize(b, E4, axes[1])
    out = scaled_matmul(a8, b8, sa, sb, out_dtype=out_dtype, implementation=impl)
    assert out.dtype == jnp.dtype(out_dtype) and out.shape == (m, n)
    assert sqnr(out, np.asarray(a, np.float64) @ np.asarray(b, np.float64)) >= 25
    base = scaled_matmul(a8, b8, sa, sb, out_dtype=jnp.float32, implementation="xla")
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(base), rtol=1e-2, atol=1e-2 * float(
        jnp.max(jnp.abs(base))))


def test_scaled_matmul_bad_input():
    a8, b8 = jnp.ones((8, 16), E4), jnp.ones((16, 4), E4)
    with pytest.raises(ValueError, match="a_fp8"):
        scaled_matmul(jnp.ones((8, 16), jnp.bfloat16), b8, 1.0, 1.0)
    with pytest.raises(ValueError, match="b_fp8"):
        scaled_matmul(a8, jnp.ones((16, 4), jnp.int8), 1.0, 1.0)
    with pytest.raises(ValueError, match="a_scale"):
        scaled_matmul(a8, b8, jnp.ones((16, 1)), 1.0)
    with pytest.raises(ValueError, match="b_scale"):
        scaled_matmul(a8, b8, 1.0, jnp.ones((4, 1)))
    with pytest.raises(ValueError, match="share K"):
        scaled_matmul(a8, jnp.ones((8, 4), E4), 1.0, 1.0)
    with pytest.raises(ValueError, match="out_dtype"):
        scaled_matmul(a8, b8, 1.0, 1.0, out_dtype=jnp.int32)
    with pytest.raises(ValueError, match="bt_fp8"):
        scaled_matmul_nt(a8, jnp.ones((4, 16)), 1.0, 1.0)
    if _backend.gpu_device() is None:
        with pytest.raises(_backend.ImplementationError):
            scaled_matmul(a8, b8, 1.0, 1.0, implementation="pallas:sm90")


def test_scaled_matmul_jit_vmap(impl):
    a, b = rand(6, (3, 16, 32)), rand(7, (32, 8))
    a8, sa = quantize(a, axis=-1)
    b8, sb = quantize(b, axis=0)
    f = jax.jit(jax.vmap(lambda a, sa: scaled_matmul(a, b8, sa, sb, out_dtype=jnp.float32, implementation=impl)))
    out = f(a8, sa)
    want = jnp.stack([scaled_matmul(a8[i], b8, sa[i], sb, out_dtype=jnp.float32, implementation="xla")
                      for i in range(3)])
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------- linear layer


def _dense_vs_bf16(impl, recipe, tokens=64, din=48, dout=40):
    x = rand(8, (tokens, din), jnp.bfloat16)
    dense = nn.Dense(dout, dtype=jnp.bfloat16)
    fp8 = nn.Dense(dout, dtype=jnp.bfloat16,
                   dot_general_cls=functools.partial(Float8DotGeneral, config=recipe, implementation=impl))
    v = dense.init(jax.random.key(0), x)
    g = rand(9, (tokens, dout), jnp.float32)

    @functools.partial(jax.jit, static_argnums=0)
    def run(m, v, x):
        loss = lambda v, x: jnp.sum(m.apply(v, x).astype(jnp.float32) * g)  # noqa: E731
        return m.apply(v, x), jax.grad(loss, argnums=(0, 1))(v, x)

    return run(fp8, v, x), run(dense, v, x)


@pytest.mark.parametrize("recipe", RECIPES)
def test_dense_sqnr_vs_bf16(impl, recipe):
    skip_blockwise_kernel(impl, recipe)
    (y, (gv, gx)), (y0, (gv0, gx0)) = _dense_vs_bf16(impl, recipe)
    assert y.dtype == jnp.bfloat16
    assert sqnr(y, y0) >= 18
    assert sqnr(gv["params"]["kernel"], gv0["params"]["kernel"]) >= 17
    assert sqnr(gx, gx0) >= 17
    np.testing.assert_allclose(np.asarray(gv["params"]["bias"]), np.asarray(gv0["params"]["bias"]), rtol=1e-2)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_linear_gemms_follow_config(recipe):
    """Forward and both gradients equal the three GEMMs built by hand from quantize_reference."""
    cfg = Float8Config.from_recipe(recipe)
    x, w, dy = rand(10, (32, 24), jnp.float32), rand(11, (24, 16), jnp.float32), rand(12, (32, 16), jnp.float32)
    pow2 = cfg.round_scales_to_power_of_2

    def cast(v, cc, axis):  # axis: the GEMM's contraction axis of v (as stored)
        if cc.disabled:
            return v
        q, s = ref.quantize_reference(v, cc.dtype, None if cc.scaling == "tensorwise" else axis, pow2)
        return q.astype(jnp.float32) * s

    y_want = cast(x, cfg.cast_config_input, 1) @ cast(w, cfg.cast_config_weight, 0)
    dx_want = cast(dy, cfg.cast_config_grad_output, 1) @ cast(w, cfg.cast_config_weight_for_grad_input, 1).T
    dw_want = cast(x, cfg.cast_config_input_for_grad_weight, 0).T @ cast(
        dy, cfg.cast_config_grad_output_for_grad_weight, 0)

    @jax.jit
    def run(x, w, dy):
        y, vjp = jax.vjp(lambda x, w: fp8_linear(x, w, cfg, implementation="xla"), x, w)
        return (y, *vjp(dy))

    y, dx, dw = run(x, w, dy)
    for got, want in ((y, y_want), (dx, dx_want), (dw, dw_want)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m,n,k", [(16384, 5504, 2048), (2048, 5504, 16384), (16384, 2048, 5504),
                                   (5504, 2048, 16384), (256, 384, 128), (1000, 700, 600), (100, 5504, 128)])
def test_sm90_tile_avoids_padding(m, n, k):
    """The Hopper GEMM's tile fits the shape whenever one of its two splits does (N = 5504 = 43 x 128 needs the
    split along M: 256 x 128); otherwise the one that pads less."""
    from pallas_fused.fp8 import kernel_sm90

    config = kernel_sm90.config_for(m, n, k, num_sms=1)  # the padding rule alone (no few-tiles rule)
    splits = [dataclasses.replace(kernel_sm90.tiles()[0], wg_split=w) for w in ("n", "m")]
    fits = [c for c in splits if kernel_sm90.supported(m, n, k, E4, E4, c)]
    if fits:  # the grid walk aside (test_sm90_tile_grid_walk)
        assert dataclasses.replace(config, grid_minor_dim=fits[0].grid_minor_dim) == fits[0]
    else:
        padded = [(m + -m % c.cta_tile[0]) * (n + -n % c.cta_tile[1]) for c in (config, *splits)]
        assert padded[0] == min(padded[1:])
    assert config.tile_k == kernel_sm90.tiles()[0].tile_k


def test_linear_hp_gemm_writes_its_dtype():
    """rowwise_with_gw_hp: the bf16 weight-gradient GEMM writes bf16 itself (an fp32 result is a full extra
    write and read of dW for the cast)."""
    x, w, dy = (rand(i, s, jnp.bfloat16) for i, s in ((40, (32, 24)), (41, (24, 16)), (42, (32, 16))))

    def grads(x, w, dy):
        return jax.vjp(lambda x, w: fp8_linear(x, w, "rowwise_with_gw_hp", implementation="xla"), x, w)[1](dy)

    text = jax.jit(grads).lower(x, w, dy).as_text()
    dots = [line for line in text.splitlines() if "dot_general" in line]
    assert any(line.rstrip().endswith("tensor<24x16xbf16>") for line in dots), dots
    assert not any("tensor<24x16xf32>" in line for line in dots), dots
    _, dw = jax.jit(grads)(x, w, dy)
    assert dw.dtype == jnp.bfloat16
    assert sqnr(dw, np.asarray(x, np.float32).T @ np.asarray(dy, np.float32)) >= 40  # x^T dy, rounded once


def test_linear_kernel_matches_xla(kernel_impl):
    x, w, dy = rand(13, (40, 24), jnp.bfloat16), rand(14, (24, 20), jnp.bfloat16), rand(15, (40, 20), jnp.bfloat16)
    for recipe in (r for r in RECIPES if not Float8Config.from_recipe(r).blockwise):  # test_blockwise.py
        def run(x, w, dy, i, recipe=recipe):
            y, vjp = jax.vjp(lambda x, w: fp8_linear(x, w, recipe, implementation=i), x, w)
            return (y, *vjp(dy))

        run = jax.jit(run, static_argnums=3)
        for a, b in zip(run(x, w, dy, "xla"), run(x, w, dy, kernel_impl)):
            assert a.dtype == b.dtype == jnp.bfloat16
            assert sqnr(b, a) >= 40


def test_linear_fast_accum_off_and_e5m2_forward():
    cfg = Float8Config(cast_config_input=CastConfig("axiswise", E5), gemm_config_output=GemmConfig(False),
                       gemm_config_grad_input=GemmConfig(False), gemm_config_grad_weight=GemmConfig(False))
    x, w = rand(16, (32, 24), jnp.float32), rand(17, (24, 16), jnp.float32)
    y = fp8_linear(x, w, cfg)
    assert sqnr(y, x @ w) >= 18


def test_linear_jit_vmap_remat(impl):
    x, w = rand(18, (2, 16, 24), jnp.bfloat16), rand(19, (24, 8), jnp.bfloat16)
    f = lambda x, w: jnp.sum(fp8_linear(x, w, "rowwise", implementation=impl).astype(jnp.float32) ** 2)  # noqa: E731
    g0 = jax.jit(jax.grad(f, argnums=(0, 1)))(x, w)
    g_jit = jax.jit(jax.grad(jax.checkpoint(f), argnums=(0, 1)))(x, w)
    for a, b in zip(g0, g_jit):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2, atol=1e-2)
    if impl != "xla":  # vmap of the interpreted kernels is slow on the CPU; vmap is tested on "xla"
        return
    gv = jax.jit(jax.vmap(jax.grad(f, argnums=1), in_axes=(0, None)))(x, w)  # per-example weight grads
    assert gv.shape == (2, 24, 8)
    for i in range(2):
        want = jax.jit(jax.grad(f, argnums=1))(x[i], w)
        np.testing.assert_allclose(np.asarray(gv[i], np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=1e-2)


def test_linear_bad_input():
    with pytest.raises(ValueError, match="w must be 2-D"):
        fp8_linear(jnp.ones((4, 3)), jnp.ones((3,)))
    with pytest.raises(ValueError, match="x must be"):
        fp8_linear(jnp.ones((4, 5)), jnp.ones((3, 2)))


# ---------------------------------------------------------------------------------------------- flax


def test_dense_general_and_float8_dense():
    x = rand(20, (4, 6, 3, 8), jnp.float32)
    dg = nn.DenseGeneral((5, 7), axis=(-2, -1))
    dg8 = nn.DenseGeneral((5, 7), axis=(-2, -1), dot_general_cls=functools.partial(Float8DotGeneral, config="rowwise"))
    v = dg.init(jax.random.key(1), x)
    y, y0 = jax.jit(dg8.apply)(v, x), jax.jit(dg.apply)(v, x)
    assert y.shape == y0.shape == (4, 6, 5, 7)
    assert sqnr(y, y0) >= 18
    # Float8Dense: nn.Dense's parameters, and the same result as nn.Dense with the fp8 dot_general
    fd = Float8Dense(12, config="tensorwise")
    d = nn.Dense(12, dot_general_cls=functools.partial(Float8DotGeneral, config="tensorwise"))
    x2 = rand(21, (10, 8), jnp.float32)
    v2 = d.init(jax.random.key(2), x2)
    assert jax.tree.structure(fd.init(jax.random.key(2), x2)) == jax.tree.structure(v2)
    np.testing.assert_array_equal(np.asarray(jax.jit(fd.apply)(v2, x2)), np.asarray(jax.jit(d.apply)(v2, x2)))


def test_dense_general_batch_dims():
    lhs, rhs = rand(22, (3, 10, 8)), rand(23, (3, 8, 6))
    dn = (((2,), (1,)), ((0,), (0,)))
    out = jax.jit(lambda a, b: Float8DotGeneral("rowwise")(a, b, dn))(lhs, rhs)
    assert sqnr(out, jax.lax.dot_general(lhs, rhs, dn)) >= 18


def test_nnx_linear():
    lin = nnx.Linear(16, 12, rngs=nnx.Rngs(0))
    lin8 = nnx.Linear(16, 12, dot_general=Float8DotGeneral("rowwise_with_gw_hp"), rngs=nnx.Rngs(0))
    x = rand(24, (8, 16), jnp.float32)
    assert sqnr(nnx.jit(lambda m, x: m(x))(lin8, x), lin(x)) >= 18
    grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x) ** 2)))(lin8)
    grads0 = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x) ** 2)))(lin)
    assert sqnr(grads.kernel[...], grads0.kernel[...]) >= 17


# ---------------------------------------------------------------------------------------------- training


class _MLP(nn.Module):
    recipe: str | None

    @nn.compact
    def __call__(self, x):
        dg = None if self.recipe is None else functools.partial(Float8DotGeneral, config=self.recipe)
        h = nn.gelu(nn.Dense(64, dtype=jnp.bfloat16, dot_general_cls=dg)(x))
        h = nn.gelu(nn.Dense(64, dtype=jnp.bfloat16, dot_general_cls=dg)(h))
        return nn.Dense(8, dtype=jnp.bfloat16, dot_general_cls=dg)(h)


def _train(recipe, steps=300):
    kx, kw = jax.random.split(jax.random.key(0))
    teacher = jax.random.normal(kw, (32, 8)) * 0.5
    model = _MLP(recipe)
    params = model.init(jax.random.key(1), jnp.ones((1, 32)))
    tx = optax.adam(3e-3)
    state = tx.init(params)

    @jax.jit
    def step(params, state, i):
        kb, kl = jax.random.split(jax.random.fold_in(kx, i))
        x = jax.random.normal(kb, (128, 32))
        labels = jax.random.categorical(kl, jnp.tanh(x @ teacher) * 3)  # sampled: the loss has a floor

        def loss_fn(p):
            logits = model.apply(p, x).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        loss, g = jax.value_and_grad(loss_fn)(params)
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    for i in range(steps):
        params, state, loss = step(params, state, i)
        losses.append(float(loss))
    return float(np.mean(losses[-50:]))


# Floor leg only: 300 training steps of each recipe repeat at length what the forward and gradient tests above check
# on both legs (flax's Dense through Float8DotGeneral against bf16: test_dense_sqnr_vs_bf16; every recipe's
# fp8_linear: test_linear_kernel_matches_xla and tests/fp8/test_blockwise.py).
@pytest.mark.slow
def test_training_matches_bf16():
    base = _train(None)
    for recipe in RECIPES:
        loss = _train(recipe)
        assert abs(loss - base) <= 0.02 * base + 1e-3, f"{recipe}: final loss {loss:.4f} vs bf16 {base:.4f}"


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("impl_name", ["pallas:sm90", "pallas:triton", "pallas"])
@pytest.mark.parametrize("m,k,n", [(1024, 512, 2048), (1000, 600, 700), (4096, 4096, 4096)])
@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise"])
def test_gpu_scaled_matmul_matches_reference(impl_name, m, k, n, granularity):
    if impl_name == "pallas:sm90" and not _backend.is_hopper():
        pytest.skip("needs Hopper")
    a, b = rand(30, (m, k), jnp.bfloat16), rand(31, (k, n), jnp.bfloat16)
    axes = (None, None) if granularity == "tensorwise" else (1, 0)
    a8, sa = quantize(a, E4, axes[0], implementation="pallas")
    b8, sb = quantize(b, E4, axes[1], implementation="pallas")
    out = scaled_matmul(a8, b8, sa, sb, implementation=impl_name)
    want = scaled_matmul(a8, b8, sa, sb, implementation="xla")
    assert sqnr(out, want) >= 40
    assert sqnr(out, np.asarray(a, np.float32) @ np.asarray(b, np.float32)) >= 25


@pytest.mark.parametrize("m,n,k,small", [(2048, 512, 16384, True), (512, 2048, 16384, True), (2048, 384, 16384, True),
                                         (2048, 2048, 16384, False), (16384, 512, 2048, False),
                                         (2048, 320, 16384, False)])
def test_sm90_tile_few_output_tiles(m, n, k, small):
    """With fewer 128 x 256 tiles than half the SMs (132 on an H100 / H200) the 128 x 128 CTA tile is taken, where
    it fits unpadded; 128 tiles or more keep the larger one."""
    from pallas_fused.fp8 import kernel_sm90

    config = kernel_sm90.config_for(m, n, k, num_sms=132)
    assert (config.cta_tile == (128, 128)) is small
    assert kernel_sm90.supported(m, n, k, E4, E4, config) or not small
    assert kernel_sm90.config_for(m, n, k, num_sms=1) == kernel_sm90.config_for(m, n, k, num_sms=1)  # a pure function
    assert kernel_sm90.config_for(m, n, k, num_sms=1).cta_tile != (128, 128)


@pytest.mark.parametrize("m,n,k,xla", [(2048, 512, 16384, True), (512, 2048, 16384, True), (2048, 512, 4096, False),
                                       (2048, 2048, 16384, False), (16384, 512, 2048, False)])
def test_cublas_wins_few_tiles_long_k(m, n, k, xla):
    """Plain "pallas" hands a GEMM to XLA's fp8 dot only where the small tiles still leave most of 132 SMs idle
    and K is long (cuBLAS splits K; the sm90 kernel does not)."""
    from pallas_fused.fp8 import kernel_sm90

    assert kernel_sm90.cublas_wins(m, n, k, num_sms=132) is xla
    assert not kernel_sm90.cublas_wins(m, n, k, num_sms=1)


@pytest.mark.parametrize("m,n,k,xla", [(2048, 5504, 16384, True), (5504, 2048, 16384, True),
                                       (2048, 5504, 8192, False), (2048, 2048, 16384, False),
                                       (16384, 16384, 16384, False), (8192, 8192, 8192, False)])
def test_cublas_wins_partial_last_wave_long_k(m, n, k, xla):
    """Plain "pallas" hands a long-K GEMM to XLA's fp8 dot where the sm90 tiles' last wave leaves SMs idle
    (344 tiles on 132 SMs: 87% of 3 waves), not where the waves are nearly full (128 tiles; thousands) or K is
    shorter; on one SM every wave is full."""
    from pallas_fused.fp8 import kernel_sm90

    assert kernel_sm90.cublas_wins(m, n, k, num_sms=132) is xla
    assert not kernel_sm90.cublas_wins(m, n, k, num_sms=1)
    assert not kernel_sm90.cublas_wins(m, n, k, num_sms=2)  # one cluster, where the tile has one


@pytest.mark.gpu
@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("m,k,n,cta_tile,schedule", [
    (2048, 256, 6528, (256, 128), "cooperative"),  # wide, N = 51 x 128: only the 256 x 128 tile fits unpadded
    (6144, 256, 384, (128, 128), "pingpong"),  # tall, many tiles: the tuned ping-pong tile
    (256, 1024, 384, (128, 128), "cooperative"),  # so few output tiles that the small tile is taken
])
def test_gpu_scaled_matmul_nt_tiles(granularity, m, k, n, cta_tile, schedule):
    """The user's call (quantize outputs into scaled_matmul_nt) on each kind of tile the H200's tuning table picks."""
    from pallas_fused.fp8 import kernel_sm90

    if not _backend.is_hopper():
        pytest.skip("needs Hopper")
    config = kernel_sm90.config_for(m, n, k)
    assert (config.cta_tile, config.schedule) == (cta_tile, schedule)
    axis = None if granularity == "tensorwise" else -1
    a8, sa = quantize(rand(35, (m, k), jnp.bfloat16), E4, axis)
    bt8, sb = quantize(rand(36, (n, k), jnp.bfloat16), E4, axis)
    out = jax.jit(scaled_matmul_nt)(a8, bt8, sa, sb)
    want = scaled_matmul_nt(a8, bt8, sa, sb, implementation="xla")
    assert out.shape == (m, n)
    assert sqnr(out, want) >= 40


# A tuning table whose tiles carry a cluster and a grid walk (fields the table may set per tile).
CLUSTER_TABLE = {"large": dict(tile_m=128, tile_n=128, tile_k=128, max_concurrent_steps=4, cluster="m",
                               grid_tile_width=16),
                 "small": dict(tile_m=128, tile_n=64, tile_k=128, max_concurrent_steps=4, cluster="n"),
                 "cluster_min_tiles_per_sm": 2.0}


@pytest.fixture
def cluster_table(monkeypatch):
    """"fp8_sm90" of this device kind's tuning table replaced by CLUSTER_TABLE."""
    tuned = _backend.tuned
    monkeypatch.setattr(_backend, "tuned", lambda section, heuristic: {**tuned(section, heuristic), **CLUSTER_TABLE}
                        if section == "fp8_sm90" else tuned(section, heuristic))


@pytest.mark.parametrize("m,n,num_sms,cluster,cta_tile", [
    (4096, 4096, 132, "m", (128, 256)),  # 512 CTA tiles: 3.9 per SM, at least cluster_min_tiles_per_sm
    (4096, 2048, 132, None, (128, 256)),  # 256 CTA tiles: 1.9 per SM, fewer
    (384, 4096, 1, None, (128, 256)),  # M = 3 x 128: no multiple of either cluster tile along M
    (512, 5504, 1, "m", (256, 128)),  # N = 43 x 128: the split along M, clustered
    (1024, 1024, 132, "n", (128, 128)),  # few tiles: the small tile, with its own cluster
    (1024, 1152, 132, None, (128, 128)),  # N = 9 x 128: the small tile without its cluster
])
def test_sm90_tile_cluster_rule(cluster_table, m, n, num_sms, cluster, cta_tile):
    """A tuned tile keeps its cluster where the shape is a multiple of the cluster tile and (the large tile) the
    GEMM has at least cluster_min_tiles_per_sm CTA tiles per SM; elsewhere the same tile runs without it."""
    from pallas_fused.fp8 import kernel_sm90

    config = kernel_sm90.config_for(m, n, 4096, num_sms=num_sms)
    assert (config.cluster, config.cta_tile) == (cluster, cta_tile)
    assert kernel_sm90.supported(m, n, 4096, E4, E4, config)
    assert config.grid_tile_width == (8 if cta_tile == (128, 128) else 16)


@pytest.mark.parametrize("m,n,num_sms,minor", [
    (16384, 5504, 132, "m"),  # tall, split along M: walks along M
    (16384, 2048, 132, "m"),
    (4096, 4096, 132, "m"),  # square counts as tall
    (2048, 5504, 132, "n"),  # wide: the tuned walk
    (1024, 1024, 132, "n"),  # few tiles: the small tile keeps its own walk
])
def test_sm90_tile_grid_walk(monkeypatch, m, n, num_sms, minor):
    """The large tile walks the grid along "tall_grid_minor_dim" where M >= N; a table without it keeps the tile's
    own walk everywhere."""
    from pallas_fused.fp8 import kernel_sm90

    config = kernel_sm90.config_for(m, n, 4096, num_sms=num_sms)
    assert config.grid_minor_dim == minor
    assert kernel_sm90.supported(m, n, 4096, E4, E4, config)
    tuned = _backend.tuned
    without = {k: v for k, v in kernel_sm90.HEURISTIC.items() if k != "tall_grid_minor_dim"}
    monkeypatch.setattr(_backend, "tuned", lambda section, heuristic: without if section == "fp8_sm90"
                        else tuned(section, heuristic))
    assert kernel_sm90.config_for(m, n, 4096, num_sms=num_sms) == dataclasses.replace(config, grid_minor_dim="n")


@pytest.fixture
def h200_table(monkeypatch):
    """"fp8_sm90" as the H200's tuning table gives it, on any machine (on a CPU `tuned` gives the heuristic)."""
    tuned, table = _backend.tuned, _backend.tuning_table("NVIDIA H200")["fp8_sm90"]
    monkeypatch.setattr(_backend, "tuned", lambda section, heuristic: {**heuristic, **table}
                        if section == "fp8_sm90" else tuned(section, heuristic))


@pytest.mark.parametrize("m,k,n,schedule,steps", [
    (16384, 2048, 5504, "pingpong", 6),  # the example's tall GEMMs: K at most max_k
    (16384, 2048, 2048, "pingpong", 6),
    (16384, 4096, 11008, "pingpong", 6),
    (16384, 8192, 4096, "pingpong", 6),  # K longer than max_k, M at least long_k_min_m
    (16384, 16384, 16384, "pingpong", 6),
    (8192, 8192, 8192, "cooperative", 4),  # K longer than max_k, M under long_k_min_m
    (2048, 16384, 5504, "cooperative", 4),  # wide
    (1024, 2048, 1024, "cooperative", 4),  # few tiles: the small tile
])
def test_sm90_tall_pingpong_rule(h200_table, monkeypatch, m, k, n, schedule, steps):
    """The H200 table's "tall_pingpong" tile runs tall GEMMs (M >= N) with K at most its max_k, or M at least its
    long_k_min_m, on the ping-pong schedule, walking the grid as the large tile would; the others, and every GEMM of
    a table without the entry, keep the cooperative tiles."""
    from pallas_fused.fp8 import kernel_sm90

    config = kernel_sm90.config_for(m, n, k, num_sms=132)
    assert (config.schedule, config.max_concurrent_steps) == (schedule, steps)
    assert kernel_sm90.supported(m, n, k, E4, E4, config)
    if schedule == "pingpong":
        assert (config.tile_m, config.tile_n, config.tile_k, config.cluster) == (128, 128, 128, None)
        assert config.grid_minor_dim == "m"
    table = _backend.tuned("fp8_sm90", kernel_sm90.HEURISTIC)
    without = {key: v for key, v in table.items() if key != "tall_pingpong"}
    monkeypatch.setattr(_backend, "tuned", lambda section, heuristic: without)
    assert kernel_sm90.config_for(m, n, k, num_sms=132).schedule == "cooperative"


@pytest.mark.parametrize("table", ["heuristic", "h200"])
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("m,k,n", [(16384, 2048, 5504), (16384, 4096, 11008), (8192, 8192, 8192), (4096, 512, 4096),
                                   (2048, 16384, 512)])
def test_sm90_config_fits_shared_memory(request, table, out_dtype, m, k, n):
    """Every tile `kernel_sm90.config_for` gives fits one CTA's shared memory with its result's epilogue staging, so
    "pallas:sm90" takes every out_dtype it accepts (a float32 result, as the sharded weight gradient's partial sums
    are, stages twice a bf16 one's bytes: a shallower ring); a 16-bit result keeps the tuned depth."""
    from pallas_fused import _sm90
    from pallas_fused.fp8 import kernel_sm90

    if table == "h200":
        request.getfixturevalue("h200_table")
    config = kernel_sm90.config_for(m, n, k, num_sms=132, out_dtype=out_dtype)
    assert _sm90.smem_bytes(config, 1, 1, jnp.dtype(out_dtype).itemsize) <= _sm90.SMEM_LIMIT
    if jnp.dtype(out_dtype).itemsize == 2:
        assert config == kernel_sm90.config_for(m, n, k, num_sms=132)
    cm, cn = config.cluster_tile
    a = jax.ShapeDtypeStruct((-(-m // cm) * cm, k), E4)
    bt = jax.ShapeDtypeStruct((-(-n // cn) * cn, k), E4)
    out = jax.eval_shape(functools.partial(kernel_sm90.scaled_matmul_nt, out_dtype=out_dtype, config=config), a, bt,
                         jax.ShapeDtypeStruct(a.shape[:1], jnp.float32),
                         jax.ShapeDtypeStruct(bt.shape[:1], jnp.float32))
    assert out.shape == (a.shape[0], bt.shape[0]) and out.dtype == out_dtype


@pytest.mark.gpu
@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("cluster", ["m", "n"])
def test_gpu_scaled_matmul_nt_cluster(granularity, cluster):
    """The Hopper kernel with a 2-CTA cluster (the shared operand tile multicast) against the reference, at a
    multiple of the cluster tile with several cluster tiles per cluster."""
    from pallas_fused.fp8 import kernel_sm90

    if not _backend.is_hopper():
        pytest.skip("needs Hopper")
    config = dataclasses.replace(kernel_sm90.tiles()[0], cluster=cluster)
    m, k, n = 4096, 1024, 6144
    axis = None if granularity == "tensorwise" else -1
    a8, sa = quantize(rand(37, (m, k), jnp.bfloat16), E4, axis)
    bt8, sb = quantize(rand(38, (n, k), jnp.bfloat16), E4, axis)
    sa_v, sb_v = (jnp.broadcast_to(s.reshape(-1), (rows,)) for s, rows in ((sa, m), (sb, n)))
    out = kernel_sm90.scaled_matmul_nt(a8, bt8, sa_v, sb_v, out_dtype=jnp.bfloat16, config=config)
    want = scaled_matmul_nt(a8, bt8, sa, sb, implementation="xla")
    assert sqnr(out, want) >= 40


@pytest.mark.gpu
@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("stages, out_dtype, cluster", [(4, jnp.bfloat16, None), (6, jnp.bfloat16, None),
                                                     (4, jnp.float32, None), (6, jnp.bfloat16, "m"),
                                                     (4, jnp.bfloat16, "n")])
def test_gpu_scaled_matmul_nt_pingpong(granularity, stages, out_dtype, cluster):
    """The Hopper kernel on the ping-pong schedule (each compute warpgroup owning whole tiles, one's epilogue beside
    the other's main loop) against the reference: 16 K steps per tile through the ring, ~10 tiles per CTA, the
    scales as vectors (rowwise) or (1,) scalars (tensorwise), as the benchmark's pallas:sm90_pingpong rows run it;
    and on 2-CTA clusters, the shared tile multicast (which interpret mode does not model)."""
    from pallas_fused import _sm90
    from pallas_fused.fp8 import kernel_sm90

    if not _backend.is_hopper():
        pytest.skip("needs Hopper")
    config = _sm90.TileConfig(max_concurrent_steps=stages, schedule="pingpong", grid_minor_dim="m", cluster=cluster)
    m, k, n = 4096, 2048, 5376 if cluster == "n" else 5504  # a multiple of the cluster tile
    axis = None if granularity == "tensorwise" else -1
    a8, sa = quantize(rand(41, (m, k), jnp.bfloat16), E4, axis)
    bt8, sb = quantize(rand(42, (n, k), jnp.bfloat16), E4, axis)
    out = kernel_sm90.scaled_matmul_nt(a8, bt8, sa.reshape(-1), sb.reshape(-1), out_dtype=out_dtype, config=config)
    want = scaled_matmul_nt(a8, bt8, sa, sb, implementation="xla", out_dtype=out_dtype)
    assert out.dtype == out_dtype and sqnr(out, want) >= 40


@pytest.mark.gpu
def test_gpu_scaled_matmul_nt_cluster_user_path(cluster_table):
    """The user's call picks the tuned cluster tile (CLUSTER_TABLE) and matches XLA."""
    from pallas_fused.fp8 import kernel_sm90

    if not _backend.is_hopper():
        pytest.skip("needs Hopper")
    m, k, n = 4096, 768, 8192  # wide: a tall GEMM would take the tuned ping-pong tile, which has no cluster
    assert kernel_sm90.config_for(m, n, k).cluster == "m"
    a8, sa = quantize(rand(39, (m, k), jnp.bfloat16), E4, -1)
    bt8, sb = quantize(rand(40, (n, k), jnp.bfloat16), E4, -1)
    out = jax.jit(scaled_matmul_nt)(a8, bt8, sa, sb)
    assert sqnr(out, scaled_matmul_nt(a8, bt8, sa, sb, implementation="xla")) >= 40


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES)
def test_gpu_dense_matches_xla(recipe):
    skip_blockwise_kernel("pallas", recipe)
    x, w, dy = rand(32, (2048, 1024), jnp.bfloat16), rand(33, (1024, 768), jnp.bfloat16), rand(34, (2048, 768),
                                                                                              jnp.bfloat16)
    outs = [jax.vjp(functools.partial(fp8_linear, config=recipe, implementation=i), x, w) for i in ("xla", "pallas")]
    (y0, v0), (y1, v1) = outs
    for a, b in zip((y0, *v0(dy)), (y1, *v1(dy))):
        assert sqnr(b, a) >= 35


@pytest.mark.gpu
@pytest.mark.parametrize("axis", [None, 0, 1])
def test_gpu_quantize_matches_reference(axis):
    from pallas_fused.fp8 import kernel

    x = rand(35, (4099, 2050), jnp.bfloat16, scale=3.0)
    q, qt, s = kernel.quantize_2d(x, dtype=E4, axis=axis, power_of_2=True, emit_n=True, emit_t=True)
    qr, sr = ref.quantize_reference(x, E4, axis, True)
    np.testing.assert_array_equal(np.asarray(s), np.asarray(sr))
    assert np.mean(np.asarray(q != qr)) <= 1e-3 and np.mean(np.asarray(qt != qr.T)) <= 1e-3
