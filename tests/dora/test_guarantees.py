"""DoRA guarantees: pretrained weights load the way users load them (linen and NNX), merge cannot silently use
another scale, a zero column never makes NaN, and empty batches work forward and backward."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallas_fused.dora import dora_dense, dora_dense_dropout, dora_dense_reference
from pallas_fused.dora.flax import DoRADense, DoRALinear, dense_to_dora_params, merge
from tests.helpers import assert_all_written, rand

NAMES = ("x", "lora_a", "lora_b", "magnitude", "bias")


# ------------------------------------------------------------------------------------------- pretrained weights


def test_linen_dense_params_without_adapters_say_how_to_convert():
    x = rand(0, (3, 16))
    dense_params = nn.Dense(8).init(jax.random.key(0), x)["params"]
    layer = DoRADense(8, rank=4, alpha=8.0)
    with pytest.raises(ValueError, match=r"dense_to_dora_params\(dense_params, 4, key=key, alpha=8.0\)"):
        layer.apply({"params": dense_params}, x)
    params = dense_to_dora_params(dense_params, 4, key=jax.random.key(1), alpha=8.0)
    np.testing.assert_allclose(layer.apply({"params": params}, x), nn.Dense(8).apply({"params": dense_params}, x),
                               rtol=1e-6, atol=1e-6)


def test_merge_needs_the_layers_scale():
    """merge without alpha raises; merge_params uses the layer's own alpha / rsLoRA, so the round trip is exact."""
    x = rand(1, (5, 16))
    layer = DoRADense(12, rank=4, alpha=32.0, use_rslora=True, lora_b_init=nn.initializers.normal(0.3))
    params = layer.init(jax.random.key(0), x)["params"]
    params = dict(params, magnitude=params["magnitude"] * 1.3)
    with pytest.raises(ValueError, match="alpha"):
        merge(params)
    y = layer.apply({"params": params}, x)
    for merged in (layer.merge_params(params), merge(params, alpha=32.0, use_rslora=True)):
        np.testing.assert_allclose(nn.Dense(12).apply({"params": merged}, x), y, rtol=2e-5, atol=2e-5)
    wrong = merge(params, alpha=None)
    assert not np.allclose(nn.Dense(12).apply({"params": wrong}, x), y, atol=1e-3)  # why alpha has no default
    with pytest.raises(ValueError, match="rank"):
        DoRADense(12, rank=2).merge_params(params)


def test_nnx_from_linear_to_linear_round_trip():
    linear = nnx.Linear(16, 12, rngs=nnx.Rngs(0), bias_init=nnx.initializers.normal(0.1))
    x = rand(2, (7, 16))
    dora = DoRALinear.from_linear(linear, rank=4, alpha=8.0, rngs=nnx.Rngs(1))
    assert dora.scale == 2.0 and dora.rank == 4
    np.testing.assert_allclose(dora(x), linear(x), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dora.magnitude[...], jnp.linalg.norm(linear.kernel[...], axis=0), rtol=1e-6)
    # trained adapters merge back into a plain nnx.Linear with the same outputs
    dora.lora_b = nnx.LoRAParam(rand(3, (4, 12), scale=0.3))
    dora.magnitude = nnx.LoRAParam(dora.magnitude[...] * 1.2)
    merged = dora.to_linear()
    assert type(merged) is nnx.Linear
    np.testing.assert_allclose(merged(x), dora(x), rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="linear"):
        DoRALinear.from_linear(dora.lora_a, rank=4, rngs=nnx.Rngs(0))


def test_nnx_update_then_reset_magnitude():
    """nnx.update with a Linear's state replaces the kernel; reset_magnitude makes the layer equal the Linear."""
    linear = nnx.Linear(16, 12, rngs=nnx.Rngs(0))
    dora = DoRALinear(16, 12, rank=4, rngs=nnx.Rngs(5))
    x = rand(4, (6, 16))
    nnx.update(dora, nnx.state(linear))
    assert not np.allclose(dora(x), linear(x), atol=1e-2)  # the stale magnitude the docstring warns of
    dora.reset_magnitude()
    np.testing.assert_allclose(dora(x), linear(x), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------- zero column


def _zero_column_case(seed, dtype=jnp.float32):
    x = rand(seed, (9, 24), dtype)
    w = rand(seed + 1, (24, 20), dtype, scale=0.2).at[:, 3].set(0.0).at[:, 11].set(0.0)
    a = rand(seed + 2, (24, 4), scale=0.2)
    b = jnp.zeros((4, 20))
    m = jnp.linalg.norm(w.astype(jnp.float32), axis=0)  # the initial magnitude: 0 at the zero columns
    bias = rand(seed + 3, (20,), scale=0.1)
    dy = rand(seed + 4, (9, 20), dtype)
    return x, w, a, b, m, bias, dy


def _variant(kernel_impl, variant):
    return kernel_impl + (f":{variant}" if variant else "")


@pytest.mark.parametrize("variant", ["", "gemm", "epilogue", "merged"])
@pytest.mark.parametrize("exact", [False, True])
def test_zero_column_with_zero_b_is_finite(kernel_impl, variant, exact):
    """A zero column of W with B = 0 (so magnitude 0): the output column is the bias and every gradient is finite,
    equal to the reference's (peft gives NaN here)."""
    x, w, a, b, m, bias, dy = _zero_column_case(10)
    outs = {}
    kernel_impl = _variant(kernel_impl, variant)
    for impl in ("xla", kernel_impl):
        fn = lambda *p, impl=impl: dora_dense(p[0], w, *p[1:], scale=2.0, exact_norm_grad=exact,  # noqa: E731
                                              implementation=impl)
        y, pull = jax.vjp(fn, x, a, b, m, bias)
        outs[impl] = (y, pull(dy))
        assert_all_written(y, f"{impl} y")
        np.testing.assert_allclose(y[:, 3], jnp.broadcast_to(bias[3], (9,)), rtol=1e-6)
        for name, g in zip(NAMES, outs[impl][1]):
            assert_all_written(g, f"{impl} d{name}")
    for name, g, r in zip(("y",) + NAMES, (outs[kernel_impl][0], *outs[kernel_impl][1]),
                          (outs["xla"][0], *outs["xla"][1])):
        np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-5, err_msg=name)


@pytest.mark.parametrize("variant", ["", "gemm", "merged"])
def test_zero_magnitude_with_nonzero_column_keeps_its_gradient(kernel_impl, variant):
    """m = 0 on a column whose W is not zero: y - bias is 0 there, so dm = sum dy z / n cannot come from y; it is
    recomputed, matching the reference instead of 0 / 0."""
    x, w, a, b, m, bias, dy = _zero_column_case(20)
    b = rand(25, (4, 20), scale=0.3)
    m = m.at[5].set(0.0)
    ref = jax.vjp(lambda m: dora_dense_reference(x, w, a, b, m, bias, scale=2.0), m)[1](dy)[0]
    for impl in ("xla", _variant(kernel_impl, variant)):
        got = jax.vjp(lambda m, impl=impl: dora_dense(x, w, a, b, m, bias, scale=2.0, implementation=impl), m)[1](dy)[0]
        assert_all_written(got, impl)
        assert abs(float(got[5])) > 1e-3
        np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-5, err_msg=impl)


# ------------------------------------------------------------------------------------------- empty batches


@pytest.mark.parametrize("lead", [(0,), (3, 0)], ids=["0", "3x0"])
def test_empty_batch_forward_and_backward(kernel_impl, lead):
    x = jnp.zeros((*lead, 16), jnp.bfloat16)
    w = rand(30, (16, 12), jnp.bfloat16)
    a, b, m, bias = rand(31, (16, 4)), rand(32, (4, 12)), jnp.ones((12,)), jnp.zeros((12,))
    for impl in (None, "xla", kernel_impl):
        for fn in (lambda x, *p, impl=impl: dora_dense(x, w, *p, scale=1.0, implementation=impl),
                   lambda x, *p, impl=impl: dora_dense_dropout(x, x, w, *p, scale=1.0, implementation=impl)):
            y, pull = jax.vjp(fn, x, a, b, m, bias)
            assert y.shape == (*lead, 12) and y.dtype == jnp.bfloat16
            grads = pull(jnp.ones_like(y))
            for name, g, p in zip(NAMES, grads, (x, a, b, m, bias)):
                assert g.shape == p.shape and not np.any(np.asarray(g, np.float32)), name


def test_flax_empty_batch_like_nn_dense(kernel_impl):
    x = jnp.zeros((2, 0, 16))
    layer = DoRADense(12, rank=4, implementation=kernel_impl)
    params = layer.init(jax.random.key(0), x)
    assert layer.apply(params, x).shape == (2, 0, 12)
    grads = jax.grad(lambda p: jnp.sum(layer.apply(p, x)))(params)
    assert all(not np.any(np.asarray(g)) for g in jax.tree.leaves(grads))
    model = DoRALinear(16, 12, rank=4, implementation=kernel_impl, rngs=nnx.Rngs(0))
    assert model(x).shape == (2, 0, 12)


# ------------------------------------------------------------------------------------------- precision contract


def _dora64(x, w, a, b, m, bias, dy, s):
    """float64 numpy forward and gradients (x, A, B, m, bias) of DoRA with the norm constant in the backward."""
    x, w, a, b, m, bias, dy = (np.asarray(v, np.float64) for v in (x, w, a, b, m, bias, dy))
    v = w + s * a @ b
    n = np.sqrt(np.sum(v * v, axis=0))
    g = m / n
    z = x @ v
    dyg = dy * g
    return z * g + bias, (dyg @ v.T, s * x.T @ (dyg @ b.T), s * (x @ a).T @ dyg, np.sum(dy * z, axis=0) / n,
                          np.sum(dy, axis=0))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["", "gemm", "epilogue", "merged"])
def test_gpu_fp32_highest_precision_matches_float64(variant):
    """fp32 DoRA on the GPU runs its matmuls at TF32 by default; under jax.default_matmul_precision("highest")
    every GEMM (Pallas and cuBLAS) is full fp32: forward and every gradient within 1e-5 relative of float64."""
    from tests.helpers import rel_err

    x = rand(40, (512, 384))
    w = rand(41, (384, 320), scale=384 ** -0.5)
    a, b = rand(42, (384, 16), scale=384 ** -0.5), rand(43, (16, 320), scale=0.3)
    m, bias, dy = jnp.abs(rand(44, (320,))) + 0.5, rand(45, (320,), scale=0.1), rand(46, (512, 320))
    y64, grads64 = _dora64(x, w, a, b, m, bias, dy, 0.5)
    impl = _variant("pallas", variant)
    with jax.default_matmul_precision("highest"):
        fn = jax.jit(lambda *p: jax.vjp(lambda *q: dora_dense(q[0], w, *q[1:], scale=0.5, implementation=impl),
                                        *p)[1](dy))
        y = jax.jit(lambda *p: dora_dense(p[0], w, *p[1:], scale=0.5, implementation=impl))(x, a, b, m, bias)
        grads = fn(x, a, b, m, bias)
    assert rel_err(y, y64) < 1e-5, ("y", rel_err(y, y64))
    for name, g, r in zip(NAMES, grads, grads64):
        assert rel_err(g, r) < 1e-5, (name, rel_err(g, r))
