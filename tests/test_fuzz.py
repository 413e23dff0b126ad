"""Fuzz every public op over shapes (empty ones included), dtypes and options: a finite input gives a finite
result (and finite gradients), or a ValueError that names an argument; never any other exception."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pallas_fused.dora import column_scale, dora_dense, quantize_int8
from pallas_fused.embed import embed
from pallas_fused.fp8 import RECIPES, fp8_linear, quantize, scaled_matmul, scaled_matmul_nt
from pallas_fused.norm import rms_norm
from pallas_fused.optim import adamw, adamw_step, galore_adamw, galore_adamw_inplace
from pallas_fused.rotary import RotaryScaling, apply_rotary
from pallas_fused.swiglu import swiglu
from tests.helpers import rand

# Many random shapes through every kernel: the unit tests cover each shape class on both jax legs.
pytestmark = pytest.mark.slow

# Few examples (each interpret-mode example compiles its kernels): CI runs on two cores.
FUZZ = settings(max_examples=6, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
IMPLS = st.sampled_from(["xla", "interpret"])
FLOATS = st.sampled_from([jnp.float32, jnp.bfloat16, jnp.float16])
FP8 = st.sampled_from([jnp.float8_e4m3fn, jnp.float8_e5m2])


def finite_or_named_error(fn, names):
    """fn() -> its outputs, all finite; or None after a ValueError whose message names one of `names`."""
    try:
        out = fn()
    except ValueError as e:
        assert any(re.search(rf"\b{re.escape(n)}\b", str(e)) for n in names), f"no argument named in: {e}"
        return None
    for leaf in jax.tree.leaves(out):
        arr = np.asarray(jnp.asarray(leaf).astype(jnp.float32))
        assert np.all(np.isfinite(arr)), f"{int(np.sum(~np.isfinite(arr)))} non-finite values"
    return out


def _with_grad(fn, *args):
    """fn(*args) and its vjp with ones (cotangent of each float output)."""
    y, pull = jax.vjp(fn, *args)
    return y, pull(jax.tree.map(jnp.ones_like, y))


@FUZZ
@given(data=st.data())
def test_fuzz_apply_rotary(data):
    draw = data.draw
    layout = draw(st.sampled_from(["bshd", "bhsd", "bad"]))
    batch, seq, hq, d = draw(st.integers(0, 2)), draw(st.integers(0, 5)), draw(st.integers(1, 3)), draw(
        st.sampled_from([2, 4, 6, 8, 16, 5]))
    hk = draw(st.sampled_from([None, 1, 2]))
    dtype = draw(FLOATS)
    shape = (lambda h: (batch, seq, h, d)) if layout != "bhsd" else (lambda h: (batch, h, seq, d))
    q = rand(0, shape(hq), dtype)
    k = None if hk is None else rand(1, shape(hk), dtype)
    pos_kind = draw(st.sampled_from(["none", "shared", "batched", "wrong"]))
    lo, hi = draw(st.sampled_from([(0, 4096), (-2**31, 2**31 - 1)]))
    pos = {"none": None, "shared": (seq,), "batched": (batch, seq), "wrong": (seq + 1,)}[pos_kind]
    if pos is not None:
        pos = jax.random.randint(jax.random.key(2), pos, lo, hi, dtype=jnp.int32)
    kw = dict(rotary_dim=draw(st.sampled_from([None, 2, d, d + 2, 3])), interleaved=draw(st.booleans()),
              scaling=draw(st.sampled_from([None, RotaryScaling.linear(4.0), RotaryScaling.yarn(4.0, 64)])),
              layout=layout, implementation=draw(IMPLS))
    names = ("q", "k", "positions", "rotary_dim", "layout")
    if k is None:
        finite_or_named_error(lambda: _with_grad(lambda q: apply_rotary(q, None, pos, **kw)[0], q), names)
    else:
        finite_or_named_error(lambda: _with_grad(lambda q, k: apply_rotary(q, k, pos, **kw), q, k), names)


@FUZZ
@given(data=st.data())
def test_fuzz_dora_dense(data):
    draw = data.draw
    lead = draw(st.sampled_from([(0,), (3,), (2, 0), (2, 3), ()]))
    fin, fout = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    rank = draw(st.integers(0, 5))
    dtype = draw(FLOATS)
    x = rand(0, (*lead, fin), dtype)
    w = rand(1, (fin, fout), dtype, scale=0.3)
    if draw(st.booleans()):
        w = w.at[:, 0].set(0.0)  # a zero column (with B = 0 below, magnitude 0 there)
    kernel = quantize_int8(w) if draw(st.booleans()) else w
    a = rand(2, (fin, max(rank, 1)))[:, :rank]
    b = rand(3, (rank, fout), scale=0.2) if draw(st.booleans()) else jnp.zeros((rank, fout))
    if draw(st.booleans()):
        b = b[:, : fout - 1]  # a mis-shaped lora_b
    m = jnp.sqrt(jnp.sum(jnp.square(w.astype(jnp.float32)), axis=0))
    bias = draw(st.sampled_from([None, "ok"]))
    bias = None if bias is None else rand(4, (fout,), scale=0.1)
    impl = draw(IMPLS)
    variant = draw(st.sampled_from(["", ":gemm", ":merged", ":epilogue", ":bad"]))
    kw = dict(scale=draw(st.sampled_from([0.5, 2.0])), implementation=impl + variant if impl in ("pallas", "interpret")
              else impl, exact_norm_grad=draw(st.booleans()))
    names = ("x", "kernel", "lora_a", "lora_b", "magnitude", "bias", "implementation", "rank")
    finite_or_named_error(lambda: _with_grad(lambda x, a, b, m: dora_dense(x, kernel, a, b, m, bias, **kw),
                                             x, a, b, m), names)
    finite_or_named_error(lambda: column_scale(kernel, a, b, m + 0.5, scale=kw["scale"], implementation=impl), names)


@settings(FUZZ, max_examples=12)
@given(data=st.data())
def test_fuzz_quantize(data):
    draw = data.draw
    shape = draw(st.sampled_from([(0,), (5,), (0, 4), (4, 0), (3, 7), (2, 0, 3), (2, 3, 5), ()]))
    xdtype = draw(st.sampled_from([jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32]))
    x = (rand(0, shape) * draw(st.sampled_from([1.0, 1e-30, 3e4]))).astype(xdtype)
    axis = draw(st.sampled_from([None, 0, 1, -1, 2, 3]))
    kw = dict(axis=axis, power_of_2=draw(st.booleans()), implementation=draw(IMPLS))
    dtype = draw(st.sampled_from([jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.int8]))
    out = finite_or_named_error(lambda: quantize(x, dtype, **kw), ("x", "dtype", "axis"))
    if out is not None:
        assert out[0].shape == shape and out[0].dtype == dtype


@FUZZ
@given(data=st.data())
def test_fuzz_scaled_matmul(data):
    draw = data.draw
    m, k, n = draw(st.integers(0, 9)), draw(st.integers(0, 9)), draw(st.integers(0, 9))
    k2 = draw(st.sampled_from([k, k, k + 1]))
    adt, bdt = draw(FP8), draw(FP8)
    a = rand(0, (m, k)).astype(adt)
    b = rand(1, (k2, n)).astype(bdt)
    sa = draw(st.sampled_from(["scalar", "row", "bad"]))
    sa = {"scalar": jnp.float32(0.5), "row": jnp.full((m, 1), 0.25), "bad": jnp.ones((m + 1, 2))}[sa]
    sb = draw(st.sampled_from(["scalar", "col", "bad"]))
    kw = dict(out_dtype=draw(st.sampled_from([jnp.bfloat16, jnp.float32, jnp.float16, jnp.int8])),
              fast_accum=draw(st.booleans()), implementation=draw(IMPLS))
    names = ("a_fp8", "b_fp8", "bt_fp8", "a_scale", "b_scale", "out_dtype")
    sb_nn = {"scalar": 2.0, "col": jnp.full((1, n), 0.5), "bad": jnp.ones((3,))}[sb]
    finite_or_named_error(lambda: scaled_matmul(a, b, sa, sb_nn, **kw), names)
    sb_nt = {"scalar": 2.0, "col": jnp.full((n, 1), 0.5), "bad": jnp.ones((3,))}[sb]
    finite_or_named_error(lambda: scaled_matmul_nt(a, b.T, sa, sb_nt, **kw), names)


@FUZZ
@given(data=st.data())
def test_fuzz_fp8_linear(data):
    draw = data.draw
    lead = draw(st.sampled_from([(0,), (5,), (2, 0), (2, 3)]))
    fin, fout = draw(st.integers(0, 9)), draw(st.integers(0, 9))
    dtype = draw(FLOATS)
    x = rand(0, (*lead, fin), dtype)
    w = rand(1, (draw(st.sampled_from([fin, fin, fin + 1])), fout), dtype)
    config = draw(st.sampled_from([*RECIPES, "bad"]))
    impl = draw(IMPLS)
    finite_or_named_error(lambda: _with_grad(lambda x, w: fp8_linear(x, w, config, implementation=impl), x, w),
                          ("x", "w", "config", "name"))


# Optimizers: a tree of leaves of random shapes (scalars, empty, 1-D, thin and wide 2-D, N-D; one over 4096 elements
# so that 8-bit moments are quantized) stepped twice under jit (a projector refresh, then a step between refreshes).
LEAF_SHAPES = st.sampled_from([(), (0,), (5,), (0, 4), (3, 0), (3, 7), (9, 2), (1, 6), (12, 20), (2, 3, 4),
                               (64, 65)])
OPT_NAMES = ("leaf", "rank", "mask", "update_proj_gap", "learning_rate", "b1", "b2", "eps", "weight_decay",
             "state_bits", "params", "projector", "oversample", "power_iters")


def _opt_tree(draw):
    shapes = draw(st.lists(LEAF_SHAPES, min_size=1, max_size=3))
    dtype = draw(FLOATS)
    params = {f"p{i}": rand(i, s, dtype, scale=0.5) for i, s in enumerate(shapes)}
    grads = [{k: rand(10 * t + i, p.shape, dtype) for i, (k, p) in enumerate(params.items())} for t in range(2)]
    if draw(st.integers(0, 5)) == 0:  # a gradient of another shape than its param
        k = draw(st.sampled_from(sorted(params)))
        grads[1][k] = rand(99, (*params[k].shape[:-1], params[k].shape[-1] + 1) if params[k].ndim else (2,), dtype)
    return params, grads


def _steps(tx, params, grads):
    state = tx.init(params)
    update = jax.jit(tx.update)
    outs = []
    for g in grads:
        u, state = update(g, state, params)
        params = optax.apply_updates(params, u)
        outs.append(u)
    return outs, params, state


@FUZZ
@given(data=st.data())
def test_fuzz_galore(data):
    draw = data.draw
    params, grads = _opt_tree(draw)
    mask = draw(st.sampled_from([None, True, "2d"]))
    mask = {k: p.ndim == 2 for k, p in params.items()} if mask == "2d" else mask
    kw = dict(rank=draw(st.sampled_from([1, 4, 8, 0])), update_proj_gap=draw(st.sampled_from([1, 2])),
              weight_decay=draw(st.sampled_from([0.0, 0.1])), mask=mask,
              convention=draw(st.sampled_from(["galore", "optax"])),
              proj_type=draw(st.sampled_from([None, "std", "reverse_std", "left", "right"])),
              projector=draw(st.sampled_from(["svd", "randomized"])), implementation=draw(IMPLS))
    out = finite_or_named_error(lambda: _steps(galore_adamw(1e-2, **kw), params, grads), OPT_NAMES)
    if out is not None:
        assert all(u.dtype == p.dtype and u.shape == p.shape for u, p in zip(jax.tree.leaves(out[0][0]),
                                                                           jax.tree.leaves(params)))
        opt = galore_adamw_inplace(1e-2, **kw)
        finite_or_named_error(lambda: jax.jit(opt.step)(params, grads[0], opt.init(params)), OPT_NAMES)


@FUZZ
@given(data=st.data())
def test_fuzz_adamw(data):
    draw = data.draw
    params, grads = _opt_tree(draw)
    kw = dict(b1=draw(st.sampled_from([0.9, 0.0, 1.0])), eps=draw(st.sampled_from([1e-8, 0.0])),
              weight_decay=draw(st.sampled_from([0.0, 1e-2, -1.0])),
              mask=draw(st.sampled_from([None, True, False])), implementation=draw(IMPLS))
    bits = draw(st.sampled_from([None, 8, 32, 16]))
    mu_dtype = draw(st.sampled_from([None, jnp.bfloat16]))
    out = finite_or_named_error(lambda: _steps(adamw(1e-2, state_bits=bits, mu_dtype=mu_dtype, **kw), params, grads),
                                OPT_NAMES)
    if out is not None:
        assert all(u.dtype == p.dtype and u.shape == p.shape for u, p in zip(jax.tree.leaves(out[0][0]),
                                                                           jax.tree.leaves(params)))
        state = adamw(1e-2, state_bits=bits, mu_dtype=mu_dtype, **kw).init(params)
        finite_or_named_error(lambda: jax.jit(lambda p, g, s: adamw_step(p, g, s, learning_rate=1e-2, **kw))(
            params, grads[0], state), OPT_NAMES)


@FUZZ
@given(data=st.data())
def test_fuzz_embed(data):
    """Ids in [-V, V) (the others give NaN rows by nn.Embed's rule), both table-gradient paths (one-hot GEMM for
    small vocabularies, the segment sum above), empty id arrays, mis-shaped tables and non-integer ids."""
    draw = data.draw
    vocab, feat = draw(st.sampled_from([1, 3, 64, 300, 1100])), draw(st.integers(0, 40))
    table = rand(0, draw(st.sampled_from([(vocab, feat), (vocab,)])), draw(FLOATS))
    ids_shape = draw(st.sampled_from([(0,), (5,), (2, 7), (3, 0)]))
    ids = jax.random.randint(jax.random.key(1), ids_shape, -vocab, vocab, jnp.int32)
    ids = ids.astype(draw(st.sampled_from([jnp.int32, jnp.uint8, jnp.float32]))) if vocab <= 64 else ids
    dtype, impl = draw(st.sampled_from([None, jnp.bfloat16, jnp.float32])), draw(IMPLS)
    finite_or_named_error(lambda: _with_grad(lambda t: embed(t, ids, dtype=dtype, implementation=impl), table),
                          ["table", "ids", "dtype"])


@FUZZ
@given(data=st.data())
def test_fuzz_rms_norm(data):
    """Leading shapes with empty axes, odd widths, a scale of the wrong shape or none, epsilons, dtypes."""
    draw = data.draw
    width = draw(st.sampled_from([1, 7, 130, 2048]))
    x = rand(0, draw(st.sampled_from([(0, width), (3, width), (2, 0, width), (2, 3, width), ()])), draw(FLOATS))
    scale = draw(st.sampled_from([None, (width,), (width + 1,)]))
    scale = None if scale is None else rand(1, scale, jnp.float32)
    eps, impl = draw(st.sampled_from([1e-6, 1e-2, 0.0])), draw(IMPLS)
    args = (x,) if scale is None else (x, scale)
    finite_or_named_error(lambda: _with_grad(lambda *a: rms_norm(*a, epsilon=eps, implementation=impl), *args),
                          ["x", "scale", "epsilon"])


@FUZZ
@given(data=st.data())
def test_fuzz_swiglu(data):
    """Empty and odd shapes, scalars, dtypes of gate and up alike or not, up of another shape."""
    draw = data.draw
    shape = draw(st.sampled_from([(0, 7), (3, 77), (2, 0, 5), (2, 3, 130), (), (5,)]))
    dtype = draw(FLOATS)
    gate = rand(0, shape, dtype, scale=4.0)
    up = rand(1, draw(st.sampled_from([shape, shape, (*shape, 2)])), draw(st.sampled_from([dtype, dtype,
                                                                                           jnp.float32])))
    impl = draw(IMPLS)
    finite_or_named_error(lambda: _with_grad(lambda g, u: swiglu(g, u, implementation=impl), gate, up),
                          ["gate", "up"])
