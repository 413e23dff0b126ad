"""DoRA's backward column reductions over tokens: P = xa^T dy (R, N), sum dy * (y - bias), sum dy.

(dB = s * g * P and dm = sum(dy * (y - bias)) / m follow, in the kernel when one program covers every token, by
XLA on (N,)-sized data otherwise.)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_fused import _backend
from pallas_fused.dora.kernel_util import cdiv, in_bounds, load, mask, pow2, store, tile


@dataclasses.dataclass(frozen=True)
class ColumnsConfig:
    """The column reductions' launch (GPU defaults; small inputs shrink the tiles)."""

    bn: int = 64  # columns per program
    bt: int = 64  # tokens per loop step
    rows: int = 512  # tokens per program (>= tokens: one program per column strip, dB / dm / dbias finished in it)
    warps: int = 4
    stages: int = 2
    # 16-bit dy: sum_t dy y and sum_t dy as MMAs too (diag(dy^T y), e0^T dy): dy and y both pipelined MMA operands,
    # no per-element register work. By the compiled loop (sm_90a, default tiles): 164 instead of 281 PTX
    # instructions per thread per step, 104 registers instead of 163. Only at bn >= 64 (below, no wgmma for dy^T y
    # and y is no longer pipelined); otherwise the sums run in registers with y loaded one step ahead.
    mma_sums: bool = True


DEFAULT = ColumnsConfig()


def _cols_kernel(*refs, M, N, R, bt, bn, rows_per_prog, has_bias, finish, mma_sums, emit_dyg):
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
    cmask = in_bounds(n0, bn, N, N % bn == 0)
    bias = load(bias_ref.at[pl.ds(n0, bn)], cmask).astype(jnp.float32) if has_bias else None
    g = load(g_ref.at[pl.ds(n0, bn)], cmask).astype(jnp.float32) if emit_dyg else None

    def store_dyg(t0, dy, mask):  # dy * g in dy's dtype, for dx = (dy g) W^T + ... ("sm90")
        if emit_dyg:
            store(dyg_ref.at[pl.ds(t0, bt), pl.ds(n0, bn)], (dy.astype(jnp.float32) * g[None, :]).astype(dt), mask)
    t_start = split * rows_per_prog
    dt = dy_ref.dtype
    nsteps = rows_per_prog // bt

    def y_tile(i):  # masked past M and past this program's tokens (a prefetch beyond them fetches nothing)
        t0 = t_start + i * bt
        rows_ok = jnp.logical_and(t0 + jnp.arange(bt) < M, i < nsteps)
        return load(y_ref.at[pl.ds(t0, bt), pl.ds(n0, bn)], mask(rows_ok, cmask, (bt, bn)))

    def step(i, p, dmz, db, y):
        t0 = pl.multiple_of(t_start + i * bt, bt)
        rmask = in_bounds(t0, bt, M, False)
        dy = load(dy_ref.at[pl.ds(t0, bt), pl.ds(n0, bn)], mask(rmask, cmask, (bt, bn)))
        store_dyg(t0, dy, mask(rmask, cmask, (bt, bn)))
        xa = load(xa_ref.at[pl.ds(t0, bt), :], mask(rmask, None, (bt, R)))
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
        m2 = mask(in_bounds(t0, bt, M, False), cmask, (bt, bn))
        dy = load(dy_ref.at[pl.ds(t0, bt), pl.ds(n0, bn)], m2)
        store_dyg(t0, dy, m2)
        y = load(y_ref.at[pl.ds(t0, bt), pl.ds(n0, bn)], m2)
        xa = load(xa_ref.at[pl.ds(t0, bt), :], mask(in_bounds(t0, bt, M, False), None, (bt, R)))
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
        # dy feeds an MMA, so Triton pipelines its load; y does not: load the next step's y tile one step ahead.
        def body(i, carry):
            *acc, y = carry
            y_next = y_tile(i + 1)
            return (*step(i, *acc, y), y_next)

        zeros = jnp.zeros((bt, bn), jnp.float32)
        init = (jnp.zeros((R, bn), jnp.float32), zeros, zeros, y_tile(0))
        p, dmz, db = lax.fori_loop(0, nsteps, body, init)[:3]
        dmz, db = jnp.sum(dmz, axis=0), jnp.sum(db, axis=0)
    if finish:  # one program covers every token: the final dB = P g s, dm = sum dy (y - bias) / m, dbias
        gs = load(gs_ref.at[pl.ds(n0, bn)], cmask)
        store(p_ref.at[:, pl.ds(n0, bn)], (p * gs[None, :]).astype(p_ref.dtype), mask(None, cmask, (R, bn)))
        m = load(m_ref.at[pl.ds(n0, bn)], cmask, 1.0).astype(jnp.float32)
        store(dmz_ref.at[pl.ds(n0, bn)], (dmz / m).astype(dmz_ref.dtype), cmask)
        store(db_ref.at[pl.ds(n0, bn)], db.astype(db_ref.dtype), cmask)
        return
    store(p_ref.at[split, :, pl.ds(n0, bn)], p, mask(None, cmask, (R, bn)))
    store(dmz_ref.at[split, pl.ds(n0, bn)], dmz, cmask)
    store(db_ref.at[split, pl.ds(n0, bn)], db, cmask)


def backward_columns(dy, y, xa, bias, *, interpret: bool, config: ColumnsConfig = DEFAULT, finish=None, dyg_scale=None):
    """(xa^T dy (R, N), sum_t dy*(y - bias) (N,), sum_t dy (N,)), all float32.

    finish=(gs, magnitude, dB dtype, dm dtype, dbias dtype): return (xa^T dy * gs, sum_t dy*(y - bias) / m,
    sum_t dy) in those dtypes instead - inside the kernel when one program covers all tokens (config.rows
    >= tokens: no XLA op after the launch), otherwise by XLA from the partial sums.
    dyg_scale=g ((N,)): also return dy * g in dy's dtype, written from the tiles this pass reads anyway
    ("sm90": dx = (dy g) W^T + ((dy g)(s B)^T) A^T), as a 4th output.
    """
    M, N = dy.shape
    R = xa.shape[1]
    bt, bn = tile(M, config.bt), tile(N, config.bn)
    rows_per_prog = max(bt, min(config.rows, pow2(M, bt)))
    nsplit = cdiv(M, rows_per_prog)
    in_kernel = finish is not None and nsplit == 1
    kernel = functools.partial(_cols_kernel, M=M, N=N, R=R, bt=bt, bn=bn, rows_per_prog=rows_per_prog,
                               has_bias=bias is not None, finish=in_kernel,
                               mma_sums=config.mma_sums and dy.dtype in (jnp.bfloat16, jnp.float16)
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
        grid=(cdiv(N, bn), nsplit),
        name="pallas_fused_dora_bwd_cols",
        interpret=interpret,
        num_warps=config.warps,
        num_stages=config.stages,
    )(*args)
    if in_kernel:
        return p, dmz, db, *dyg
    p, dmz, db = jnp.sum(p, axis=0), jnp.sum(dmz, axis=0), jnp.sum(db, axis=0)
    if finish is None:
        return p, dmz, db, *dyg
    gs, m, p_dt, dm_dt, db_dt = finish
    return (p * gs[None, :]).astype(p_dt), (dmz / m.astype(jnp.float32)).astype(dm_dt), db.astype(db_dt), *dyg
