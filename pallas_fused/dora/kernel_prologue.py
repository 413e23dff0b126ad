"""Everything the Hopper forward's GEMM takes beside x and W, from one Triton launch ("pallas:sm90_prologue"):

  programs [0, N / bn):           the "expand" column sums of W + s A B over every input row (kernel_norm), finished
                                  to n = max(||W + s A B||, NORM_FLOOR) and g = m / n, and s B in the compute dtype;
  programs [N / bn, + M / bm):    x A (M, R), accumulated in float32 and rounded once to x's dtype.

"pallas:sm90" runs the same arithmetic as separate kernels: the column norm (its row ranges then summed and finished
by XLA), cuBLAS x A and XLA's s B, each a launch of its own before the GEMM. The two halves here are independent
reads of memory (W for the norm, x for x A), so one grid streams both with no launch or tail between them; the bytes
are the same: W and x read once each, n, g, s B and x A written.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_fused import _backend
from pallas_fused.dora.kernel_norm import expand_column_sums, store_norm_scale
from pallas_fused.dora.kernel_util import cdiv, in_bounds, load, mask, pow2, store, tile


@dataclasses.dataclass(frozen=True)
class PrologueConfig:
    """The prologue launch: the column half's (bk rows, bn columns) tiles, the x A half's (bm rows, bkx of K) tiles.
    Untuned: each program of either half reads a K x 64 strip (W's columns or x's rows), 2 x 4096 x 64 bytes at
    4096 -> 4096, so at 4096 tokens the halves are 64 programs each."""

    bn: int = 64
    bk: int = 128
    bm: int = 64
    bkx: int = 128
    warps: int = 4
    stages: int = 3


DEFAULT = PrologueConfig()


def _prologue_kernel(x_ref, w_ref, a_ref, b_ref, s_ref, m_ref, n_ref, g_ref, sb_ref, xa_ref, *, M, K, N, R, bn, bk,
                     bm, bkx, col_programs):
    pid = pl.program_id(0)
    s = s_ref[0]

    @pl.when(pid < col_programs)
    def _columns():
        rows = pow2(K, bk)  # one program per column block: every input row, so n and g finish here
        total, b, n0, cmask = expand_column_sums((w_ref,), a_ref, b_ref, s, kind="dense", K=K, N=N, R=R, bk=bk, bn=bn,
                                                 j=pid, split=0, rows_per_prog=rows)
        store_norm_scale(total, m_ref, n_ref, g_ref, n0, bn, cmask)
        # s B rounded once to the compute dtype, as the GEMM's low-rank operand
        store(sb_ref.at[:, pl.ds(n0, bn)], (b * s).astype(sb_ref.dtype), mask(None, cmask, (R, bn)))

    @pl.when(pid >= col_programs)
    def _xa():
        m0 = pl.multiple_of((pid - col_programs) * bm, bm)
        rmask = in_bounds(m0, bm, M, M % bm == 0)

        def body(i, acc):
            k0 = pl.multiple_of(i * bkx, bkx)
            kmask = in_bounds(k0, bkx, K, K % bkx == 0)
            xt = load(x_ref.at[pl.ds(m0, bm), pl.ds(k0, bkx)], mask(rmask, kmask, (bm, bkx)))
            at = load(a_ref.at[pl.ds(k0, bkx), :], mask(kmask, None, (bkx, R)))
            return acc + _backend.dot(xt, at)

        acc = lax.fori_loop(0, cdiv(K, bkx), body, jnp.zeros((bm, R), jnp.float32))
        store(xa_ref.at[pl.ds(m0, bm), :], acc.astype(xa_ref.dtype), mask(rmask, None, (bm, R)))


def supported(x, w, lora_a) -> bool:
    """16-bit x, W and A of one dtype (the "expand" sums take W and A as MMA operands)."""
    return (x.dtype in (jnp.bfloat16, jnp.float16) and w.dtype == x.dtype and lora_a.dtype == x.dtype)


def prologue(x, w, lora_a, lora_b, scale, magnitude, *, interpret: bool, config: PrologueConfig = DEFAULT):
    """(n, g, s B, x A): n = max(||W + s A B||, NORM_FLOOR) and g = m / n float32 (N,), s B (R, N) and x A (M, R) in
    x's dtype; x (M, K), W (K, N), A (K, R), B (R, N), R padded (>= 16, a power of two), all 16-bit but m."""
    M, K = x.shape
    N = w.shape[1]
    R = lora_a.shape[1]
    if not supported(x, w, lora_a) or lora_b.dtype != x.dtype:
        raise ValueError(f"dora prologue: x, W, A and B must share a 16-bit dtype, got {x.dtype}, {w.dtype}, "
                         f"{lora_a.dtype}, {lora_b.dtype}")
    bk, bn = tile(K, config.bk), tile(N, config.bn)
    bm, bkx = tile(M, config.bm), tile(K, config.bkx)
    col_programs = cdiv(N, bn)
    kernel = functools.partial(_prologue_kernel, M=M, K=K, N=N, R=R, bn=bn, bk=bk, bm=bm, bkx=bkx,
                               col_programs=col_programs)
    col = jax.ShapeDtypeStruct((N,), jnp.float32)
    return _backend.triton_call(
        kernel,
        out_shape=(col, col, jax.ShapeDtypeStruct((R, N), x.dtype), jax.ShapeDtypeStruct((M, R), x.dtype)),
        grid=(col_programs + cdiv(M, bm),),
        name="pallas_fused_dora_prologue",
        interpret=interpret,
        num_warps=config.warps,
        num_stages=config.stages,
    )(x, w, lora_a, lora_b, jnp.reshape(jnp.asarray(scale, jnp.float32), (1,)), magnitude)
