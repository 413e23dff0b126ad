"""GPU checks of the compiled one-hot gradient kernel at the example's shapes (skipped without a CUDA GPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_fused.embed import embed
from tests.helpers import assert_all_written, assert_close, rand

pytestmark = pytest.mark.gpu


def _grad(impl, table, ids, dy, dtype):
    return jax.jit(lambda t, g: jax.vjp(lambda t: embed(t, ids, dtype=dtype, implementation=impl), t)[1](g)[0])(
        table, dy)


@pytest.mark.parametrize("vocab,features,tokens,dtype", [
    (256, 2048, (16, 1024), jnp.bfloat16),  # the example's GPU preset
    (256, 2048, (16, 1024), jnp.float32),
    (1000, 1000, (3, 777), jnp.float16),
    (300, 130, (5, 67), jnp.float32),
], ids=str)
def test_compiled_kernel_against_exact(vocab, features, tokens, dtype):
    table = rand(0, (vocab, features))
    ids = jax.random.randint(jax.random.key(1), tokens, -vocab, vocab)
    dy = rand(2, tokens + (features,), dtype)
    grad = _grad("pallas", table, ids, dy, dtype)
    assert_all_written(grad, "dtable")
    exact = _grad("xla", table, ids, dy.astype(jnp.float32), jnp.float32)  # fp32 scatter, ~1e-7 relative
    baseline = _grad("xla", table, ids, dy, dtype)
    assert_close(grad, np.asarray(exact, np.float64), baseline=baseline, dtype=jnp.float32, floor=1e-5, what="dtable")
    y = jax.jit(lambda t: embed(t, ids, dtype=dtype, implementation="pallas"))(table)
    np.testing.assert_array_equal(np.asarray(y.astype(jnp.float32)), np.asarray(table[ids % vocab].astype(dtype)
                                                                                .astype(jnp.float32)))
