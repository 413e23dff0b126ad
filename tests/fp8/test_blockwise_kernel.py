"""The one-pass blockwise quantize kernel (`kernel.quantize_blockwise`) against `quantize_blockwise_reference`, bit
for bit, in interpret mode (and on the GPU), and the blockwise layer's Pallas path against its XLA path."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_fused.fp8 import Float8Config, fp8_linear, kernel
from pallas_fused.fp8 import reference as ref
from tests.helpers import rand

E4 = jnp.float8_e4m3fn
ACT, WEIGHT = (1, 128), (128, 128)
_ref = jax.jit(ref.quantize_blockwise_reference, static_argnums=(1, 2, 3))


def _bits(q):
    return np.asarray(jax.lax.bitcast_convert_type(q, jnp.uint8))


def _x(seed, shape, dtype):
    """Random normal with magnitudes from 2^-6 to 2^6 by row and by column, so that every block has its own scale."""
    r, c = shape
    k1, k2 = jax.random.split(jax.random.key(seed + 100))
    mag = jnp.exp2(jax.random.randint(k1, (r, 1), -6, 7) + jax.random.randint(k2, (1, c), -6, 7) // 2)
    return (rand(seed, shape, jnp.float32, scale=3.0) * mag).astype(dtype)


def _run(x, block_n, block_t, pow2, interpret=True):
    return kernel.quantize_blockwise(x, dtype=E4, block_n=block_n, block_t=block_t, power_of_2=pow2,
                                     interpret=interpret)


def _check(x, block_n, block_t, pow2, interpret=True):
    """Each asked copy and its scales equal the reference's (q^T: the reference of x^T with the block transposed).

    Compiled for the GPU, XLA rewrites the reference's x * (1 / scale) into a correctly rounded x / scale, which
    differs from the kernel's product with the correctly rounded reciprocal by one fp32 ulp now and then; where
    that lands on a rounding boundary of the fp8 grid, the two codes are neighbours (2 to 86 of 8.4 million
    elements measured on an H200, as XLA's fusion of the reference varies). There the codes may differ by one step
    at a rate of at most 1e-4; the scales must not."""
    q, s, qt, st = _run(x, block_n, block_t, pow2, interpret)
    assert (q is None) == (block_n is None) and (qt is None) == (block_t is None)
    for got_q, got_s, operand, block in ((q, s, x, block_n), (qt, st, x.T, block_t and block_t[::-1])):
        if block is None:
            continue
        want_q, want_s = _ref(operand, E4, block, pow2)
        assert got_q.dtype == jnp.dtype(E4) and got_s.dtype == jnp.float32
        assert got_s.shape == want_s.shape[::-1]  # K-block major: one row per block along the contraction
        np.testing.assert_array_equal(np.asarray(kernel.reference_layout(got_s)), np.asarray(want_s))
        if interpret:
            np.testing.assert_array_equal(_bits(got_q), _bits(want_q))
        else:
            got_f, want_f = np.asarray(got_q, np.float32), np.asarray(want_q, np.float32)
            differ = (got_f != want_f) & ~(np.isnan(got_f) & np.isnan(want_f))
            assert differ.mean() <= 1e-4, f"{differ.sum()} of {differ.size} codes differ"
            steps = np.abs(_bits(got_q)[differ].astype(int) - _bits(want_q)[differ].astype(int))
            assert (steps <= 1).all(), f"codes differ by up to {steps.max()} steps"
    return q, s, qt, st


@pytest.mark.parametrize("shape,dtype,pow2", [
    ((130, 300), jnp.bfloat16, False), ((130, 300), jnp.float32, True), ((1, 128), jnp.bfloat16, True),
    ((128, 1), jnp.float32, False), ((257, 129), jnp.bfloat16, False), ((257, 129), jnp.float32, True)])
def test_matches_reference(shape, dtype, pow2):
    """Activations (q along the columns and q^T along the rows, one pass) and weights (128 x 128 tiles shared by q
    and q^T): bit-equal to the reference, ragged edges included."""
    x = _x(0, shape, dtype)
    _check(x, ACT, ACT[::-1], pow2)
    q, s, qt, st = _check(x, WEIGHT, WEIGHT, pow2)
    np.testing.assert_array_equal(np.asarray(s), np.asarray(st).T)  # one scale per tile, in both layouts


# Launches beside the heuristic's (packed by 64-row chunks for both copies, 32-row chunks for one, square tiles at
# once): the whole tile at once for both copies and one, square tiles by chunks. With a row count that is a multiple
# of 4 and one that is not, the two cover the packed and the unpacked two-copy pass, each looped and at once.
OTHER_LAUNCH = {"both": {"num_warps": 4, "rows": None, "packed": True}, "one": {"num_warps": 4, "rows": None},
                "square": {"num_warps": 4, "rows": 32}}


@pytest.fixture(params=["tuned", "other"])
def launch(request, monkeypatch):
    """The launch `quantize_blockwise` takes (on the CPU: BLOCKWISE_HEURISTIC), its jit cache cleared around it."""
    if request.param == "other":
        monkeypatch.setattr(kernel, "BLOCKWISE_HEURISTIC", OTHER_LAUNCH)
    kernel.quantize_blockwise.clear_cache()
    yield kernel.BLOCKWISE_HEURISTIC
    kernel.quantize_blockwise.clear_cache()


@pytest.mark.parametrize("shape,dtype,pow2", [((260, 200), jnp.bfloat16, False), ((130, 129), jnp.float32, True)])
def test_launches_match_reference(launch, shape, dtype, pow2):
    """Each launch form, bit for bit: both activation copies packed (rows % 4 == 0) or not, each copy alone, square
    tiles; ragged edges, bf16 and fp32, +-inf and NaN."""
    x = _x(10, shape, dtype).at[3, 5].set(jnp.inf).at[shape[0] - 1, 7].set(jnp.nan).at[9, 128].set(-jnp.inf)
    for block_n, block_t in ((ACT, ACT[::-1]), (ACT, None), (None, ACT[::-1]), (WEIGHT, WEIGHT)):
        tile, _, chunk, packed = kernel._blockwise_launch(shape[0], block_n, block_t)
        mode = "square" if block_n == block_t else "both" if block_n and block_t else "one"
        assert chunk == min(launch[mode]["rows"] or tile[0], tile[0])
        assert packed == (mode == "both" and launch[mode].get("packed", False) and shape[0] % 4 == 0)
        _check(x, block_n, block_t, pow2)


@pytest.mark.parametrize("block_n,block_t", [(ACT, None), (None, ACT[::-1]), (WEIGHT, None), (None, WEIGHT),
                                             ((1, 32), (64, 1)), ((32, 64), (32, 64))])
def test_one_copy_and_other_blocks(block_n, block_t):
    _check(_x(1, (70, 150), jnp.bfloat16), block_n, block_t, False)


def test_zero_tiles_saturation_and_non_finite():
    """An all-zero block gets the finite floor scale and zeros; +-inf saturates, NaN stays NaN, neither reaches its
    block's scale; a value near the fp32 max is its block's amax: exactly as the reference, in every layout."""
    x = rand(2, (140, 260), jnp.float32)
    x = x.at[3, 128:256].set(0.0).at[0:128, 0:128].set(0.0)  # a zero 1 x 128 block and a zero 128 x 128 tile
    x = x.at[130, 5].set(3e38).at[131, 7].set(-3e38).at[135, 200].set(jnp.inf).at[136, 201].set(-jnp.inf)
    x = x.at[137, 202].set(jnp.nan).at[50, 140].set(jnp.nan)
    for block_n, block_t in ((ACT, ACT[::-1]), (WEIGHT, WEIGHT)):
        q, s, qt, st = _check(x, block_n, block_t, False)
        assert np.all(np.isfinite(np.asarray(s))) and np.all(np.asarray(s) > 0)
        qf = np.asarray(q.astype(jnp.float32))
        assert qf[130, 5] == 448.0 and qf[131, 7] == -448.0 and qf[135, 200] == 448.0 and qf[136, 201] == -448.0
        assert np.isnan(qf[137, 202]) and np.isnan(qf[50, 140]) and np.sum(np.isnan(qf)) == 2
        assert not np.any(qf[3, 128:256]) and not np.any(qf[:128, :128])
    _check(x.astype(jnp.bfloat16), ACT, ACT[::-1], True)


@pytest.mark.parametrize("shape", [(0, 300), (130, 0), (0, 0)])
def test_empty(shape):
    x = jnp.zeros(shape, jnp.bfloat16)
    for block_n, block_t in ((ACT, ACT[::-1]), (WEIGHT, WEIGHT)):
        q, s, qt, st = _check(x, block_n, block_t, False)
        assert q.shape == shape and qt.shape == shape[::-1] and s.size == st.size == 0


@pytest.mark.parametrize("block_n,block_t", [(None, None), ((1, 100), None), ((2, 128), (128, 1)),
                                             ((128, 128), (64, 64)), (None, (1, 128)), ((1, 128), (1, 128))])
def test_unsupported_blocks(block_n, block_t):
    assert not kernel.blockwise_supported(block_n, block_t)
    with pytest.raises(ValueError, match="block_n=.*block_t=.*must be"):
        _run(jnp.ones((4, 128)), block_n, block_t, False)


BLOCKWISE = Float8Config.from_recipe("blockwise")


@pytest.mark.parametrize("config", [BLOCKWISE, dataclasses.replace(BLOCKWISE, round_scales_to_power_of_2=True)],
                         ids=["fp32_scales", "pow2_scales"])
def test_layer_interpret_equals_xla(config):
    """fp8_linear with implementation="interpret" (the kernel quantizes x and dy in both layouts and W once) gives
    the forward and both gradients of the "xla" path bit for bit: same quantization, same fp32 GEMMs."""
    x, w, dy = rand(3, (130, 300), jnp.bfloat16), rand(4, (300, 200), jnp.bfloat16), rand(5, (130, 200), jnp.bfloat16)

    def layer(impl, x, w, dy):
        y, vjp = jax.vjp(lambda x, w: fp8_linear(x, w, config, implementation=impl), x, w)
        return (y, *vjp(dy))

    want = jax.jit(functools.partial(layer, "xla"))(x, w, dy)
    got = jax.jit(functools.partial(layer, "interpret"))(x, w, dy)
    for g, v in zip(got, want):
        assert g.dtype == v.dtype == jnp.bfloat16 and g.shape == v.shape
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(v, np.float32))


def test_layer_mixed_blockwise_and_rowwise():
    """Blockwise for some arguments only: x blocked for y = x W but rowwise for dW, W blocked for one GEMM only."""
    c = Float8Config.from_recipe("blockwise")
    row = Float8Config.from_recipe("rowwise").cast_config_input
    config = dataclasses.replace(c, cast_config_input_for_grad_weight=row, cast_config_weight_for_grad_input=row)
    x, w, dy = rand(6, (40, 136), jnp.float32), rand(7, (136, 24), jnp.float32), rand(8, (40, 24), jnp.float32)
    (y0, vjp0), (y1, vjp1) = (jax.vjp(lambda x, w, i=impl: fp8_linear(x, w, config, implementation=i), x, w)
                              for impl in ("xla", "interpret"))
    for a, b in zip((y0, *vjp0(dy)), (y1, *vjp1(dy))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 2048), (1000, 700), (1001, 700)])
def test_gpu_matches_reference(shape):
    """The compiled kernel at its tuned launches (the packed two-copy pass where rows % 4 == 0, the unpacked one
    where not; the conversion's own saturation; products and a correctly rounded reciprocal, PTX rcp.rn) against
    XLA's reference on the GPU: scales bit for bit, codes as `_check` says."""
    for dtype in (jnp.bfloat16, jnp.float32):
        x = _x(9, shape, dtype).at[7, 9].set(jnp.inf).at[8, 10].set(jnp.nan).at[300, 5].set(-jnp.inf)
        for pow2 in (False, True):
            _check(x, ACT, ACT[::-1], pow2, interpret=False)
            _check(x, WEIGHT, WEIGHT, pow2, interpret=False)
        _check(x, ACT, None, False, interpret=False)
        _check(x, None, ACT[::-1], True, interpret=False)
