"""GPU checks of the compiled RMSNorm kernels at the example's shapes (skipped without a CUDA GPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_fused.norm import reference_rms_norm, rms_norm
from tests.helpers import assert_all_written, assert_close, rand, to64

pytestmark = pytest.mark.gpu


def _run(impl, x, scale, dy, dtype):
    if impl == "exact":  # the reference in float32 on the device: ~1e-7, far below bf16's rounding
        f = lambda x, s: reference_rms_norm(x.astype(jnp.float32), s, 1e-6, jnp.float32)  # noqa: E731
        x, dy = x.astype(jnp.float32), dy.astype(jnp.float32)
    else:
        f = lambda x, s: rms_norm(x, s, dtype=dtype, implementation=impl)  # noqa: E731
    y, vjp = jax.vjp(f, x, scale)
    return (y, *vjp(dy))


@pytest.mark.parametrize("shape,dtype", [((16, 1024, 2048), jnp.bfloat16), ((4096, 2048), jnp.float32),
                                         ((1000, 5504), jnp.bfloat16), ((333, 16384), jnp.float16),
                                         ((77, 33), jnp.bfloat16)], ids=str)
def test_compiled_kernels_against_float32(shape, dtype):
    x = rand(0, shape, dtype, scale=2.0, offset=0.3)
    scale = rand(1, shape[-1:], offset=1.0, scale=0.1)
    dy = rand(2, shape, dtype)
    ours = jax.jit(lambda x, s, g: _run("pallas", x, s, g, dtype))(x, scale, dy)
    base = jax.jit(lambda x, s, g: _run("xla", x, s, g, dtype))(x, scale, dy)
    exact = jax.jit(lambda x, s, g: _run("exact", x, s, g, dtype))(x, scale, dy)
    for name, o, b, e in zip(("y", "dx", "dscale"), ours, base, exact):
        assert_all_written(o, name)
        assert_close(o, to64(e), baseline=b, dtype=jnp.float32 if name == "dscale" else dtype, floor=1e-5
                     if name == "dscale" else None, what=f"{name} {shape}")
