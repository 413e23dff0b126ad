"""The linen and NNX modules: no state, same result as apply_rotary, usable inside jit."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_fused.rotary import NNXRotaryEmbedding, RotaryEmbedding, RotaryScaling, apply_rotary
from tests.helpers import rand

KW = dict(rotary_dim=32, interleaved=True, base=500000.0, scaling=RotaryScaling.llama3(8.0, 1.0, 4.0, 64))


def _inputs():
    q, k = rand(0, (2, 5, 4, 64), jnp.bfloat16), rand(1, (2, 5, 2, 64), jnp.bfloat16)
    return q, k, jnp.arange(10, 15, dtype=jnp.int32)


def test_linen_module(kernel_impl):
    q, k, pos = _inputs()
    module = RotaryEmbedding(implementation=kernel_impl, **KW)
    variables = module.init(jax.random.key(0), q, k, pos)
    assert not jax.tree_util.tree_leaves(variables), "RotaryEmbedding must not hold parameters or tables"
    out = jax.jit(lambda q, k, pos: module.apply(variables, q, k, pos))(q, k, pos)
    want = apply_rotary(q, k, pos, implementation="xla", **KW)
    for o, w in zip(out, want):
        np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(w, np.float32), rtol=1e-2, atol=1e-2)


def test_nnx_module(kernel_impl):
    q, k, pos = _inputs()
    module = NNXRotaryEmbedding(implementation=kernel_impl, **KW)
    assert not jax.tree_util.tree_leaves(nnx.state(module)), "NNXRotaryEmbedding must hold no Variables"
    q_rot, k_none = nnx.jit(lambda m, q, pos: m(q, None, pos))(module, q, pos)
    assert k_none is None
    want = apply_rotary(q, None, pos, implementation="xla", **KW)[0]
    np.testing.assert_allclose(np.asarray(q_rot, np.float32), np.asarray(want, np.float32), rtol=1e-2, atol=1e-2)
