"""DoRA's column norm: n = ||W + s A B|| per output column (and g = m / n), never materialising A B.

Two kernels (see kernel_util for the shapes and weight kinds):
  "direct": (W + s A B)^2 tile by tile, partial sums over row ranges: any weight kind and dtype;
  "expand": sum W^2 + 2 s sum_r B (A^T W) + s^2 B^T (A^T A) B, so W is an MMA operand (pipelined by cp.async) and
            never meets the A B tile in registers: 16-bit dense W or int8 codes with 16-bit adapters, up to
            `expand_max_rank` (per program the A^T A accumulation grows as r^2).
"direct" can also write int8 codes transposed (`transposed_codes`): QDoRA's Hopper forward takes q^T as its GEMM's
A operand, and this pass reads every code anyway.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_fused import _backend
from pallas_fused.dora.kernel_util import (
    NF4_TILE,
    cdiv,
    in_bounds,
    load,
    mask,
    nf4_rows,
    nf4_rows_per_program,
    num_weight_refs,
    pow2,
    store,
    tile,
)
from pallas_fused.dora.reference import floored_norm


@dataclasses.dataclass(frozen=True)
class NormTiles:
    """One column-norm kernel's launch: (rows per loop step, columns) tiles, rows per program, warps, stages."""

    bn: int  # columns per program
    bk: int  # rows per loop step
    rows: int  # rows per program (< in features: partial sums over row ranges; >= in features: one per column)
    warps: int
    stages: int


@dataclasses.dataclass(frozen=True)
class NormConfig:
    """The column norm's kernel choice and launches (GPU defaults; small inputs shrink the tiles).

    "direct" tiles: amortized over 4 weights at 4096 -> 11008 r64 on an H200, with the next W tile loaded into
    registers one step ahead (W is no MMA operand there, so Triton's pipeliner leaves its load synchronous): 0.0432
    ms against 0.0606 for rows128 without that prefetch (XLA 0.0949). "expand" tiles: 4 warps, 0.0167 ms at 4096^2
    r16 (8 warps 0.0226; XLA 0.0511). At 4096 -> 11008 r64 "direct" beat every "expand" tiling, hence
    `expand_max_rank`. benchmarks/bench_dora.py's tune_norm section re-times the candidates.
    "codes_t" tiles: the "direct" launch that also writes the int8 codes transposed, for QDoRA's Hopper forward;
    amortized over 6 weights on an H200, 0.0303 ms at 4096^2 r16 and 0.0772 at 4096 -> 11008 r64 against the plain
    norm and XLA's transpose of the codes, 0.0256 + 0.0171 and 0.0536 + 0.0364 (9 tilings in
    benchmarks/results/user_path_dev/2026-11-26g_h200_qdora_norm_probe.json); the "expand" kernel writing them
    took 0.0469 at 4096^2 (..._probe_1.json: its int8 tile is converted for the MMA and transposed for the store).
    """

    mode: str = "expand"  # "expand" where it applies (see expand_supported), else "direct"
    expand_max_rank: int = 32  # above this (padded) rank the column norm uses "direct"
    expand: NormTiles = NormTiles(bn=64, bk=128, rows=1024, warps=4, stages=3)
    direct: NormTiles = NormTiles(bn=64, bk=64, rows=512, warps=4, stages=2)
    codes_t: NormTiles = NormTiles(bn=128, bk=64, rows=512, warps=4, stages=2)


DEFAULT = NormConfig()


def _colnorm_kernel(*refs, kind, K, N, R, bk, bn, rows_per_prog, kloop, emit_t):
    nw = num_weight_refs(kind)
    w_refs = refs[:nw]
    a_ref, b_ref, s_ref, out_ref = refs[nw:nw + 4]
    j, split = pl.program_id(0), pl.program_id(1)
    n0 = pl.multiple_of(j * bn, bn)
    cmask = in_bounds(n0, bn, N, N % bn == 0)
    s = s_ref[0]
    b_t = load(b_ref.at[:, pl.ds(n0, bn)], mask(None, cmask, (R, bn)))
    k_start = split * rows_per_prog

    if kind == "int8":
        wscale = load(w_refs[1].at[pl.ds(n0, bn)], cmask, 1.0)

    def a_tile(k0):
        rmask = in_bounds(k0, bk, K, False)
        return load(a_ref.at[pl.ds(k0, bk), :], mask(rmask, None, (bk, R)))

    nsteps = rows_per_prog // bk

    def w_tile(i):  # masked past K and past this program's rows (a prefetch beyond them fetches nothing)
        k0 = k_start + i * bk
        rows_ok = jnp.logical_and(k0 + jnp.arange(bk) < K, i < nsteps)
        return load(w_refs[0].at[pl.ds(k0, bk), pl.ds(n0, bn)], mask(rows_ok, cmask, (bk, bn)))

    def square(k0, w, acc):
        if emit_t:
            _store_codes_t(refs[-1], w, wscale, k0, n0, bk, bn, K, cmask)
        w = w.astype(jnp.float32)
        if kind == "int8":
            w = w * wscale[None, :]
        v = w + s * _backend.dot(a_tile(k0), b_t)
        return acc + v * v

    if kind in ("dense", "int8"):
        # W is no MMA operand here, so Triton's pipeliner leaves its load synchronous: load the next step's tile
        # into registers before this step's math (one tile in flight per program while it computes).
        def body(i, carry):
            acc, w = carry
            w_next = w_tile(i + 1)
            return square(pl.multiple_of(k_start + i * bk, bk), w, acc), w_next

        acc, _ = lax.fori_loop(0, nsteps, body, (jnp.zeros((bk, bn), jnp.float32), w_tile(0)))
        store(out_ref.at[split, pl.ds(n0, bn)], jnp.sum(acc, axis=0), cmask)
        return
    packed_ref, absmax_ref = w_refs

    def body(i, acc):
        # rows_per_prog divides kloop for NF4 (see column_sumsq): no row masks on packed/absmax.
        k0 = pl.multiple_of(k_start + i * bk, bk)
        w_hi, w_lo = nf4_rows(packed_ref, absmax_ref, k0, n0, bn, cmask, kloop)
        v_hi = w_hi + s * _backend.dot(a_tile(k0), b_t)
        v_lo = w_lo + s * _backend.dot(a_tile(kloop + k0), b_t)
        return acc + v_hi * v_hi + v_lo * v_lo

    # Accumulate a (bk, bn) tile of squares and reduce over rows once at the end (a cross-thread
    # reduction per step would dominate this memory-bound loop).
    acc = lax.fori_loop(0, rows_per_prog // bk, body, jnp.zeros((bk, bn), jnp.float32))
    store(out_ref.at[split, pl.ds(n0, bn)], jnp.sum(acc, axis=0), cmask)


def _store_codes_t(qt_ref, codes, wscale, k0, n0, bk: int, bn: int, K: int, cmask):
    """Writes a (bk, bn) tile of int8 codes into q^T (N, K), zero where the column's scale is 0: W's column is 0
    there whatever its codes, and zero codes let QDoRA's forward treat the column like any other (scale 1)."""
    codes = jnp.where((wscale != 0)[None, :], codes, jnp.zeros_like(codes))
    store(qt_ref.at[pl.ds(n0, bn), pl.ds(k0, bk)], codes.T, mask(cmask, in_bounds(k0, bk, K, K % bk == 0), (bn, bk)))


def column_sumsq(weight, kind: str, lora_a, lora_b, scale, *, interpret: bool, config: NormConfig = DEFAULT):
    """sum over the input axis of (W + s A B)^2, float32 (out,). `lora_a` (K, R), `lora_b` (R, N), R padded."""
    return jnp.sum(column_partials(weight, kind, lora_a, lora_b, scale, interpret=interpret, config=config), axis=0)


def column_partials(weight, kind: str, lora_a, lora_b, scale, *, interpret: bool, config: NormConfig = DEFAULT,
                    rows: int | None = None):
    """Partial sums of squares of W + s A B over row ranges, float32 (nsplit, out): one launch, no reduction
    after it (`merge_weight` or `column_sumsq` sums the nsplit rows). `rows`: rows per program of the "expand"
    kernel (default config.expand.rows)."""
    if config.mode == "expand" and expand_supported(weight, kind, lora_a, config.expand_max_rank):
        return _expand_launch(weight, kind, lora_a, lora_b, scale, None, interpret=interpret, config=config,
                              rows=rows)
    return _direct_launch(weight, kind, lora_a, lora_b, scale, config.direct, interpret=interpret)[0]


def _direct_launch(weight, kind, lora_a, lora_b, scale, tiles: NormTiles, *, interpret, transposed_codes=False):
    """The "direct" kernel's (nsplit, N) partial sums, and q^T after them with `transposed_codes`."""
    K, R = lora_a.shape
    N = lora_b.shape[1]
    if kind == "nf4":
        bk = NF4_TILE
        kloop = weight[0].shape[0]  # in_padded // 2
    else:
        bk = tile(K, tiles.bk)
        kloop = K
    bn = tile(N, tiles.bn)
    if kind == "nf4":
        rows_per_prog = nf4_rows_per_program(kloop, tiles.rows)
    else:
        rows_per_prog = max(bk, min(tiles.rows, pow2(kloop, bk)))
    nsplit = cdiv(kloop, rows_per_prog)
    codes_t = ()
    if transposed_codes:
        if kind != "int8":
            raise ValueError(f"dora column norm: transposed_codes needs int8 codes, got a {kind} weight")
        codes_t = (jax.ShapeDtypeStruct((N, K), weight[0].dtype),)
    kernel = functools.partial(_colnorm_kernel, kind=kind, K=K, N=N, R=R, bk=bk, bn=bn,
                               rows_per_prog=rows_per_prog, kloop=kloop, emit_t=transposed_codes)
    return _backend.triton_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((nsplit, N), jnp.float32), *codes_t),
        grid=(cdiv(N, bn), nsplit),
        name="pallas_fused_dora_colnorm",
        interpret=interpret,
        num_warps=tiles.warps,
        num_stages=tiles.stages,
    )(*weight, lora_a, lora_b, jnp.reshape(jnp.asarray(scale, jnp.float32), (1,)))


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
    nw = num_weight_refs(kind)
    w_refs = refs[:nw]
    a_ref, b_ref, s_ref = refs[nw:nw + 3]
    if finish:
        m_ref, n_ref, g_ref = refs[nw + 3:]
    else:
        (out_ref,) = refs[nw + 3:]
    j, split = pl.program_id(0), pl.program_id(1)
    n0 = pl.multiple_of(j * bn, bn)
    cmask = in_bounds(n0, bn, N, N % bn == 0)
    k_start = split * rows_per_prog
    rows_aligned = K % rows_per_prog == 0 and rows_per_prog % bk == 0
    mma_dt = a_ref.dtype

    def a_tile(k0):  # masked always: the last step's prefetch reads past the row range (maybe past K)
        return load(a_ref.at[pl.ds(k0, bk), :], mask(in_bounds(k0, bk, K, False), None, (bk, R)))

    def body(i, carry):
        sq, wa, aa, a = carry
        k0 = pl.multiple_of(k_start + i * bk, bk)
        rmask = in_bounds(k0, bk, K, rows_aligned)
        w = load(w_refs[0].at[pl.ds(k0, bk), pl.ds(n0, bn)], mask(rmask, cmask, (bk, bn)))
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
    b = load(b_ref.at[:, pl.ds(n0, bn)], mask(None, cmask, (R, bn))).astype(jnp.float32)
    sq = jnp.sum(sq, axis=0)
    if kind == "int8":  # W = q * wscale: every term linear in W takes one wscale, W^2 two
        wscale = load(w_refs[1].at[pl.ds(n0, bn)], cmask, 1.0)
        sq, wa = sq * wscale * wscale, wa * wscale[:, None]
    aab = _dot_f32_exact(aa, b_ref.dtype, load(b_ref.at[:, pl.ds(n0, bn)], mask(None, cmask, (R, bn))))
    total = sq + 2.0 * s * jnp.sum(wa * b.T, axis=1) + (s * s) * jnp.sum(b * aab, axis=0)
    if finish:
        n = floored_norm(total)  # a zero column gives g = 0, not 0 / 0
        store(n_ref.at[pl.ds(n0, bn)], n, cmask)
        g = load(m_ref.at[pl.ds(n0, bn)], cmask, 1.0).astype(jnp.float32) / n
        store(g_ref.at[pl.ds(n0, bn)], g, cmask)
    else:
        store(out_ref.at[split, pl.ds(n0, bn)], total, cmask)


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
    bk, bn = tile(K, config.expand.bk), tile(N, config.expand.bn)
    rows_per_prog = max(bk, min(pow2(rows or config.expand.rows, bk), pow2(K, bk)))
    nsplit = cdiv(K, rows_per_prog)
    finish = magnitude is not None and nsplit == 1
    kernel = functools.partial(_colnorm_expand_kernel, kind=kind, K=K, N=N, R=R, bk=bk, bn=bn,
                               rows_per_prog=rows_per_prog, finish=finish)
    col = jax.ShapeDtypeStruct((N,), jnp.float32)
    out_shape = (col, col) if finish else jax.ShapeDtypeStruct((nsplit, N), jnp.float32)
    args = (*weight, lora_a, lora_b, jnp.reshape(jnp.asarray(scale, jnp.float32), (1,)))
    out = _backend.triton_call(
        kernel,
        out_shape=out_shape,
        grid=(cdiv(N, bn), nsplit),
        name="pallas_fused_dora_colnorm",
        interpret=interpret,
        num_warps=config.expand.warps,
        num_stages=config.expand.stages,
    )(*args, *((magnitude,) if finish else ()))
    return out


def column_norm_scale(weight, kind: str, lora_a, lora_b, scale, magnitude, *, interpret: bool,
                      config: NormConfig = DEFAULT, transposed_codes: bool = False):
    """(n, g): n = max(||W + s A B||, NORM_FLOOR) per output column and g = m / n, float32 (N,); A, B rank-padded.
    With `transposed_codes` (int8 codes): (n, g, q^T), q^T written by the same pass (the "direct" kernel at
    config.codes_t tiles; see `_store_codes_t`).

    One launch when the "expand" kernel applies and one program covers all input rows; otherwise the
    partial sums of squares are reduced and finished by XLA.
    """
    codes_t = None
    if transposed_codes:
        parts, codes_t = _direct_launch(weight, kind, lora_a, lora_b, scale, config.codes_t, interpret=interpret,
                                        transposed_codes=True)
    elif config.mode == "expand" and expand_supported(weight, kind, lora_a, config.expand_max_rank):
        out = _expand_launch(weight, kind, lora_a, lora_b, scale, magnitude, interpret=interpret, config=config)
        if isinstance(out, tuple):
            return out
        parts = out
    else:
        parts = column_partials(weight, kind, lora_a, lora_b, scale, interpret=interpret, config=config)
    n = floored_norm(jnp.sum(parts, axis=0))
    g = magnitude.astype(jnp.float32) / n
    return (n, g) if codes_t is None else (n, g, codes_t)
