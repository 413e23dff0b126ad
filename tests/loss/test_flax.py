"""The linen and NNX heads: a Dense lm_head's params load unchanged, tied heads take an embedding, and the loss of HF's
Flax Llama (model code we did not write) through its last hidden state and `lm_head` kernel equals the loss of its
logits, with the same gradients."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallas_fused.loss import LinearCrossEntropy, NNXLinearCrossEntropy, linear_cross_entropy
from tests.adapt._models import hf_llama, lm_loss
from tests.helpers import rand
from tests.loss.test_loss import optax_loss

D, V = 24, 70


def _data():
    hidden = rand(0, (2, 5, D))
    labels = jax.random.randint(jax.random.key(1), (2, 5), 0, V).at[0, 1].set(-100)
    return hidden, labels


def test_linen_head_loads_dense_params(kernel_impl):
    hidden, labels = _data()
    dense = nn.Dense(V, use_bias=False)
    params = dense.init(jax.random.key(2), hidden)
    head = LinearCrossEntropy(V, implementation=kernel_impl, z_loss=1e-3)
    assert jax.tree.map(jnp.shape, head.init(jax.random.key(2), hidden, labels)) == {"params": {"kernel": (D, V)}}
    got = head.apply(params, hidden, labels)
    want = optax_loss(hidden, params["params"]["kernel"], labels, layout="dv", z_loss=1e-3)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    grads = jax.grad(lambda p: head.apply(p, hidden, labels))(params)
    ref = jax.grad(lambda p: optax_loss(hidden, p["params"]["kernel"], labels, layout="dv", z_loss=1e-3))(params)
    np.testing.assert_allclose(grads["params"]["kernel"], ref["params"]["kernel"], rtol=1e-4, atol=1e-7)


def test_linen_tied_head_and_dtype():
    hidden, labels = _data()
    embed = nn.Embed(V, D)
    table = embed.init(jax.random.key(3), labels)["params"]["embedding"]
    head = LinearCrossEntropy(V, tied=True, dtype=jnp.bfloat16, implementation="xla")
    assert head.init(jax.random.key(0), hidden, labels, embedding=table) == {}
    got = head.apply({}, hidden, labels, embedding=table)
    want = optax_loss(hidden.astype(jnp.bfloat16), table, labels, layout="vd")
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    with pytest.raises(ValueError, match="embedding: LinearCrossEntropy\\(tied=True\\) needs"):
        head.apply({}, hidden, labels)
    with pytest.raises(ValueError, match="embedding: LinearCrossEntropy holds its own kernel"):
        LinearCrossEntropy(V).init(jax.random.key(0), hidden, labels, embedding=table)


def test_nnx_head_matches_nnx_linear(kernel_impl):
    hidden, labels = _data()
    linear = nnx.Linear(D, V, use_bias=False, rngs=nnx.Rngs(4))
    head = NNXLinearCrossEntropy(D, V, reduction="sum", implementation=kernel_impl, rngs=nnx.Rngs(4))
    np.testing.assert_array_equal(np.asarray(head.kernel[...]), np.asarray(linear.kernel[...]))
    want = optax_loss(hidden, linear.kernel[...], labels, layout="dv", reduction="sum")
    np.testing.assert_allclose(float(head(hidden, labels)), float(want), rtol=1e-5)
    grads = nnx.grad(lambda m: m(hidden, labels))(head)
    ref = jax.grad(lambda k: optax_loss(hidden, k, labels, layout="dv", reduction="sum"))(linear.kernel[...])
    np.testing.assert_allclose(grads.kernel[...], ref, rtol=1e-4, atol=1e-6)


def test_nnx_tied_head_takes_an_embed_param():
    hidden, labels = _data()
    embed = nnx.Embed(V, D, rngs=nnx.Rngs(5))
    head = NNXLinearCrossEntropy(D, V, tied=True, implementation="xla")
    got = head(hidden, labels, embedding=embed.embedding)
    np.testing.assert_allclose(float(got), float(optax_loss(hidden, embed.embedding[...], labels, layout="vd")),
                               rtol=1e-5)
    with pytest.raises(ValueError, match="rngs: NNXLinearCrossEntropy needs rngs"):
        NNXLinearCrossEntropy(D, V)


@pytest.mark.slow  # an HF model: the floor leg only
def test_hf_flax_llama_recipe(kernel_impl):
    """HF's FlaxLlamaForCausalLM: the loss of its last hidden state against the `lm_head` kernel equals its own
    logits' loss, and the gradients of every param agree."""
    module, params, inputs, targets = hf_llama()

    def ours(params, impl):
        out = module.apply({"params": params}, *inputs, output_hidden_states=True)
        return linear_cross_entropy(out.hidden_states[-1], params["lm_head"]["kernel"], targets, implementation=impl)

    def theirs(params):
        return lm_loss(module.apply({"params": params}, *inputs).logits, targets)

    want, want_grads = jax.jit(jax.value_and_grad(theirs))(params)  # jitted: eager, the model ran op by op
    got, grads = jax.jit(jax.value_and_grad(ours), static_argnums=1)(params, kernel_impl)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    want_grads = dict(jax.tree_util.tree_leaves_with_path(want_grads))
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        np.testing.assert_allclose(np.asarray(g), np.asarray(want_grads[path]), rtol=2e-3, atol=2e-6,
                                   err_msg=jax.tree_util.keystr(path))
