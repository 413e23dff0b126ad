"""FP8 blockwise scaling (DeepSeek-V3's recipe): the config, per-tile quantization, the exact fp32 product of the
dequantized operands, the recipe through fp8_linear and the Flax drop-ins on XLA (the quantize kernel:
test_blockwise_kernel.py), and on a Hopper GPU the GEMM kernel with per-K-block scale promotion (the `gpu` tests)."""

import dataclasses
import functools
import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallas_fused.fp8 import CastConfig, Float8Config, Float8Dense, Float8DotGeneral, fp8_linear
from pallas_fused.fp8 import reference as ref
from tests.fp8.test_fp8 import sqnr
from tests.helpers import rand

E4, E5 = jnp.float8_e4m3fn, jnp.float8_e5m2
BLOCKWISE = Float8Config.from_recipe("blockwise")
BLOCKWISE_POW2 = dataclasses.replace(BLOCKWISE, round_scales_to_power_of_2=True)
# Ragged everywhere: 130 tokens, 300 -> 200 features (tiles of 128 leave 2, 44 and 72 over).
T, DIN, DOUT = 130, 300, 200


def _f32(q):
    return np.asarray(q.astype(jnp.float32))


def _ints(seed, shape, lo=-8, hi=9):
    return jax.random.randint(jax.random.key(seed), shape, lo, hi).astype(jnp.float32)


def _tiles(shape, block):
    """(row slice, col slice) of every tile, row-major, ragged last tiles included."""
    (m, k), (bm, bk) = shape, block
    return [(i, j, slice(i * bm, (i + 1) * bm), slice(j * bk, (j + 1) * bk))
            for i in range(-(-m // bm)) for j in range(-(-k // bk))]


def _layer(config, x, w, dy, implementation=None):
    y, vjp = jax.vjp(lambda x, w: fp8_linear(x, w, config, implementation=implementation), x, w)
    return (y, *vjp(dy))


# ---------------------------------------------------------------------------------------------- config


def test_recipe():
    cfg = BLOCKWISE
    act, weight = CastConfig("blockwise", E4, block=(1, 128)), CastConfig("blockwise", E4, block=(128, 128))
    assert cfg.cast_config_input == cfg.cast_config_grad_output == act
    assert cfg.cast_config_input_for_grad_weight == cfg.cast_config_grad_output_for_grad_weight == act
    assert cfg.cast_config_weight == cfg.cast_config_weight_for_grad_input == weight
    assert not cfg.round_scales_to_power_of_2 and cfg.blockwise
    assert hash(cfg) == hash(Float8Config.from_recipe("blockwise"))
    assert not any(Float8Config.from_recipe(r).blockwise for r in ("tensorwise", "rowwise", "rowwise_with_gw_hp"))
    assert CastConfig("blockwise", E4, block=[1, 128]).block == (1, 128)  # a list is taken, stored hashable


@pytest.mark.parametrize("kwargs,match", [
    (dict(scaling="blockwise"), "block must be a pair of positive ints"),
    (dict(scaling="blockwise", block=(0, 128)), "block must be a pair of positive ints"),
    (dict(scaling="blockwise", block=(128,)), "block must be a pair of positive ints"),
    (dict(scaling="blockwise", block=(1.0, 128)), "block must be a pair of positive ints"),
    (dict(scaling="blockwise", block=(True, 128)), "block must be a pair of positive ints"),
    (dict(scaling="blockwise", block=128), "block must be a pair of positive ints"),
    (dict(scaling="axiswise", block=(1, 128)), "block is for scaling='blockwise' only"),
    (dict(scaling="blockwise", dtype=jnp.bfloat16, block=(1, 128)), "dtype must be"),
])
def test_bad_cast_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CastConfig(**kwargs)


@pytest.mark.parametrize("implementation", ["pallas:sm90", "pallas:triton"])
def test_gemm_variants_refused(implementation):
    x, w = rand(0, (4, 8)), rand(1, (8, 3))
    msg = "blockwise scaling takes implementation None, 'xla', 'pallas' or 'interpret'"
    with pytest.raises(ValueError, match=msg):
        fp8_linear(x, w, "blockwise", implementation=implementation)
    with pytest.raises(ValueError, match=msg):
        Float8Dense(3, config="blockwise", implementation=implementation).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="implementation must be None or one of"):  # an unknown name: the usual error
        fp8_linear(x, w, "blockwise", implementation="pallas:cublas")


def test_blockwise_tile():
    """The blockwise GEMM's tile: each warpgroup's accumulators (the K step's product and the running sum) fit
    the registers (at most 128 x 64 fp32 each), the tuned split unless only the other avoids padding, K = one
    scale block, the SMEM stages fit beside the scale rows (4 at a 128 x 128 CTA tile, bf16 or fp32 out), and a
    tall output walks the grid along M, a wide one along N."""
    from pallas_fused.fp8 import kernel_sm90

    # The tuned 64 x 128 split along M (a 128 x 128 CTA tile); split along N (64 x 256) where only that fits.
    for (m, n), split in (((16384, 5504), "m"), ((16384, 512), "m"), ((300, 200), "m"), ((320, 512), "n")):
        for out_dtype in (jnp.bfloat16, jnp.float32):
            tile = kernel_sm90.blockwise_tile(m, n, out_dtype)
            assert tile.tile_m * tile.tile_n <= 128 * 64 and tile.tile_k == kernel_sm90.BLOCK_K
            assert tile.wg_split == split, (m, n, tile)
            assert tile.grid_minor_dim == ("m" if m >= n else "n"), (m, n, tile)
            assert kernel_sm90.blockwise_config(tile, out_dtype) == tile
            if tile.cta_tile == (128, 128):
                assert tile.max_concurrent_steps == 4, tile


# ---------------------------------------------------------------------------------------------- quantize


@pytest.mark.parametrize("block", [(1, 128), (128, 128), (7, 5)])
@pytest.mark.parametrize("pow2", [False, True])
def test_quantize_blockwise_per_tile(block, pow2):
    """Every tile (ragged ones included) is quantized as `quantize_reference` quantizes it alone."""
    x = rand(2, (T, DIN), jnp.bfloat16, scale=3.0) * jnp.exp2(_ints(3, (T, 1), -6, 7)).astype(jnp.bfloat16)
    q, s = jax.jit(ref.quantize_blockwise_reference, static_argnums=(1, 2, 3))(x, E4, block, pow2)
    assert q.dtype == jnp.dtype(E4) and q.shape == x.shape and s.dtype == jnp.float32
    assert s.shape == (-(-T // block[0]), -(-DIN // block[1]))
    tiles = _tiles(x.shape, block)
    differ = seen = 0
    for i, j, rows, cols in [*tiles[:: max(1, len(tiles) // 12)], tiles[-1]]:  # a sample, the ragged corner too
        qt, st = ref.quantize_reference(x[rows, cols], E4, None, pow2)
        # XLA may turn the division by fp8_max into a reciprocal multiply: 1 ulp in the scale, and the rare
        # element that then rounds to the neighbouring fp8 value (one subnormal step, 2^-9, near zero)
        np.testing.assert_allclose(np.asarray(s[i, j]), np.asarray(st), rtol=2e-7)
        np.testing.assert_allclose(_f32(q[rows, cols]), _f32(qt), rtol=0.13, atol=2.0**-9)
        differ, seen = differ + np.sum(_f32(q[rows, cols]) != _f32(qt)), seen + qt.size
    assert differ <= 0.01 * seen
    deq = ref.dequantize_blockwise(q, s, block)
    assert sqnr(deq, x) >= 25
    if pow2:
        assert np.all(np.frexp(np.asarray(s))[0] == 0.5)


def test_quantize_blockwise_zero_tiles_saturation_and_non_finite():
    x = rand(4, (6, 300), jnp.float32)
    x = x.at[2, 128:256].set(0.0)  # one all-zero 1 x 128 tile
    x = x.at[4, 0].set(3e38).at[5, 260].set(jnp.inf).at[5, 261].set(jnp.nan)  # huge, inf and NaN in other tiles
    q, s = ref.quantize_blockwise_reference(x, E4, (1, 128))
    sf, qf = np.asarray(s), _f32(q)
    assert np.all(np.isfinite(sf)) and np.all(sf > 0)
    assert sf[2, 1] == np.float32(ref.AMAX_FLOOR) / np.float32(448.0) and not np.any(qf[2, 128:256])
    assert qf[4, 0] == 448.0 and np.all(np.isfinite(qf[4]))  # the huge value is its tile's amax: fp8 max
    assert qf[5, 260] == 448.0 and np.isnan(qf[5, 261])  # inf saturates, NaN stays NaN
    # the tile with inf and NaN is scaled by its finite values, and the tiles beside it are untouched
    clean = x.at[5, 260].set(0.0).at[5, 261].set(0.0)
    q0, s0 = ref.quantize_blockwise_reference(clean, E4, (1, 128))
    np.testing.assert_array_equal(sf, np.asarray(s0))
    np.testing.assert_array_equal(np.delete(qf[5], [260, 261]), np.delete(_f32(q0)[5], [260, 261]))
    # the cast saturates at fp8_max where the scales are too small for the values
    sat = ref.saturating_cast(x[:1], ref.expand_block_scales(s[:1] / 4, (1, 128), (1, 300)), E4)
    assert np.max(np.abs(_f32(sat))) == 448.0


@pytest.mark.parametrize("shape", [(0, 300), (130, 0), (0, 0)])
def test_quantize_blockwise_empty(shape):
    q, s = ref.quantize_blockwise_reference(jnp.zeros(shape, jnp.bfloat16), E4, (1, 128))
    assert q.shape == shape and s.shape == (shape[0], -(-shape[1] // 128))


# ---------------------------------------------------------------------------------------------- matmul


def test_blockwise_matmul_exact_on_small_ints():
    """Small integers times power-of-2 scales are exact in e4m3: the blockwise product equals the fp32 one."""
    a, bt = _ints(5, (T, DIN)), _ints(6, (DOUT, DIN))
    a8, sa = ref.quantize_blockwise_reference(a, E4, (1, 128), power_of_2=True)
    b8, sb = ref.quantize_blockwise_reference(bt, E4, (128, 128), power_of_2=True)
    np.testing.assert_array_equal(_f32(ref.dequantize_blockwise(a8, sa, (1, 128))), np.asarray(a))
    out = ref.blockwise_scaled_matmul_nt_reference(a8, b8, sa, sb, (1, 128), (128, 128), out_dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(a) @ np.asarray(bt).T)
    bf = ref.blockwise_scaled_matmul_nt_reference(a8, b8, sa, sb, (1, 128), (128, 128))
    assert bf.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(bf, np.float32), np.asarray(out.astype(jnp.bfloat16), np.float32))


def test_layer_exact_on_small_ints():
    """The three GEMMs of the layer on small integers with power-of-2 scales: exactly the fp32 GEMMs."""
    x, w, dy = _ints(7, (T, DIN)), _ints(8, (DIN, DOUT)), _ints(9, (T, DOUT))
    y, dx, dw = jax.jit(functools.partial(_layer, BLOCKWISE_POW2))(x, w, dy)
    xn, wn, dyn = (np.asarray(v, np.float64) for v in (x, w, dy))
    for got, want in ((y, xn @ wn), (dx, dyn @ wn.T), (dw, xn.T @ dyn)):
        assert got.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(got, np.float64), want)


@pytest.mark.parametrize("config", [BLOCKWISE, BLOCKWISE_POW2], ids=["fp32_scales", "pow2_scales"])
def test_layer_gemms_follow_the_reference(config):
    """fp8_linear's forward and vjp are the three blockwise GEMMs built from the references: x and dy
    re-quantized along the tokens for dW = x^T dy, W in 128 x 128 blocks for both of its GEMMs."""
    x, w, dy = rand(10, (T, DIN), jnp.bfloat16), rand(11, (DIN, DOUT), jnp.bfloat16), rand(12, (T, DOUT),
                                                                                           jnp.bfloat16)
    pow2 = config.round_scales_to_power_of_2

    def gemm(a, bt, a_block, b_block):  # both K-major
        a8, sa = ref.quantize_blockwise_reference(a, E4, a_block, pow2)
        b8, sb = ref.quantize_blockwise_reference(bt, E4, b_block, pow2)
        return ref.blockwise_scaled_matmul_nt_reference(a8, b8, sa, sb, a_block, b_block, out_dtype=jnp.bfloat16)

    act, wb = (1, 128), (128, 128)
    want = jax.jit(lambda x, w, dy: (gemm(x, w.T, act, wb), gemm(dy, w, act, wb), gemm(x.T, dy.T, act, act)))(
        x, w, dy)
    got = jax.jit(functools.partial(_layer, config))(x, w, dy)
    for g, v in zip(got, want):
        assert g.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(v, np.float32), rtol=1e-2, atol=1e-2)
        assert sqnr(g, v) >= 45  # one bf16 rounding apart at most (the order of the fp32 sums may differ)


def test_layer_sqnr_per_gemm_vs_bf16():
    """Random normal inputs: each of the three GEMMs within 25 dB of the bf16 layer's (jax.vjp of x @ w)."""
    x, w, dy = rand(13, (T, DIN), jnp.bfloat16), rand(14, (DIN, DOUT), jnp.bfloat16), rand(15, (T, DOUT),
                                                                                           jnp.bfloat16)
    y0, vjp0 = jax.vjp(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype), x, w)
    got = jax.jit(functools.partial(_layer, BLOCKWISE))(x, w, dy)
    for g, want in zip(got, (y0, *vjp0(dy))):
        assert sqnr(g, want) >= 25


def test_blockwise_keeps_what_rowwise_loses():
    """x's magnitude changes along K by 2^10 per 128 columns and W's rows the other way, so that every K-block
    adds as much to y: one scale per row (of x, and of W^T) flushes the smallest block below e4m3's range
    (rowwise: ~2 dB), one per 1 x 128 tile (per 128 x 128 block of W) keeps each block precise (~29 dB)."""
    ramp = jnp.repeat(jnp.exp2(jnp.arange(3.0) * 10 - 10), 128)
    x = rand(16, (64, 384), jnp.float32) * ramp[None, :]
    w = rand(17, (384, 96), jnp.float32) / ramp[:, None]
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    linear = jax.jit(fp8_linear, static_argnums=2)
    row, block = (sqnr(linear(x, w, r), exact) for r in ("rowwise", "blockwise"))
    assert block >= 25 and row < 10, (row, block)


def test_layer_empty_contraction_and_batched_x():
    w = rand(18, (0, 5))
    y, dx, dw = jax.jit(functools.partial(_layer, "blockwise"))(jnp.zeros((3, 0)), w, jnp.ones((3, 5)))
    assert y.shape == (3, 5) and not np.any(np.asarray(y)) and dx.shape == (3, 0) and dw.shape == (0, 5)
    x3 = rand(19, (2, 65, DIN), jnp.bfloat16)
    w = rand(20, (DIN, DOUT), jnp.bfloat16)
    linear = jax.jit(fp8_linear, static_argnums=2)
    y3 = linear(x3, w, "blockwise")
    np.testing.assert_array_equal(np.asarray(y3.reshape(T, DOUT), np.float32),
                                  np.asarray(linear(x3.reshape(T, DIN), w, "blockwise"), np.float32))


# ---------------------------------------------------------------------------------------------- flax


def _loss(apply, g):
    return lambda p, x: jnp.sum(apply(p, x).astype(jnp.float32) * g)


def test_flax_linen_dense_vs_bf16():
    x = rand(21, (2, 65, DIN), jnp.bfloat16)
    g = rand(22, (2, 65, DOUT), jnp.float32)
    dense = nn.Dense(DOUT, dtype=jnp.bfloat16)
    layers = [nn.Dense(DOUT, dtype=jnp.bfloat16, dot_general_cls=functools.partial(Float8DotGeneral,
                                                                                    config="blockwise")),
              Float8Dense(DOUT, config="blockwise", dtype=jnp.bfloat16)]
    v = dense.init(jax.random.key(0), x)
    run = jax.jit(lambda m, v, x: (m.apply(v, x), jax.grad(_loss(m.apply, g), argnums=(0, 1))(v, x)),
                  static_argnums=0)
    y0, (gv0, gx0) = run(dense, v, x)
    outs = [run(layer, v, x) for layer in layers]
    (y, (gv, gx)), (y_fd, _) = outs
    assert y.dtype == jnp.bfloat16 and y.shape == y0.shape
    assert sqnr(y, y0) >= 18
    assert sqnr(gv["params"]["kernel"], gv0["params"]["kernel"]) >= 18
    assert sqnr(gx, gx0) >= 18
    np.testing.assert_array_equal(np.asarray(y_fd, np.float32), np.asarray(y, np.float32))


def test_flax_nnx_linear_vs_bf16():
    lin = nnx.Linear(DIN, DOUT, rngs=nnx.Rngs(0))
    lin8 = nnx.Linear(DIN, DOUT, dot_general=Float8DotGeneral("blockwise"), rngs=nnx.Rngs(0))
    x = rand(23, (T, DIN), jnp.float32)
    assert sqnr(nnx.jit(lambda m, x: m(x))(lin8, x), lin(x)) >= 18
    grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x) ** 2)))(lin8)
    grads0 = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x) ** 2)))(lin)
    assert sqnr(grads.kernel[...], grads0.kernel[...]) >= 18
    assert sqnr(grads.bias[...], grads0.bias[...]) >= 18


# ---------------------------------------------------------------------------------------------- GPU


def _hopper():
    from pallas_fused import _backend

    if not _backend.is_hopper():
        pytest.skip("the blockwise kernel needs a Hopper GPU")


def _block_magnitudes(seed, shape, block):
    """A power of two per `block` tile of `shape`, 2^-5 .. 2^5: per-K-block magnitudes varying by 2^10, so that a
    kernel applying one K block's scales to another's product (or none) is far off."""
    (m, k), (bm, bk) = shape, block
    e = jax.random.randint(jax.random.key(seed), (-(-m // bm), -(-k // bk)), -5, 6).astype(jnp.float32)
    return ref.expand_block_scales(jnp.exp2(e), block, shape)


def _blockwise_operands(seed, m, n, k, b_block, ints=False):
    """a (M, K) in 1 x 128 tiles, bt (N, K) in `b_block` tiles, quantized; random normal (or small integers) times
    per-tile powers of two."""
    draw = (lambda s, shape: _ints(s, shape, -3, 4)) if ints else (lambda s, shape: rand(s, shape, jnp.float32))
    a = draw(seed, (m, k)) * _block_magnitudes(seed + 1, (m, k), (1, 128))
    bt = draw(seed + 2, (n, k)) * _block_magnitudes(seed + 3, (n, k), b_block)
    a8, sa = ref.quantize_blockwise_reference(a, E4, (1, 128), power_of_2=ints)
    b8, sb = ref.quantize_blockwise_reference(bt, E4, b_block, power_of_2=ints)
    return a8, sa, b8, sb


def _kernel_configs(m, n, k):
    from pallas_fused.fp8 import kernel_sm90

    large, small, _ = kernel_sm90.tiles()
    configs = [kernel_sm90.config_for(m, n, k), large, dataclasses.replace(large, wg_split="m"), small]
    return [c for c in dict.fromkeys(configs) if kernel_sm90.supported(m, n, k, E4, E4, c)]


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(256, 512, 384), (1024, 2048, 1024)])
@pytest.mark.parametrize("b_block", [(128, 128), (1, 128)], ids=["weight_blocks", "token_tiles"])
def test_gpu_kernel_vs_reference(m, k, n, b_block):
    """kernel_sm90.blockwise_matmul_nt against the exact fp32 product of the dequantized operands, with every tile
    config that takes the shape: 128 x 128-block b (the forward and dx GEMMs) and 1 x 128-tile b (dW)."""
    _hopper()
    from pallas_fused.fp8 import api, kernel_sm90

    a8, sa, b8, sb = _blockwise_operands(40, m, n, k, b_block)
    want = ref.blockwise_scaled_matmul_nt_reference(a8, b8, sa, sb, (1, 128), b_block, out_dtype=jnp.float32)
    sa_t = api._step_scales(api._Operand(a8, sa.T, block=(1, 128)), k)
    sb_t = api._step_scales(api._Operand(b8, sb.T, block=b_block), k)
    assert sa_t.shape == (k // 128, m) and sb_t.shape == (k // 128, n)
    # What a kernel that ignored the per-K-block scales (one scale per row and column, the mean) would give.
    ignored = ref.matmul_nt_fp32(a8.astype(jnp.float32) * jnp.mean(sa_t, 0)[:, None],
                                 b8.astype(jnp.float32) * jnp.mean(sb_t, 0)[:, None], jnp.float32)
    assert sqnr(ignored, want) < 10
    configs = _kernel_configs(m, n, k)
    assert configs
    for config in configs:
        for out_dtype, floor in ((jnp.float32, 40), (jnp.bfloat16, 38)):
            cfg = kernel_sm90.blockwise_config(config, out_dtype)
            got = jax.jit(functools.partial(kernel_sm90.blockwise_matmul_nt, out_dtype=out_dtype, config=cfg))(
                a8, b8, sa_t, sb_t)
            assert got.dtype == out_dtype and got.shape == (m, n)
            assert sqnr(got, want) >= floor, (cfg, out_dtype, sqnr(got, want))


@pytest.mark.gpu
@pytest.mark.parametrize("b_block", [(128, 128), (1, 128)], ids=["weight_blocks", "token_tiles"])
def test_gpu_kernel_promotion(b_block):
    """The tuned tile (64 x 128 split along M) and 128 x 64 split along N, each K step's stage released after the
    promotion or as soon as its wgmma is done (early_release), with the block heights passed (a 128 x 128-block
    b's scale read once per warpgroup tile) and not, against the exact product."""
    _hopper()
    from pallas_fused import _sm90
    from pallas_fused.fp8 import api, kernel_sm90

    m, k, n = 512, 768, 512
    a8, sa, b8, sb = _blockwise_operands(43, m, n, k, b_block)
    want = ref.blockwise_scaled_matmul_nt_reference(a8, b8, sa, sb, (1, 128), b_block, out_dtype=jnp.float32)
    sa_t = api._step_scales(api._Operand(a8, sa.T, block=(1, 128)), k)
    sb_t = api._step_scales(api._Operand(b8, sb.T, block=b_block), k)
    tuned = kernel_sm90.blockwise_tile(m, n, jnp.bfloat16)
    other = kernel_sm90.blockwise_config(_sm90.TileConfig(tile_m=128, tile_n=64, max_concurrent_steps=4),
                                         jnp.bfloat16)
    for base, early in itertools.product((tuned, other), (False, True)):
        cfg = dataclasses.replace(base, early_release=early)
        for rows in ((1, 1), (1, b_block[0])):
            got = jax.jit(functools.partial(kernel_sm90.blockwise_matmul_nt, out_dtype=jnp.bfloat16, config=cfg,
                                            scale_rows=rows))(a8, b8, sa_t, sb_t)
            assert sqnr(got, want) >= 38, (cfg, rows, sqnr(got, want))


@pytest.mark.gpu
def test_gpu_kernel_exact_on_small_ints():
    """Small integers times power-of-2 per-tile scales: each K block's wgmma product is exact, so the kernel's
    result equals the exact one up to the rounding of the fp32 sum over blocks."""
    _hopper()
    from pallas_fused.fp8 import api

    m, k, n = 256, 640, 384
    a8, sa, b8, sb = _blockwise_operands(41, m, n, k, (128, 128), ints=True)
    want = ref.blockwise_scaled_matmul_nt_reference(a8, b8, sa, sb, (1, 128), (128, 128), out_dtype=jnp.float32)
    sa_t = api._step_scales(api._Operand(a8, sa.T, block=(1, 128)), k)
    sb_t = api._step_scales(api._Operand(b8, sb.T, block=(128, 128)), k)
    got = jax.jit(functools.partial(api._mm_nt_blockwise, out_dtype=jnp.float32))(a8, b8, sa_t, sb_t)
    # The blocks' exact products differ in exponent by up to ~2^20: their fp32 sum rounds (in any order).
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6 * float(jnp.max(jnp.abs(want))))


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(300, 520, 200), (130, 128, 72), (1, 260, 5)])
def test_gpu_kernel_ragged_through_the_api(m, k, n):
    """Shapes that are no tile multiple, through the api (which pads a, bt and the scale rows and slices)."""
    _hopper()
    from pallas_fused.fp8 import api

    for b_block in ((128, 128), (1, 128)):
        a8, sa, b8, sb = _blockwise_operands(42, m, n, k, b_block)
        want = ref.blockwise_scaled_matmul_nt_reference(a8, b8, sa, sb, (1, 128), b_block, out_dtype=jnp.float32)
        sa_t = api._step_scales(api._Operand(a8, sa.T, block=(1, 128)), k)
        sb_t = api._step_scales(api._Operand(b8, sb.T, block=b_block), k)
        got = jax.jit(functools.partial(api._mm_nt_blockwise, out_dtype=jnp.bfloat16))(a8, b8, sa_t, sb_t)
        assert got.shape == (m, n) and got.dtype == jnp.bfloat16
        assert sqnr(got, want) >= 38


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2048, 1024, 768), (130, 300, 200)], ids=["training", "ragged"])
def test_gpu_dense_forward_backward(shape):
    """A Dense forward + backward: on Hopper the three GEMMs run on the blockwise kernel (implementation None and
    "pallas" alike), within fp8 tolerance of the same recipe forced to "xla" (the exact fp32 product of the same
    quantized operands: the quantize kernel matches the reference bit for bit) and of the bf16 layer; elsewhere
    the GEMMs are XLA's, bit-equal to "xla"."""
    from pallas_fused import _backend

    t, din, dout = shape
    x, w, dy = rand(30, (t, din), jnp.bfloat16), rand(31, (din, dout), jnp.bfloat16), rand(32, (t, dout),
                                                                                       jnp.bfloat16)
    got = jax.jit(functools.partial(_layer, "blockwise"))(x, w, dy)
    forced = jax.jit(functools.partial(_layer, "blockwise", implementation="xla"))(x, w, dy)
    y0, vjp0 = jax.vjp(lambda x, w: x @ w, x, w)
    impls = ["pallas"] if _backend.is_hopper() else []
    for other in [got] + [jax.jit(functools.partial(_layer, "blockwise", implementation=i))(x, w, dy) for i in impls]:
        for g, f, want in zip(other, forced, (y0, *vjp0(dy))):
            assert g.dtype == jnp.bfloat16 and g.shape == f.shape
            assert sqnr(g, want) >= 25
            if _backend.is_hopper():
                assert sqnr(g, f) >= 35, sqnr(g, f)  # fast accumulation within each 128-block, then bf16
            else:
                np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(f, np.float32))
    dense = Float8Dense(dout, config="blockwise", dtype=jnp.bfloat16)
    params = dense.init(jax.random.key(0), x)
    grads = jax.jit(jax.grad(lambda p: jnp.sum(dense.apply(p, x).astype(jnp.float32) ** 2)))(params)
    assert all(np.all(np.isfinite(np.asarray(leaf, np.float32))) for leaf in jax.tree.leaves(grads))
