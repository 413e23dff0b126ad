"""embed: the one-hot-GEMM gradient kernel (interpret mode here) against exact sums, the reference against
flax, index semantics, the vocabulary switch, bad input, and the linen / NNX drop-ins."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallas_fused.embed import ONEHOT_MAX_VOCAB, Embed, NNXEmbed, embed, reference_embed, use_onehot
from pallas_fused.embed import api as embed_api
from pallas_fused.embed.kernel import LaunchConfig, choose_config
from tests.helpers import assert_close, rand

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _exact_grad(ids, dy, vocab):
    """float64 sum of dy's rows per id, with jnp.take's index rules (negative wrap, others dropped)."""
    ids = np.asarray(ids).reshape(-1).astype(np.int64)
    ids = np.where(ids < 0, ids + vocab, ids)
    dy = np.asarray(jnp.asarray(dy).astype(jnp.float32), np.float64).reshape(ids.shape[0], -1)
    out = np.zeros((vocab, dy.shape[1]))
    ok = (ids >= 0) & (ids < vocab)
    np.add.at(out, ids[ok], dy[ok])
    return out


def _grads(impl, table, ids, dy, dtype, config=None):
    def f(t):
        return embed_api.embed_with_config(t, ids, dtype=dtype, implementation=impl, config=config)

    y, vjp = jax.vjp(f, table)
    return y, vjp(dy)[0]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("vocab,features,ids_shape,config", [
    (37, 50, (3, 67), None),  # odd everything, the heuristic geometry
    (256, 16, (2, 40), LaunchConfig(128, 16, 16, 3)),  # several vocab blocks and token splits
    (19, 130, (101,), LaunchConfig(16, 64, 32, 2)),  # ragged feature blocks, a split past the last token
])
def test_gradient_matches_exact_sums(kernel_impl, dtype, vocab, features, ids_shape, config):
    table = rand(0, (vocab, features), jnp.float32)
    ids = jax.random.randint(jax.random.key(1), ids_shape, -vocab, vocab)  # negative ids wrap
    dy = rand(2, ids_shape + (features,), dtype)
    y, grad = _grads(kernel_impl, table, ids, dy, dtype, config)
    y_ref, grad_ref = _grads("xla", table, ids, dy, dtype)
    np.testing.assert_array_equal(np.asarray(y.astype(jnp.float32)), np.asarray(y_ref.astype(jnp.float32)))
    assert y.dtype == y_ref.dtype == jnp.dtype(dtype) and grad.dtype == jnp.float32
    exact = _exact_grad(ids, dy, vocab)
    # float32 accumulation, one rounding: at least as close as XLA's scatter in dy's dtype (fp32: to the ulps).
    assert_close(grad, exact, baseline=grad_ref, dtype=jnp.float32, what="dtable")


def test_repeated_ids_accumulate(kernel_impl):
    """Every token on one row (the worst collision for a scatter) and a few rows never hit."""
    table = rand(0, (40, 24))
    ids = jnp.full((5, 31), 7, jnp.int32).at[0, :3].set(jnp.array([0, 39, 7]))
    dy = rand(1, ids.shape + (24,), jnp.bfloat16)
    _, grad = _grads(kernel_impl, table, ids, dy, jnp.bfloat16)
    exact = _exact_grad(ids, dy, 40)
    np.testing.assert_allclose(np.asarray(grad), exact, rtol=1e-6, atol=1e-6)
    assert not np.any(np.asarray(grad)[[1, 2, 38]])


def test_out_of_range_ids_as_flax(kernel_impl):
    """ids >= V or < -V: a NaN row forward (jnp.take's fill) and no gradient, exactly as nn.Embed."""
    vocab, features = 12, 20
    table = rand(0, (vocab, features))
    ids = jnp.array([[0, 11, 12, -1, -12, -13, 1000, 3]], jnp.int32)
    layer = nn.Embed(vocab, features)
    variables = {"params": {"embedding": table}}
    dy = rand(1, ids.shape + (features,))
    y_flax, vjp_flax = jax.vjp(lambda t: layer.apply({"params": {"embedding": t}}, ids), table)
    y, grad = _grads(kernel_impl, table, ids, dy, None)
    np.testing.assert_array_equal(np.isnan(np.asarray(y)), np.isnan(np.asarray(y_flax)))
    assert np.isnan(np.asarray(y)[0, [2, 5, 6]]).all() and not np.isnan(np.asarray(y)[0, [0, 1, 3, 4, 7]]).any()
    np.testing.assert_array_equal(np.asarray(y), np.asarray(layer.apply(variables, ids)))
    np.testing.assert_allclose(np.asarray(grad), np.asarray(vjp_flax(dy)[0]), rtol=1e-6, atol=1e-6)


def test_unsigned_ids(kernel_impl):
    table = rand(0, (10, 16))
    ids = jnp.array([0, 9, 10, 4294967295, 3], jnp.uint32)
    dy = rand(1, (5, 16))
    y, grad = _grads(kernel_impl, table, ids, dy, None)
    y_ref, grad_ref = _grads("xla", table, ids, dy, None)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref))
    np.testing.assert_allclose(np.asarray(grad), np.asarray(grad_ref), rtol=1e-6, atol=1e-6)


def test_empty_ids_and_one_row_table(kernel_impl):
    table = rand(0, (9, 16))
    ids = jnp.zeros((0, 5), jnp.int32)
    y, grad = _grads(kernel_impl, table, ids, jnp.zeros((0, 5, 16)), None)
    assert y.shape == (0, 5, 16) and grad.shape == (9, 16) and not np.any(np.asarray(grad))
    one = rand(1, (1, 16))
    ids = jnp.array([0, 5, -3], jnp.int32)  # a one-row table ignores the ids, as nn.Embed
    y, grad = _grads(kernel_impl, one, ids, rand(2, (3, 16)), None)
    np.testing.assert_array_equal(np.asarray(y), np.broadcast_to(np.asarray(one), (3, 16)))
    np.testing.assert_allclose(np.asarray(grad)[0], np.asarray(rand(2, (3, 16))).sum(0), rtol=1e-6)


def test_large_vocabulary_takes_the_segment_sum(kernel_impl):
    """Above the threshold no kernel runs: the sorted segment sum, still float32 and exact per row."""
    assert use_onehot(ONEHOT_MAX_VOCAB, jnp.bfloat16) and not use_onehot(ONEHOT_MAX_VOCAB + 1, jnp.bfloat16)
    assert not use_onehot(ONEHOT_MAX_VOCAB // 3 + 1, jnp.float32)
    vocab = ONEHOT_MAX_VOCAB + 7
    table = rand(0, (vocab, 8))
    ids = jax.random.randint(jax.random.key(1), (300,), -vocab - 5, vocab + 5)
    dy = rand(2, (300, 8), jnp.bfloat16)
    f = jax.jit(lambda t, g: jax.vjp(lambda t: embed(t, ids, dtype=jnp.bfloat16, implementation=kernel_impl),
                                     t)[1](g))
    assert "pallas_call" not in str(jax.make_jaxpr(f)(table, dy))
    assert_close(f(table, dy)[0], _exact_grad(ids, dy, vocab), dtype=jnp.float32, what="segment sum")


def test_bf16_table_and_jit_vmap_remat(kernel_impl):
    table = rand(0, (30, 32), jnp.bfloat16)
    ids = jax.random.randint(jax.random.key(1), (4, 3, 9), 0, 30)
    dy = rand(2, (4, 3, 9, 32), jnp.bfloat16)

    def loss(t, impl):
        y = jax.vmap(jax.checkpoint(lambda i: embed(t, i, implementation=impl)))(ids)
        return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))

    g = jax.jit(jax.grad(lambda t: loss(t, kernel_impl)))(table)
    g_ref = jax.grad(lambda t: loss(t, "xla"))(table)
    assert g.dtype == jnp.bfloat16
    assert_close(g, _exact_grad(ids, dy, 30), baseline=g_ref, what="vmap/remat grad")


def test_choose_config_fills_the_gpu():
    cfg = choose_config(16384, 256, 2048)
    assert (cfg.block_vocab, cfg.block_features) == (128, 128) and cfg.splits >= 1
    small = choose_config(5, 3, 7)
    assert small.block_vocab == 16 and small.block_features == 16 and small.splits == 1


@pytest.mark.parametrize("bad,match", [
    (dict(table=jnp.zeros((4,))), "table: expected a 2-D"),
    (dict(table=jnp.zeros((4, 3), jnp.int32)), "table: expected a floating"),
    (dict(table=jnp.zeros((0, 3))), "table: expected at least one row"),
    (dict(ids=jnp.zeros((2,), jnp.float32)), "ids: expected an integer"),
    (dict(dtype=jnp.int8), "dtype: expected None or a floating"),
    (dict(implementation="cuda"), "implementation must be"),
])
def test_bad_input_names_the_argument(bad, match):
    args = dict(table=jnp.ones((4, 3)), ids=jnp.zeros((2,), jnp.int32), dtype=None, implementation="interpret")
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        embed(args.pop("table"), args.pop("ids"), **args)


def test_linen_drop_in_is_nn_embed(kernel_impl):
    ids = jax.random.randint(jax.random.key(1), (2, 11), 0, 33)
    ours = Embed(33, 24, dtype=jnp.bfloat16, implementation=kernel_impl)
    theirs = nn.Embed(33, 24, dtype=jnp.bfloat16)
    params = ours.init(jax.random.key(0), ids)
    flax_params = theirs.init(jax.random.key(0), ids)
    assert jax.tree.map(jnp.shape, params) == {"params": {"embedding": (33, 24)}}
    np.testing.assert_array_equal(np.asarray(params["params"]["embedding"]),
                                  np.asarray(flax_params["params"]["embedding"]))
    np.testing.assert_array_equal(np.asarray(ours.apply(params, ids).astype(jnp.float32)),
                                  np.asarray(theirs.apply(params, ids).astype(jnp.float32)))
    q = rand(3, (2, 24))
    np.testing.assert_array_equal(np.asarray(ours.apply(params, q, method="attend").astype(jnp.float32)),
                                  np.asarray(theirs.apply(params, q, method="attend").astype(jnp.float32)))
    # implementation "xla" is flax's own __call__: the same numbers and gradient, to the bit.
    base = Embed(33, 24, dtype=jnp.bfloat16, implementation="xla")
    dy = rand(4, (2, 11, 24), jnp.bfloat16)
    g_base = jax.vjp(lambda p: base.apply(p, ids), params)[1](dy)
    g_flax = jax.vjp(lambda p: theirs.apply(p, ids), params)[1](dy)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), g_base, g_flax)
    g_ours = jax.vjp(lambda p: ours.apply(p, ids), params)[1](dy)[0]["params"]["embedding"]
    assert_close(g_ours, _exact_grad(ids, dy, 33), baseline=g_flax[0]["params"]["embedding"], what="linen grad")


def test_nnx_drop_in_is_nnx_embed(kernel_impl):
    ids = jax.random.randint(jax.random.key(1), (3, 5), 0, 17)
    ours = NNXEmbed(17, 20, dtype=jnp.bfloat16, implementation=kernel_impl, rngs=nnx.Rngs(0))
    theirs = nnx.Embed(17, 20, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    assert jax.tree.map(jnp.shape, nnx.state(ours, nnx.Param)) == jax.tree.map(jnp.shape, nnx.state(theirs, nnx.Param))
    np.testing.assert_array_equal(np.asarray(ours.embedding[...]), np.asarray(theirs.embedding[...]))
    np.testing.assert_array_equal(np.asarray(ours(ids).astype(jnp.float32)),
                                  np.asarray(theirs(ids).astype(jnp.float32)))
    dy = rand(2, (3, 5, 20), jnp.bfloat16)

    def grad_of(model):
        return nnx.grad(lambda m: jnp.sum(m(ids).astype(jnp.float32) * dy.astype(jnp.float32)))(model).embedding[...]

    assert_close(grad_of(ours), _exact_grad(ids, dy, 17), baseline=grad_of(theirs), what="nnx grad")


def test_reference_is_flax():
    table, ids = rand(0, (9, 6)), jnp.array([[1, -2, 8]], jnp.int32)
    for dtype in (None, jnp.bfloat16):
        y = nn.Embed(9, 6, dtype=dtype).apply({"params": {"embedding": table}}, ids)
        np.testing.assert_array_equal(np.asarray(reference_embed(table, ids, dtype).astype(jnp.float32)),
                                      np.asarray(y.astype(jnp.float32)))
