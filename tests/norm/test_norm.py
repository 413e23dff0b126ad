"""rms_norm: the fused kernels (interpret mode here) against float64 and the reference, the reference against
flax bit for bit, bad input, empty input, and the linen / NNX drop-ins."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallas_fused.norm import NNXRMSNorm, RMSNorm, reference_rms_norm, rms_norm
from pallas_fused.norm import kernel as norm_kernel
from tests.helpers import assert_close, rand, to64

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _exact(x, scale, dy, eps=1e-6):
    """float64 forward and the analytic gradients (dx, dscale)."""
    x, dy = to64(x), to64(dy)
    s = np.ones(x.shape[-1]) if scale is None else to64(scale)
    r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    xhat = x * r
    g = dy * s
    dx = r * (g - xhat * np.mean(g * xhat, axis=-1, keepdims=True))
    dscale = np.sum((dy * xhat).reshape(-1, x.shape[-1]), axis=0)
    return xhat * s, dx, dscale


def _run(impl, x, scale, dy, dtype):
    def f(x, s):
        return rms_norm(x, s, dtype=dtype, implementation=impl)

    if scale is None:
        y, vjp = jax.vjp(lambda x: f(x, None), x)
        return y, vjp(dy)[0], None
    y, vjp = jax.vjp(f, x, scale)
    return (y, *vjp(dy))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", [(3, 37, 50), (129, 16), (5, 300), (2, 3)], ids=str)
def test_matches_exact_and_reference(kernel_impl, dtype, shape):
    x = rand(0, shape, dtype, scale=3.0, offset=0.5)
    scale = rand(1, shape[-1:], jnp.float32, scale=0.2, offset=1.0)
    dy = rand(2, shape, dtype)
    y, dx, dscale = _run(kernel_impl, x, scale, dy, dtype)
    y_ref, dx_ref, dscale_ref = _run("xla", x, scale, dy, dtype)
    assert y.dtype == y_ref.dtype == jnp.dtype(dtype) and dx.dtype == x.dtype and dscale.dtype == jnp.float32
    exact_y, exact_dx, exact_ds = _exact(x, scale, dy)
    assert_close(y, exact_y, baseline=y_ref, what="y")
    assert_close(dx, exact_dx, baseline=dx_ref, what="dx")
    assert_close(dscale, exact_ds, baseline=dscale_ref, dtype=jnp.float32, floor=1e-5, what="dscale")


@pytest.mark.parametrize("config", [norm_kernel.LaunchConfig(4, 2, programs=3), norm_kernel.LaunchConfig(1, 1, 7)])
def test_backward_geometries(kernel_impl, config):
    """Programs that walk several row blocks, blocks past the last row, programs with no rows at all."""
    x, scale, dy = rand(0, (13, 40)), rand(1, (40,), offset=1.0), rand(2, (13, 40))
    rstd = jax.lax.rsqrt(jnp.mean(x * x, axis=-1) + 1e-6)
    dx, dscale = norm_kernel.rms_norm_bwd_pallas(dy, x, rstd, scale, interpret=True, config=config)
    _, exact_dx, exact_ds = _exact(x, scale, dy)
    np.testing.assert_allclose(np.asarray(dx), exact_dx, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(dscale), exact_ds, rtol=2e-5, atol=2e-5)
    y, r = norm_kernel.rms_norm_fwd_pallas(x, scale, eps=1e-6, out_dtype=jnp.float32, interpret=True, config=config)
    np.testing.assert_allclose(np.asarray(r), np.asarray(rstd), rtol=1e-6)


def test_no_scale_and_dtype_rules(kernel_impl):
    x, dy = rand(0, (6, 24), jnp.bfloat16), rand(1, (6, 24), jnp.bfloat16)
    y, dx, _ = _run(kernel_impl, x, None, dy, None)
    y_ref, dx_ref, _ = _run("xla", x, None, dy, None)
    exact_y, exact_dx, _ = _exact(x, None, dy)
    assert y.dtype == jnp.bfloat16
    assert_close(y, exact_y, baseline=y_ref, what="y")
    assert_close(dx, exact_dx, baseline=dx_ref, what="dx")
    # dtype None with a float32 scale: the result is float32, as nn.RMSNorm's.
    out = rms_norm(x, jnp.ones((24,)), implementation=kernel_impl)
    assert out.dtype == jnp.float32


def test_empty_and_wide_rows(kernel_impl):
    x = jnp.zeros((0, 7, 33), jnp.bfloat16)
    y, dx, dscale = _run(kernel_impl, x, jnp.ones((33,)), x, jnp.bfloat16)
    assert y.shape == dx.shape == x.shape and dscale.shape == (33,) and not np.any(np.asarray(dscale))
    wide = norm_kernel.MAX_FEATURES + 1  # past one register tile: the reference, under every implementation
    f = jax.jit(lambda x: rms_norm(x, jnp.ones((wide,)), implementation=kernel_impl))
    assert "pallas_call" not in str(jax.make_jaxpr(f)(jnp.ones((2, wide))))


def test_jit_vmap_remat(kernel_impl):
    x, scale, dy = rand(0, (4, 3, 20), jnp.bfloat16), rand(1, (20,), offset=1.0), rand(2, (4, 3, 20), jnp.bfloat16)

    def loss(x, s, impl):
        y = jax.vmap(jax.checkpoint(lambda r: rms_norm(r, s, dtype=jnp.bfloat16, implementation=impl)))(x)
        return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))

    g = jax.jit(jax.grad(lambda x, s: loss(x, s, kernel_impl), argnums=(0, 1)))(x, scale)
    g_ref = jax.grad(lambda x, s: loss(x, s, "xla"), argnums=(0, 1))(x, scale)
    _, exact_dx, exact_ds = _exact(x, scale, dy)
    assert_close(g[0], exact_dx, baseline=g_ref[0], what="dx")
    assert_close(g[1], exact_ds, baseline=g_ref[1], dtype=jnp.float32, floor=1e-5, what="dscale")


def test_reference_is_flax_to_the_bit():
    x = rand(0, (5, 48), jnp.bfloat16, scale=2.0)
    scale = rand(1, (48,), offset=1.0)
    for dtype in (None, jnp.bfloat16, jnp.float32):
        layer = nn.RMSNorm(dtype=dtype)
        y = layer.apply({"params": {"scale": scale}}, x)
        ref = reference_rms_norm(x, scale, 1e-6, dtype)
        assert y.dtype == ref.dtype
        np.testing.assert_array_equal(np.asarray(y.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32)))
    no_scale = nn.RMSNorm(use_scale=False, epsilon=1e-3).apply({}, x)
    np.testing.assert_array_equal(np.asarray(no_scale.astype(jnp.float32)),
                                  np.asarray(reference_rms_norm(x, None, 1e-3).astype(jnp.float32)))


@pytest.mark.parametrize("bad,match", [
    (dict(x=jnp.ones((2, 3), jnp.int32)), "x: expected a floating"),
    (dict(x=jnp.float32(1.0)), "x: expected at least 1 dimension"),
    (dict(scale=jnp.ones((4,))), r"scale: expected shape \(3,\)"),
    (dict(scale=jnp.ones((3,), jnp.int32)), "scale: expected None or a floating"),
    (dict(epsilon=-1.0), "epsilon: expected a Python number"),
    (dict(dtype=jnp.int32), "dtype: expected None or a floating"),
])
def test_bad_input_names_the_argument(bad, match):
    args = dict(x=jnp.ones((2, 3)), scale=jnp.ones((3,)), implementation="interpret")
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        rms_norm(args.pop("x"), args.pop("scale"), **args)


def test_linen_drop_in_is_nn_rmsnorm(kernel_impl):
    x = rand(0, (2, 9, 40), jnp.bfloat16)
    ours = RMSNorm(dtype=jnp.bfloat16, implementation=kernel_impl)
    theirs = nn.RMSNorm(dtype=jnp.bfloat16)
    params = ours.init(jax.random.key(0), x)
    assert jax.tree.map(jnp.shape, params) == jax.tree.map(jnp.shape, theirs.init(jax.random.key(0), x))
    params = {"params": {"scale": rand(1, (40,), offset=1.0)}}
    dy = rand(2, x.shape, jnp.bfloat16)
    y, vjp = jax.vjp(lambda p, x: ours.apply(p, x), params, x)
    y_flax, vjp_flax = jax.vjp(lambda p, x: theirs.apply(p, x), params, x)
    (gp, gx), (gp_flax, gx_flax) = vjp(dy), vjp_flax(dy)
    exact_y, exact_dx, exact_ds = _exact(x, params["params"]["scale"], dy)
    assert_close(y, exact_y, baseline=y_flax, what="y")
    assert_close(gx, exact_dx, baseline=gx_flax, what="dx")
    assert_close(gp["params"]["scale"], exact_ds, baseline=gp_flax["params"]["scale"], dtype=jnp.float32, floor=1e-5)
    base = RMSNorm(dtype=jnp.bfloat16, implementation="xla")  # flax's own __call__: the same bits
    np.testing.assert_array_equal(np.asarray(base.apply(params, x).astype(jnp.float32)),
                                  np.asarray(y_flax.astype(jnp.float32)))
    no_scale = RMSNorm(use_scale=False, implementation=kernel_impl)
    assert no_scale.init(jax.random.key(0), x) == {}


def test_nnx_drop_in_is_nnx_rmsnorm(kernel_impl):
    x = rand(0, (3, 5, 24), jnp.bfloat16)
    ours = NNXRMSNorm(24, dtype=jnp.bfloat16, implementation=kernel_impl, rngs=nnx.Rngs(0))
    theirs = nnx.RMSNorm(24, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    scale = rand(1, (24,), offset=1.0)
    ours.scale[...] = scale
    theirs.scale[...] = scale
    assert jax.tree.map(jnp.shape, nnx.state(ours, nnx.Param)) == jax.tree.map(jnp.shape, nnx.state(theirs, nnx.Param))
    dy = rand(2, x.shape, jnp.bfloat16)

    def run(model):
        def loss(m, x):
            return jnp.sum(m(x).astype(jnp.float32) * dy.astype(jnp.float32))

        return model(x), nnx.grad(loss, argnums=(0, 1))(model, x)

    (y, (gm, gx)), (y_ref, (gm_ref, gx_ref)) = run(ours), run(theirs)
    scale16 = scale.astype(jnp.bfloat16)  # nnx.RMSNorm casts the scale to dtype first
    exact_y, exact_dx, exact_ds = _exact(x, scale16, dy)
    assert_close(y, exact_y, baseline=y_ref, what="y")
    assert_close(gx, exact_dx, baseline=gx_ref, what="dx")
    assert_close(gm.scale[...], exact_ds, baseline=gm_ref.scale[...], dtype=jnp.bfloat16, what="dscale")
