"""Plain LoRA (dora.lora_dense): the fused layer against the plain-jnp reference, forward and every gradient."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_fused import _backend
from pallas_fused.dora import lora_dense, lora_dense_reference
from tests.helpers import assert_close, rand

HAS_MOSAIC_INTERPRET = _backend.has_mosaic_interpret()


def _make(seed, lead, fin, fout, r, dtype):
    x = rand(seed, (*lead, fin), dtype)
    w = rand(seed + 1, (fin, fout), dtype, scale=fin ** -0.5)
    a = rand(seed + 2, (fin, r), scale=fin ** -0.5)
    b = rand(seed + 3, (r, fout), scale=0.3)
    bias = rand(seed + 4, (fout,), scale=0.1)
    dy = rand(seed + 5, (*lead, fout), dtype)
    return x, w, a, b, bias, dy


def _check(impl, lead, fin, fout, r, dtype, with_bias, scale=0.75):
    x, w, a, b, bias, dy = _make(40, lead, fin, fout, r, dtype)
    bias = bias if with_bias else None

    def grads(fn, x, a, b, bias, dy):
        def run(x, a, b, bias, dy):
            y, pull = jax.vjp(lambda x, a, b, bias: fn(x, w, a, b, bias, scale=scale), x, a, b, bias)
            return y, pull(dy)
        return jax.jit(run)(x, a, b, bias, dy)

    ours = lambda *args, **kw: lora_dense(*args, **kw, implementation=impl)  # noqa: E731
    base = lambda *args, **kw: lora_dense(*args, **kw, implementation="xla")  # noqa: E731
    y, g = grads(ours, x, a, b, bias, dy)
    yb, gb = grads(base, x, a, b, bias, dy)
    f32 = lambda v: None if v is None else v.astype(jnp.float32)  # noqa: E731
    with jax.default_matmul_precision("highest"):
        ye, ge = grads(lora_dense_reference, f32(x), a, b, f32(bias), f32(dy))
    assert y.dtype == dtype and y.shape == (*lead, fout)
    assert_close(y, ye, baseline=yb, dtype=dtype, what=f"{impl} y")
    for name, ours_g, base_g, ex in zip(("x", "lora_a", "lora_b", "bias"), g, gb, ge):
        if ours_g is None:
            assert not with_bias and name == "bias"
            continue
        assert ours_g.dtype == base_g.dtype, name
        assert_close(ours_g, ex, baseline=base_g, dtype=dtype, what=f"{impl} d{name}")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=lambda d: d.__name__)
def test_xla_fallback_odd_shapes(dtype):
    """Shapes no sm90 tile fits (and float32): "interpret" runs XLA's dots under the custom_vjp."""
    _check("interpret", (3, 7), 45, 29, 5, dtype, with_bias=True)


@pytest.mark.skipif(not HAS_MOSAIC_INTERPRET, reason="Mosaic GPU interpret mode needs jax >= 0.12")
@pytest.mark.parametrize("r, with_bias", [(5, True), (40, False)])
def test_sm90_interpret(r, with_bias):
    """The sm90 kernels with the low-rank step both ways (forward x W + (x A)(s B) + bias, dx = dy W^T +
    (dy (s B)^T) A^T), interpreted; odd ranks padded to 16 / 64."""
    _check("interpret", (128,), 256, 256, r, jnp.bfloat16, with_bias)


def test_empty_and_bad_input():
    x, w, a, b, bias, _ = _make(50, (0,), 16, 8, 2, jnp.float32)
    assert lora_dense(x, w, a, b, bias, scale=1.0, implementation="interpret").shape == (0, 8)
    x = jnp.ones((2, 16))
    with pytest.raises(ValueError, match="lora_dense: lora_b must have shape"):
        lora_dense(x, w, a, b.T, scale=1.0)
    with pytest.raises(ValueError, match="lora_dense: kernel must be a 2-D float"):
        lora_dense(x, w[0], a, b, scale=1.0)
    with pytest.raises(ValueError, match="lora_dense: bias must have shape"):
        lora_dense(x, w, a, b, jnp.ones(3), scale=1.0)
    with pytest.raises(ValueError, match="lora_dense: x has 15 input features but kernel expects 16"):
        lora_dense(jnp.ones((2, 15)), w, a, b, scale=1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 4096, 4096, 16), (4096, 4096, 11008, 64)], ids=str)
def test_gpu_sm90(shape):
    """The compiled sm90 kernels at the benchmark's shapes, bf16, against the reference."""
    if not _backend.is_hopper():
        pytest.skip("the sm90 kernels need a Hopper GPU")
    tokens, fin, fout, r = shape
    _check("pallas", (tokens,), fin, fout, r, jnp.bfloat16, with_bias=True)


def test_linen_lora_dense():
    """The linen drop-in: nn.Dense params plus the adapters; with B = 0 it equals the Dense, and it trains A, B."""
    import flax.linen as nn

    from pallas_fused.dora import LoRADense

    x = rand(60, (3, 5, 24), jnp.float32)
    layer = LoRADense(16, rank=4, alpha=8.0, implementation="interpret")
    params = layer.init(jax.random.key(0), x)["params"]
    assert set(params) == {"kernel", "bias", "lora_a", "lora_b"}
    dense = nn.Dense(16).apply({"params": {"kernel": params["kernel"], "bias": params["bias"]}}, x)
    np.testing.assert_allclose(layer.apply({"params": params}, x), dense, rtol=1e-6, atol=1e-6)
    params = {**params, "lora_b": rand(61, (4, 16), scale=0.1)}
    want = lora_dense_reference(x, params["kernel"], params["lora_a"], params["lora_b"], params["bias"], scale=2.0)
    np.testing.assert_allclose(layer.apply({"params": params}, x), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="LoRADense: rank"):
        LoRADense(16, rank=0).init(jax.random.key(0), x)


def test_runs_sm90_rank_rule():
    """On Hopper, plain "pallas" runs the sm90 kernels up to DoRA's tuned rank and XLA's dots above it."""
    from pallas_fused.dora import kernel_sm90
    from pallas_fused.dora.lora import runs_sm90

    with _backend.gpu_target((9, 0)):
        assert kernel_sm90.max_rank() == 16
        assert runs_sm90(4096, 4096, 4096, jnp.bfloat16, 16, False)
        assert runs_sm90(4096, 4096, 4096, jnp.bfloat16, 5, False)  # padded to 16
        assert not runs_sm90(4096, 4096, 11008, jnp.bfloat16, 64, False)
        assert not runs_sm90(4096, 4096, 4096, jnp.float32, 16, False)  # 16-bit x only
    assert runs_sm90(4096, 4096, 11008, jnp.bfloat16, 64, True) == _backend.has_mosaic_interpret()
