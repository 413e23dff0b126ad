"""The shared Hopper GEMM skeleton (pallas_fused/_sm90.py) in Mosaic GPU's interpret mode (jax >= 0.12): its
16-bit "kn" and 8-bit "nk" paths with epilogue vectors, its per-K-step promotion, its 2-CTA cluster (multicast
loads, cluster barriers), its int8 a operand (converted before the kernel there: the interpreter takes wgmma operands
from shared memory only), its transposed store and its low-rank step against plain jnp, on the CPU
(tests/test_lowering.py lowers the promotion's configurations for an sm90 GPU). The GPU tests of its users run the
compiled kernel."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_fused import _backend, _sm90
from pallas_fused.dora import kernel_sm90 as dora_sm90
from pallas_fused.fp8 import kernel_sm90 as fp8_sm90
from tests.helpers import rand, to64

needs_interpret = pytest.mark.skipif(not _backend.has_mosaic_interpret(),
                                     reason="Mosaic GPU interpret mode needs jax >= 0.12")
SMALL = _sm90.TileConfig(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2)


@needs_interpret
@pytest.mark.parametrize("wg_split", ["n", "m"])
def test_kn_column_epilogue(wg_split):
    """(x v) g + bias, the DoRA epilogue: 3 K steps through a 2-deep ring, several output tiles per CTA."""
    config = _sm90.TileConfig(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2, wg_split=wg_split)
    check_kn_column_epilogue(config, 0, (256, 192, 256))


def check_kn_column_epilogue(config, seed, shape):
    """(x v) g + bias through `_sm90.matmul` in interpret mode with `config`, x (M, K) and v (K, N) 16-bit, against
    float64."""
    m, k, n = shape
    x, v = rand(seed, (m, k), jnp.bfloat16), rand(seed + 1, (k, n), jnp.bfloat16)
    g, bias = rand(seed + 2, (n,), offset=1.0), rand(seed + 3, (n,), jnp.bfloat16)
    out = _sm90.matmul(x, v, b_layout="kn", col_vecs=(g, bias), epilogue=dora_sm90._scale_bias,
                       out_dtype=jnp.bfloat16, config=config, name="test_kn", interpret=True)
    ref = (to64(x) @ to64(v)) * to64(g)[None] + to64(bias)[None]
    np.testing.assert_allclose(to64(out), ref, rtol=2e-2, atol=2e-2 * np.abs(ref).max())


@needs_interpret
def test_nk_fp8_row_column_scales():
    a = rand(4, (128, 256), scale=4.0).astype(jnp.float8_e4m3fn)
    bt = rand(5, (128, 256), scale=4.0).astype(jnp.float8_e4m3fn)
    sa, sb = rand(6, (128,), offset=2.0), rand(7, (128,), offset=2.0)
    out = _sm90.matmul(a, bt, b_layout="nk", row_vecs=(sa,), col_vecs=(sb,), epilogue=fp8_sm90._row_col_scales,
                       out_dtype=jnp.float32, config=SMALL, name="test_nk", interpret=True)
    ref = (to64(a) * to64(sa)[:, None]) @ (to64(bt) * to64(sb)[:, None]).T
    np.testing.assert_allclose(to64(out), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@needs_interpret
@pytest.mark.parametrize("scalar_rows, scalar_cols", [(True, False), (True, True)])
def test_nk_fp8_scalar_scales(scalar_rows, scalar_cols):
    """A (1,) row or column vector is one scale for every row (column): the epilogue gets it as a scalar."""
    a = rand(4, (128, 256), scale=4.0).astype(jnp.float8_e4m3fn)
    bt = rand(5, (256, 256), scale=4.0).astype(jnp.float8_e4m3fn)
    sa = rand(6, (1,), offset=2.0) if scalar_rows else rand(6, (128,), offset=2.0)
    sb = rand(7, (1,), offset=2.0) if scalar_cols else rand(7, (256,), offset=2.0)
    out = _sm90.matmul(a, bt, b_layout="nk", row_vecs=(sa,), col_vecs=(sb,), epilogue=fp8_sm90._row_col_scales,
                       out_dtype=jnp.float32, config=SMALL, name="test_nk_scalar", interpret=True)
    ref = (to64(a) * to64(sa)[:, None]) @ (to64(bt) * to64(sb)[:, None]).T
    np.testing.assert_allclose(to64(out), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_vector_shapes_checked():
    a = jnp.zeros((128, 256), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"row_vecs must have shape \(M,\) = \(128,\) or \(1,\), got \(2,\)"):
        _sm90.matmul(a, a, b_layout="nk", row_vecs=(jnp.ones(2),), col_vecs=(jnp.ones(128),),
                     epilogue=fp8_sm90._row_col_scales, out_dtype=jnp.float32, config=SMALL, name="t", interpret=True)


def _blockwise_operands(m, k, n):
    """fp8 a (M, K), bt (N, K) and per-step scales: powers of 2 in 2^-4 .. 2^4 per 128 rows (block scales, so the
    same arrays serve the vector and the uniform_steps reads)."""
    a = rand(8, (m, k), scale=4.0).astype(jnp.float8_e4m3fn)
    bt = rand(9, (n, k), scale=4.0).astype(jnp.float8_e4m3fn)
    scales = [jnp.repeat(jnp.exp2(jax.random.randint(jax.random.key(10 + i), (k // 128, rows // 128), -4, 5)
                                  .astype(jnp.float32)), 128, axis=1) for i, rows in enumerate((m, n))]
    want = np.einsum("mkc,nkc,km,kn->mn", to64(a).reshape(m, k // 128, 128), to64(bt).reshape(n, k // 128, 128),
                     *map(to64, scales))
    return (a, bt, *scales), want


@needs_interpret
@pytest.mark.parametrize("tile_n,split,uniform,early", [
    (64, "n", (False, False), False), (64, "m", (False, True), True), (128, "m", (False, True), True),
    (64, "n", (True, True), True), (128, "m", (True, False), False)])
def test_promote_blockwise(tile_n, split, uniform, early):
    """The blockwise FP8 GEMM's per-K-step promotion (3 K steps through a 2-deep ring, several output tiles per
    CTA), the step's stage released after the promotion or as soon as its wgmma is done (early_release), the
    scales read as vectors or one scalar per warpgroup tile: each step's product times that step's row and column
    scales, summed in fp32."""
    config = _sm90.TileConfig(tile_m=64, tile_n=tile_n, tile_k=128, max_concurrent_steps=2, wg_split=split,
                              early_release=early)
    (a, bt, sa, sb), want = _blockwise_operands(512, 384, 256)
    out = _sm90.matmul(a, bt, b_layout="nk", step_row_vecs=(sa,), step_col_vecs=(sb,), uniform_steps=uniform,
                       promote=fp8_sm90._promote_blocks, epilogue=fp8_sm90._identity, out_dtype=jnp.float32,
                       config=config, name="test_promote", interpret=True)
    np.testing.assert_allclose(to64(out), want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


def test_interpret_needs_new_jax():
    """Where jax has no Mosaic GPU interpret mode, asking for it names the version that has it."""
    if _backend.has_mosaic_interpret():
        pytest.skip("this jax has Mosaic GPU interpret mode")
    x = rand(0, (128, 64), jnp.bfloat16)
    with pytest.raises(_backend.ImplementationError, match="jax >= 0.12"):
        _sm90.matmul(x, x.T, b_layout="kn", epilogue=dora_sm90._scale_bias, col_vecs=(jnp.ones(128),),
                     out_dtype=jnp.bfloat16, config=SMALL, name="t", interpret=True)


def _codes(seed, shape):
    return jnp.clip(jnp.round(rand(seed, shape, scale=60.0)), -127, 127).astype(jnp.int8)


# The int8 codes converted straight to bf16 (QDoRA's dequant) or through float32 (any dequant's result dtype is
# converted to b's).
DEQUANTS = {"direct": lambda t: t, "f32": lambda t: t.astype(jnp.float32)}


@needs_interpret
@pytest.mark.parametrize("k, cluster", [(64, None), (192, "n")], ids=["one_step", "cluster_n"])
@pytest.mark.parametrize("dequant", ["direct", "f32"])
@pytest.mark.parametrize("transpose_out", [False, True])
def test_int8_a_dequant_lowrank(k, cluster, dequant, transpose_out):
    """int8 a with the low-rank wgmma after the main loop: a single K step (a ring the pipeline shrinks to one stage)
    and a 2-CTA cluster sharing a's int8 tiles (each stage released to both CTAs), over several output tiles per CTA
    (each one a new pipeline run over the same barriers), the result stored as is or transposed."""
    config = dataclasses.replace(SMALL, wg_split="m", cluster=cluster)
    q, xt = _codes(14, (256, k)), rand(15, (128, k), jnp.bfloat16)
    la, lb = rand(16, (256, 16), jnp.bfloat16), rand(17, (128, 16), jnp.bfloat16)
    out = _sm90.matmul(q, xt, b_layout="nk", a_dequant=DEQUANTS[dequant], epilogue=lambda acc, rows, cols: acc,
                       out_dtype=jnp.bfloat16, config=config, name="test_int8_ring", lowrank=(la, lb),
                       transpose_out=transpose_out, interpret=True)
    ref = to64(q) @ to64(xt).T + to64(la) @ to64(lb).T
    np.testing.assert_allclose(to64(out), ref.T if transpose_out else ref, rtol=1e-2, atol=1e-2 * np.abs(ref).max())


def test_qdora_smem():
    """QDoRA's int8 a takes one byte of the ring per weight; its tiles are the first of the table whose ring, as deep
    as shared memory allows beside the low-rank slices, keeps 3 stages: 64 x 256 with 4 stages at rank 16 and 3 at
    rank 64 (the warpgroups split M and hold the low-rank columns once), 128 x 128 at rank 128 (where 64 x 256
    keeps 2)."""
    wide, square = (_sm90.TileConfig(**t) for t in dora_sm90.QDORA_HEURISTIC["tiles"])
    for rank, tiles, steps in ((16, wide, 4), (64, wide, 3), (128, square, 3)):
        config = dora_sm90.qdora_config(11008, 4096, 4096, rank, jnp.bfloat16)
        assert config == dataclasses.replace(tiles, max_concurrent_steps=steps), rank
        assert dora_sm90._smem(config, rank, 2, int8_a=True) <= _sm90.SMEM_LIMIT
        deeper = dataclasses.replace(config, max_concurrent_steps=steps + 1)
        assert dora_sm90._smem(deeper, rank, 2, int8_a=True) > _sm90.SMEM_LIMIT
    assert dora_sm90.fit_lowrank(wide, 128, int8_a=True).max_concurrent_steps == 2
    # the shared low-rank slice is counted once: (cta_m + cta_n) R bytes per item
    assert _sm90.smem_bytes(wide, 1, 2, 2, 64) - _sm90.smem_bytes(wide, 1, 2, 2) == 64 * (128 + 256) * 2
    assert (dora_sm90._smem(wide, 16, 2) - dora_sm90._smem(wide, 16, 2, int8_a=True)
            == 4 * wide.tile_k * wide.cta_tile[0])


@needs_interpret
@pytest.mark.parametrize("wg_split", ["m", "n"])
def test_int8_a_transposed_out(wg_split):
    """QDoRA's GEMMs: int8 a (a_dequant; in the interpreter converted before the kernel), 16-bit b read "nk", the
    low-rank step, per-row scale and bias in the epilogue, the result stored transposed; 3 K steps through a 2-deep
    ring, several output tiles per CTA."""
    config = dataclasses.replace(SMALL, wg_split=wg_split)
    q, xt = _codes(24, (256, 192)), rand(25, (128, 192), jnp.bfloat16)
    la, lb = rand(26, (256, 16), jnp.bfloat16), rand(27, (128, 16), jnp.bfloat16)
    rowscale, bias = rand(28, (256,), scale=0.01, offset=0.02), rand(29, (256,), jnp.bfloat16)
    out = _sm90.matmul(q, xt, b_layout="nk", row_vecs=(rowscale, bias), a_dequant=dora_sm90._int8_codes,
                       lowrank=(la, lb), epilogue=dora_sm90._row_scale_bias, out_dtype=jnp.bfloat16, config=config,
                       transpose_out=True, name="test_int8_a", interpret=True)
    ref = (to64(q) @ to64(xt).T + to64(la) @ to64(lb).T) * to64(rowscale)[:, None] + to64(bias)[:, None]
    assert out.shape == (128, 256)
    np.testing.assert_allclose(to64(out), ref.T, rtol=1e-2, atol=1e-2 * np.abs(ref).max())


@pytest.mark.parametrize("change, match", [
    (dict(b=jnp.ones((128, 128), jnp.float32)), "b must be bfloat16 or float16"),
    (dict(out_dtype=jnp.float32), "transpose_out stores 16-bit"),
])
def test_int8_a_bad_input(change, match):
    kwargs = dict(b=jnp.ones((128, 128), jnp.bfloat16), out_dtype=jnp.bfloat16) | change
    with pytest.raises(ValueError, match=match):
        _sm90.matmul(_codes(30, (128, 128)), b_layout="nk", a_dequant=dora_sm90._int8_codes, transpose_out=True,
                     epilogue=lambda acc, r, c: acc, config=SMALL, name="t", **kwargs)


@needs_interpret
@pytest.mark.parametrize("b_layout", ["kn", "nk"])
@pytest.mark.parametrize("wg_split", ["n", "m"])
def test_lowrank_step(b_layout, wg_split):
    """x W + la lb with the column epilogue: the low-rank wgmma lands in the same accumulator before g and the
    bias apply; rank 32 (two instruction K steps at a 64-byte swizzle), several output tiles per CTA."""
    config = _sm90.TileConfig(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2, wg_split=wg_split)
    x, w = rand(8, (256, 192), jnp.bfloat16), rand(9, (192, 256), jnp.bfloat16)
    la, lb = rand(10, (256, 32), jnp.bfloat16), rand(11, (32, 256), jnp.bfloat16)
    g, bias = rand(12, (256,), offset=1.0), rand(13, (256,), jnp.bfloat16)
    b, lb_in = (w, lb) if b_layout == "kn" else (w.T, lb.T)
    out = _sm90.matmul(x, b, b_layout=b_layout, col_vecs=(g, bias), epilogue=dora_sm90._scale_bias,
                       out_dtype=jnp.bfloat16, config=config, name="test_lowrank", lowrank=(la, lb_in),
                       interpret=True)
    ref = (to64(x) @ to64(w) + to64(la) @ to64(lb)) * to64(g)[None] + to64(bias)[None]
    np.testing.assert_allclose(to64(out), ref, rtol=2e-2, atol=2e-2 * np.abs(ref).max())


@needs_interpret
def test_lowrank_rank16():
    """The smallest rank (one 32-byte swizzle row), with no epilogue vectors."""
    x, w = rand(14, (128, 128), jnp.bfloat16), rand(15, (128, 128), jnp.bfloat16)
    la, lb = rand(16, (128, 16), jnp.bfloat16), rand(17, (16, 128), jnp.bfloat16)
    out = _sm90.matmul(x, w, b_layout="kn", epilogue=lambda acc, rows, cols: acc, out_dtype=jnp.float32,
                       config=SMALL, name="test_lowrank16", lowrank=(la, lb), interpret=True)
    ref = to64(x) @ to64(w) + to64(la) @ to64(lb)
    np.testing.assert_allclose(to64(out), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("la_shape, lb_shape, dtype, match", [
    ((128, 24), (24, 128), jnp.bfloat16, "multiple of 16"),
    ((64, 16), (16, 128), jnp.bfloat16, r"la must have shape \(M, R\)"),
    ((128, 16), (128, 16), jnp.bfloat16, r"lb must have shape \(16, 128\)"),
    ((128, 16), (16, 128), jnp.float16, "in a's dtype"),
])
def test_lowrank_bad_input(la_shape, lb_shape, dtype, match):
    x = rand(0, (128, 128), jnp.bfloat16)
    la, lb = jnp.ones(la_shape, dtype), jnp.ones(lb_shape, dtype)
    with pytest.raises(ValueError, match=match):
        _sm90.matmul(x, x, b_layout="kn", epilogue=dora_sm90._scale_bias, col_vecs=(jnp.ones(128),),
                     out_dtype=jnp.bfloat16, config=SMALL, name="t", lowrank=(la, lb), interpret=True)


def test_smem_limit():
    """A ring that leaves no room for the low-rank slices is refused before Mosaic compiles anything."""
    big = _sm90.TileConfig(tile_m=128, tile_n=128, tile_k=128, max_concurrent_steps=2)
    x, w = rand(0, (128, 256), jnp.bfloat16), rand(1, (256, 256), jnp.bfloat16)
    la, lb = jnp.ones((128, 16), jnp.bfloat16), jnp.ones((16, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="shared memory"):
        _sm90.matmul(x, w, b_layout="kn", epilogue=dora_sm90._scale_bias, col_vecs=(jnp.ones(256),),
                     out_dtype=jnp.bfloat16, config=big, name="t", lowrank=(la, lb), interpret=True)


def _fp8_scaled(config, m, k, n, name):
    a = rand(20, (m, k), scale=4.0).astype(jnp.float8_e4m3fn)
    bt = rand(21, (n, k), scale=4.0).astype(jnp.float8_e4m3fn)
    sa, sb = rand(22, (m,), offset=2.0), rand(23, (n,), offset=2.0)
    out = _sm90.matmul(a, bt, b_layout="nk", row_vecs=(sa,), col_vecs=(sb,), epilogue=fp8_sm90._row_col_scales,
                       out_dtype=jnp.float32, config=config, name=name, interpret=True)
    ref = (to64(a) * to64(sa)[:, None]) @ (to64(bt) * to64(sb)[:, None]).T
    np.testing.assert_allclose(to64(out), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@needs_interpret
@pytest.mark.parametrize("cluster,wg_split,minor", [("m", "n", "n"), ("n", "m", "n"), ("m", "n", "m")])
def test_cluster(cluster, wg_split, minor):
    """Two CTAs per cluster sharing b's tile (cluster "m") or a's ("n") through multicast loads, 3 K steps through
    a 2-deep ring, several cluster tiles per cluster, the grid walked along N or M (in bands of two tiles)."""
    config = _sm90.TileConfig(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2, wg_split=wg_split,
                              cluster=cluster, grid_minor_dim=minor, grid_tile_width=2)
    _fp8_scaled(config, 256, 192, 512, "test_cluster")


@needs_interpret
def test_cluster_promote_dequant_lowrank():
    """The cluster with the per-K-step promotion (its stage released early), with int8 a (its tiles shared along
    N), and with the low-rank step."""
    config = _sm90.TileConfig(tile_m=64, tile_n=64, tile_k=128, max_concurrent_steps=2, wg_split="m",
                              early_release=True, cluster="n")
    (a, bt, sa, sb), want = _blockwise_operands(256, 384, 256)
    out = _sm90.matmul(a, bt, b_layout="nk", step_row_vecs=(sa,), step_col_vecs=(sb,), promote=fp8_sm90._promote_blocks,
                       epilogue=fp8_sm90._identity, out_dtype=jnp.float32, config=config, name="t", interpret=True)
    np.testing.assert_allclose(to64(out), want, rtol=1e-6, atol=1e-6 * np.abs(want).max())

    config = dataclasses.replace(SMALL, cluster="m")
    x, q = rand(24, (256, 192), jnp.bfloat16), jnp.clip(jnp.round(rand(25, (192, 256), scale=60.0)), -127, 127)
    la, lb = rand(26, (256, 16), jnp.bfloat16), rand(27, (16, 256), jnp.bfloat16)
    out = _sm90.matmul(q.T.astype(jnp.int8), x, b_layout="nk", a_dequant=lambda t: t.astype(jnp.float32),
                       epilogue=lambda acc, rows, cols: acc, out_dtype=jnp.bfloat16, config=config, name="t",
                       transpose_out=True, interpret=True)
    ref = to64(x) @ to64(q)
    np.testing.assert_allclose(to64(out), ref, rtol=1e-2, atol=1e-2 * np.abs(ref).max())
    out = _sm90.matmul(x, q.astype(jnp.bfloat16), b_layout="kn", lowrank=(la, lb), epilogue=lambda acc, r, c: acc,
                       out_dtype=jnp.float32, config=config, name="t",
                       interpret=True)
    ref = ref + to64(la) @ to64(lb)
    np.testing.assert_allclose(to64(out), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("change,kwargs,match", [
    (dict(cluster="k"), {}, "config.cluster must be None, 'm' or 'n'"),
    (dict(cluster="m"), {}, r"multiples of the tile \(128, 128, 64\)"),
])
def test_cluster_bad_config(change, kwargs, match):
    """A cluster value that is none, a shape that is no multiple of the cluster tile: refused before Mosaic compiles
    anything."""
    x = rand(0, (64, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match=match):
        _sm90.matmul(x, jnp.ones((128, 128), jnp.bfloat16), b_layout="kn", epilogue=lambda acc, r, c: acc,
                     out_dtype=jnp.float32, config=dataclasses.replace(SMALL, **change), name="t", **kwargs,
                     interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("rank", [16, 64])
@pytest.mark.parametrize("direction", ["forward", "dx"])
def test_gpu_int8_a(rank, direction):
    """The compiled QDoRA GEMM (int8 a converted in registers, the low-rank step, its result stored transposed,
    QDoRA's tile configuration: its ring as deep as shared memory allows) at 4096 tokens: 4096 -> 4096 (forward: q^T
    as a) and 4096 -> 11008's dx (q as stored, 4096 x 11008 as a); many K steps and output tiles per SM, where a
    stage reused too early shows."""
    if not _backend.is_hopper():
        pytest.skip("a Hopper kernel")
    fm, fk = (4096, 4096) if direction == "forward" else (4096, 11008)
    config = dora_sm90.qdora_config(fm, 4096, fk, rank, jnp.bfloat16)
    q, x = _codes(20, (fm, fk)), rand(21, (4096, fk), jnp.bfloat16)
    la, lb = rand(22, (fm, rank), jnp.bfloat16, scale=30.0), rand(23, (4096, rank), jnp.bfloat16)
    rowscale = rand(24, (fm,), scale=0.01, offset=0.02)
    out = _sm90.matmul(q, x, b_layout="nk", row_vecs=(rowscale,), a_dequant=dora_sm90._int8_codes,
                       lowrank=(la, lb), epilogue=dora_sm90._row_scale_bias, out_dtype=jnp.bfloat16, config=config,
                       transpose_out=True, name="test_gpu_int8_a")
    f32 = jnp.float32
    ref = ((jnp.dot(q.astype(f32), x.astype(f32).T, precision="highest")
            + jnp.dot(la.astype(f32), lb.astype(f32).T, precision="highest")) * rowscale[:, None]).T
    # one bf16 rounding of the fp32 result (2^-8 relative); a tile read from a stage reused too early is off by O(1)
    np.testing.assert_allclose(np.asarray(out.astype(f32)), np.asarray(ref), rtol=8e-3,
                               atol=8e-3 * float(jnp.abs(ref).max()))


# The ping-pong schedule: 64 x 64 tiles per warpgroup, 3 K steps through a 2-deep ring, so a warpgroup's steps wrap
# the ring and share it with the other's.
PINGPONG = _sm90.TileConfig(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2, schedule="pingpong")


@pytest.fixture
def race_checked(monkeypatch):
    """Interpret mode with its happens-before race detector, raising at the first race: a ring stage refilled
    before its warpgroup has read it, an epilogue slot overwritten while its store reads it."""
    plgpu = _backend.mosaic_gpu()
    monkeypatch.setattr(_backend, "mosaic_interpret", lambda what: plgpu.InterpretGPUParams(detect_races=True))


@needs_interpret
@pytest.mark.parametrize("granularity", ["rowwise", "tensorwise"])
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("ctas", [1, 5])
def test_pingpong_fp8_scales(race_checked, monkeypatch, granularity, out_dtype, ctas):
    """The FP8 scaled GEMM on the ping-pong schedule, race-checked: 12 output tiles walked by one CTA (6 per
    warpgroup) or by 5 (3, 3, 2, 2, 2 tiles: warpgroup 0 takes one more where a CTA's count is odd), row and
    column scales as vectors (rowwise) or scalars (tensorwise), against the fp32 product."""
    monkeypatch.setattr(_backend, "num_sms", lambda: ctas)
    m, k, n = 256, 192, 192
    a = rand(40, (m, k), scale=4.0).astype(jnp.float8_e4m3fn)
    bt = rand(41, (n, k), scale=4.0).astype(jnp.float8_e4m3fn)
    shape_a, shape_b = ((m,), (n,)) if granularity == "rowwise" else ((1,), (1,))
    sa, sb = rand(42, shape_a, offset=2.0), rand(43, shape_b, offset=2.0)
    out = _sm90.matmul(a, bt, b_layout="nk", row_vecs=(sa,), col_vecs=(sb,), epilogue=fp8_sm90._row_col_scales,
                       out_dtype=out_dtype, config=PINGPONG, name="test_pingpong", interpret=True)
    ref = (to64(a) * to64(sa)[:, None]) @ (to64(bt) * to64(sb)[:, None]).T
    tol = 1e-5 if out_dtype == jnp.float32 else 1e-2  # one rounding of the fp32 result
    assert out.dtype == out_dtype
    np.testing.assert_allclose(to64(out), ref, rtol=tol, atol=tol * np.abs(ref).max())


@needs_interpret
def test_pingpong_kn_walk(race_checked, monkeypatch):
    """16-bit b read "kn" with DoRA's column epilogue, 128 x 64 tiles of 2 warpgroups walking 3 CTAs in bands of
    two along M, a ring deeper than a tile's K steps (3 stages, 2 steps)."""
    monkeypatch.setattr(_backend, "num_sms", lambda: 3)
    config = _sm90.TileConfig(tile_m=128, tile_n=64, tile_k=64, max_concurrent_steps=3, schedule="pingpong",
                              grid_minor_dim="m", grid_tile_width=2)
    check_kn_column_epilogue(config, 44, (512, 128, 256))


@needs_interpret
@pytest.mark.parametrize("cluster, minor", [("m", "m"), ("n", "n")])
def test_pingpong_cluster(race_checked, monkeypatch, cluster, minor):
    """The ping-pong schedule on 2-CTA clusters, race-checked: the two CTAs' tiles sharing b's columns ("m") or a's
    rows ("n"), 2 clusters over 6 cluster tiles (3 each: warpgroup 0 takes two), rowwise scales. The interpreter
    loads a collective copy into each CTA by itself (no multicast): what runs here is the walk over cluster tiles
    and the cluster barriers' arrivals; the multicast runs on a GPU (tests/fp8/test_fp8.py)."""
    monkeypatch.setattr(_backend, "num_sms", lambda: 4)
    config = dataclasses.replace(PINGPONG, cluster=cluster, grid_minor_dim=minor)
    m, n = (384, 128) if cluster == "m" else (192, 256)
    a = rand(48, (m, 192), scale=4.0).astype(jnp.float8_e4m3fn)
    bt = rand(49, (n, 192), scale=4.0).astype(jnp.float8_e4m3fn)
    sa, sb = rand(50, (m,), offset=2.0), rand(51, (n,), offset=2.0)
    out = _sm90.matmul(a, bt, b_layout="nk", row_vecs=(sa,), col_vecs=(sb,), epilogue=fp8_sm90._row_col_scales,
                       out_dtype=jnp.float32, config=config, name="test_pingpong_cluster", interpret=True)
    ref = (to64(a) * to64(sa)[:, None]) @ (to64(bt) * to64(sb)[:, None]).T
    np.testing.assert_allclose(to64(out), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_pingpong_tiles():
    """A warpgroup's tile is the unit of the ping-pong walk: shapes are multiples of it, and a ring stage holds
    its a and b tiles alone."""
    config = _sm90.TileConfig(schedule="pingpong")
    assert config.cta_tile == config.cluster_tile == (128, 128)
    assert _sm90.supported(384, 128, 256, config) and not _sm90.supported(384, 128, 192, config)
    assert _sm90.smem_bytes(config, 1, 1, 2) == 4 * 128 * (128 + 128) + 4 * 64 * 64 * 2
    assert dataclasses.replace(config, cluster="m").cluster_tile == (256, 128)
    assert _sm90.TileConfig().schedule == "cooperative" and _sm90.TileConfig().cta_tile == (128, 256)


@pytest.mark.parametrize("change, kwargs, match", [
    (dict(schedule="pingpang"), {}, "schedule must be 'cooperative' or 'pingpong'"),
    (dict(schedule="pingpong"), dict(transpose_out=True), "not transpose_out"),
    (dict(schedule="pingpong"), dict(lowrank=(jnp.ones((128, 16), jnp.bfloat16), jnp.ones((16, 128), jnp.bfloat16))),
     "not lowrank"),
    (dict(schedule="pingpong"), dict(promote=fp8_sm90._promote_blocks), "not promote"),
    (dict(schedule="pingpong"), dict(a_dequant=lambda t: t), "not a_dequant"),
])
def test_pingpong_unsupported(change, kwargs, match):
    """What the ping-pong schedule does not run is refused by name before Mosaic compiles anything."""
    x = rand(0, (128, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match=match):
        _sm90.matmul(x, x, b_layout="kn", epilogue=lambda acc, r, c: acc, out_dtype=jnp.bfloat16,
                     config=dataclasses.replace(SMALL, **change), name="t", **kwargs, interpret=True)
