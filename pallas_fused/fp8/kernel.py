"""Triton-lowered Pallas kernels for FP8: the quantize passes and a portable scaled matmul.

Quantize (x ~= q * scale, saturating; see `quantize_2d`): XLA reduces the amax, then one Pallas pass
over a 2-D grid of tiles casts, writing the transposed copy q^T in the same pass when asked (the K-major
operand the backward GEMMs need), so an fp8 tensor is produced in both layouts from one cast pass.

Scaled matmul (`scaled_matmul_nt`): out = (a * a_scale) @ (bt * b_scale)^T, a (M, K) and bt (N, K)
both K-major, with per-row/per-column fp32 scale vectors applied to the fp32 accumulator in the
epilogue. This is the portable fallback (and what the CPU tests interpret); the Hopper-speed version
is the Mosaic GPU kernel in kernel_sm90.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_fused import _backend
from pallas_fused.fp8.reference import AMAX_FLOOR, finite_amax, fp8_max, round_up_pow2


def _scale(amax, dtype, power_of_2):
    scale = jnp.maximum(amax, AMAX_FLOOR) / fp8_max(dtype)
    return round_up_pow2(scale) if power_of_2 else scale


def _cast(x, scale, dtype):
    """As reference.saturating_cast: +-inf saturates, NaN stays NaN (Triton's min/max would turn it into -limit)."""
    limit = fp8_max(dtype)
    v = x / scale
    return jnp.where(v == v, jnp.clip(v, -limit, limit), v)


def _cast_kernel(x_ref, s_ref, *refs, shape, block, dtype, scale_axis, emit_n, emit_t):
    """One program: one `block` tile of x, cast with the scalar scale (scale_axis=None), the per-row
    scales (scale_axis=1: the amax was taken along axis 1) or the per-column scales (scale_axis=0)."""
    refs = list(refs)
    o_ref = refs.pop(0) if emit_n else None
    ot_ref = refs.pop(0) if emit_t else None
    r0, c0 = pl.program_id(0) * block[0], pl.program_id(1) * block[1]
    rows, cols = r0 + jnp.arange(block[0]), c0 + jnp.arange(block[1])
    row_mask, col_mask = rows < shape[0], cols < shape[1]
    mask = row_mask[:, None] & col_mask[None, :]
    idx = (pl.ds(r0, block[0]), pl.ds(c0, block[1]))
    x = _backend.load(x_ref.at[idx], mask=mask, other=0.0).astype(jnp.float32)
    if scale_axis is None:
        scale = _backend.load(s_ref.at[pl.ds(0, 1)])[:, None]
    elif scale_axis == 1:
        scale = _backend.load(s_ref.at[pl.ds(r0, block[0])], mask=row_mask, other=1.0)[:, None]
    else:
        scale = _backend.load(s_ref.at[pl.ds(c0, block[1])], mask=col_mask, other=1.0)[None, :]
    q = _cast(x, scale, dtype)
    if emit_n:
        _backend.store(o_ref.at[idx], q.astype(dtype), mask=mask)
    if emit_t:
        _backend.store(ot_ref.at[idx[1], idx[0]], q.T.astype(dtype), mask=mask.T)


def _outs(shape, dtype, emit_n, emit_t):
    outs = []
    if emit_n:
        outs.append(jax.ShapeDtypeStruct(shape, dtype))
    if emit_t:
        outs.append(jax.ShapeDtypeStruct(shape[::-1], dtype))
    return outs


# (rows, columns) of x per program of the cast pass, and warps, per scale axis, for a GPU without a tuning table:
# the H200's (the fastest of its sweep, see pallas_fused/tuning/nvidia_h200.json).
HEURISTIC = {"tensorwise": dict(block=(128, 128), num_warps=8), "axis1": dict(block=(64, 64), num_warps=8),
             "axis0": dict(block=(128, 64), num_warps=4)}


def cast_config(axis) -> tuple[tuple[int, int], int]:
    """((rows, columns) per program, warps) of the cast pass for this scale axis and device kind."""
    entry = _backend.tuned("fp8_cast", HEURISTIC)["tensorwise" if axis is None else f"axis{axis}"]
    return tuple(entry["block"]), entry["num_warps"]


@functools.partial(jax.jit, static_argnames=("dtype", "axis", "power_of_2", "emit_n", "emit_t", "interpret",
                                             "block", "num_warps"))
def quantize_2d(x, *, dtype, axis, power_of_2, emit_n=True, emit_t=False, interpret=False, block=None,
                num_warps=None):
    """Quantize a 2-D x: returns (q or None, q^T or None, scale).

    axis=None: tensorwise (scale shape ()); axis=1: one scale per row ((R, 1)); axis=0: one per
    column ((1, C)). The transposed copy q^T has the same scale, transposed.

    XLA reduces the amax (one read of x), then one Pallas pass over a 2-D grid of tiles casts and writes
    q and/or q^T (a second read of x): bytes = 2 reads + the writes, but every tile runs in parallel.
    Measured on an H200 (16384x8192 bf16, q and q^T): 0.24-0.27 ms for every axis; one program per block
    of rows (columns) taking the amax and casting in one kernel took 0.53-0.73 ms (too few programs in
    flight).
    """
    dtype = jnp.dtype(dtype)
    shape = x.shape
    # Phase 1: the amax of the finite values (XLA's reduction fuses abs, max and the scale arithmetic into one
    # read of x).
    amax = finite_amax(x, axis)
    scale = _scale(amax, dtype, power_of_2)
    # Phase 2: the cast, tile by tile.
    tuned_block, tuned_warps = cast_config(axis)
    block = block or ((32, 32) if interpret else tuned_block)
    outs = _backend.triton_call(
        functools.partial(_cast_kernel, shape=shape, block=block, dtype=dtype, scale_axis=axis, emit_n=emit_n,
                          emit_t=emit_t),
        out_shape=_outs(shape, dtype, emit_n, emit_t),
        grid=(pl.cdiv(shape[0], block[0]), pl.cdiv(shape[1], block[1])),
        name="pallas_fused_fp8_quantize_" + ("tensorwise" if axis is None else f"axis{axis}"),
        interpret=interpret,
        num_warps=num_warps or tuned_warps,
    )(x, scale.reshape(-1))
    outs = list(outs)
    q = outs.pop(0) if emit_n else None
    qt = outs.pop(0) if emit_t else None
    return q, qt, scale


def _matmul_kernel(a_ref, bt_ref, sa_ref, sb_ref, o_ref, *, shape, block, upcast):
    m, n, k = shape
    bm, bn, bk = block
    m0, n0 = pl.program_id(0) * bm, pl.program_id(1) * bn
    rows, cols = m0 + jnp.arange(bm), n0 + jnp.arange(bn)
    row_mask, col_mask = rows < m, cols < n

    def step(i, acc):
        ks = i * bk + jnp.arange(bk)
        k_mask = ks < k
        a = _backend.load(a_ref.at[pl.ds(m0, bm), pl.ds(i * bk, bk)], mask=row_mask[:, None] & k_mask[None, :],
                          other=0.0)
        b = _backend.load(bt_ref.at[pl.ds(n0, bn), pl.ds(i * bk, bk)], mask=col_mask[:, None] & k_mask[None, :],
                          other=0.0)
        if upcast is not None:  # mixed fp8 dtypes (or the CPU interpreter): multiply in a wider type
            a, b = a.astype(upcast), b.astype(upcast)
        return acc + _backend.dot(a, b, trans_b=True)

    acc = jax.lax.fori_loop(0, pl.cdiv(k, bk), step, jnp.zeros((bm, bn), jnp.float32))
    sa = _backend.load(sa_ref.at[pl.ds(m0, bm)], mask=row_mask, other=0.0)
    sb = _backend.load(sb_ref.at[pl.ds(n0, bn)], mask=col_mask, other=0.0)
    out = acc * sa[:, None] * sb[None, :]
    _backend.store(o_ref.at[pl.ds(m0, bm), pl.ds(n0, bn)], out.astype(o_ref.dtype),
                   mask=row_mask[:, None] & col_mask[None, :])


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "block"))
def scaled_matmul_nt(a, bt, a_scale, b_scale, *, out_dtype, interpret=False, block=None):
    """(a * a_scale[:, None]) @ (bt * b_scale[:, None])^T for a (M, K), bt (N, K) fp8 and fp32 scale
    vectors a_scale (M,), b_scale (N,)."""
    m, k = a.shape
    n = bt.shape[0]
    if block is None:
        block = (32, 32, 32) if interpret else (128, 128, 64)
    if interpret:
        upcast = jnp.float32
    elif a.dtype != bt.dtype:
        upcast = jnp.bfloat16
    else:
        upcast = None
    return _backend.triton_call(
        functools.partial(_matmul_kernel, shape=(m, n, k), block=block, upcast=upcast),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(pl.cdiv(m, block[0]), pl.cdiv(n, block[1])),
        name="pallas_fused_fp8_scaled_matmul_triton",
        interpret=interpret,
        num_warps=8 if not interpret else 4,
        num_stages=3 if not interpret else None,
    )(a, bt, a_scale, b_scale)
