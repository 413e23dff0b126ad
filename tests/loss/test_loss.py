"""linear_cross_entropy against optax on materialized logits (values and both gradients) for every option, both
weight layouts and both dtypes, through the chunked "xla" implementation and the Pallas kernels (interpret mode
here); ignored, non-finite and out-of-range tokens; odd shapes; bad input."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pallas_fused.loss import kernel as loss_kernel
from pallas_fused.loss import linear_cross_entropy, reference_linear_cross_entropy
from pallas_fused.loss.api import linear_cross_entropy_with_config
from pallas_fused.loss.reference import LossConfig
from tests.helpers import assert_all_written, assert_close, rand, to64

IGNORE = -100
# Small blocks so that the tiny shapes below still cross several token, vocabulary and d blocks, vocabulary splits
# (forward) and chunks (backward), each with a masked remainder: V 100 = 3 x 32 + 4, d 40 = 2 x 16 + 8, N 37.
FWD = loss_kernel.LaunchConfig(16, 32, 16, num_warps=4, splits=2)
BWD = loss_kernel.LaunchConfig(16, 32, 16, num_warps=4, group=2)
N, D, V = 37, 40, 100

OPTIONS = {
    "plain": {},
    "ignore_index": {"ignore": True},
    "z_loss": {"z_loss": 0.05},
    "label_smoothing": {"label_smoothing": 0.2},
    "soft_cap": {"logit_soft_cap": 2.5},
    "sum": {"reduction": "sum", "ignore": True},
    "none": {"reduction": "none", "ignore": True},
    "all": {"ignore": True, "z_loss": 0.05, "label_smoothing": 0.2, "logit_soft_cap": 2.5},
}


def _inputs(dtype, layout, shape=(N,), d=D, vocab=V, ignore=False, seed=0):
    hidden = rand(seed, (*shape, d), dtype)
    weight = rand(seed + 1, (vocab, d) if layout == "vd" else (d, vocab), dtype, scale=0.4)
    labels = jax.random.randint(jax.random.key(seed + 2), shape, 0, vocab)
    if ignore:  # every third token ignored
        labels = jnp.where(jnp.arange(labels.size).reshape(shape) % 3 == 1, IGNORE, labels)
    return hidden, weight, labels


def optax_loss(hidden, weight, labels, *, layout, z_loss=0.0, label_smoothing=0.0, reduction="mean",
               logit_soft_cap=None):
    """The loss as a user writes it with optax, on the materialized float32 logits."""
    w = weight.astype(hidden.dtype)
    z = jnp.einsum("...d,vd->...v" if layout == "vd" else "...d,dv->...v", hidden, w,
                   preferred_element_type=jnp.float32)
    if logit_soft_cap is not None:
        z = logit_soft_cap * jnp.tanh(z / logit_soft_cap)
    vocab = z.shape[-1]
    counted = labels != IGNORE
    safe = jnp.where(counted, labels, 0)
    if label_smoothing:
        targets = optax.smooth_labels(jax.nn.one_hot(safe, vocab), label_smoothing)
        per = optax.softmax_cross_entropy(z, targets)
    else:
        per = optax.softmax_cross_entropy_with_integer_labels(z, safe)
    per = per + z_loss * jax.nn.logsumexp(z, axis=-1) ** 2
    per = jnp.where(counted, per, 0.0)
    if reduction == "none":
        return per
    return jnp.sum(per) / (jnp.maximum(jnp.sum(counted), 1) if reduction == "mean" else 1)


def _value_and_grads(fn, hidden, weight, cotangent=None):
    out, vjp = jax.vjp(fn, hidden, weight)
    ct = jnp.ones_like(out) if cotangent is None else cotangent
    return (out, *vjp(ct))


def _ours(impl, layout, **kw):
    if impl == "xla":  # small token chunks: several chunks and a padded last one
        return lambda h, w, y: linear_cross_entropy_with_config(h, w, y, weight_layout=layout, implementation="xla",
                                                                chunk=16, **kw)
    return lambda h, w, y: linear_cross_entropy_with_config(h, w, y, weight_layout=layout, implementation=impl,
                                                            fwd_config=FWD, bwd_config=BWD, chunk=48, **kw)


def _check(impl, dtype, layout, options, shape=(N,)):
    options = dict(options)
    hidden, weight, labels = _inputs(dtype, layout, shape=shape, ignore=options.pop("ignore", False))
    ct = rand(9, labels.shape) if options.get("reduction") == "none" else None
    ours = _value_and_grads(lambda h, w: _ours(impl, layout, **options)(h, w, labels), hidden, weight, ct)
    # The judge: optax in float32 on the same (upcast) values; the baseline: optax in the inputs' dtype.
    exact = _value_and_grads(lambda h, w: optax_loss(h, w, labels, layout=layout, **options),
                             hidden.astype(jnp.float32), weight.astype(jnp.float32), ct)
    base = _value_and_grads(lambda h, w: optax_loss(h, w, labels, layout=layout, **options), hidden, weight, ct)
    for name, o, e, b, like in zip(("loss", "d_hidden", "d_weight"), ours, exact, base,
                                   (jnp.float32, hidden.dtype, weight.dtype)):
        assert o.dtype == jnp.dtype(like) and o.shape == e.shape, (name, o.dtype, o.shape)
        assert_all_written(o, name)
        # float32: the two sums differ in order only; bf16: dz is rounded to bf16 before the gradient GEMMs.
        floor = 2e-5 if dtype == jnp.float32 else 1.5e-2
        assert_close(o, to64(e), baseline=b, floor=floor, what=f"{impl} {layout} {name} {options}")


@pytest.fixture(params=["xla", "kernel"])
def impl(request, kernel_impl):
    return "xla" if request.param == "xla" else kernel_impl


@pytest.mark.parametrize("option", list(OPTIONS))
def test_each_option_matches_optax(impl, option):
    layout = "dv" if len(option) % 2 else "vd"
    _check(impl, jnp.float32, layout, OPTIONS[option])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("layout", ["vd", "dv"])
def test_layouts_and_dtypes_with_every_option(impl, dtype, layout):
    _check(impl, dtype, layout, OPTIONS["all"])


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_leading_batch_dims(impl, reduction):
    _check(impl, jnp.bfloat16, "dv", {"ignore": True, "reduction": reduction}, shape=(3, 7))


def test_public_defaults_match_reference(kernel_impl):
    """The public function's own launch (no explicit config), one token, a vocabulary of one block."""
    for shape in ((1,), (2, 5)):
        hidden, weight, labels = _inputs(jnp.float32, "dv", shape=shape, vocab=50)
        for impl in ("xla", kernel_impl):
            ours = _value_and_grads(
                lambda h, w, impl=impl, y=labels: linear_cross_entropy(h, w, y, implementation=impl), hidden, weight)
            ref = _value_and_grads(lambda h, w, y=labels: optax_loss(h, w, y, layout="dv"), hidden, weight)
            for o, r in zip(ours, ref):
                np.testing.assert_allclose(np.asarray(o), np.asarray(r), rtol=2e-5, atol=1e-6)


def test_reference_matches_optax():
    hidden, weight, labels = _inputs(jnp.float32, "vd", ignore=True)
    kw = dict(z_loss=0.05, label_smoothing=0.2, logit_soft_cap=2.5)
    cfg = LossConfig("vd", IGNORE, **kw)
    for reduction in ("mean", "sum", "none"):
        ours = reference_linear_cross_entropy(hidden, weight, labels, cfg, reduction)
        np.testing.assert_allclose(np.asarray(ours), optax_loss(hidden, weight, labels, layout="vd",
                                                                reduction=reduction, **kw), rtol=1e-5, atol=1e-6)


def test_smoothing_is_torch_and_optax_convention():
    """eps / V on every class and 1 - eps on the label: (1 - eps) CE + eps * mean over classes of -log p."""
    hidden, weight, labels = _inputs(jnp.float32, "vd")
    eps = 0.3
    z = hidden @ weight.T
    logp = jax.nn.log_softmax(z)
    want = jnp.mean((1 - eps) * -jnp.take_along_axis(logp, labels[:, None], 1)[:, 0] + eps * -jnp.mean(logp, -1))
    got = linear_cross_entropy(hidden, weight, labels, label_smoothing=eps, implementation="xla")
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)


def test_every_token_ignored_gives_zero(impl):
    """mean over no counted tokens is defined as 0 (not 0 / 0), with zero gradients; sum and none are 0 too."""
    hidden, weight, _ = _inputs(jnp.float32, "dv")
    labels = jnp.full((N,), IGNORE)
    for reduction in ("mean", "sum", "none"):
        out, dh, dw = _value_and_grads(lambda h, w, r=reduction: _ours(impl, "dv", reduction=r)(h, w, labels), hidden,
                                       weight)
        assert not np.any(np.asarray(out)) and not np.any(np.asarray(dh)) and not np.any(np.asarray(dw)), reduction


def test_nan_hidden_poisons_the_loss(impl):
    """A NaN in a counted token's row makes that token's loss, the mean and the gradients NaN. In an ignored token's
    row it leaves the loss and d_hidden as they were (the row is not part of the loss), while d_weight = dz^T h
    carries it (0 x NaN) at that feature: jax.grad of the optax loss makes d_weight NaN too (everywhere: its softmax
    backward spreads the row's NaN), so the NaN is never hidden from the update."""
    hidden, weight, labels = _inputs(jnp.float32, "dv", ignore=True)
    assert int(labels[5]) != IGNORE and int(labels[1]) == IGNORE
    fn = _ours(impl, "dv", reduction="none")
    per = fn(hidden.at[5, 3].set(jnp.nan), weight, labels)
    assert np.isnan(per[5]) and np.all(np.isfinite(np.delete(np.asarray(per), 5)))
    out, dh, dw = _value_and_grads(lambda h, w: _ours(impl, "dv")(h, w, labels), hidden.at[5, 3].set(jnp.nan),
                                   weight)
    assert np.isnan(out) and np.all(np.isnan(dh[5])) and np.any(np.isnan(dw))
    clean = _value_and_grads(lambda h, w: _ours(impl, "dv")(h, w, labels), hidden, weight)
    nan_row = hidden.at[1, 3].set(jnp.nan)
    out, dh, dw = _value_and_grads(lambda h, w: _ours(impl, "dv")(h, w, labels), nan_row, weight)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(clean[0]))
    np.testing.assert_array_equal(np.asarray(dh), np.asarray(clean[1]))
    _, _, ref_dw = _value_and_grads(lambda h, w: optax_loss(h, w, labels, layout="dv"), nan_row, weight)
    assert np.all(np.isnan(np.asarray(dw))[3]) and np.any(np.isnan(np.asarray(ref_dw)))
    assert not np.any(np.isnan(np.delete(np.asarray(dw), 3, axis=0)))


def test_nan_weight_and_infinite_logits(impl):
    """A NaN anywhere in the weight reaches every token; an infinite hidden value makes that token's loss
    non-finite (as optax's), and a soft cap does not hide a NaN."""
    hidden, weight, labels = _inputs(jnp.float32, "vd")
    fn = _ours(impl, "vd", reduction="none")
    assert np.all(np.isnan(fn(hidden, weight.at[7, 2].set(jnp.nan), labels)))
    per = fn(hidden.at[5].set(jnp.inf), weight, labels)
    ref = optax_loss(hidden.at[5].set(jnp.inf), weight, labels, layout="vd", reduction="none")
    assert not np.isfinite(per[5]) and not np.isfinite(ref[5])
    assert np.all(np.isfinite(np.delete(np.asarray(per), 5)))
    capped = _ours(impl, "vd", reduction="none", logit_soft_cap=2.0)
    assert np.isnan(capped(hidden.at[6, 0].set(jnp.nan), weight, labels)[6])


def test_label_out_of_range_is_nan(impl):
    hidden, weight, labels = _inputs(jnp.float32, "dv")
    per = _ours(impl, "dv", reduction="none")(hidden, weight, labels.at[2].set(V).at[3].set(-1))
    assert np.isnan(per[2]) and np.isnan(per[3]) and np.isfinite(per[4])


def test_empty_tokens(kernel_impl):
    hidden, weight, labels = jnp.zeros((0, D)), rand(1, (V, D)), jnp.zeros((0,), jnp.int32)
    for impl in ("xla", kernel_impl):
        out, dh, dw = _value_and_grads(lambda h, w, impl=impl: linear_cross_entropy(h, w, labels,
                                                                                    implementation=impl),
                                       hidden, weight)
        assert float(out) == 0.0 and dh.shape == (0, D) and not np.any(np.asarray(dw))


def test_mixed_dtypes_and_jit(kernel_impl):
    """bf16 hidden with a float32 weight (as nn.Dense(dtype=bf16) holds it): the product in bf16, dW in float32."""
    hidden, _, labels = _inputs(jnp.bfloat16, "dv")
    weight = rand(1, (D, V), jnp.float32, scale=0.4)
    fn = jax.jit(jax.value_and_grad(lambda h, w: linear_cross_entropy(h, w, labels, implementation=kernel_impl),
                                    (0, 1)))
    out, (dh, dw) = fn(hidden, weight)
    assert dh.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
    ref, (rh, rw) = jax.value_and_grad(lambda h, w: optax_loss(h, w, labels, layout="dv"), (0, 1))(hidden, weight)
    assert_close(out, to64(ref), floor=1e-5, what="loss")
    assert_close(dw, to64(rw), floor=1.5e-2, what="d_weight")


def test_square_weight_needs_the_layout(impl):
    hidden, _, labels = _inputs(jnp.float32, "vd", d=48)
    weight = rand(3, (48, 48), jnp.float32, scale=0.4)
    with pytest.raises(ValueError, match="weight_layout: head_weight .* is square"):
        linear_cross_entropy(hidden, weight, labels, implementation=impl)
    for layout, w in (("vd", weight), ("dv", weight.T)):
        got = _ours(impl, layout)(hidden, w, labels)
        np.testing.assert_allclose(float(got), float(optax_loss(hidden, weight, labels, layout="vd")), rtol=1e-5)


def test_one_kernel_forward_and_chunked_backward(kernel_impl):
    hidden, weight, labels = _inputs(jnp.bfloat16, "dv")
    fn = jax.grad(lambda h, w: _ours(kernel_impl, "dv")(h, w, labels), (0, 1))
    jaxpr = str(jax.make_jaxpr(fn)(hidden, weight))
    # chunks of 48 over V 100: two in the loop's body (traced once) and the last 4 columns as a narrower one
    assert jaxpr.count("name=pallas_fused_loss_fwd") == 1 and jaxpr.count("name=pallas_fused_loss_dlogits") == 2
    assert "pallas_call" not in str(jax.make_jaxpr(lambda h, w: _ours("xla", "dv")(h, w, labels))(hidden, weight))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("tokens,d,vocab,chunk", [(37, 40, 100, 48), (19, 24, 77, 77), (23, 17, 90, 30)])
def test_both_layouts_give_the_same_results(kernel_impl, dtype, tokens, d, vocab, chunk):
    """The same weight as a (V, d) table and as its (d, V) transpose: the same per-token losses (the kernels make
    each logit from the same products over the same d steps), and the same gradients up to the order of the
    float32 sums inside the two gradient GEMMs, which the backend may choose by operand layout (a few float32
    ulps; bf16 outputs round them away, except where a sum lies on a rounding boundary: one bf16 ulp). Chunks:
    two full and a narrower last one, one chunk of the whole vocabulary, three that divide it."""
    hidden, weight, labels = _inputs(dtype, "vd", shape=(tokens,), d=d, vocab=vocab, ignore=True, seed=4)
    options = dict(z_loss=0.05, label_smoothing=0.2, logit_soft_cap=2.5, reduction="none")
    ct = rand(9, labels.shape)
    vd = _value_and_grads(lambda h, w: _ours(kernel_impl, "vd", **options)(h, w, labels), hidden, weight, ct)
    chunked = lambda h, w: linear_cross_entropy_with_config(  # noqa: E731
        h, w, labels, weight_layout="dv", implementation=kernel_impl, fwd_config=FWD, bwd_config=BWD, chunk=chunk,
        **options)
    dv = _value_and_grads(chunked, hidden, weight.T, ct)
    np.testing.assert_allclose(np.asarray(dv[0]), np.asarray(vd[0]), rtol=1e-6, atol=0)
    ulp = float(jnp.finfo(dtype).eps)
    for name, a, b in (("d_hidden", dv[1], vd[1]), ("d_weight", dv[2].T, vd[2])):
        assert a.dtype == b.dtype == dtype, name
        a, b = to64(a), to64(b)
        np.testing.assert_allclose(a, b, rtol=0, atol=4 * ulp * np.max(np.abs(b)), err_msg=name)


@pytest.mark.parametrize("width,offset,align", [(384, 512, 128), (48, 96, 16), (100, 0, 4), (7, 14, 1)])
def test_dlogits_kernel_states_its_alignment(width, offset, align):
    """The chunk's start (offset + index * width, the index being data) and the vocabulary block's start reach
    Triton as stated multiples (the largest power of two dividing both width and offset; the block): without them
    a (d, V) weight's tiles load 2 bytes at a time (see `pallas_fused.loss.kernel`), which no CPU test would see."""
    hidden, weight, labels = _inputs(jnp.float32, "dv", vocab=1000)
    zeros = jnp.zeros((N,), jnp.float32)
    call = lambda h, w: loss_kernel.logits_grad_pallas(  # noqa: E731
        h, w, labels, zeros, zeros, zeros, zeros, jnp.zeros((1,), jnp.int32), width=width, offset=offset,
        layout="dv", cap=None, interpret=True, config=BWD)
    stated = re.findall(r"multiple_of\[values=\((\d+),\)\]", str(jax.make_jaxpr(call)(hidden, weight)))
    assert sorted(map(int, stated)) == sorted([align, BWD.block_vocab]), stated


def test_chunk_outside_the_vocabulary_is_refused():
    hidden, weight, labels = _inputs(jnp.float32, "dv")
    zeros = jnp.zeros((N,), jnp.float32)
    for width, offset in ((V + 1, 0), (48, 60), (0, 0), (10, -1)):
        with pytest.raises(ValueError, match="width, offset: expected a chunk"):
            loss_kernel.logits_grad_pallas(hidden, weight, labels, zeros, zeros, zeros, zeros,
                                           jnp.zeros((1,), jnp.int32), width=width, offset=offset, layout="dv",
                                           cap=None, interpret=True, config=BWD)


def test_xla_never_holds_the_full_logits():
    """The chunked "xla" implementation's compiled forward + backward needs far less than one (N, V) float32
    array of temporaries."""
    tokens, vocab, d = 1024, 4096, 32
    hidden, weight, labels = _inputs(jnp.float32, "dv", shape=(tokens,), d=d, vocab=vocab)
    fn = jax.jit(jax.value_and_grad(lambda h, w: linear_cross_entropy_with_config(
        h, w, labels, implementation="xla", chunk=64), (0, 1)))
    temp = fn.lower(hidden, weight).compile().memory_analysis().temp_size_in_bytes
    assert temp < tokens * vocab * 4 / 4, temp


@pytest.mark.parametrize("tokens,vocab,features", [(8192, 128256, 4096), (37, 100, 40), (1, 1, 1), (300, 5, 3000)])
def test_choose_config(tokens, vocab, features):
    for backward in (False, True):
        c = loss_kernel.choose_config(tokens, vocab, features, backward)
        for n in (c.block_tokens, c.block_vocab, c.block_k):
            assert n >= 16 and n & (n - 1) == 0, c
        assert 1 <= c.splits <= -(-vocab // c.block_vocab) and (c.splits == 1 or not backward)
    width = loss_kernel.chunk_width(tokens, vocab, 2, 128)
    assert 1 <= width <= vocab and (width == vocab or width % 128 == 0 or (vocab % width == 0 and width % 8 == 0))


@pytest.mark.parametrize("tokens,vocab,width", [(8192, 128256, 8016), (16384, 128256, 4008), (8192, 32000, 8000),
                                                (8192, 151936, 8064), (16384, 50257, 3968), (64, 1000, 1000)])
def test_chunk_width_tiles_the_vocabulary_where_it_can(tokens, vocab, width):
    """Equal chunks at a multiple of 8 columns where the fewest that fit the dz budget (128 MiB) tile the
    vocabulary (no remainder chunk); else a multiple of the vocabulary block, with a narrower remainder."""
    got = loss_kernel.chunk_width(tokens, vocab, 2, 128)
    assert got == width
    assert tokens * got * 2 <= 128 << 20


@pytest.mark.parametrize("kwargs,match", [
    (dict(hidden=jnp.ones((4, 8), jnp.float16)), "hidden: expected a float32 or bfloat16 array"),
    (dict(head_weight=jnp.ones((16, 8), jnp.int32)), "head_weight: expected a float32 or bfloat16 array"),
    (dict(head_weight=jnp.ones((16, 9))), r"head_weight: expected \(vocab, 8\) or \(8, vocab\)"),
    (dict(head_weight=jnp.ones((16, 8, 1))), "head_weight: expected a 2-D"),
    (dict(labels=jnp.ones((4,))), "labels: expected an integer array"),
    (dict(labels=jnp.ones((5,), jnp.int32)), r"labels: expected hidden's leading shape \(4,\)"),
    (dict(weight_layout="dv"), r"head_weight: expected shape \(8, vocab\)"),
    (dict(weight_layout="kn"), "weight_layout: expected None, 'vd'"),
    (dict(ignore_index=1.5), "ignore_index: expected a Python int"),
    (dict(z_loss=-1.0), "z_loss: expected a finite Python number >= 0"),
    (dict(label_smoothing=1.0), r"label_smoothing: expected a finite Python number in \[0.0, 1.0\)"),
    (dict(reduction="avg"), "reduction: expected one of"),
    (dict(logit_soft_cap=0.0), "logit_soft_cap: expected None or a positive number"),
    (dict(logit_soft_cap=float("nan")), "logit_soft_cap: expected a finite Python number"),
    (dict(implementation="triton"), "linear_cross_entropy: implementation must be None or one of"),
])
def test_bad_input_names_the_argument(kwargs, match):
    args = dict(hidden=jnp.ones((4, 8)), head_weight=jnp.ones((16, 8)), labels=jnp.zeros((4,), jnp.int32))
    args.update(kwargs)
    call = {k: args.pop(k) for k in ("hidden", "head_weight", "labels")}
    with pytest.raises(ValueError, match=match):
        linear_cross_entropy(call["hidden"], call["head_weight"], call["labels"], **args)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["vd", "dv"])
def test_default_launch_at_a_larger_shape(kernel_impl, layout):
    """The default launch (128-wide blocks, chunks of the configured bytes) over a vocabulary of several blocks
    with a remainder, bf16, every option."""
    hidden, weight, labels = _inputs(jnp.bfloat16, layout, shape=(2, 150), d=96, vocab=1000, ignore=True)
    opts = dict(z_loss=1e-3, label_smoothing=0.1, logit_soft_cap=3.0)
    ours = _value_and_grads(lambda h, w: linear_cross_entropy(h, w, labels, implementation=kernel_impl, **opts),
                            hidden, weight)
    exact = _value_and_grads(lambda h, w: optax_loss(h, w, labels, layout=layout, **opts),
                             hidden.astype(jnp.float32), weight.astype(jnp.float32))
    base = _value_and_grads(lambda h, w: optax_loss(h, w, labels, layout=layout, **opts), hidden, weight)
    for name, o, e, b in zip(("loss", "d_hidden", "d_weight"), ours, exact, base):
        assert_close(o, to64(e), baseline=b, floor=1.5e-2, what=name)


def test_vmap_jit_remat(impl):
    """vmap over a batch of sequences (the weight shared), jit and remat give what the unbatched calls give."""
    hidden, weight, labels = _inputs(jnp.float32, "dv", shape=(3, 20), vocab=70)
    fn = _ours(impl, "dv")
    one_by_one = jax.value_and_grad(lambda h, w: sum(fn(h[i], w, labels[i]) for i in range(3)), (0, 1))(hidden,
                                                                                                     weight)
    batched = jax.jit(jax.value_and_grad(lambda h, w: jnp.sum(jax.vmap(jax.checkpoint(fn), (0, None, 0))(
        h, w, labels)), (0, 1)))(hidden, weight)
    for a, b in zip(jax.tree.leaves(batched), jax.tree.leaves(one_by_one)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
