"""GPU checks of the compiled SwiGLU kernels at the example's MLP shape (skipped without a CUDA GPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_fused.swiglu import swiglu, swiglu_reference
from tests.helpers import assert_all_written, assert_close, rand, to64

pytestmark = pytest.mark.gpu

# 16 x 1024 tokens, d_ff 5504 (the example's MLP), and a wider d_ff
SHAPES = [((16384, 5504), jnp.bfloat16), ((8192, 11008), jnp.bfloat16), ((4096, 5504), jnp.float32),
          ((1000, 77), jnp.float16)]


def _fns(impl):
    if impl == "exact":  # the reference in float32 on the device: ~1e-7, far below bf16's rounding
        fwd = lambda g, u: swiglu_reference(g.astype(jnp.float32), u.astype(jnp.float32))  # noqa: E731
    else:
        fwd = lambda g, u: swiglu(g, u, implementation=impl)  # noqa: E731

    def fwdbwd(g, u, dout):
        out, vjp = jax.vjp(fwd, g, u)
        return (out, *vjp(dout.astype(out.dtype)))

    return jax.jit(fwd), jax.jit(fwdbwd)


@pytest.mark.parametrize("shape,dtype", SHAPES, ids=str)
def test_forward_pallas_matches_xla(shape, dtype):
    gate, up = rand(0, shape, dtype, scale=3.0, offset=0.1), rand(1, shape, dtype, offset=0.2)
    ours, base, exact = (_fns(impl)[0](gate, up) for impl in ("pallas", "xla", "exact"))
    assert ours.dtype == base.dtype == jnp.dtype(dtype)
    assert_all_written(ours, "out")
    assert_close(ours, to64(exact), baseline=base, dtype=dtype, what=f"out {shape}")


@pytest.mark.parametrize("shape,dtype", SHAPES, ids=str)
def test_forward_backward_pallas_matches_xla(shape, dtype):
    gate, up = rand(0, shape, dtype, scale=3.0, offset=0.1), rand(1, shape, dtype, offset=0.2)
    dout = rand(2, shape, dtype)
    ours, base, exact = (_fns(impl)[1](gate, up, dout) for impl in ("pallas", "xla", "exact"))
    for name, o, b, e in zip(("out", "d_gate", "d_up"), ours, base, exact):
        assert o.dtype == jnp.dtype(dtype)
        assert_all_written(o, name)
        assert_close(o, to64(e), baseline=b, dtype=dtype, what=f"{name} {shape}")


def test_kernels_run_compiled():
    gate = rand(0, (64, 5504), jnp.bfloat16)
    text = jax.jit(jax.grad(lambda g: jnp.sum(swiglu(g, g, implementation="pallas").astype(jnp.float32)))).lower(
        gate).as_text()
    assert "pallas_fused_swiglu_bwd" in text
