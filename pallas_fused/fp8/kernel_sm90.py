"""Mosaic GPU (Hopper, sm90) FP8 scaled matmul: TMA-fed, warp-specialized wgmma with a scale epilogue.

out = (a * a_scale[:, None]) @ (bt * b_scale[:, None])^T, a (M, K) and bt (N, K) fp8 of ONE dtype
(wgmma takes a single element type for both operands), both K-major: wgmma reads 8-bit operands
only K-major, so B arrives transposed ((N, K) row-major) and is viewed as (K, N) in shared memory.
The quantize kernels emit that layout directly, so the Dense path never transposes an fp8 tensor.

The GEMM is the shared sm90 skeleton (pallas_fused/_sm90.py: persistent, TMA-fed, warp-specialized
wgmma); this module gives it the scale epilogue: the fp32 accumulator times the row scales and the
column scales, cast once to the output dtype.

Accumulation: the wgmma fp8 accumulator is the tensor cores' "fast accumulation"; callers that ask
for fast_accum=False are routed elsewhere by the api.

`blockwise_matmul_nt` (blockwise scaling, DeepSeek-V3's recipe) is the same skeleton with its per-K-step
promotion: each 128-wide K block's product is scaled by that block's row and column scales and summed in fp32.
Shapes must be multiples of the CTA tile and tile_k; the api pads otherwise.

The tile rules over the tuning table live here too, beside the kernel they configure: `config_for` (the tile a
GEMM runs without a tuned one), `cublas_wins` (where plain "pallas" takes XLA's fp8 dot instead) and
`pingpong_tiles` (what the tuner times besides); gemm.py's sm90 implementation asks them.

Measured on an H200 (jax 0.11.2), e4m3 -> bf16, 8192^3: 1431 TFLOP/s rowwise, 1383 tensorwise
(XLA fp8 dot + rescale 867; torch._scaled_mm 1556 / 1518 in the same run); 16384x4096x11008 rowwise
1359. Tile sweep at 8192^3 (rowwise): 128x128x128 per warpgroup, split along N, 4 stages: 1390;
3 stages 1361; split along M 1379; tile_k=64 x 6 stages 1340; 128x256 x 2 stages 274 (register
spills: a 128x256 fp32 accumulator per warpgroup is too big). On the shared skeleton (pallas_fused/_sm90.py):
8192^3 rowwise 1377, tensorwise 1383; 16384x4096x11008 rowwise 1408 (torch._scaled_mm 1560 / 1512 / 1554).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_fused import _backend, _sm90

TileConfig = _sm90.TileConfig

# The tiles of a GPU without a tuning table: the H200's (the sweeps: docs/performance.md, "Tuning tables").
# "large": 128 x 128 per warpgroup, tile_k 128 (bytes), 4 stages = 192 KiB of shared memory; "small": half as wide,
# for a GEMM whose large tiles number at most "small_max_tiles_per_sm" per SM (`tile_for`); "xla_*": where
# plain "pallas" calls XLA's fp8 dot instead (`cublas_wins`). A tile may carry any TileConfig field: the large
# one a 2-CTA cluster along M (its two CTAs share b's tiles by multicast); "cluster_min_tiles_per_sm": the fewest
# large CTA tiles per SM at which the large tile keeps its cluster; "tall_grid_minor_dim": the large tile's grid walk
# where M >= N (`tile_for`).
HEURISTIC = {"large": dict(tile_m=128, tile_n=128, tile_k=128, max_concurrent_steps=4, cluster="m"),
             "small": dict(tile_m=128, tile_n=64, tile_k=128, max_concurrent_steps=4),
             "small_max_tiles_per_sm": 0.5, "xla_max_tiles_per_sm": 0.5, "xla_min_k": 8192,
             "xla_tail_min_k": 16384, "xla_tail_max_wave_use": 0.9, "cluster_min_tiles_per_sm": 0.0,
             "tall_grid_minor_dim": "m"}


def tiles() -> tuple[TileConfig, TileConfig, float]:
    """(large, small, the small tile's threshold in large tiles per SM) for this device kind
    (pallas_fused/tuning/<device>.json, else HEURISTIC)."""
    table = _backend.tuned("fp8_sm90", HEURISTIC)
    return TileConfig(**table["large"]), TileConfig(**table["small"]), float(table["small_max_tiles_per_sm"])


def supported(m: int, n: int, k: int, a_dtype, b_dtype, config: TileConfig) -> bool:
    """Whether the kernel runs these operands as they are (no padding): one fp8 dtype, tile multiples."""
    return a_dtype == b_dtype and _sm90.supported(m, n, k, config)


def _row_col_scales(acc, rows, cols):
    """acc times its row scales, then its column scales: WGMMA-layout vectors, or fp32 scalars where one scale
    covers every row (column), as a tensorwise scale does."""
    r, c = rows[0], cols[0]
    r = lax.broadcast_in_dim(r, acc.shape, [0]) if r.ndim else r
    c = lax.broadcast_in_dim(c, acc.shape, [1]) if c.ndim else c
    return acc * r * c


@functools.partial(jax.jit, static_argnames=("out_dtype", "config"))
def scaled_matmul_nt(a, bt, a_scale, b_scale, *, out_dtype, config: TileConfig):
    """(a * a_scale[:, None]) @ (bt * b_scale[:, None])^T on Hopper; shapes must be tile multiples. a_scale is (M,)
    or (1,), b_scale (N,) or (1,): a tensorwise scale stays a scalar (the kernel reads it once).

    Under vmap the batch runs as a loop of kernel launches (the Mosaic GPU kernel has no batching rule).
    """
    m, k = a.shape
    if not supported(m, bt.shape[0], k, a.dtype, bt.dtype, config):
        raise ValueError(f"kernel_sm90.scaled_matmul_nt: shapes {a.shape} x {bt.shape} must be multiples of the "
                         f"tile {config.cluster_tile + (config.tile_k,)} with one fp8 dtype")
    return _sm90.matmul(a, bt, b_layout="nk", row_vecs=(a_scale.astype(jnp.float32),),
                        col_vecs=(b_scale.astype(jnp.float32),), epilogue=_row_col_scales, out_dtype=out_dtype,
                        config=config, name="pallas_fused_fp8_scaled_matmul_sm90")


# ----------------------------------------------------------------------------------------------
# the tile: a rule over the tuning table (what plain "pallas" and the tuner start from)


def config_for(m, n, k, num_sms: int | None = None, out_dtype=jnp.bfloat16):
    """The sm90 tile for an (M, K) x (N, K) GEMM with an `out_dtype` result (`tile_for`), its ring as deep as
    fits in shared memory beside the epilogue's staging: a float32 result stages twice the bytes of a bf16 one,
    so the tuned 128 x 256 tile's 4 stages become 3 there (and the ping-pong tile's 6, 5)."""
    return fit_stages(tile_for(m, n, k, num_sms), out_dtype)


def fit_stages(config, out_dtype):
    """`config` with its ring (at least 2 stages) cut to what fits in shared memory beside an `out_dtype` result's
    staging."""
    out_itemsize = jnp.dtype(out_dtype).itemsize
    steps = config.max_concurrent_steps
    while steps > 2 and _sm90.smem_bytes(dataclasses.replace(config, max_concurrent_steps=steps), 1, 1,
                                         out_itemsize) > _sm90.SMEM_LIMIT:
        steps -= 1
    return dataclasses.replace(config, max_concurrent_steps=steps)


def tile_for(m, n, k, num_sms: int | None = None, pingpong: bool = True):
    """The sm90 tile for an (M, K) x (N, K) GEMM: the two compute warpgroups split the CTA tile along N
    (128 x 256) unless only the split along M (256 x 128) fits the shape without padding, as for the
    N = 5504 projections of a 2048-wide Llama. Padding costs a copy of each padded operand and of the
    output (the slice back).

    A GEMM with at most half as many such tiles as the GPU's SMs (`num_sms`, default this process' GPU; the
    fraction is tuning data) leaves most SMs idle: the weight gradients of narrow projections (2048x16384x512: 32
    tiles for 132 SMs). The small tile, 128 x 128 per CTA, doubles the tiles in flight there; with 128 tiles or
    more the larger tile wins (docs/performance.md, "Tuning tables", `fp8_sm90`). The tiles are `tiles()` (this
    device kind's tuning table).

    A tile may name a 2-CTA cluster (TileConfig.cluster): it is kept where the shape is a multiple of the cluster
    tile (a cluster is never worth padding for) and, for the large tile, where the GEMM has at least
    "cluster_min_tiles_per_sm" large CTA tiles per SM (tuning data); elsewhere the same tile runs without it.

    Where the output is at least as tall as it is wide (M >= N), the large tile walks the grid with the minor
    dimension "tall_grid_minor_dim" (tuning data), if the table names one: consecutive tiles then share the
    weight's column block in L2 (measured per device: docs/performance.md, `fp8_sm90`).

    Where the table names a "tall_pingpong" tile, a tall GEMM (M >= N) with more tiles than the small tile's
    threshold, and K at most its "max_k" or M at least its "long_k_min_m", runs on the ping-pong schedule (`_sm90`'s
    TileConfig.schedule), each compute warpgroup owning whole tiles so that one's epilogue overlaps the other's main
    loop: faster than the cooperative tile at a Llama layer's tall GEMMs, slower at square ones (the timings:
    docs/performance.md, `fp8_sm90`, tall_pingpong)."""
    config, small, small_max_tiles_per_sm = tiles()
    table = _backend.tuned("fp8_sm90", HEURISTIC)
    fp8 = jnp.float8_e4m3fn
    fits = lambda c: supported(m, n, k, fp8, fp8, c)  # noqa: E731
    alone = lambda c: dataclasses.replace(c, cluster=None)  # noqa: E731
    splits = (config, dataclasses.replace(config, wg_split="m"))
    # The first that fits: with the cluster, then without it; none fits: pad as little as possible (the first on a
    # tie), without the cluster.
    fitting = [c for c in (*splits, *map(alone, splits)) if fits(c)]
    padded = lambda c: (m + -m % c.cta_tile[0]) * (n + -n % c.cta_tile[1])  # noqa: E731
    chosen = fitting[0] if fitting else min(map(alone, splits), key=padded)
    chosen = walk_tall(chosen, m, n, table)
    count = -(-m // chosen.cta_tile[0]) * -(-n // chosen.cta_tile[1])
    num_sms = _backend.num_sms() if num_sms is None else num_sms
    if count <= small_max_tiles_per_sm * num_sms:
        small_fits = [c for c in (small, alone(small)) if fits(c)]
        if small_fits:
            return small_fits[0]
    tall = table.get("tall_pingpong") if pingpong else None  # the tuner times the cooperative tile too
    if m >= n and tall and (k <= tall["max_k"] or m >= tall.get("long_k_min_m", math.inf)):
        # Short K leaves the cooperative tile's epilogue a large share of each tile's time; the ping-pong
        # schedule hides it behind the other warpgroup's main loop. It walks the grid as the large tile would.
        config = TileConfig(**tall["tile"], grid_minor_dim=chosen.grid_minor_dim,
                            grid_tile_width=chosen.grid_tile_width)
        if fits(config):
            return config
    if count < table["cluster_min_tiles_per_sm"] * num_sms:
        return alone(chosen)
    return chosen


def cublas_wins(m, n, k, num_sms: int | None = None) -> bool:
    """Whether plain "pallas" runs an (M, K) x (N, K) GEMM as XLA's fp8 dot (cuBLAS) instead of the sm90 kernel
    (tuning data "fp8_sm90"; the timings behind it: docs/performance.md, `fp8_sm90`), where K is long and the sm90
    kernel's tiles leave SMs idle:

    - even `config_for`'s small tile leaves most SMs idle (at most "xla_max_tiles_per_sm" tiles per SM, K at least
      "xla_min_k"): cuBLAS splits K across the idle SMs, which the sm90 kernel does not, as in the weight gradient
      of a narrow projection (2048x16384x512).
    - the last wave of `config_for`'s tiles leaves SMs idle for a long K loop (K at least "xla_tail_min_k", the
      tiles filling at most "xla_tail_max_wave_use" of the waves they take): cuBLAS's tiles divide the output into
      fuller waves (168 x 128: 528 tiles, four nearly full waves), as at 2048x16384x5504 and 5504x16384x2048 (344
      tiles on 132 SMs: 2.6 waves)."""
    table = _backend.tuned("fp8_sm90", HEURISTIC)
    num_sms = _backend.num_sms() if num_sms is None else num_sms
    if k >= table["xla_min_k"]:
        _, small, _ = tiles()
        if -(-m // small.cta_tile[0]) * -(-n // small.cta_tile[1]) <= table["xla_max_tiles_per_sm"] * num_sms:
            return True
    if k < table["xla_tail_min_k"]:
        return False
    config = config_for(m, n, k, num_sms)
    tile_m, tile_n = config.cluster_tile
    units = -(-m // tile_m) * -(-n // tile_n)
    slots = max(1, num_sms // (2 if config.cluster else 1))  # a cluster's two CTAs take one unit on two SMs
    return units / (-(-units // slots) * slots) <= table["xla_tail_max_wave_use"]


def pingpong_tiles(m, n, k, num_sms: int | None = None):
    """The ping-pong schedule's tiles worth timing at an (M, K) x (N, K) GEMM: 128 x 128 x 128 walked as
    `config_for`'s tile walks that shape, with 4 and 6 ring stages, and 6 on a 2-CTA cluster along the longer side;
    each only where the shape is a multiple of its (cluster) tile."""
    rule = config_for(m, n, k, num_sms)
    base = TileConfig(tile_m=128, tile_n=128, tile_k=128, max_concurrent_steps=4, schedule="pingpong",
                      grid_minor_dim=rule.grid_minor_dim, grid_tile_width=rule.grid_tile_width)
    found = {"sm90_pingpong": base,
             "sm90_pingpong_s6": dataclasses.replace(base, max_concurrent_steps=6),
             "sm90_pingpong_cluster": dataclasses.replace(base, max_concurrent_steps=6,
                                                          cluster="m" if m >= n else "n")}
    return {name: c for name, c in found.items() if _sm90.supported(m, n, k, c)}


# ----------------------------------------------------------------------------------------------
# blockwise scaling: per-K-block scales promoted in fp32 (DeepSeek-V3 / DeepGEMM)

BLOCK_K = 128  # the K extent of one scale block, = tile_k: one scale row per pipeline step
# The blockwise tile of a GPU without a tuning table: the H200's (the sweeps: docs/performance.md,
# "Tuning tables"). Each compute warpgroup holds two fp32 accumulators (the K step's product and the running sum), so
# its tile is half the scaled GEMM's: 64 x 128 (64 registers per thread each), the warpgroups splitting the
# 128 x 128 CTA tile along M; each K step's stage is released as soon as its wgmma is done (early_release).
# At 128 x 128 per warpgroup ptxas spills. "tall_grid_minor_dim": the grid walk where M >= N, as for the scaled GEMM.
BLOCKWISE_HEURISTIC = {"tile": dict(tile_m=64, tile_n=128, tile_k=BLOCK_K, max_concurrent_steps=4, wg_split="m",
                                    early_release=True),
                       "tall_grid_minor_dim": "m"}


def walk_tall(config: TileConfig, m: int, n: int, table) -> TileConfig:
    """`config` walking the grid with the minor dimension `table["tall_grid_minor_dim"]` where the output is at
    least as tall as it is wide (M >= N) and the table names one; else `config` as it is."""
    if m >= n and table.get("tall_grid_minor_dim"):
        return dataclasses.replace(config, grid_minor_dim=table["tall_grid_minor_dim"])
    return config


def blockwise_tile(m: int, n: int, out_dtype) -> TileConfig:
    """The blockwise GEMM's tile for an (M, K) x (N, K) product on this device kind (its tuning table's
    "fp8_sm90_blockwise", else BLOCKWISE_HEURISTIC): the two warpgroups split the CTA tile as the table says
    unless only the other split fits the shape without padding; an output at least as tall as it is wide walks the
    grid with the minor dimension "tall_grid_minor_dim"; stages as `blockwise_config` fits them."""
    table = _backend.tuned("fp8_sm90_blockwise", BLOCKWISE_HEURISTIC)
    base = TileConfig(**table["tile"])
    other = dataclasses.replace(base, wg_split="n" if base.wg_split == "m" else "m")
    fits = lambda c: _sm90.supported(m, n, BLOCK_K, c)  # noqa: E731 - K is padded to BLOCK_K in any case
    return blockwise_config(walk_tall(other if fits(other) and not fits(base) else base, m, n, table), out_dtype)


def blockwise_config(config: TileConfig, out_dtype) -> TileConfig:
    """`config` with tile_k = BLOCK_K and as many SMEM stages (at most config's) as fit beside the output
    staging, each stage holding the step's fp8 tiles and its two scale rows."""
    cta_m, cta_n = config.cta_tile
    stage = (cta_m + cta_n) * BLOCK_K + 4 * (cta_m + cta_n)  # fp8 tiles of a and b, fp32 scale rows
    fixed = 4 * config.epi_tile ** 2 * jnp.dtype(out_dtype).itemsize + 1024  # out staging, barriers
    stages = max(2, min(config.max_concurrent_steps, (_sm90.SMEM_LIMIT - fixed) // stage))
    return dataclasses.replace(config, tile_k=BLOCK_K, max_concurrent_steps=stages)


def _promote_blocks(step, rows, cols):
    r, c = rows[0], cols[0]  # a scalar where one scale covers the warpgroup's tile (_sm90.matmul's uniform_steps)
    if r.ndim and c.ndim:
        return step * (lax.broadcast_in_dim(r, step.shape, [0]) * lax.broadcast_in_dim(c, step.shape, [1]))
    if r.ndim:
        return step * lax.broadcast_in_dim(r * c, step.shape, [0])
    if c.ndim:
        return step * lax.broadcast_in_dim(c * r, step.shape, [1])
    return step * (r * c)


def _identity(acc, rows, cols):
    return acc


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "scale_rows"))
def blockwise_matmul_nt(a, bt, a_scales_t, b_scales_t, *, out_dtype, config: TileConfig,
                        scale_rows: tuple[int, int] = (1, 1)):
    """out[i, j] = sum_kb (a_kb @ bt_kb^T)[i, j] * a_scales_t[kb, i] * b_scales_t[kb, j] on Hopper, kb running over
    the K blocks of 128: each block's wgmma product (the tensor cores' fast fp8 accumulation over 128 products) is
    scaled and added into a separate fp32 accumulator (DeepSeek-V3's per-128 promotion).

    a (M, K), bt (N, K): one fp8 dtype, both K-major. a_scales_t (K / 128, M): the transposed (M, K / 128) scales
    of a's 1 x 128 tiles, so a K step's scales are one contiguous row; b_scales_t (K / 128, N): one scale per
    row of bt per K block (a 128 x 128-block weight passes its block scales repeated 128 times along N). Shapes
    must be tile multiples with config.tile_k == 128 (the api pads; `blockwise_tile` picks the tile).
    scale_rows: over how many consecutive rows of a (of bt) a_scales_t (b_scales_t) repeats one scale (the block
    height: 128 for a 128 x 128-block weight); where a warpgroup's tile lies inside one block, the kernel reads one
    scale per step for it instead of a vector.
    """
    op = "kernel_sm90.blockwise_matmul_nt"
    (m, k), n = a.shape, bt.shape[0]
    if config.tile_k != BLOCK_K:
        raise ValueError(f"{op}: config.tile_k must be {BLOCK_K} (one scale block per K step), got {config.tile_k}")
    if not supported(m, n, k, a.dtype, bt.dtype, config) or bt.shape[1] != k:
        raise ValueError(f"{op}: shapes {a.shape} x {bt.shape} must share K and be multiples of the tile "
                         f"{config.cluster_tile + (config.tile_k,)} with one fp8 dtype")
    for name, s, want in (("a_scales_t", a_scales_t, (k // BLOCK_K, m)), ("b_scales_t", b_scales_t, (k // BLOCK_K, n))):
        if s.shape != want:
            raise ValueError(f"{op}: {name} must have shape (K / {BLOCK_K}, {'M' if name[0] == 'a' else 'N'}) = "
                             f"{want}, got {s.shape}")
    return _sm90.matmul(a, bt, b_layout="nk", step_row_vecs=(a_scales_t.astype(jnp.float32),),
                        step_col_vecs=(b_scales_t.astype(jnp.float32),), promote=_promote_blocks, epilogue=_identity,
                        uniform_steps=(scale_rows[0] % config.tile_m == 0, scale_rows[1] % config.tile_n == 0),
                        out_dtype=out_dtype, config=config, name="pallas_fused_fp8_blockwise_matmul_sm90")
