"""DoRA's GEMMs in Pallas: the forward with a fused epilogue, the epilogue alone after cuBLAS, the backward dx.

forward_gemm: y = (x W [* wscale] + s (x A) B) * g + bias in one pass (W dequantised tile by tile: the "gemm"
variant, and the path of quantised weights). epilogue: y = (z + s xa B) * g + bias for z = x W from cuBLAS (the
"epilogue" variant): one read of z, one write. backward_dx: dx = (dy * gw) W^T + us A^T, dy * gw applied in the
prologue of each tile, the low-rank term in the epilogue.
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
    grouped_pid,
    in_bounds,
    load,
    mask,
    nf4_values,
    num_weight_refs,
    store,
    tile,
)


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """A Pallas GEMM's tiles and launch (GPU defaults; small inputs shrink the tiles). The forward's: a sweep on one
    H200 at 4096 x 4096 -> 4096 bf16 (128 x 256 tiles spilled badly there)."""

    bm: int = 128  # tile over tokens
    bn: int = 128  # tile over output columns (dx: over input features)
    bk: int = 64  # reduction tile
    group_m: int = 8  # grouped program order for L2 reuse
    warps: int = 8
    stages: int = 4


FORWARD = GemmConfig()
DX = GemmConfig(warps=4)  # the backward dx GEMM's default


@dataclasses.dataclass(frozen=True)
class EpilogueConfig:
    """The standalone epilogue pass's tile and warps (not swept yet)."""

    bm: int = 64
    bn: int = 128
    warps: int = 4


EPILOGUE = EpilogueConfig()


def _fwd_kernel(*refs, kind, M, K, N, R, bm, bn, bk, group_m, has_bias, kloop):
    nw = num_weight_refs(kind)
    x_ref = refs[0]
    w_refs = refs[1:1 + nw]
    xa_ref, b_ref, g_ref, s_ref = refs[1 + nw:5 + nw]
    bias_ref = refs[5 + nw] if has_bias else None
    o_ref = refs[-1]
    pid_m, pid_n = grouped_pid(pl.program_id(0), cdiv(M, bm), cdiv(N, bn), group_m)
    m0 = pl.multiple_of(pid_m * bm, bm)
    n0 = pl.multiple_of(pid_n * bn, bn)
    rmask = in_bounds(m0, bm, M, M % bm == 0)
    cmask = in_bounds(n0, bn, N, N % bn == 0)
    dt = x_ref.dtype

    def x_tile(k0, aligned):
        kmask = in_bounds(k0, bk, K, aligned)
        return load(x_ref.at[pl.ds(m0, bm), pl.ds(k0, bk)], mask(rmask, kmask, (bm, bk)))

    mma = _backend.dot

    if kind in ("dense", "int8"):
        def body(i, acc):
            k0 = pl.multiple_of(i * bk, bk)
            kmask = in_bounds(k0, bk, K, K % bk == 0)
            w = load(w_refs[0].at[pl.ds(k0, bk), pl.ds(n0, bn)], mask(kmask, cmask, (bk, bn)))
            return acc + mma(x_tile(k0, K % bk == 0), w.astype(dt))
    else:
        packed_ref, absmax_ref = w_refs

        def body(i, acc):
            k0 = pl.multiple_of(i * bk, bk)
            p = load(packed_ref.at[pl.ds(k0, bk), pl.ds(n0, bn)], mask(None, cmask, (bk, bn))).astype(jnp.int32)
            blk = k0 // NF4_TILE
            am_hi = load(absmax_ref.at[pl.ds(blk, 1), pl.ds(n0, bn)], mask(None, cmask, (1, bn)))
            am_lo = load(absmax_ref.at[pl.ds(blk + kloop // NF4_TILE, 1), pl.ds(n0, bn)], mask(None, cmask, (1, bn)))
            w_hi = (nf4_values(p >> 4) * am_hi).astype(dt)
            w_lo = (nf4_values(p & 15) * am_lo).astype(dt)
            acc = acc + mma(x_tile(k0, False), w_hi)
            return acc + mma(x_tile(kloop + k0, False), w_lo)

    acc = lax.fori_loop(0, cdiv(kloop, bk), body, jnp.zeros((bm, bn), jnp.float32))
    # Epilogue: per-column dequant scale, low-rank term, magnitude scale, bias; one rounding.
    if kind == "int8":
        acc = acc * load(w_refs[1].at[pl.ds(n0, bn)], cmask, 1.0)[None, :]
    xa = load(xa_ref.at[pl.ds(m0, bm), :], mask(rmask, None, (bm, R)))
    b = load(b_ref.at[:, pl.ds(n0, bn)], mask(None, cmask, (R, bn)))
    acc = acc + s_ref[0] * _backend.dot(xa, b)
    acc = acc * load(g_ref.at[pl.ds(n0, bn)], cmask)[None, :]
    if has_bias:
        acc = acc + load(bias_ref.at[pl.ds(n0, bn)], cmask).astype(jnp.float32)[None, :]
    store(o_ref.at[pl.ds(m0, bm), pl.ds(n0, bn)], acc.astype(o_ref.dtype), mask(rmask, cmask, (bm, bn)))


def forward_gemm(x, weight, kind: str, xa, lora_b, g, scale, bias, *, interpret: bool, config: GemmConfig = FORWARD):
    """(x W + s xa B) * g + bias for 2-D x (M, K); xa = x A (M, R) and B (R, N) rank-padded; g float32 (N,)."""
    M, K = x.shape
    R, N = lora_b.shape
    if kind == "nf4":
        bk = NF4_TILE
        kloop = weight[0].shape[0]
    else:
        bk = tile(K, config.bk)
        kloop = K
    bm, bn = tile(M, config.bm), tile(N, config.bn)
    kernel = functools.partial(_fwd_kernel, kind=kind, M=M, K=K, N=N, R=R, bm=bm, bn=bn, bk=bk,
                               group_m=config.group_m, has_bias=bias is not None, kloop=kloop)
    args = (x, *weight, xa, lora_b, g, jnp.reshape(jnp.asarray(scale, jnp.float32), (1,)))
    if bias is not None:
        args = args + (bias,)
    return _backend.triton_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((M, N), x.dtype),
        grid=(cdiv(M, bm) * cdiv(N, bn),),
        name="pallas_fused_dora_fwd",
        interpret=interpret,
        num_warps=config.warps,
        num_stages=config.stages,
    )(*args)


def _epilogue_kernel(*refs, M, N, R, bm, bn, has_bias, has_zscale):
    z_ref, refs = refs[0], refs[1:]
    zscale_ref, refs = (refs[0], refs[1:]) if has_zscale else (None, refs)
    xa_ref, b_ref, g_ref, s_ref = refs[:4]
    bias_ref = refs[4] if has_bias else None
    o_ref = refs[-1]
    m0 = pl.multiple_of(pl.program_id(0) * bm, bm)
    n0 = pl.multiple_of(pl.program_id(1) * bn, bn)
    rmask = in_bounds(m0, bm, M, M % bm == 0)
    cmask = in_bounds(n0, bn, N, N % bn == 0)
    z = load(z_ref.at[pl.ds(m0, bm), pl.ds(n0, bn)], mask(rmask, cmask, (bm, bn))).astype(jnp.float32)
    if has_zscale:  # int8 codes times their per-column scale
        z = z * load(zscale_ref.at[pl.ds(n0, bn)], cmask, 1.0)[None, :]
    xa = load(xa_ref.at[pl.ds(m0, bm), :], mask(rmask, None, (bm, R)))
    b = load(b_ref.at[:, pl.ds(n0, bn)], mask(None, cmask, (R, bn)))
    acc = (z + s_ref[0] * _backend.dot(xa, b)) * load(g_ref.at[pl.ds(n0, bn)], cmask)[None, :]
    if has_bias:
        acc = acc + load(bias_ref.at[pl.ds(n0, bn)], cmask).astype(jnp.float32)[None, :]
    store(o_ref.at[pl.ds(m0, bm), pl.ds(n0, bn)], acc.astype(o_ref.dtype), mask(rmask, cmask, (bm, bn)))


def epilogue(z, xa, lora_b, g, scale, bias, *, interpret: bool, config: EpilogueConfig = EPILOGUE, zscale=None,
             out_dtype=None):
    """(z [* zscale] + s xa B) * g + bias for z = x W (M, N) from another GEMM; xa (M, R), B (R, N) rank-padded,
    g fp32. Also forms the merged weight (W + s A B) * g with z = W, xa = A (z = int8 codes with `zscale`)."""
    M, N = z.shape
    R = lora_b.shape[0]
    bm, bn = tile(M, config.bm), tile(N, config.bn)
    kernel = functools.partial(_epilogue_kernel, M=M, N=N, R=R, bm=bm, bn=bn, has_bias=bias is not None,
                               has_zscale=zscale is not None)
    args = (z,) + (() if zscale is None else (zscale,))
    args += (xa, lora_b, g, jnp.reshape(jnp.asarray(scale, jnp.float32), (1,)))
    args += (bias,) if bias is not None else ()
    return _backend.triton_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((M, N), out_dtype or z.dtype),
        grid=(cdiv(M, bm), cdiv(N, bn)),
        name="pallas_fused_dora_epilogue",
        interpret=interpret,
        num_warps=config.warps,
    )(*args)


def _dx_kernel(*refs, kind, M, K, N, R, bm, bn, bk, group_m, khalf):
    # Here the GEMM is (M, N=out) x (N=out, K=in): the reduction runs over the output features.
    nw = num_weight_refs(kind)
    dy_ref, gw_ref = refs[:2]
    w_refs = refs[2:2 + nw]
    us_ref, a_ref, dx_ref = refs[2 + nw:]
    dt = dy_ref.dtype
    ncols = khalf if kind == "nf4" else K  # dx columns addressed by one program index
    pid_m, pid_n = grouped_pid(pl.program_id(0), cdiv(M, bm), cdiv(ncols, bn), group_m)
    m0 = pl.multiple_of(pid_m * bm, bm)
    c0 = pl.multiple_of(pid_n * bn, bn)
    rmask = in_bounds(m0, bm, M, M % bm == 0)

    def dyg_tile(j0):
        nmask = in_bounds(j0, bk, N, N % bk == 0)
        dy = load(dy_ref.at[pl.ds(m0, bm), pl.ds(j0, bk)], mask(rmask, nmask, (bm, bk)))
        gw = load(gw_ref.at[pl.ds(j0, bk)], nmask)
        return (dy.astype(jnp.float32) * gw[None, :]).astype(dt), nmask

    def lowrank(c_start):
        kmask = in_bounds(c_start, bn, K, False)
        us = load(us_ref.at[pl.ds(m0, bm), :], mask(rmask, None, (bm, R)))
        a = load(a_ref.at[pl.ds(c_start, bn), :], mask(kmask, None, (bn, R)))
        return _backend.dot(us, a, trans_b=True), kmask

    if kind in ("dense", "int8"):
        cmask = in_bounds(c0, bn, K, K % bn == 0)

        def body(i, acc):
            j0 = pl.multiple_of(i * bk, bk)
            dyg, nmask = dyg_tile(j0)
            w = load(w_refs[0].at[pl.ds(c0, bn), pl.ds(j0, bk)], mask(cmask, nmask, (bn, bk)))
            return acc + _backend.dot(dyg, w.astype(dt), trans_b=True)

        acc = lax.fori_loop(0, cdiv(N, bk), body, jnp.zeros((bm, bn), jnp.float32))
        low, kmask = lowrank(c0)
        store(dx_ref.at[pl.ds(m0, bm), pl.ds(c0, bn)], (acc + low).astype(dx_ref.dtype), mask(rmask, kmask, (bm, bn)))
        return

    packed_ref, absmax_ref = w_refs
    blk = c0 // NF4_TILE

    def body(i, accs):
        acc_hi, acc_lo = accs
        j0 = pl.multiple_of(i * bk, bk)
        dyg, nmask = dyg_tile(j0)
        p = load(packed_ref.at[pl.ds(c0, bn), pl.ds(j0, bk)], mask(None, nmask, (bn, bk))).astype(jnp.int32)
        am_hi = load(absmax_ref.at[pl.ds(blk, 1), pl.ds(j0, bk)], mask(None, nmask, (1, bk)))
        am_lo = load(absmax_ref.at[pl.ds(blk + khalf // NF4_TILE, 1), pl.ds(j0, bk)], mask(None, nmask, (1, bk)))
        w_hi = (nf4_values(p >> 4) * am_hi).astype(dt)
        w_lo = (nf4_values(p & 15) * am_lo).astype(dt)
        return acc_hi + _backend.dot(dyg, w_hi, trans_b=True), acc_lo + _backend.dot(dyg, w_lo, trans_b=True)

    zeros = jnp.zeros((bm, bn), jnp.float32)
    acc_hi, acc_lo = lax.fori_loop(0, cdiv(N, bk), body, (zeros, zeros))
    for acc, start in ((acc_hi, c0), (acc_lo, khalf + c0)):
        low, kmask = lowrank(start)
        out = (acc + low).astype(dx_ref.dtype)
        store(dx_ref.at[pl.ds(m0, bm), pl.ds(start, bn)], out, mask(rmask, kmask, (bm, bn)))


def backward_dx(dy, gw, weight, kind: str, us, lora_a, *, interpret: bool, config: GemmConfig = DX):
    """dx (M, K) = (dy * gw) W^T + us A^T, dy (M, N), gw float32 (N,), us (M, R), A (K, R)."""
    M, N = dy.shape
    K, R = lora_a.shape
    bm, bk = tile(M, config.bm), tile(N, config.bk)
    if kind == "nf4":
        bn = NF4_TILE
        khalf = weight[0].shape[0]
        ncols = khalf
    else:
        bn = tile(K, config.bn)
        khalf = 0
        ncols = K
    kernel = functools.partial(_dx_kernel, kind=kind, M=M, K=K, N=N, R=R, bm=bm, bn=bn, bk=bk,
                               group_m=config.group_m, khalf=khalf)
    return _backend.triton_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((M, K), dy.dtype),
        grid=(cdiv(M, bm) * cdiv(ncols, bn),),
        name="pallas_fused_dora_bwd_dx",
        interpret=interpret,
        num_warps=config.warps,
        num_stages=config.stages,
    )(dy, gw, *weight, us, lora_a)
