"""swiglu: the fused kernels (interpret mode here) against float64 and the reference, odd and empty shapes, every
dtype, gradients, jit / vmap / remat, launch geometries and bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_fused.swiglu import kernel as swiglu_kernel
from pallas_fused.swiglu import swiglu, swiglu_reference
from pallas_fused.swiglu.api import swiglu_with_config
from tests.helpers import DTYPES, assert_all_written, assert_close, rand, to64


def _exact(gate, up, dout):
    """float64 out and the analytic gradients (d_gate, d_up)."""
    g, u, d = to64(gate), to64(up), to64(dout)
    sig = 1.0 / (1.0 + np.exp(-g))
    return g * sig * u, d * u * sig * (1.0 + g * (1.0 - sig)), d * g * sig


def _inputs(shape, dtype):
    # gate spread over [-8, 8]-ish so that both tails of the sigmoid are exercised; nothing is zero
    return rand(0, shape, dtype, scale=3.0, offset=0.1), rand(1, shape, dtype, offset=0.2), rand(2, shape, dtype)


def _run(impl, gate, up, dout, fn=None):
    fn = fn or (lambda g, u: swiglu(g, u, implementation=impl))
    out, vjp = jax.vjp(fn, gate, up)
    return (out, *vjp(dout))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", [(3, 77), (2, 5, 5504), (129, 16), (1, 1), (7,)], ids=str)
def test_matches_exact_and_reference(kernel_impl, dtype, shape):
    gate, up, dout = _inputs(shape, dtype)
    ours = _run(kernel_impl, gate, up, dout)
    ref = _run("xla", gate, up, dout)
    for name, o, r, e in zip(("out", "d_gate", "d_up"), ours, ref, _exact(gate, up, dout)):
        assert o.dtype == jnp.dtype(dtype) and o.shape == shape, (name, o.dtype, o.shape)
        assert_all_written(o, name)
        assert_close(o, e, baseline=r, what=f"{name} {shape}")


def test_reference_is_silu_times_up():
    gate, up, _ = _inputs((4, 33), jnp.float32)
    np.testing.assert_array_equal(np.asarray(swiglu_reference(gate, up)), np.asarray(jax.nn.silu(gate) * up))
    gate16, up16 = gate.astype(jnp.bfloat16), up.astype(jnp.bfloat16)
    want = (jax.nn.silu(gate16.astype(jnp.float32)) * up16.astype(jnp.float32)).astype(jnp.bfloat16)
    assert swiglu_reference(gate16, up16).dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(swiglu_reference(gate16, up16), np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("shape", [(0, 64), (4, 0), (2, 0, 7)], ids=str)
def test_empty(kernel_impl, shape):
    gate = up = dout = jnp.zeros(shape, jnp.bfloat16)
    out, dg, du = _run(kernel_impl, gate, up, dout)
    assert out.shape == dg.shape == du.shape == shape and out.dtype == dg.dtype == du.dtype == jnp.bfloat16
    out = jax.jit(lambda g, u: swiglu(g, u, implementation=kernel_impl))(gate, up)
    assert out.shape == shape


def test_kernel_launches_empty_shapes_directly():
    empty = jnp.zeros((0, 5), jnp.float16)
    assert swiglu_kernel.swiglu_fwd_pallas(empty, empty, interpret=True).shape == (0, 5)
    dg, du = swiglu_kernel.swiglu_bwd_pallas(empty, empty, empty, interpret=True)
    assert dg.shape == du.shape == (0, 5) and dg.dtype == jnp.float16


@pytest.mark.parametrize("config", [swiglu_kernel.LaunchConfig(2, 16, 1), swiglu_kernel.LaunchConfig(1, 64, 2),
                                    swiglu_kernel.LaunchConfig(16, 8, 4)], ids=str)
def test_launch_geometries(config):
    """Several column blocks with a partial last one, row blocks past the last row, tiles wider than the rows."""
    gate, up, dout = _inputs((13, 40), jnp.float32)
    fn = lambda g, u: swiglu_with_config(g, u, implementation="interpret", fwd_config=config,  # noqa: E731
                                         bwd_config=config)
    for name, o, e in zip(("out", "d_gate", "d_up"), _run(None, gate, up, dout, fn), _exact(gate, up, dout)):
        np.testing.assert_allclose(np.asarray(o), e, rtol=2e-6, atol=2e-6, err_msg=name)


@pytest.mark.parametrize("rows,cols", [(16384, 5504), (8192, 11008), (3, 77), (1, 1), (100, 2048), (5, 100000)])
def test_choose_config(rows, cols):
    for backward in (False, True):
        c = swiglu_kernel.choose_config(rows, cols, backward)
        launch = swiglu_kernel.HEURISTIC["bwd" if backward else "fwd"]
        for n in (c.block_rows, c.block_cols, c.num_warps):
            assert n >= 1 and n & (n - 1) == 0, c
        assert c.block_cols <= launch["max_block_cols"] and c.block_rows * c.block_cols <= launch["block_elements"]
        assert c.block_rows <= max(1, 1 << (rows - 1).bit_length()) and c.num_warps <= launch["num_warps"]


def test_choose_config_reads_the_tuning_table(monkeypatch):
    table = {"fwd": dict(block_elements=1024, max_block_cols=256, num_warps=2),
             "bwd": dict(block_elements=512, max_block_cols=128, num_warps=1)}
    seen = []

    def tuned(section, heuristic):
        seen.append((section, heuristic))
        return table

    monkeypatch.setattr(swiglu_kernel._backend, "tuned", tuned)
    assert swiglu_kernel.choose_config(1000, 5504, False) == swiglu_kernel.LaunchConfig(4, 256, 2)
    assert swiglu_kernel.choose_config(1000, 5504, True) == swiglu_kernel.LaunchConfig(4, 128, 1)
    assert seen[0] == ("swiglu", swiglu_kernel.HEURISTIC)


def test_one_kernel_each_way(kernel_impl):
    gate, up, dout = _inputs((6, 24), jnp.bfloat16)
    jaxpr = str(jax.make_jaxpr(lambda g, u: _run(kernel_impl, g, u, dout))(gate, up))
    assert jaxpr.count("name=pallas_fused_swiglu_fwd") == 1 and jaxpr.count("name=pallas_fused_swiglu_bwd") == 1
    assert "pallas_call" not in str(jax.make_jaxpr(lambda g, u: _run("xla", g, u, dout))(gate, up))


def test_jit_vmap_remat(kernel_impl):
    gate, up, dout = _inputs((4, 3, 20), jnp.bfloat16)

    def loss(g, u, impl):
        out = jax.vmap(jax.checkpoint(lambda a, b: swiglu(a, b, implementation=impl)))(g, u)
        return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))

    grads = jax.jit(jax.grad(lambda g, u: loss(g, u, kernel_impl), argnums=(0, 1)))(gate, up)
    grads_ref = jax.grad(lambda g, u: loss(g, u, "xla"), argnums=(0, 1))(gate, up)
    _, exact_dg, exact_du = _exact(gate, up, dout)
    assert_close(grads[0], exact_dg, baseline=grads_ref[0], what="d_gate")
    assert_close(grads[1], exact_du, baseline=grads_ref[1], what="d_up")


def test_scalar_and_numpy_inputs(kernel_impl):
    g, u = np.float32(1.5) * np.ones((), np.float32), np.full((), 2.0, np.float32)
    out = swiglu(g, u, implementation=kernel_impl)
    np.testing.assert_allclose(float(out), 1.5 / (1 + np.exp(-1.5)) * 2.0, rtol=1e-6)


@pytest.mark.parametrize("gate,up,match", [
    (jnp.ones((2, 3), jnp.int32), jnp.ones((2, 3), jnp.int32), "gate: expected a float32, bfloat16 or float16"),
    (jnp.ones((2, 3)), jnp.ones((2, 3), jnp.int32), "up: expected a float32, bfloat16 or float16"),
    ([1.0, 2.0], jnp.ones((2,)), "gate: expected an array"),
    (jnp.ones((2, 3)), jnp.ones((3, 2)), r"up: expected gate's shape \(2, 3\), got \(3, 2\)"),
    (jnp.ones((2, 3)), jnp.ones((2, 3), jnp.bfloat16), "up: expected gate's dtype float32, got bfloat16"),
])
def test_bad_input_names_the_argument(gate, up, match):
    for impl in ("interpret", "xla"):
        with pytest.raises(ValueError, match=match):
            swiglu(gate, up, implementation=impl)


def test_unknown_implementation():
    with pytest.raises(ValueError, match="swiglu: implementation must be None or one of"):
        swiglu(jnp.ones((2,)), jnp.ones((2,)), implementation="triton")
