"""DoRA Pallas kernels (Triton lowering): column norm, output GEMM with fused epilogue, backward.

Shapes (Flax layout): x (M, K=in), W (K, N=out), A (K, R), B (R, N), g/m/bias (N,). The rank is
zero-padded to R >= 16 (a Triton dot needs every dimension >= 16); padded rows/columns contribute 0.

The base weight arrives as one of three "weight kinds", dequantised tile by tile in registers:
  "dense": (w,)                          W itself, any float dtype
  "int8":  (q, wscale)                   W = q * wscale[None, :] (per output column)
  "nf4":   (packed, absmax)              see quant.py: rows i and i + in_padded/2 share a byte; blocks
                                         of 64 input rows share an absmax. Tiles along the input axis
                                         are exactly one block (64), so the absmax of a tile is a row.
Every launch goes through `_backend.triton_call`; all reductions accumulate in float32.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_fused import _backend
from pallas_fused.dora.quant import NF4_CODEBOOK
from pallas_fused.dora.reference import floored_norm

NF4_TILE = 64  # = quant.NF4_BLOCK: one absmax row per tile


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, int(pl.next_power_of_2(int(n))))


def _tile(dim: int, cap: int, lo: int = 16) -> int:
    """The configured tile, shrunk (to a power of two >= lo) for small dimensions."""
    return min(cap, _pow2(dim, lo))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _mask(rows=None, cols=None, shape=None):
    """2-D mask from optional row/column masks (None means all in bounds); None if nothing to mask."""
    if rows is None and cols is None:
        return None
    if rows is None:
        return jnp.broadcast_to(cols[None, :], shape)
    if cols is None:
        return jnp.broadcast_to(rows[:, None], shape)
    return rows[:, None] & cols[None, :]


def _in_bounds(start, size: int, bound: int, aligned: bool):
    """Mask of start + arange(size) < bound, or None when the caller knows it is always true."""
    if aligned:
        return None
    return start + jnp.arange(size) < bound


def _load(ref, mask, other=0):
    if mask is None:
        return _backend.load(ref)
    return _backend.load(ref, mask=mask, other=other)


def _store(ref, val, mask):
    if mask is None:
        _backend.store(ref, val)
    else:
        _backend.store(ref, val, mask=mask)


def _num_weight_refs(kind: str) -> int:
    return {"dense": 1, "int8": 2, "nf4": 2}[kind]


def _nf4_values(codes):
    """NF4 codebook lookup as a 4-level select tree on the code bits (float32).

    A gather from a codebook in memory put a dependent load in every GEMM step (measured 8.6x slower
    than bf16 on an H200); 15 selects on registers keep the loop free of it.
    """
    level = [float(v) for v in NF4_CODEBOOK]
    for bit in range(4):
        on = (codes & (1 << bit)) != 0
        level = [jnp.where(on, level[2 * i + 1], level[2 * i]) for i in range(len(level) // 2)]
    return level[0]


@dataclasses.dataclass(frozen=True)
class Config:
    """Tile sizes and launch parameters (GPU defaults; small inputs shrink the tiles)."""

    # Defaults from a sweep on one H200 at 4096 x 4096 -> 4096 bf16 (128x256 tiles spilled badly there).
    bm: int = 128  # forward GEMM tile over tokens
    bn: int = 128  # forward GEMM tile over output columns
    bk: int = 64  # forward GEMM reduction tile
    group_m: int = 8  # grouped program order for L2 reuse
    num_warps: int = 8
    num_stages: int = 4
    dx_bm: int = 128  # backward dx GEMM tiles / launch
    dx_bn: int = 128
    dx_bk: int = 64
    dx_warps: int = 4
    dx_stages: int = 4
    norm_bn: int = 64  # column norm: columns per program
    norm_bk: int = 64  # column norm: rows per loop step
    norm_rows: int = 512  # column norm: rows per program (split-K; partial sums reduced after)
    norm_warps: int = 4
    norm_stages: int = 2
    norm_prefetch: bool = True  # "direct": load the next W tile into registers one step ahead (sweep rows "direct+pf")
    # "direct" defaults: H200 session 3 call 3 (h200_s3_call3_dora.log), 4096 -> 11008 r64, amortized over 4 W:
    # direct+pf bn64 bk64 rows512 w4 s2 0.0432 ms against 0.0606 for the old rows128 without prefetch (XLA 0.0949).
    # "expand": sum W^2 + 2 s sum_r B (A^T W) + s^2 B^T (A^T A) B, so W is an MMA operand (pipelined by
    # cp.async) and never meets the A B tile in registers; dense bf16/fp16 and int8 weights only (fp32
    # weights and NF4 keep "direct": (W + s A B)^2 tile by tile).
    norm_mode: str = "expand"
    # "expand" tiles: 256 programs of 8 warps at 4096 -> 4096, 16 KiB W tiles, 3 stages; 80 registers with
    # xnorm_mma_squares, no spills (ptxas, sm_90a). The session-2 H200 sweep behind them was timed one call at a
    # time, which measured the ~0.03 ms host dispatch (void); the bench's tune_norm section re-times every
    # candidate amortized. At 4096 -> 11008 r64 "direct" beat every "expand" tiling there: per program the A^T A
    # accumulation grows as r^2 (hence `expand_max_rank`; `xnorm_gram_rank` passes A^T A in instead).
    xnorm_bn: int = 64  # "expand" mode: columns per program
    xnorm_bk: int = 128  # ... rows per loop step
    xnorm_rows: int = 1024  # ... rows per program (>= in features: one program per column block, g fused)
    xnorm_warps: int = 4  # call 3: bn64 bk128 rows1024 4 warps 0.0167 ms at 4096^2 r16 (8 warps 0.0226; XLA 0.0511)
    xnorm_stages: int = 3
    expand_max_rank: int = 32  # above this (padded) rank the column norm uses "direct"
    # gemm="merged": keep the merged weight (W + s A B) g from the forward for the backward's dx = dy (that)^T:
    # one bf16 copy of W per layer held until the backward (Llama-7B: ~12.5 GB over 32 blocks). False: the
    # backward forms it again (one more pass over W: read W, write the copy).
    save_merged: bool = True
    # gemm="merged" (forward): the column norm launch writes partial sums over row ranges of `mnorm_rows` (more
    # programs in flight than one per column strip) and the merge launch finishes g from them (`merge_weight`).
    mnorm_rows: int = 1024
    # merge_weight tiles: (W rows, W columns) per program; H200 session 2, as the epilogue kernel forming the
    # merged weight: 128 x 64 with 4 warps was the fastest of 4 tilings at 4096 -> 4096 (0.2261 ms layer forward).
    # Call 3: 64 x 64 took 0.2320 / 0.5914 ms (layer forward, 4096 tokens, r16 / 4096 -> 11008 r64) against
    # 0.2329 / 0.6142 for 128 x 64.
    merge_bk: int = 64
    merge_bn: int = 64
    merge_warps: int = 4
    merge_rows: int = 128  # rows per program (merge_bk per step; g, B and the partial sums loaded once per program)
    merge_stages: int = 2
    # merge_weight with emit_partials (gemm="sm90": V = W + s A B unscaled and its column sums of squares): rows per
    # step and columns per program (0: 64 up to 4096 columns, else 128). H200, session 4 call 3, amortized over 4 W:
    # bk32 bn64 0.0281 ms at 4096 -> 4096 r16 (bk64 0.0332; a plain Pallas copy of W 0.0215, XLA's w * 2 0.0255);
    # bk32 bn128 0.0692 at 4096 -> 11008 r64 (bn64 0.0801; copy 0.0495). The A B tile as R outer products on the
    # FMA units instead of the MMA measured 1.9x slower at r16 and 7x at r64.
    vmerge_bk: int = 32
    vmerge_bn: int = 0
    merge_reverse: bool = True  # walk W in the reverse of the norm launch's order (L2 hits on the tiles it read last)
    epi_bm: int = 64  # gemm="epilogue": tile of the standalone epilogue kernel (untimed guess)
    epi_bn: int = 128
    epi_warps: int = 4
    cols_bn: int = 64  # backward column reductions: columns per program
    cols_bt: int = 64  # ... tokens per loop step
    cols_rows: int = 512  # ... tokens per program
    cols_warps: int = 4
    cols_stages: int = 2
    cols_prefetch: bool = True  # load the next y tile one step ahead (y is no MMA operand: not pipelined by Triton)
    # 16-bit dy: sum_t dy y and sum_t dy as MMAs too (diag(dy^T y), e0^T dy), as the column norm's squares: dy and y
    # both pipelined MMA operands, no per-element register work (cols_prefetch then does not apply). By the compiled
    # loop (sm_90a, default tiles): 164 instead of 281 PTX instructions per thread per step, 104 registers instead
    # of 163. Only at cols_bn >= 64 (below, no wgmma for dy^T y and y is no longer pipelined). Untimed.
    cols_mma_sums: bool = True


DEFAULT = Config()


def _grouped_pid(pid, num_m: int, num_n: int, group_m: int):
    """Map a 1-D program id to (pid_m, pid_n), walking group_m rows of tiles at a time (L2 reuse of W)."""
    width = group_m * num_n
    group = pid // width
    first_m = group * group_m
    size = jnp.minimum(num_m - first_m, group_m)
    pid_m = first_m + (pid % width) % size
    pid_n = (pid % width) // size
    return pid_m, pid_n


# ----------------------------------------------------------------------------------------------------
# Column norm: partial sums of squares of W + s A B, never materialising A B.
# ----------------------------------------------------------------------------------------------------


def _colnorm_kernel(*refs, kind, K, N, R, bk, bn, rows_per_prog, kloop, prefetch):
    nw = _num_weight_refs(kind)
    w_refs = refs[:nw]
    a_ref, b_ref, s_ref, out_ref = refs[nw:]
    j, split = pl.program_id(0), pl.program_id(1)
    n0 = pl.multiple_of(j * bn, bn)
    cmask = _in_bounds(n0, bn, N, N % bn == 0)
    s = s_ref[0]
    b_t = _load(b_ref.at[:, pl.ds(n0, bn)], _mask(None, cmask, (R, bn)))
    k_start = split * rows_per_prog

    if kind == "int8":
        wscale = _load(w_refs[1].at[pl.ds(n0, bn)], cmask, 1.0)

    def a_tile(k0):
        rmask = _in_bounds(k0, bk, K, False)
        return _load(a_ref.at[pl.ds(k0, bk), :], _mask(rmask, None, (bk, R)))

    nsteps = rows_per_prog // bk

    def w_tile(i):  # masked past K and past this program's rows (a prefetch beyond them fetches nothing)
        k0 = k_start + i * bk
        rows_ok = jnp.logical_and(k0 + jnp.arange(bk) < K, i < nsteps)
        return _load(w_refs[0].at[pl.ds(k0, bk), pl.ds(n0, bn)], _mask(rows_ok, cmask, (bk, bn)))

    def square(k0, w, acc):
        w = w.astype(jnp.float32)
        if kind == "int8":
            w = w * wscale[None, :]
        v = w + s * _backend.dot(a_tile(k0), b_t)
        return acc + v * v

    if kind in ("dense", "int8") and prefetch:
        # W is no MMA operand here, so Triton's pipeliner leaves its load synchronous: load the next step's tile
        # into registers before this step's math (one tile in flight per program while it computes).
        def body(i, carry):
            acc, w = carry
            w_next = w_tile(i + 1)
            return square(pl.multiple_of(k_start + i * bk, bk), w, acc), w_next

        acc, _ = lax.fori_loop(0, nsteps, body, (jnp.zeros((bk, bn), jnp.float32), w_tile(0)))
        _store(out_ref.at[split, pl.ds(n0, bn)], jnp.sum(acc, axis=0), cmask)
        return
    if kind in ("dense", "int8"):
        def body(i, acc):
            k0 = pl.multiple_of(k_start + i * bk, bk)
            rmask = _in_bounds(k0, bk, K, False)
            return square(k0, _load(w_refs[0].at[pl.ds(k0, bk), pl.ds(n0, bn)], _mask(rmask, cmask, (bk, bn))), acc)
    else:
        packed_ref, absmax_ref = w_refs

        def body(i, acc):
            # rows_per_prog divides kloop for NF4 (see column_sumsq): no row masks on packed/absmax.
            k0 = pl.multiple_of(k_start + i * bk, bk)
            p = _load(packed_ref.at[pl.ds(k0, bk), pl.ds(n0, bn)], _mask(None, cmask, (bk, bn))).astype(jnp.int32)
            blk = k0 // NF4_TILE
            am_hi = _load(absmax_ref.at[pl.ds(blk, 1), pl.ds(n0, bn)], _mask(None, cmask, (1, bn)))
            am_lo = _load(absmax_ref.at[pl.ds(blk + kloop // NF4_TILE, 1), pl.ds(n0, bn)], _mask(None, cmask, (1, bn)))
            w_hi = _nf4_values(p >> 4) * am_hi
            w_lo = _nf4_values(p & 15) * am_lo
            v_hi = w_hi + s * _backend.dot(a_tile(k0), b_t)
            v_lo = w_lo + s * _backend.dot(a_tile(kloop + k0), b_t)
            return acc + v_hi * v_hi + v_lo * v_lo

    # Accumulate a (bk, bn) tile of squares and reduce over rows once at the end (a cross-thread
    # reduction per step would dominate this memory-bound loop).
    acc = lax.fori_loop(0, rows_per_prog // bk, body, jnp.zeros((bk, bn), jnp.float32))
    _store(out_ref.at[split, pl.ds(n0, bn)], jnp.sum(acc, axis=0), cmask)


def column_sumsq(weight, kind: str, lora_a, lora_b, scale, *, interpret: bool, config: Config = DEFAULT):
    """sum over the input axis of (W + s A B)^2, float32 (out,). `lora_a` (K, R), `lora_b` (R, N), R padded."""
    return jnp.sum(column_partials(weight, kind, lora_a, lora_b, scale, interpret=interpret, config=config), axis=0)


def column_partials(weight, kind: str, lora_a, lora_b, scale, *, interpret: bool, config: Config = DEFAULT,
                    rows: int | None = None):
    """Partial sums of squares of W + s A B over row ranges, float32 (nsplit, out): one launch, no reduction
    after it (`merge_weight` or `column_sumsq` sums the nsplit rows). `rows`: rows per program of the "expand"
    kernel (default config.xnorm_rows)."""
    if config.norm_mode == "expand" and expand_supported(weight, kind, lora_a, config.expand_max_rank):
        return _expand_launch(weight, kind, lora_a, lora_b, scale, None, interpret=interpret, config=config,
                              rows=rows)
    K, R = lora_a.shape
    N = lora_b.shape[1]
    if kind == "nf4":
        bk = NF4_TILE
        kloop = weight[0].shape[0]  # in_padded // 2
    else:
        bk = _tile(K, config.norm_bk)
        kloop = K
    bn = _tile(N, config.norm_bn)
    if kind == "nf4":
        rows_per_prog = NF4_TILE * math.gcd(kloop // NF4_TILE, max(1, config.norm_rows // NF4_TILE))
    else:
        rows_per_prog = max(bk, min(config.norm_rows, _pow2(kloop, bk)))
    nsplit = _cdiv(kloop, rows_per_prog)
    kernel = functools.partial(_colnorm_kernel, kind=kind, K=K, N=N, R=R, bk=bk, bn=bn,
                               rows_per_prog=rows_per_prog, kloop=kloop, prefetch=config.norm_prefetch)
    partial_sums = _backend.triton_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((nsplit, N), jnp.float32),
        grid=(_cdiv(N, bn), nsplit),
        name="pallas_fused_dora_colnorm",
        interpret=interpret,
        num_warps=config.norm_warps,
        num_stages=config.norm_stages,
    )(*weight, lora_a, lora_b, jnp.reshape(jnp.asarray(scale, jnp.float32), (1,)))
    return partial_sums


def _bf16_parts(v, n: int):
    """v (float32) as n bfloat16 terms whose float32 sum is v to 8 n bits (3 terms: all of float32's 24)."""
    parts = []
    for _ in range(n):
        p = v.astype(jnp.bfloat16)
        parts.append(p)
        v = v - p.astype(jnp.float32)
    return parts


def _dot_f32_exact(a32, b_dtype, b):
    """a32 (float32) @ b (16-bit) to float32 accuracy on the tensor cores: a32 split in 3 bfloat16 terms,
    b in 1 (bf16) or 2 (fp16) - every product is exact in the float32 accumulator. An fp32 FMA dot of
    (R, R) x (R, bn) at rank 64 held so many registers that the kernel spilled."""
    b_parts = [b] if b_dtype == jnp.bfloat16 else _bf16_parts(b.astype(jnp.float32), 2)
    out = None
    for i, ap in enumerate(_bf16_parts(a32, 3)):
        for j, bp in enumerate(b_parts):
            if i + j < 3:  # terms below 2^-24 relative are dropped
                d = _backend.dot(ap, bp)
                out = d if out is None else out + d
    return out


def _colnorm_expand_kernel(*refs, kind, K, N, R, bk, bn, rows_per_prog, finish):
    """||W + s A B||^2 per column as sum W^2 + 2 s sum_r B (A^T W) + s^2 sum_r B (A^T A B), per row range.

    W is the right operand of an MMA (A^T W), so Triton streams it through shared memory with cp.async
    (num_stages deep); the squares read the same tile. With `finish` (one program per column block) the
    program also writes n = sqrt(sum) and g = m / n: the whole column scale is one launch.
    """
    nw = _num_weight_refs(kind)
    w_refs = refs[:nw]
    a_ref, b_ref, s_ref = refs[nw:nw + 3]
    if finish:
        m_ref, n_ref, g_ref = refs[nw + 3:]
    else:
        (out_ref,) = refs[nw + 3:]
    j, split = pl.program_id(0), pl.program_id(1)
    n0 = pl.multiple_of(j * bn, bn)
    cmask = _in_bounds(n0, bn, N, N % bn == 0)
    k_start = split * rows_per_prog
    rows_aligned = K % rows_per_prog == 0 and rows_per_prog % bk == 0
    mma_dt = a_ref.dtype

    def a_tile(k0):  # masked always: the last step's prefetch reads past the row range (maybe past K)
        return _load(a_ref.at[pl.ds(k0, bk), :], _mask(_in_bounds(k0, bk, K, False), None, (bk, R)))

    def body(i, carry):
        sq, wa, aa, a = carry
        k0 = pl.multiple_of(k_start + i * bk, bk)
        rmask = _in_bounds(k0, bk, K, rows_aligned)
        w = _load(w_refs[0].at[pl.ds(k0, bk), pl.ds(n0, bn)], _mask(rmask, cmask, (bk, bn)))
        # The A tile of the next step is loaded now (a hand-made prefetch): A feeds a transposed
        # register operand (A^T A), which Triton's pipeliner leaves as a synchronous load.
        a_next = a_tile(k0 + bk)
        # W^T A with W^T the transposed left operand: W streams through shared memory (wgmma reads it there).
        # int8 codes and bf16/fp16 values are exact in the MMA dtype. The squares stay a (bk, bn) tile, reduced
        # over rows once at the end.
        wf = w.astype(jnp.float32)
        return (sq + wf * wf, wa + _backend.dot(w.astype(mma_dt), a, trans_a=True),
                aa + _backend.dot(a, a, trans_a=True), a_next)

    init = (jnp.zeros((bk, bn), jnp.float32), jnp.zeros((bn, R), jnp.float32), jnp.zeros((R, R), jnp.float32),
            a_tile(k_start))
    sq, wa, aa, _ = lax.fori_loop(0, rows_per_prog // bk, body, init)
    s = s_ref[0]
    b = _load(b_ref.at[:, pl.ds(n0, bn)], _mask(None, cmask, (R, bn))).astype(jnp.float32)
    sq = jnp.sum(sq, axis=0)
    if kind == "int8":  # W = q * wscale: every term linear in W takes one wscale, W^2 two
        wscale = _load(w_refs[1].at[pl.ds(n0, bn)], cmask, 1.0)
        sq, wa = sq * wscale * wscale, wa * wscale[:, None]
    aab = _dot_f32_exact(aa, b_ref.dtype, _load(b_ref.at[:, pl.ds(n0, bn)], _mask(None, cmask, (R, bn))))
    total = sq + 2.0 * s * jnp.sum(wa * b.T, axis=1) + (s * s) * jnp.sum(b * aab, axis=0)
    if finish:
        n = floored_norm(total)  # a zero column gives g = 0, not 0 / 0
        _store(n_ref.at[pl.ds(n0, bn)], n, cmask)
        g = _load(m_ref.at[pl.ds(n0, bn)], cmask, 1.0).astype(jnp.float32) / n
        _store(g_ref.at[pl.ds(n0, bn)], g, cmask)
    else:
        _store(out_ref.at[split, pl.ds(n0, bn)], total, cmask)


def expand_supported(weight, kind: str, lora_a, max_rank: int | None = None) -> bool:
    """Whether the "expand" column norm applies: 16-bit dense W (in A's dtype) or int8 codes, 16-bit A, and
    (when given) a rank of at most `max_rank`."""
    if max_rank is not None and lora_a.shape[1] > max_rank:
        return False
    if lora_a.dtype not in (jnp.bfloat16, jnp.float16):
        return False
    if kind == "int8":
        return True
    return kind == "dense" and weight[0].dtype == lora_a.dtype


def _expand_launch(weight, kind, lora_a, lora_b, scale, magnitude, *, interpret, config, rows=None):
    """(n, g) when `magnitude` is given and one program covers all rows; otherwise (nsplit, N) partial sums."""
    K, R = lora_a.shape
    N = lora_b.shape[1]
    bk, bn = _tile(K, config.xnorm_bk), _tile(N, config.xnorm_bn)
    rows_per_prog = max(bk, min(_pow2(rows or config.xnorm_rows, bk), _pow2(K, bk)))
    nsplit = _cdiv(K, rows_per_prog)
    finish = magnitude is not None and nsplit == 1
    kernel = functools.partial(_colnorm_expand_kernel, kind=kind, K=K, N=N, R=R, bk=bk, bn=bn,
                               rows_per_prog=rows_per_prog, finish=finish)
    col = jax.ShapeDtypeStruct((N,), jnp.float32)
    out_shape = (col, col) if finish else jax.ShapeDtypeStruct((nsplit, N), jnp.float32)
    args = (*weight, lora_a, lora_b, jnp.reshape(jnp.asarray(scale, jnp.float32), (1,)))
    out = _backend.triton_call(
        kernel,
        out_shape=out_shape,
        grid=(_cdiv(N, bn), nsplit),
        name="pallas_fused_dora_colnorm",
        interpret=interpret,
        num_warps=config.xnorm_warps,
        num_stages=config.xnorm_stages,
    )(*args, *((magnitude,) if finish else ()))
    return out


# ----------------------------------------------------------------------------------------------------
# Merged weight: (W + s A B) * g, g finished from the column norm's partial sums in the same launch.
# ----------------------------------------------------------------------------------------------------


def _merge_kernel(*refs, kind, K, N, R, bk, bn, steps, nsplit, from_partials, reverse, emit_partials):
    nw = _num_weight_refs(kind)
    w_refs = refs[:nw]
    a_ref, b_ref, s_ref = refs[nw:nw + 3]
    if from_partials:
        part_ref, m_ref, vg_ref, n_ref, g_ref, bg_ref = refs[nw + 3:]
    elif emit_partials:
        vg_ref, part_out_ref = refs[nw + 3:]
    else:
        gin_ref, vg_ref = refs[nw + 3:]
    rows = bk * steps  # rows per program, in `steps` tiles of bk
    nkb, nnb = _cdiv(K, rows), _cdiv(N, bn)
    pid = pl.program_id(0)
    if reverse:  # the norm launch read W top to bottom: start where it ended (those tiles are likeliest in L2)
        pid = nkb * nnb - 1 - pid
    kb, nb = pid // nnb, pid % nnb
    n0 = pl.multiple_of(nb * bn, bn)
    cmask = _in_bounds(n0, bn, N, N % bn == 0)
    if from_partials:
        # g = m / sqrt(sum of the nsplit partial sums), per program (nsplit x bn floats: cheap); row block 0
        # also writes n, g and B g s for the backward. nsplit is a power of two (`merge_weight` pads with zeros).
        part = _load(part_ref.at[:, pl.ds(n0, bn)], _mask(None, cmask, (nsplit, bn)))
        n = floored_norm(jnp.sum(part, axis=0))
        g = _load(m_ref.at[pl.ds(n0, bn)], cmask, 1.0).astype(jnp.float32) / n
        first = jnp.logical_and(n0 + jnp.arange(bn) < N, kb == 0)
        _backend.store(n_ref.at[pl.ds(n0, bn)], n, mask=first)
        _backend.store(g_ref.at[pl.ds(n0, bn)], g, mask=first)
    elif emit_partials:  # V = W + s A B unscaled, and its column sums of squares over this program's rows
        g = None
    else:
        g = _load(gin_ref.at[pl.ds(n0, bn)], cmask, 1.0).astype(jnp.float32)
    b = _load(b_ref.at[:, pl.ds(n0, bn)], _mask(None, cmask, (R, bn)))
    if from_partials:
        bg = (b.astype(jnp.float32) * (g * s_ref[0])[None, :]).astype(bg_ref.dtype)
        _backend.store(bg_ref.at[:, pl.ds(n0, bn)], bg, mask=jnp.broadcast_to(first[None, :], (R, bn)))
    wscale = _load(w_refs[1].at[pl.ds(n0, bn)], cmask, 1.0)[None, :] if kind == "int8" else None
    k_start = kb * rows

    def w_tile(i):  # masked past K and past this program's rows (the last step's prefetch fetches nothing)
        k0 = k_start + i * bk
        if steps == 1:
            ok = _in_bounds(k0, bk, K, K % rows == 0)
        else:
            ok = jnp.logical_and(k0 + jnp.arange(bk) < K, i < steps)
        return _load(w_refs[0].at[pl.ds(k0, bk), pl.ds(n0, bn)], _mask(ok, cmask, (bk, bn)))

    def tile(i, w):  # -> this tile's column sums of squares of V (masked rows load 0: they add nothing)
        k0 = pl.multiple_of(k_start + i * bk, bk)
        rmask = _in_bounds(k0, bk, K, K % rows == 0)
        w = w.astype(jnp.float32)
        if kind == "int8":
            w = w * wscale
        a = _load(a_ref.at[pl.ds(k0, bk), :], _mask(rmask, None, (bk, R)))
        v = w + s_ref[0] * _backend.dot(a, b)
        out = v if g is None else v * g[None, :]
        _store(vg_ref.at[pl.ds(k0, bk), pl.ds(n0, bn)], out.astype(vg_ref.dtype), _mask(rmask, cmask, (bk, bn)))
        return v * v

    def body(i, carry):  # W is no MMA operand: its next tile is loaded by hand one step ahead
        w, sq = carry
        w_next = w_tile(i + 1) if steps > 1 else w
        v2 = tile(i, w)
        return w_next, (sq + v2 if emit_partials else sq)

    # Squares are summed elementwise over the steps and reduced across rows once (a cross-warp reduction per
    # step measured 2x the pass's time).
    sq0 = jnp.zeros((bk, bn) if emit_partials else (1, 1), jnp.float32)
    _, sq = lax.fori_loop(0, steps, body, (w_tile(0), sq0))
    if emit_partials:
        _store(part_out_ref.at[kb, pl.ds(n0, bn)], jnp.sum(sq, axis=0), cmask)


def merge_weight(weight, kind: str, lora_a, lora_b, scale, *, g=None, partials=None, magnitude=None,
                 emit_partials: bool = False, interpret: bool, config: Config = DEFAULT):
    """The merged weight (W + s A B) * g in A's dtype (K, N), for a dense or int8 W; A (K, R), B (R, N) rank-padded.

    Either `g` (float32 (N,)) is given, or the column norm's `partials` ((nsplit, N) sums of squares, from
    `column_partials`) and `magnitude`: then g = m / sqrt(sum partials) is formed in this launch (no XLA op
    between the two launches) and (wm, n, g, B g s) is returned (B g s in B's dtype: the backward's
    us = dy (B g s)^T takes it as is). With `emit_partials` (no g): (V, partials), V = W + s A B unscaled and
    partials the float32 (nsplit, N) column sums of squares of V over row ranges (V's norm, from the pass that
    forms it: the sm90 GEMM applies g in its epilogue).
    """
    if kind not in ("dense", "int8"):
        raise ValueError(f"merge_weight: dense or int8 weights only, got {kind!r}")
    K, R = lora_a.shape
    N = lora_b.shape[1]
    if emit_partials:
        bk, bn = _tile(K, config.vmerge_bk), _tile(N, config.vmerge_bn or (64 if N <= 4096 else 128))
    else:
        bk, bn = _tile(K, config.merge_bk), _tile(N, config.merge_bn)
    steps = max(1, min(config.merge_rows, _pow2(K, bk)) // bk)
    from_partials = partials is not None
    if from_partials:
        # The kernel loads all partial rows as one block, whose height Triton wants a power of two: zero rows
        # (nsplit x N floats) keep that block inside the array instead of reading past its end under a mask,
        # which jax >= 0.12 rejects at trace time.
        partials = jnp.pad(partials, ((0, _pow2(partials.shape[0], 1) - partials.shape[0]), (0, 0)))
    nsplit = partials.shape[0] if from_partials else 0
    kernel = functools.partial(_merge_kernel, kind=kind, K=K, N=N, R=R, bk=bk, bn=bn, steps=steps, nsplit=nsplit,
                               from_partials=from_partials, reverse=config.merge_reverse, emit_partials=emit_partials)
    wm = jax.ShapeDtypeStruct((K, N), lora_a.dtype)
    col = jax.ShapeDtypeStruct((N,), jnp.float32)
    nkb = _cdiv(K, bk * steps)
    args = (*weight, lora_a, lora_b, jnp.reshape(jnp.asarray(scale, jnp.float32), (1,)))
    if from_partials:
        args += (partials, magnitude)
        out_shape = (wm, col, col, jax.ShapeDtypeStruct((R, N), lora_b.dtype))
    elif emit_partials:
        out_shape = (wm, jax.ShapeDtypeStruct((nkb, N), jnp.float32))
    else:
        args += (g.astype(jnp.float32),)
        out_shape = wm
    return _backend.triton_call(
        kernel,
        out_shape=out_shape,
        grid=(nkb * _cdiv(N, bn),),
        name="pallas_fused_dora_merge",
        interpret=interpret,
        num_warps=config.merge_warps,
        num_stages=config.merge_stages,
    )(*args)


def column_norm_scale(weight, kind: str, lora_a, lora_b, scale, magnitude, *, interpret: bool,
                      config: Config = DEFAULT):
    """(n, g): n = max(||W + s A B||, NORM_FLOOR) per output column and g = m / n, float32 (N,); A, B rank-padded.

    One launch when the "expand" kernel applies and one program covers all input rows; otherwise the
    partial sums of squares are reduced and finished by XLA.
    """
    if config.norm_mode == "expand" and expand_supported(weight, kind, lora_a, config.expand_max_rank):
        out = _expand_launch(weight, kind, lora_a, lora_b, scale, magnitude, interpret=interpret, config=config)
        if isinstance(out, tuple):
            return out
        n = floored_norm(jnp.sum(out, axis=0))
    else:
        n = floored_norm(column_sumsq(weight, kind, lora_a, lora_b, scale, interpret=interpret, config=config))
    return n, magnitude.astype(jnp.float32) / n


# ----------------------------------------------------------------------------------------------------
# Forward GEMM: y = (x W [* wscale] + s (x A) B) * g + bias, one pass, epilogue fused.
# ----------------------------------------------------------------------------------------------------


def _fwd_kernel(*refs, kind, M, K, N, R, bm, bn, bk, group_m, has_bias, kloop):
    nw = _num_weight_refs(kind)
    x_ref = refs[0]
    w_refs = refs[1:1 + nw]
    xa_ref, b_ref, g_ref, s_ref = refs[1 + nw:5 + nw]
    bias_ref = refs[5 + nw] if has_bias else None
    o_ref = refs[-1]
    pid_m, pid_n = _grouped_pid(pl.program_id(0), _cdiv(M, bm), _cdiv(N, bn), group_m)
    m0 = pl.multiple_of(pid_m * bm, bm)
    n0 = pl.multiple_of(pid_n * bn, bn)
    rmask = _in_bounds(m0, bm, M, M % bm == 0)
    cmask = _in_bounds(n0, bn, N, N % bn == 0)
    dt = x_ref.dtype

    def x_tile(k0, aligned):
        kmask = _in_bounds(k0, bk, K, aligned)
        return _load(x_ref.at[pl.ds(m0, bm), pl.ds(k0, bk)], _mask(rmask, kmask, (bm, bk)))

    mma = _backend.dot

    if kind in ("dense", "int8"):
        def body(i, acc):
            k0 = pl.multiple_of(i * bk, bk)
            kmask = _in_bounds(k0, bk, K, K % bk == 0)
            w = _load(w_refs[0].at[pl.ds(k0, bk), pl.ds(n0, bn)], _mask(kmask, cmask, (bk, bn)))
            return acc + mma(x_tile(k0, K % bk == 0), w.astype(dt))
    else:
        packed_ref, absmax_ref = w_refs

        def body(i, acc):
            k0 = pl.multiple_of(i * bk, bk)
            p = _load(packed_ref.at[pl.ds(k0, bk), pl.ds(n0, bn)], _mask(None, cmask, (bk, bn))).astype(jnp.int32)
            blk = k0 // NF4_TILE
            am_hi = _load(absmax_ref.at[pl.ds(blk, 1), pl.ds(n0, bn)], _mask(None, cmask, (1, bn)))
            am_lo = _load(absmax_ref.at[pl.ds(blk + kloop // NF4_TILE, 1), pl.ds(n0, bn)], _mask(None, cmask, (1, bn)))
            w_hi = (_nf4_values(p >> 4) * am_hi).astype(dt)
            w_lo = (_nf4_values(p & 15) * am_lo).astype(dt)
            acc = acc + mma(x_tile(k0, False), w_hi)
            return acc + mma(x_tile(kloop + k0, False), w_lo)

    acc = lax.fori_loop(0, _cdiv(kloop, bk), body, jnp.zeros((bm, bn), jnp.float32))
    # Epilogue: per-column dequant scale, low-rank term, magnitude scale, bias; one rounding.
    if kind == "int8":
        acc = acc * _load(w_refs[1].at[pl.ds(n0, bn)], cmask, 1.0)[None, :]
    xa = _load(xa_ref.at[pl.ds(m0, bm), :], _mask(rmask, None, (bm, R)))
    b = _load(b_ref.at[:, pl.ds(n0, bn)], _mask(None, cmask, (R, bn)))
    acc = acc + s_ref[0] * _backend.dot(xa, b)
    acc = acc * _load(g_ref.at[pl.ds(n0, bn)], cmask)[None, :]
    if has_bias:
        acc = acc + _load(bias_ref.at[pl.ds(n0, bn)], cmask).astype(jnp.float32)[None, :]
    _store(o_ref.at[pl.ds(m0, bm), pl.ds(n0, bn)], acc.astype(o_ref.dtype), _mask(rmask, cmask, (bm, bn)))


def forward_gemm(x, weight, kind: str, xa, lora_b, g, scale, bias, *, interpret: bool, config: Config = DEFAULT):
    """(x W + s xa B) * g + bias for 2-D x (M, K); xa = x A (M, R) and B (R, N) rank-padded; g float32 (N,)."""
    M, K = x.shape
    R, N = lora_b.shape
    if kind == "nf4":
        bk = NF4_TILE
        kloop = weight[0].shape[0]
    else:
        bk = _tile(K, config.bk)
        kloop = K
    bm, bn = _tile(M, config.bm), _tile(N, config.bn)
    kernel = functools.partial(_fwd_kernel, kind=kind, M=M, K=K, N=N, R=R, bm=bm, bn=bn, bk=bk,
                               group_m=config.group_m, has_bias=bias is not None, kloop=kloop)
    args = (x, *weight, xa, lora_b, g, jnp.reshape(jnp.asarray(scale, jnp.float32), (1,)))
    if bias is not None:
        args = args + (bias,)
    return _backend.triton_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((M, N), x.dtype),
        grid=(_cdiv(M, bm) * _cdiv(N, bn),),
        name="pallas_fused_dora_fwd",
        interpret=interpret,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )(*args)


# ----------------------------------------------------------------------------------------------------
# Epilogue only: y = (z + s xa B) * g + bias, z = x W from cuBLAS (gemm="epilogue"): one read of z, one write.
# ----------------------------------------------------------------------------------------------------


def _epilogue_kernel(*refs, M, N, R, bm, bn, has_bias, has_zscale):
    z_ref, refs = refs[0], refs[1:]
    zscale_ref, refs = (refs[0], refs[1:]) if has_zscale else (None, refs)
    xa_ref, b_ref, g_ref, s_ref = refs[:4]
    bias_ref = refs[4] if has_bias else None
    o_ref = refs[-1]
    m0 = pl.multiple_of(pl.program_id(0) * bm, bm)
    n0 = pl.multiple_of(pl.program_id(1) * bn, bn)
    rmask = _in_bounds(m0, bm, M, M % bm == 0)
    cmask = _in_bounds(n0, bn, N, N % bn == 0)
    z = _load(z_ref.at[pl.ds(m0, bm), pl.ds(n0, bn)], _mask(rmask, cmask, (bm, bn))).astype(jnp.float32)
    if has_zscale:  # int8 codes times their per-column scale
        z = z * _load(zscale_ref.at[pl.ds(n0, bn)], cmask, 1.0)[None, :]
    xa = _load(xa_ref.at[pl.ds(m0, bm), :], _mask(rmask, None, (bm, R)))
    b = _load(b_ref.at[:, pl.ds(n0, bn)], _mask(None, cmask, (R, bn)))
    acc = (z + s_ref[0] * _backend.dot(xa, b)) * _load(g_ref.at[pl.ds(n0, bn)], cmask)[None, :]
    if has_bias:
        acc = acc + _load(bias_ref.at[pl.ds(n0, bn)], cmask).astype(jnp.float32)[None, :]
    _store(o_ref.at[pl.ds(m0, bm), pl.ds(n0, bn)], acc.astype(o_ref.dtype), _mask(rmask, cmask, (bm, bn)))


def epilogue(z, xa, lora_b, g, scale, bias, *, interpret: bool, config: Config = DEFAULT, zscale=None,
             out_dtype=None):
    """(z [* zscale] + s xa B) * g + bias for z = x W (M, N) from another GEMM; xa (M, R), B (R, N) rank-padded,
    g fp32. Also forms the merged weight (W + s A B) * g with z = W, xa = A (z = int8 codes with `zscale`)."""
    M, N = z.shape
    R = lora_b.shape[0]
    bm, bn = _tile(M, config.epi_bm), _tile(N, config.epi_bn)
    kernel = functools.partial(_epilogue_kernel, M=M, N=N, R=R, bm=bm, bn=bn, has_bias=bias is not None,
                               has_zscale=zscale is not None)
    args = (z,) + (() if zscale is None else (zscale,))
    args += (xa, lora_b, g, jnp.reshape(jnp.asarray(scale, jnp.float32), (1,)))
    args += (bias,) if bias is not None else ()
    return _backend.triton_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((M, N), out_dtype or z.dtype),
        grid=(_cdiv(M, bm), _cdiv(N, bn)),
        name="pallas_fused_dora_epilogue",
        interpret=interpret,
        num_warps=config.epi_warps,
    )(*args)


# ----------------------------------------------------------------------------------------------------
# Backward, column reductions over tokens: P = xa^T dy (R, N), sum dy * (y - bias), sum dy.
# (dB = s * g * P and dm = sum(dy * (y - bias)) / m follow in XLA on (N,)-sized data.)
# ----------------------------------------------------------------------------------------------------


def _cols_kernel(*refs, M, N, R, bt, bn, rows_per_prog, has_bias, finish, prefetch, mma_sums, emit_dyg):
    dy_ref, y_ref, xa_ref = refs[:3]
    bias_ref = refs[3] if has_bias else None
    if finish:
        gs_ref, m_ref = refs[3 + has_bias:5 + has_bias]
    if emit_dyg:
        g_ref, dyg_ref = refs[-5], refs[-1]
        refs = refs[:-1]
    p_ref, dmz_ref, db_ref = refs[-3:]
    j, split = pl.program_id(0), pl.program_id(1)
    n0 = pl.multiple_of(j * bn, bn)
    cmask = _in_bounds(n0, bn, N, N % bn == 0)
    bias = _load(bias_ref.at[pl.ds(n0, bn)], cmask).astype(jnp.float32) if has_bias else None
    g = _load(g_ref.at[pl.ds(n0, bn)], cmask).astype(jnp.float32) if emit_dyg else None

    def store_dyg(t0, dy, mask):  # dy * g in dy's dtype, for dx = (dy g) V^T (gemm="sm90")
        if emit_dyg:
            _store(dyg_ref.at[pl.ds(t0, bt), pl.ds(n0, bn)], (dy.astype(jnp.float32) * g[None, :]).astype(dt), mask)
    t_start = split * rows_per_prog
    dt = dy_ref.dtype
    nsteps = rows_per_prog // bt

    def y_tile(i):  # masked past M and past this program's tokens (a prefetch beyond them fetches nothing)
        t0 = t_start + i * bt
        rows_ok = jnp.logical_and(t0 + jnp.arange(bt) < M, i < nsteps)
        return _load(y_ref.at[pl.ds(t0, bt), pl.ds(n0, bn)], _mask(rows_ok, cmask, (bt, bn)))

    def step(i, p, dmz, db, y):
        t0 = pl.multiple_of(t_start + i * bt, bt)
        rmask = _in_bounds(t0, bt, M, False)
        dy = _load(dy_ref.at[pl.ds(t0, bt), pl.ds(n0, bn)], _mask(rmask, cmask, (bt, bn)))
        store_dyg(t0, dy, _mask(rmask, cmask, (bt, bn)))
        xa = _load(xa_ref.at[pl.ds(t0, bt), :], _mask(rmask, None, (bt, R)))
        p = p + _backend.dot(xa, dy.astype(dt), trans_a=True)
        dy = dy.astype(jnp.float32)
        z = y.astype(jnp.float32)
        z = z - bias[None, :] if has_bias else z
        return p, dmz + dy * z, db + dy  # (bt, bn) tiles; reduced over tokens once at the end

    def mma_body(i, carry):
        # Every reduction on the tensor cores: P = xa^T dy, dy^T y (its diagonal: sum_t dy y per column) and
        # e0^T dy (its row 0: sum_t dy), so dy and y are both MMA operands (pipelined by Triton through shared
        # memory) and no per-element work is left in registers.
        p, dyy, cs = carry
        t0 = pl.multiple_of(t_start + i * bt, bt)
        m2 = _mask(_in_bounds(t0, bt, M, False), cmask, (bt, bn))
        dy = _load(dy_ref.at[pl.ds(t0, bt), pl.ds(n0, bn)], m2)
        store_dyg(t0, dy, m2)
        y = _load(y_ref.at[pl.ds(t0, bt), pl.ds(n0, bn)], m2)
        xa = _load(xa_ref.at[pl.ds(t0, bt), :], _mask(_in_bounds(t0, bt, M, False), None, (bt, R)))
        e0 = jnp.where(jnp.arange(16)[None, :] == 0, 1.0, 0.0).astype(dt) + jnp.zeros((bt, 16), dt)
        return (p + _backend.dot(xa, dy, trans_a=True), dyy + _backend.dot(dy, y, trans_a=True),
                cs + _backend.dot(e0, dy, trans_a=True))

    if mma_sums:
        init = (jnp.zeros((R, bn), jnp.float32), jnp.zeros((bn, bn), jnp.float32), jnp.zeros((16, bn), jnp.float32))
        p, dyy, cs = lax.fori_loop(0, nsteps, mma_body, init)
        eye = jnp.arange(bn)[:, None] == jnp.arange(bn)[None, :]
        db = jnp.sum(cs, axis=0)  # rows 1..15 are zeros
        dmz = jnp.sum(jnp.where(eye, dyy, 0.0), axis=0)  # sum dy (y - bias) = sum dy y - bias sum dy
        if has_bias:
            dmz = dmz - bias * db
    else:
        if prefetch:
            # dy feeds an MMA, so Triton pipelines its load; y does not: load the next step's y tile one step ahead.
            def body(i, carry):
                *acc, y = carry
                y_next = y_tile(i + 1)
                return (*step(i, *acc, y), y_next)
        else:
            def body(i, carry):
                return step(i, *carry, y_tile(i))

        zeros = jnp.zeros((bt, bn), jnp.float32)
        init = (jnp.zeros((R, bn), jnp.float32), zeros, zeros) + ((y_tile(0),) if prefetch else ())
        p, dmz, db = lax.fori_loop(0, nsteps, body, init)[:3]
        dmz, db = jnp.sum(dmz, axis=0), jnp.sum(db, axis=0)
    if finish:  # one program covers every token: the final dB = P g s, dm = sum dy (y - bias) / m, dbias
        gs = _load(gs_ref.at[pl.ds(n0, bn)], cmask)
        _store(p_ref.at[:, pl.ds(n0, bn)], (p * gs[None, :]).astype(p_ref.dtype), _mask(None, cmask, (R, bn)))
        m = _load(m_ref.at[pl.ds(n0, bn)], cmask, 1.0).astype(jnp.float32)
        _store(dmz_ref.at[pl.ds(n0, bn)], (dmz / m).astype(dmz_ref.dtype), cmask)
        _store(db_ref.at[pl.ds(n0, bn)], db.astype(db_ref.dtype), cmask)
        return
    _store(p_ref.at[split, :, pl.ds(n0, bn)], p, _mask(None, cmask, (R, bn)))
    _store(dmz_ref.at[split, pl.ds(n0, bn)], dmz, cmask)
    _store(db_ref.at[split, pl.ds(n0, bn)], db, cmask)


def backward_columns(dy, y, xa, bias, *, interpret: bool, config: Config = DEFAULT, finish=None, dyg_scale=None):
    """(xa^T dy (R, N), sum_t dy*(y - bias) (N,), sum_t dy (N,)), all float32.

    finish=(gs, magnitude, dB dtype, dm dtype, dbias dtype): return (xa^T dy * gs, sum_t dy*(y - bias) / m,
    sum_t dy) in those dtypes instead - inside the kernel when one program covers all tokens (config.cols_rows
    >= tokens: no XLA op after the launch), otherwise by XLA from the partial sums.
    dyg_scale=g ((N,)): also return dy * g in dy's dtype, written from the tiles this pass reads anyway
    (gemm="sm90": dx = (dy g) V^T), as a 4th output.
    """
    M, N = dy.shape
    R = xa.shape[1]
    bt, bn = _tile(M, config.cols_bt), _tile(N, config.cols_bn)
    rows_per_prog = max(bt, min(config.cols_rows, _pow2(M, bt)))
    nsplit = _cdiv(M, rows_per_prog)
    in_kernel = finish is not None and nsplit == 1
    kernel = functools.partial(_cols_kernel, M=M, N=N, R=R, bt=bt, bn=bn, rows_per_prog=rows_per_prog,
                               has_bias=bias is not None, finish=in_kernel, prefetch=config.cols_prefetch,
                               mma_sums=config.cols_mma_sums and dy.dtype in (jnp.bfloat16, jnp.float16)
                               and bn >= 64 and bt >= 16, emit_dyg=dyg_scale is not None)
    args = (dy, y, xa) + ((bias,) if bias is not None else ())
    if in_kernel:
        gs, m, p_dt, dm_dt, db_dt = finish
        args += (gs.astype(jnp.float32), m)
        out_shape = (jax.ShapeDtypeStruct((R, N), p_dt), jax.ShapeDtypeStruct((N,), dm_dt),
                     jax.ShapeDtypeStruct((N,), db_dt))
    else:
        out_shape = (jax.ShapeDtypeStruct((nsplit, R, N), jnp.float32), jax.ShapeDtypeStruct((nsplit, N), jnp.float32),
                     jax.ShapeDtypeStruct((nsplit, N), jnp.float32))
    if dyg_scale is not None:
        args += (dyg_scale.astype(jnp.float32),)
        out_shape += (jax.ShapeDtypeStruct(dy.shape, dy.dtype),)
    p, dmz, db, *dyg = _backend.triton_call(
        kernel,
        out_shape=out_shape,
        grid=(_cdiv(N, bn), nsplit),
        name="pallas_fused_dora_bwd_cols",
        interpret=interpret,
        num_warps=config.cols_warps,
        num_stages=config.cols_stages,
    )(*args)
    if in_kernel:
        return p, dmz, db, *dyg
    p, dmz, db = jnp.sum(p, axis=0), jnp.sum(dmz, axis=0), jnp.sum(db, axis=0)
    if finish is None:
        return p, dmz, db, *dyg
    gs, m, p_dt, dm_dt, db_dt = finish
    return (p * gs[None, :]).astype(p_dt), (dmz / m.astype(jnp.float32)).astype(dm_dt), db.astype(db_dt), *dyg


# ----------------------------------------------------------------------------------------------------
# Backward dx = (dy * gw) W^T + us A^T, gw = g (times the int8 column scale), us = s (dy * g) B^T.
# dy * gw is applied in the prologue of each tile; the low-rank term in the epilogue.
# ----------------------------------------------------------------------------------------------------


def _dx_kernel(*refs, kind, M, K, N, R, bm, bn, bk, group_m, khalf):
    # Here the GEMM is (M, N=out) x (N=out, K=in): the reduction runs over the output features.
    nw = _num_weight_refs(kind)
    dy_ref, gw_ref = refs[:2]
    w_refs = refs[2:2 + nw]
    us_ref, a_ref, dx_ref = refs[2 + nw:]
    dt = dy_ref.dtype
    ncols = khalf if kind == "nf4" else K  # dx columns addressed by one program index
    pid_m, pid_n = _grouped_pid(pl.program_id(0), _cdiv(M, bm), _cdiv(ncols, bn), group_m)
    m0 = pl.multiple_of(pid_m * bm, bm)
    c0 = pl.multiple_of(pid_n * bn, bn)
    rmask = _in_bounds(m0, bm, M, M % bm == 0)

    def dyg_tile(j0):
        nmask = _in_bounds(j0, bk, N, N % bk == 0)
        dy = _load(dy_ref.at[pl.ds(m0, bm), pl.ds(j0, bk)], _mask(rmask, nmask, (bm, bk)))
        gw = _load(gw_ref.at[pl.ds(j0, bk)], nmask)
        return (dy.astype(jnp.float32) * gw[None, :]).astype(dt), nmask

    def lowrank(c_start):
        kmask = _in_bounds(c_start, bn, K, False)
        us = _load(us_ref.at[pl.ds(m0, bm), :], _mask(rmask, None, (bm, R)))
        a = _load(a_ref.at[pl.ds(c_start, bn), :], _mask(kmask, None, (bn, R)))
        return _backend.dot(us, a, trans_b=True), kmask

    if kind in ("dense", "int8"):
        cmask = _in_bounds(c0, bn, K, K % bn == 0)

        def body(i, acc):
            j0 = pl.multiple_of(i * bk, bk)
            dyg, nmask = dyg_tile(j0)
            w = _load(w_refs[0].at[pl.ds(c0, bn), pl.ds(j0, bk)], _mask(cmask, nmask, (bn, bk)))
            return acc + _backend.dot(dyg, w.astype(dt), trans_b=True)

        acc = lax.fori_loop(0, _cdiv(N, bk), body, jnp.zeros((bm, bn), jnp.float32))
        low, kmask = lowrank(c0)
        _store(dx_ref.at[pl.ds(m0, bm), pl.ds(c0, bn)], (acc + low).astype(dx_ref.dtype), _mask(rmask, kmask, (bm, bn)))
        return

    packed_ref, absmax_ref = w_refs
    blk = c0 // NF4_TILE

    def body(i, accs):
        acc_hi, acc_lo = accs
        j0 = pl.multiple_of(i * bk, bk)
        dyg, nmask = dyg_tile(j0)
        p = _load(packed_ref.at[pl.ds(c0, bn), pl.ds(j0, bk)], _mask(None, nmask, (bn, bk))).astype(jnp.int32)
        am_hi = _load(absmax_ref.at[pl.ds(blk, 1), pl.ds(j0, bk)], _mask(None, nmask, (1, bk)))
        am_lo = _load(absmax_ref.at[pl.ds(blk + khalf // NF4_TILE, 1), pl.ds(j0, bk)], _mask(None, nmask, (1, bk)))
        w_hi = (_nf4_values(p >> 4) * am_hi).astype(dt)
        w_lo = (_nf4_values(p & 15) * am_lo).astype(dt)
        return acc_hi + _backend.dot(dyg, w_hi, trans_b=True), acc_lo + _backend.dot(dyg, w_lo, trans_b=True)

    zeros = jnp.zeros((bm, bn), jnp.float32)
    acc_hi, acc_lo = lax.fori_loop(0, _cdiv(N, bk), body, (zeros, zeros))
    for acc, start in ((acc_hi, c0), (acc_lo, khalf + c0)):
        low, kmask = lowrank(start)
        out = (acc + low).astype(dx_ref.dtype)
        _store(dx_ref.at[pl.ds(m0, bm), pl.ds(start, bn)], out, _mask(rmask, kmask, (bm, bn)))


def backward_dx(dy, gw, weight, kind: str, us, lora_a, *, interpret: bool, config: Config = DEFAULT):
    """dx (M, K) = (dy * gw) W^T + us A^T, dy (M, N), gw float32 (N,), us (M, R), A (K, R)."""
    M, N = dy.shape
    K, R = lora_a.shape
    bm, bk = _tile(M, config.dx_bm), _tile(N, config.dx_bk)
    if kind == "nf4":
        bn = NF4_TILE
        khalf = weight[0].shape[0]
        ncols = khalf
    else:
        bn = _tile(K, config.dx_bn)
        khalf = 0
        ncols = K
    kernel = functools.partial(_dx_kernel, kind=kind, M=M, K=K, N=N, R=R, bm=bm, bn=bn, bk=bk,
                               group_m=config.group_m, khalf=khalf)
    return _backend.triton_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((M, K), dy.dtype),
        grid=(_cdiv(M, bm) * _cdiv(ncols, bn),),
        name="pallas_fused_dora_bwd_dx",
        interpret=interpret,
        num_warps=config.dx_warps,
        num_stages=config.dx_stages,
    )(dy, gw, *weight, us, lora_a)
