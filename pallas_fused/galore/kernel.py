"""Pallas (Triton lowering) kernels of the GaLore Adam step. Knows nothing of optax.

Three kernels, all launched through `_backend.triton_call` and reading the step's runtime scalars from
an (8,) fp32 operand (see `reference.Scalars`):

  down_adam_fused   the down-projection GEMM R = G P^T (side "right") or P^T G (side "left"), fp32
                    accumulate, with the low-rank Adam step in its epilogue: writes m', v' (aliased onto
                    m, v) and the normalized update N (fp32). One program owns all r columns of its
                    output rows, so the Adam epilogue sees finished sums (no split-K).
  lowrank_adam      the same epilogue as an elementwise kernel, after an XLA down-projection ("hybrid").
  up_update         the up-projection GEMM (N P or P N, K = r) with the full-rank update in its epilogue:
                    out = a W + c backproject(N), stored as the update (optax path) or added to W and
                    written over W through input_output_aliases (in-place path). One pass over W.

Block sizes are chosen by `_blocks_*` below and can be overridden for tuning.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_fused import _backend

F32 = jnp.float32


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _rank_block(rank: int) -> int:
    """Ranks are padded (by masks) to a power of two >= 16 (Triton dot minimum)."""
    return max(16, 1 << (rank - 1).bit_length())


def _scalars(s_ref):
    return tuple(s_ref[i] for i in range(8))


def _adam_epilogue(r, m, v, s):
    """fp32 low-rank Adam on a tile: returns (m', v', N)."""
    b1, b2, eps, alpha, beta, _, _, ok = s
    okb = ok > 0
    r = jnp.where(okb, r, 0.0)
    m_new = jnp.where(okb, b1 * m + (1.0 - b1) * r, m)
    v_new = jnp.where(okb, b2 * v + (1.0 - b2) * r * r, v)
    n = (alpha * m_new) / (beta * jnp.sqrt(v_new) + eps)
    return m_new, v_new, n


# ----------------------------------------------------------------------------------------- down + Adam
def _down_right_kernel(g_ref, p_ref, m_ref, v_ref, s_ref, m_out, v_out, n_out, *, M, N, R, BM, BK, RB):
    # acc[BM, RB] = G[rows, :] @ P[:, :]^T, the K loop over N.
    i = pl.program_id(0)
    rows = i * BM + jnp.arange(BM)
    rmask = rows < M
    kmask_r = jnp.arange(RB) < R

    def body(k, acc):
        cols = k * BK + jnp.arange(BK)
        cmask = cols < N
        g = _backend.load(g_ref.at[pl.ds(i * BM, BM), pl.ds(k * BK, BK)], mask=rmask[:, None] & cmask[None, :],
                          other=0.0)
        p = _backend.load(p_ref.at[pl.ds(0, RB), pl.ds(k * BK, BK)], mask=kmask_r[:, None] & cmask[None, :],
                          other=0.0)
        return acc + _backend.dot(g, p.astype(g.dtype), trans_b=True, allow_tf32=True)

    acc = lax.fori_loop(0, _cdiv(N, BK), body, jnp.zeros((BM, RB), F32))
    idx = (pl.ds(i * BM, BM), pl.ds(0, RB))
    mask = rmask[:, None] & kmask_r[None, :]
    _store_adam(acc, m_ref, v_ref, m_out, v_out, n_out, idx, mask, _scalars(s_ref))


def _down_left_kernel(g_ref, p_ref, m_ref, v_ref, s_ref, m_out, v_out, n_out, *, M, N, R, BN, BK, RB):
    # acc[RB, BN] = P[:, :]^T @ G[:, cols], the K loop over M.
    j = pl.program_id(0)
    cols = j * BN + jnp.arange(BN)
    cmask = cols < N
    kmask_r = jnp.arange(RB) < R

    def body(k, acc):
        rows = k * BK + jnp.arange(BK)
        rmask = rows < M
        p = _backend.load(p_ref.at[pl.ds(k * BK, BK), pl.ds(0, RB)], mask=rmask[:, None] & kmask_r[None, :],
                          other=0.0)
        g = _backend.load(g_ref.at[pl.ds(k * BK, BK), pl.ds(j * BN, BN)], mask=rmask[:, None] & cmask[None, :],
                          other=0.0)
        return acc + _backend.dot(p.astype(g.dtype), g, trans_a=True, allow_tf32=True)

    acc = lax.fori_loop(0, _cdiv(M, BK), body, jnp.zeros((RB, BN), F32))
    idx = (pl.ds(0, RB), pl.ds(j * BN, BN))
    mask = kmask_r[:, None] & cmask[None, :]
    _store_adam(acc, m_ref, v_ref, m_out, v_out, n_out, idx, mask, _scalars(s_ref))


def _store_adam(acc, m_ref, v_ref, m_out, v_out, n_out, idx, mask, s):
    m = _backend.load(m_ref.at[idx], mask=mask, other=0.0).astype(F32)
    v = _backend.load(v_ref.at[idx], mask=mask, other=0.0).astype(F32)
    m_new, v_new, n = _adam_epilogue(acc, m, v, s)
    _backend.store(m_out.at[idx], m_new.astype(m_out.dtype), mask=mask)
    _backend.store(v_out.at[idx], v_new.astype(v_out.dtype), mask=mask)
    _backend.store(n_out.at[idx], n.astype(n_out.dtype), mask=mask)


def _blocks_down(shape, rank, side, itemsize):
    """(block of the kept dim, K block, warps, stages) for the fused down-projection."""
    rb = _rank_block(rank)
    keep = 64 if rb <= 128 else 32
    bk = 64 if itemsize == 4 else 128
    if rb >= 512:
        keep, bk = 16, 32
    return keep, bk, (4 if rb <= 64 else 8), 3


@functools.partial(jax.jit, static_argnames=("side", "interpret", "blocks"))
def down_adam_fused(g, p, m, v, scalars, *, side: str, interpret: bool = False, blocks=None):
    """Fused down-projection + low-rank Adam. Returns (m', v', N); m', v' are written over m, v."""
    M, N = g.shape
    R = p.shape[0] if side == "right" else p.shape[1]
    RB = _rank_block(R)
    keep, bk, warps, stages = blocks or _blocks_down(g.shape, R, side, g.dtype.itemsize)
    low = m.shape
    outs = (jax.ShapeDtypeStruct(low, m.dtype), jax.ShapeDtypeStruct(low, v.dtype), jax.ShapeDtypeStruct(low, F32))
    if side == "right":
        kern = functools.partial(_down_right_kernel, M=M, N=N, R=R, BM=keep, BK=bk, RB=RB)
        grid = (_cdiv(M, keep),)
    else:
        kern = functools.partial(_down_left_kernel, M=M, N=N, R=R, BN=keep, BK=bk, RB=RB)
        grid = (_cdiv(N, keep),)
    call = _backend.triton_call(kern, out_shape=outs, grid=grid, name="pallas_fused_galore_down_adam",
                                interpret=interpret, num_warps=warps, num_stages=stages,
                                input_output_aliases={2: 0, 3: 1})
    return call(g, p, m, v, scalars)


# ------------------------------------------------------------------------------ elementwise low-rank Adam
def _lowrank_adam_kernel(r_ref, m_ref, v_ref, s_ref, m_out, v_out, n_out, *, size, BLOCK):
    i = pl.program_id(0)
    idx = pl.ds(i * BLOCK, BLOCK)
    mask = i * BLOCK + jnp.arange(BLOCK) < size
    r = _backend.load(r_ref.at[idx], mask=mask, other=0.0).astype(F32)
    _store_adam(r, m_ref, v_ref, m_out, v_out, n_out, idx, mask, _scalars(s_ref))


@functools.partial(jax.jit, static_argnames=("interpret",))
def lowrank_adam(r, m, v, scalars, *, interpret: bool = False):
    """Elementwise low-rank Adam on an already projected R (the "hybrid" path). Returns (m', v', N)."""
    shape = m.shape
    size = m.size
    block = 1024
    outs = (jax.ShapeDtypeStruct((size,), m.dtype), jax.ShapeDtypeStruct((size,), v.dtype),
            jax.ShapeDtypeStruct((size,), F32))
    kern = functools.partial(_lowrank_adam_kernel, size=size, BLOCK=block)
    call = _backend.triton_call(kern, out_shape=outs, grid=(_cdiv(size, block),), name="pallas_fused_galore_adam",
                                interpret=interpret, num_warps=4, input_output_aliases={1: 0, 2: 1})
    m2, v2, n = call(r.reshape(-1), m.reshape(-1), v.reshape(-1), scalars)
    return m2.reshape(shape), v2.reshape(shape), n.reshape(shape)


# ------------------------------------------------------------------------------------ up + full update
def _up_kernel(w_ref, a_ref, b_ref, s_ref, o_ref, *, M, N, R, BM, BN, BR, inplace):
    # acc[BM, BN] = A[rows, :] @ B[:, cols] with K = R; A, B = (N, P) on side right, (P, N) on side left.
    i, j = pl.program_id(0), pl.program_id(1)
    rows = i * BM + jnp.arange(BM)
    cols = j * BN + jnp.arange(BN)
    rmask, cmask = rows < M, cols < N
    idx = (pl.ds(i * BM, BM), pl.ds(j * BN, BN))
    mask = rmask[:, None] & cmask[None, :]
    # W is the big stream: issue its load before the short K loop so the HBM latency overlaps the GEMM.
    w = _backend.load(w_ref.at[idx], mask=mask, other=0.0).astype(F32)

    def body(k, acc):
        ks = k * BR + jnp.arange(BR)
        kmask = ks < R
        a = _backend.load(a_ref.at[pl.ds(i * BM, BM), pl.ds(k * BR, BR)], mask=rmask[:, None] & kmask[None, :],
                          other=0.0)
        b = _backend.load(b_ref.at[pl.ds(k * BR, BR), pl.ds(j * BN, BN)], mask=kmask[:, None] & cmask[None, :],
                          other=0.0)
        return acc + _backend.dot(a.astype(F32), b.astype(F32), allow_tf32=True)

    acc = lax.fori_loop(0, _cdiv(R, BR), body, jnp.zeros((BM, BN), F32))
    _, _, _, _, _, ca, cc, ok = _scalars(s_ref)
    out = jnp.where(ok > 0, ca * w + cc * acc, 0.0)
    if inplace:
        out = w + out
    _backend.store(o_ref.at[idx], out.astype(o_ref.dtype), mask=mask)


def _blocks_up(shape, rank):
    rb = _rank_block(rank)
    return 64, 128, min(rb, 32), 4, 3


@functools.partial(jax.jit, static_argnames=("side", "inplace", "interpret", "blocks"))
def up_update(w, n, p, scalars, *, side: str, inplace: bool = False, interpret: bool = False, blocks=None):
    """The up-projection GEMM with the full-rank update in its epilogue.

    Returns out = a W + c backproject(N) in W's dtype; with `inplace`, W + out written over W's buffer
    (input_output_aliases: donate W at the jit boundary to update it without a copy)."""
    M, N = w.shape
    R = n.shape[1] if side == "right" else n.shape[0]
    bm, bn, br, warps, stages = blocks or _blocks_up(w.shape, R)
    a, b = (n, p) if side == "right" else (p, n)
    kern = functools.partial(_up_kernel, M=M, N=N, R=R, BM=bm, BN=bn, BR=br, inplace=inplace)
    call = _backend.triton_call(kern, out_shape=jax.ShapeDtypeStruct(w.shape, w.dtype),
                                grid=(_cdiv(M, bm), _cdiv(N, bn)),
                                name="pallas_fused_galore_up_inplace" if inplace else "pallas_fused_galore_up",
                                interpret=interpret, num_warps=warps, num_stages=stages,
                                input_output_aliases={0: 0} if inplace else None)
    return call(w, a, b, scalars)
