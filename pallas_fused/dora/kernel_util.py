"""What the DoRA Triton kernels share: tile arithmetic, masked loads and stores, the weight kinds.

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

import math

import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_fused import _backend
from pallas_fused._backend import grouped_pid  # noqa: F401 - the DoRA kernels take it from here
from pallas_fused.dora.quant import NF4_CODEBOOK

NF4_TILE = 64  # = quant.NF4_BLOCK: one absmax row per tile


def pow2(n: int, lo: int = 16) -> int:
    return max(lo, int(pl.next_power_of_2(int(n))))


def tile(dim: int, cap: int, lo: int = 16) -> int:
    """The configured tile, shrunk (to a power of two >= lo) for small dimensions."""
    return min(cap, pow2(dim, lo))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def mask(rows=None, cols=None, shape=None):
    """2-D mask from optional row/column masks (None means all in bounds); None if nothing to mask."""
    if rows is None and cols is None:
        return None
    if rows is None:
        return jnp.broadcast_to(cols[None, :], shape)
    if cols is None:
        return jnp.broadcast_to(rows[:, None], shape)
    return rows[:, None] & cols[None, :]


def in_bounds(start, size: int, bound: int, aligned: bool):
    """Mask of start + arange(size) < bound, or None when the caller knows it is always true."""
    if aligned:
        return None
    return start + jnp.arange(size) < bound


def load(ref, mask, other=0):
    if mask is None:
        return _backend.load(ref)
    return _backend.load(ref, mask=mask, other=other)


def store(ref, val, mask):
    if mask is None:
        _backend.store(ref, val)
    else:
        _backend.store(ref, val, mask=mask)


def num_weight_refs(kind: str) -> int:
    return {"dense": 1, "int8": 2, "nf4": 2}[kind]


def nf4_values(codes):
    """NF4 codebook lookup as a 4-level select tree on the code bits (float32).

    A gather from a codebook in memory put a dependent load in every GEMM step (measured 8.6x slower
    than bf16 on an H200); 15 selects on registers keep the loop free of it.
    """
    level = [float(v) for v in NF4_CODEBOOK]
    for bit in range(4):
        on = (codes & (1 << bit)) != 0
        level = [jnp.where(on, level[2 * i + 1], level[2 * i]) for i in range(len(level) // 2)]
    return level[0]


def nf4_rows_per_program(kloop: int, rows: int) -> int:
    """Packed rows per program of an NF4 pass: whole absmax blocks (NF4_TILE), about `rows` of them at most, and a
    divisor of the kloop packed rows, so no program's tiles need a row mask on the packed codes or the absmax."""
    return NF4_TILE * math.gcd(kloop // NF4_TILE, max(1, rows // NF4_TILE))


def nf4_rows(packed_ref, absmax_ref, k0, n0, bn: int, cmask, kloop: int):
    """W's rows [k0, k0 + NF4_TILE) and [kloop + k0, kloop + k0 + NF4_TILE) in float32, from the NF4_TILE packed rows
    at k0 (each byte a code of each half; kloop = in_padded / 2) and the two halves' absmax rows (one block each)."""
    p = load(packed_ref.at[pl.ds(k0, NF4_TILE), pl.ds(n0, bn)], mask(None, cmask, (NF4_TILE, bn))).astype(jnp.int32)
    blk = k0 // NF4_TILE
    am_hi = load(absmax_ref.at[pl.ds(blk, 1), pl.ds(n0, bn)], mask(None, cmask, (1, bn)))
    am_lo = load(absmax_ref.at[pl.ds(blk + kloop // NF4_TILE, 1), pl.ds(n0, bn)], mask(None, cmask, (1, bn)))
    return nf4_values(p >> 4) * am_hi, nf4_values(p & 15) * am_lo


