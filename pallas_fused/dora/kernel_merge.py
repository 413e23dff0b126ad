"""DoRA's merged weight (W + s A B) g, one pass over W ("merged")."""

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
class MergeConfig:
    """The merge pass's launch (GPU defaults; small inputs shrink the tiles).

    (bk, bn) per step: 64 x 64 took 0.2320 / 0.5914 ms (H200 layer forward, 4096 tokens, 4096 -> 4096 r16 /
    4096 -> 11008 r64) against 0.2329 / 0.6142 for 128 x 64. The A B tile as R outer products on the FMA units
    instead of the MMA measured 1.9x slower at r16 and 7x at r64.
    """

    bk: int = 64  # W rows per step
    bn: int = 64  # W columns per program
    rows: int = 128  # rows per program (bk per step; g, B and the partial sums loaded once per program)
    warps: int = 4
    stages: int = 2
    reverse: bool = True  # walk W in the reverse of the norm launch's order (L2 hits on the tiles it read last)
    # "merged": the column norm launch writes partial sums over row ranges of `norm_rows` (more programs in flight
    # than one per column strip) and the merge launch finishes g from them.
    norm_rows: int = 1024


DEFAULT = MergeConfig()


def _merge_kernel(*refs, kind, K, N, R, bk, bn, steps, nsplit, from_partials, reverse):
    nw = num_weight_refs(kind)
    w_refs = refs[:nw]
    a_ref, b_ref, s_ref = refs[nw:nw + 3]
    if from_partials:
        part_ref, m_ref, vg_ref, n_ref, g_ref, bg_ref = refs[nw + 3:]
    else:
        gin_ref, vg_ref = refs[nw + 3:]
    rows = bk * steps  # rows per program (of W; of the packed codes for NF4), in `steps` tiles of bk
    nkb, nnb = cdiv(w_refs[0].shape[0], rows), cdiv(N, bn)
    pid = pl.program_id(0)
    if reverse:  # the norm launch read W top to bottom: start where it ended (those tiles are likeliest in L2)
        pid = nkb * nnb - 1 - pid
    kb, nb = pid // nnb, pid % nnb
    n0 = pl.multiple_of(nb * bn, bn)
    cmask = in_bounds(n0, bn, N, N % bn == 0)
    if from_partials:
        # g = m / sqrt(sum of the nsplit partial sums), per program (nsplit x bn floats: cheap); row block 0
        # also writes n, g and B g s for the backward. nsplit is a power of two (`merge_weight` pads with zeros).
        part = load(part_ref.at[:, pl.ds(n0, bn)], mask(None, cmask, (nsplit, bn)))
        n = floored_norm(jnp.sum(part, axis=0))
        g = load(m_ref.at[pl.ds(n0, bn)], cmask, 1.0).astype(jnp.float32) / n
        first = jnp.logical_and(n0 + jnp.arange(bn) < N, kb == 0)
        _backend.store(n_ref.at[pl.ds(n0, bn)], n, mask=first)
        _backend.store(g_ref.at[pl.ds(n0, bn)], g, mask=first)
    else:
        g = load(gin_ref.at[pl.ds(n0, bn)], cmask, 1.0).astype(jnp.float32)
    b = load(b_ref.at[:, pl.ds(n0, bn)], mask(None, cmask, (R, bn)))
    if from_partials:
        bg = (b.astype(jnp.float32) * (g * s_ref[0])[None, :]).astype(bg_ref.dtype)
        _backend.store(bg_ref.at[:, pl.ds(n0, bn)], bg, mask=jnp.broadcast_to(first[None, :], (R, bn)))
    k_start = kb * rows
    # W's rows past K: only in the last program (dense / int8), or in the packed array's padding (NF4)
    aligned = K == 2 * w_refs[0].shape[0] if kind == "nf4" else K % rows == 0

    def merged(k0, w):
        """Stores rows [k0, k0 + bk) of (W + s A B) g, w being those rows of W in float32."""
        rmask = in_bounds(k0, bk, K, aligned)
        a = load(a_ref.at[pl.ds(k0, bk), :], mask(rmask, None, (bk, R)))
        v = (w + s_ref[0] * _backend.dot(a, b)) * g[None, :]
        store(vg_ref.at[pl.ds(k0, bk), pl.ds(n0, bn)], v.astype(vg_ref.dtype), mask(rmask, cmask, (bk, bn)))

    if kind == "nf4":
        # Packed row k holds W's rows k and k + kloop (kloop = in_padded / 2; quant.py), and a tile of bk = 64
        # packed rows is one absmax block in each half: every program's rows lie inside the packed array
        # (`merge_weight` makes them divide it), so only W's rows past K are masked, in `merged`.
        packed_ref, absmax_ref = w_refs
        kloop = packed_ref.shape[0]

        def nf4_step(i, carry):
            k0 = pl.multiple_of(k_start + i * bk, bk)
            w_hi, w_lo = nf4_rows(packed_ref, absmax_ref, k0, n0, bn, cmask, kloop)
            merged(k0, w_hi)
            merged(kloop + k0, w_lo)
            return carry

        lax.fori_loop(0, steps, nf4_step, 0)
        return
    wscale = load(w_refs[1].at[pl.ds(n0, bn)], cmask, 1.0)[None, :] if kind == "int8" else None

    def w_tile(i):  # masked past K and past this program's rows (the last step's prefetch fetches nothing)
        k0 = k_start + i * bk
        if steps == 1:
            ok = in_bounds(k0, bk, K, K % rows == 0)
        else:
            ok = jnp.logical_and(k0 + jnp.arange(bk) < K, i < steps)
        return load(w_refs[0].at[pl.ds(k0, bk), pl.ds(n0, bn)], mask(ok, cmask, (bk, bn)))

    def body(i, w):  # W is no MMA operand: its next tile is loaded by hand one step ahead
        w_next = w_tile(i + 1) if steps > 1 else w
        w = w.astype(jnp.float32)
        merged(pl.multiple_of(k_start + i * bk, bk), w * wscale if kind == "int8" else w)
        return w_next

    lax.fori_loop(0, steps, body, w_tile(0))


def merge_weight(weight, kind: str, lora_a, lora_b, scale, *, g=None, partials=None, magnitude=None,
                 interpret: bool, config: MergeConfig = DEFAULT):
    """The merged weight (W + s A B) * g in A's dtype (K, N), for any weight kind; A (K, R), B (R, N) rank-padded.

    Either `g` (float32 (N,)) is given, or the column norm's `partials` ((nsplit, N) sums of squares, from
    `column_partials`) and `magnitude`: then g = m / sqrt(sum partials) is formed in this launch (no XLA op
    between the two launches) and (wm, n, g, B g s) is returned (B g s in B's dtype: the backward's
    us = dy (B g s)^T takes it as is).
    """
    K, R = lora_a.shape
    N = lora_b.shape[1]
    bn = tile(N, config.bn)
    if kind == "nf4":  # steps of one absmax block (64 packed rows), as many as divide the packed rows
        bk, kloop = NF4_TILE, weight[0].shape[0]
        steps = nf4_rows_per_program(kloop, config.rows) // bk
    else:
        bk, kloop = tile(K, config.bk), K
        steps = max(1, min(config.rows, pow2(K, bk)) // bk)
    from_partials = partials is not None
    if from_partials:
        # The kernel loads all partial rows as one block, whose height Triton wants a power of two: zero rows
        # (nsplit x N floats) keep that block inside the array instead of reading past its end under a mask,
        # which jax >= 0.12 rejects at trace time.
        partials = jnp.pad(partials, ((0, pow2(partials.shape[0], 1) - partials.shape[0]), (0, 0)))
    nsplit = partials.shape[0] if from_partials else 0
    kernel = functools.partial(_merge_kernel, kind=kind, K=K, N=N, R=R, bk=bk, bn=bn, steps=steps, nsplit=nsplit,
                               from_partials=from_partials, reverse=config.reverse)
    wm = jax.ShapeDtypeStruct((K, N), lora_a.dtype)
    col = jax.ShapeDtypeStruct((N,), jnp.float32)
    nkb = cdiv(kloop, bk * steps)
    args = (*weight, lora_a, lora_b, jnp.reshape(jnp.asarray(scale, jnp.float32), (1,)))
    if from_partials:
        args += (partials, magnitude)
        out_shape = (wm, col, col, jax.ShapeDtypeStruct((R, N), lora_b.dtype))
    else:
        args += (g.astype(jnp.float32),)
        out_shape = wm
    return _backend.triton_call(
        kernel,
        out_shape=out_shape,
        grid=(nkb * cdiv(N, bn),),
        name="pallas_fused_dora_merge",
        interpret=interpret,
        num_warps=config.warps,
        num_stages=config.stages,
    )(*args)
