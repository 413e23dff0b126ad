"""The sm90 (Mosaic GPU) blockwise quantize of activations and weights against the Triton kernel and the reference,
bit for bit, in Mosaic GPU's interpret mode (and on a Hopper GPU)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_fused import _backend
from pallas_fused.fp8 import kernel
from pallas_fused.fp8 import kernel_sm90_quantize as sm90
from pallas_fused.fp8 import reference as ref
from tests.helpers import rand

E4 = jnp.float8_e4m3fn
ACT = (1, 128)
WEIGHT = (128, 128)
needs_interpret = pytest.mark.skipif(not _backend.has_mosaic_interpret(),
                                     reason="Mosaic GPU interpret mode needs jax >= 0.12")


def _bits(q):
    return np.asarray(jax.lax.bitcast_convert_type(q, jnp.uint8))


def _x(seed, shape):
    """bf16 normal values with magnitudes from 2^-6 to 2^6 by row and by column (every block its own scale), +-inf
    (saturating to +-448: the amax sees finite values only), NaN, two values near the bf16 maximum (their blocks'
    amax) and an all-zero 128 x 128 tile (the floor scale)."""
    r, c = shape
    k1, k2 = jax.random.split(jax.random.key(seed + 100))
    mag = jnp.exp2(jax.random.randint(k1, (r, 1), -6, 7) + jax.random.randint(k2, (1, c), -6, 7) // 2)
    x = rand(seed, shape, jnp.float32, scale=3.0) * mag
    x = x.at[3, 5].set(jnp.inf).at[4, 6].set(-jnp.inf).at[7, 200].set(jnp.nan).at[130, 9].set(jnp.nan)
    x = x.at[130, 10].set(3e38).at[131, 11].set(-3e38)  # each its row's and its column's amax
    x = x.at[r - 128:, c - 128:].set(0.0)
    return x.astype(jnp.bfloat16)


def _check(x, pow2, interpret=True, config=None, dtype=E4, square=False):
    got = sm90.quantize_blockwise_sm90(x, dtype=dtype, power_of_2=pow2, interpret=interpret, config=config,
                                       square=square)
    block_n, block_t = (WEIGHT, WEIGHT) if square else (ACT, ACT[::-1])
    want = kernel.quantize_blockwise(x, dtype=dtype, block_n=block_n, block_t=block_t, power_of_2=pow2,
                                     interpret=interpret)
    q, s, qt, st = got
    r, c = x.shape
    assert q.shape == (r, c) and qt.shape == (c, r) and q.dtype == qt.dtype == jnp.dtype(dtype)
    scale_rows = (r // 128) if square else r
    assert s.shape == (c // 128, scale_rows) and st.shape == (r // 128, c // 128 if square else c)
    assert s.dtype == st.dtype == jnp.float32
    for g, w in zip(got, want):
        if g.dtype == jnp.float32:
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        else:
            _assert_same_codes(g, w)
    return got


def _assert_same_codes(got, want):
    """Bit for bit, except that a NaN may be any of its format's NaN codes. e4m3fn has one per sign, so its codes
    are compared whole; e5m2 has three (0x7D-0x7F), and which one XLA:CPU's conversion of a NaN lands on depends on
    how the program around it is fused (a bf16 NaN converted directly gives 0x7F, through fp32 0x7E), which varies
    from one kernel's interpret-mode program to another's and from one jax release to the next. On the GPU both
    kernels convert with cvt.rn.satfinite, whose NaN is 0x7F."""
    g, w = _bits(got), _bits(want)
    g_nan, w_nan = np.isnan(np.asarray(got, np.float32)), np.isnan(np.asarray(want, np.float32))
    np.testing.assert_array_equal(g_nan, w_nan)
    if jnp.dtype(got.dtype) != jnp.dtype(jnp.float8_e5m2):
        np.testing.assert_array_equal(g, w)
    else:
        np.testing.assert_array_equal(np.where(g_nan, 0, g), np.where(w_nan, 0, w))


@needs_interpret
@pytest.mark.parametrize("shape", [(256, 384), (384, 256)])
@pytest.mark.parametrize("pow2", [False, True], ids=["fp32_scales", "pow2_scales"])
def test_matches_triton_kernel(shape, pow2):
    """The tuned launch (one tile per program), and against the reference directly: scales
    in the K-block-major layout, saturation to +-448, NaN kept, the zero tile at the floor scale."""
    x = _x(0, shape)
    q, s, qt, st = _check(x, pow2)
    for got_q, got_s, operand in ((q, s, x), (qt, st, x.T)):
        want_q, want_s = ref.quantize_blockwise_reference(operand, E4, ACT, pow2)
        np.testing.assert_array_equal(np.asarray(kernel.reference_layout(got_s)), np.asarray(want_s))
        np.testing.assert_array_equal(_bits(got_q), _bits(want_q))
    qf = np.asarray(q.astype(jnp.float32))
    assert qf[3, 5] == 448.0 and qf[4, 6] == -448.0
    if not pow2:  # a block's amax maps to the top of the range (a power-of-2 scale may leave it lower)
        assert qf[130, 10] == 448.0 and qf[131, 11] == -448.0
    assert np.isnan(qf[7, 200]) and np.isnan(qf[130, 9]) and np.sum(np.isnan(qf)) == 2
    assert not np.any(qf[-128:, -128:]) and np.all(np.asarray(s) > 0)


@needs_interpret
@pytest.mark.parametrize("pow2", [False, True], ids=["fp32_scales", "pow2_scales"])
def test_weight_tiles(pow2):
    """A weight's 128 x 128 tiles: one scale per tile for q and q^T (the tile's amax across all its rows, in both
    layouts), bit for bit the Triton kernel's and the reference's; inf saturates, NaN is kept, the zero tile takes the
    floor scale."""
    x = _x(4, (384, 256))
    # each tile scaled by its own power of 2 (exact), so that every tile's scale differs
    x = x * jnp.exp2(-jnp.arange(6, dtype=jnp.float32).reshape(3, 2)).repeat(128, 0).repeat(128, 1).astype(x.dtype)
    q, s, qt, st = _check(x, pow2, square=True)
    want_q, want_s = ref.quantize_blockwise_reference(x, E4, WEIGHT, pow2)
    np.testing.assert_array_equal(np.asarray(st), np.asarray(want_s))
    np.testing.assert_array_equal(np.asarray(s), np.asarray(want_s).T)
    np.testing.assert_array_equal(_bits(q), _bits(want_q))
    np.testing.assert_array_equal(_bits(qt), _bits(want_q).T)
    qf = np.asarray(q.astype(jnp.float32))
    assert qf[3, 5] == 448.0 and qf[4, 6] == -448.0 and np.isnan(qf[7, 200]) and np.sum(np.isnan(qf)) == 2
    assert not np.any(qf[-128:, -128:]) and np.all(np.asarray(s) > 0)
    assert len(np.unique(np.asarray(s))) == s.size  # every tile's scale from its own amax


@needs_interpret
@pytest.mark.parametrize("config", [sm90.QuantizeConfig(chunk=128, key_amax=False),
                                    sm90.QuantizeConfig(steps=4, stages=3, out_slots=2, chunk=64),
                                    sm90.QuantizeConfig(steps=5, stages=2, out_slots=1, chunk=64)],
                         ids=["whole_tile_finite_abs", "deep_ring", "steps_rounded_down"])
def test_launches(config):
    """Other launches, for both kinds of blocks: the whole tile at once with the amax of finite |x|, a ring deeper than
    one output slot, steps that do not divide the tile count (rounded down to a divisor)."""
    _check(_x(1, (256, 512)), False, config=config)
    _check(_x(1, (256, 512)), True, config=config, square=True)


@needs_interpret
def test_e5m2():
    for square in (False, True):
        _check(_x(3, (256, 256)), True, dtype=jnp.float8_e5m2, square=square)
        _check(_x(3, (256, 256)), False, dtype=jnp.float8_e5m2, square=square)


def test_unsupported_shapes():
    for shape, dtype in (((100, 128), jnp.bfloat16), ((128, 200), jnp.bfloat16), ((0, 128), jnp.bfloat16),
                         ((128, 128), jnp.float32)):
        assert not sm90.supported(*shape, dtype)
        with pytest.raises(ValueError, match="bfloat16 or float16 with both dimensions positive multiples of 128"):
            sm90.quantize_blockwise_sm90(jnp.ones(shape, dtype), dtype=E4)


def test_api_routes_to_sm90():
    """fp8's blockwise quantize takes the Hopper kernel for both copies of an activation or a weight, a 16-bit x of
    128-multiple shape on Hopper, and the Triton kernel for anything else (one copy alone, other blocks, a ragged or
    fp32 x, another GPU)."""
    from pallas_fused.fp8 import api

    x = jax.ShapeDtypeStruct((256, 384), jnp.bfloat16)
    with _backend.gpu_target((9, 0)):
        assert api._quantize_on_sm90(x, (1, 128), (128, 1))
        assert api._quantize_on_sm90(x, (128, 128), (128, 128))
        assert not api._quantize_on_sm90(x, (1, 128), None)
        assert not api._quantize_on_sm90(x, (128, 128), None)
        assert not api._quantize_on_sm90(x, (64, 128), (64, 128))
        assert not api._quantize_on_sm90(jax.ShapeDtypeStruct((200, 384), jnp.bfloat16), (1, 128), (128, 1))
        assert not api._quantize_on_sm90(jax.ShapeDtypeStruct((256, 384), jnp.float32), (1, 128), (128, 1))
    with _backend.gpu_target((8, 0)):
        assert not api._quantize_on_sm90(x, (1, 128), (128, 1))


@pytest.mark.gpu
@pytest.mark.skipif(not _backend.is_hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("shape", [(4096, 2048), (1024, 768)])
def test_gpu_matches_triton_kernel(shape):
    """Compiled: bit for bit the Triton kernel's (both take x * (1 / scale), the reciprocal correctly rounded, and
    convert with cvt.rn.satfinite), for activations and weights."""
    for pow2, square in itertools.product((False, True), (False, True)):
        _check(_x(2, shape), pow2, interpret=False, square=square)
