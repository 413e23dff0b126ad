"""Pallas (Triton lowering) kernels for the fused Adam(W) step: one pass per tensor.

Each tensor is seen as a flat vector (reshapes are free); a program handles `block` consecutive
elements with a mask for the tail. All arithmetic is fp32; loads and stores are in the arrays' own
dtypes. The runtime hyperparameters arrive as one small fp32 operand (see reference.py), so changing
them never recompiles.

Two modes, both one pass:
- direction (`inplace=False`): reads g, m, v (and p for weight decay), writes the update, m, v.
- in place (`inplace=True`): reads p, g, m, v; writes p, m, v over their inputs
  (`input_output_aliases`): 7 passes over memory for fp32 state, the floor of an Adam step.

The 8-bit kernels see a tensor as rows of 256 elements (one quantization block per row, several
rows per program): dequantize m and v by table lookup, step, take each row's new absmax, requantize.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_fused import _backend
from pallas_fused.adam.reference import (
    NUM_SCALARS,
    QBLOCK,
    SIGNED_MAP,
    UNSIGNED_MAP,
    adam_math,
    q8_step,
)

load, store = _backend.load, _backend.store

BLOCK = 4096  # elements per program, fp32-state kernels
NUM_WARPS = 8
QROWS = 8  # quantization blocks (rows of 256) per program, 8-bit kernels
Q_NUM_WARPS = 8


def _scalars(s_ref):
    # Scalar loads (every thread reads the same word, as jax's paged_attention reads lengths_ref[0]).
    return [s_ref[i] for i in range(NUM_SCALARS)]


def _fp32_kernel(*refs, n, block, has_p, inplace):
    if inplace:
        s_ref, p_ref, g_ref, m_ref, v_ref, p_out, m_out, v_out = refs
    elif has_p:
        s_ref, g_ref, m_ref, v_ref, p_ref, u_out, m_out, v_out = refs
    else:
        s_ref, g_ref, m_ref, v_ref, u_out, m_out, v_out = refs
        p_ref = None
    idx = pl.program_id(0) * block + jnp.arange(block)
    mask = idx < n
    s = _scalars(s_ref)
    g = load(g_ref.at[idx], mask=mask, other=0.0, eviction_policy="evict_first").astype(jnp.float32)
    m = load(m_ref.at[idx], mask=mask, other=0.0, eviction_policy="evict_first").astype(jnp.float32)
    v = load(v_ref.at[idx], mask=mask, other=0.0, eviction_policy="evict_first").astype(jnp.float32)
    p = None if p_ref is None else load(p_ref.at[idx], mask=mask, other=0.0, eviction_policy="evict_first").astype(
        jnp.float32)
    u, m_new, v_new, ok = adam_math(g, m, v, p, s)
    u = jnp.where(ok, u, 0.0)
    store(m_out.at[idx], jnp.where(ok, m_new, m).astype(m_out.dtype), mask=mask)
    store(v_out.at[idx], jnp.where(ok, v_new, v).astype(v_out.dtype), mask=mask)
    if inplace:
        store(p_out.at[idx], (p + u).astype(p_out.dtype), mask=mask)
    else:
        store(u_out.at[idx], u.astype(u_out.dtype), mask=mask)


@functools.partial(jax.jit, static_argnames=("inplace", "interpret", "block", "num_warps", "u_dtype"))
def adam_fp32(s, g, m, v, p=None, *, inplace: bool, interpret: bool, block: int | None = None,
              num_warps: int | None = None, u_dtype=None):
    """Fused step for fp32/bf16 states. Flat 1-D operands of one length n.

    inplace=False: returns (update in u_dtype (default g's dtype), m, v); p (optional) enables weight decay.
    inplace=True: returns (p, m, v), written over the p, m, v operands (donate them under jit).
    block / num_warps default to the module's BLOCK / NUM_WARPS (read at call time, so a benchmark can
    sweep them).
    """
    n = g.shape[0]
    has_p = p is not None
    if inplace:
        operands = (s, p, g, m, v)
        out_shape = (jax.ShapeDtypeStruct(p.shape, p.dtype), jax.ShapeDtypeStruct(m.shape, m.dtype),
                     jax.ShapeDtypeStruct(v.shape, v.dtype))
        aliases = {1: 0, 3: 1, 4: 2}
    else:
        operands = (s, g, m, v) + ((p,) if has_p else ())
        out_shape = (jax.ShapeDtypeStruct(g.shape, u_dtype or g.dtype), jax.ShapeDtypeStruct(m.shape, m.dtype),
                     jax.ShapeDtypeStruct(v.shape, v.dtype))
        aliases = {}
    block = min(block or BLOCK, max(128, _next_pow2(n)))
    kernel = functools.partial(_fp32_kernel, n=n, block=block, has_p=has_p, inplace=inplace)
    return _backend.triton_call(
        kernel,
        out_shape=out_shape,
        grid=(_cdiv(n, block),),
        name="pallas_fused_adam_step" if inplace else "pallas_fused_adam_update",
        interpret=interpret,
        num_warps=(num_warps or NUM_WARPS) if block >= 2048 else min(num_warps or NUM_WARPS, 4),
        input_output_aliases=aliases,
    )(*operands)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _q8_kernel(*refs, n, nb, rows, has_p, inplace):
    if inplace:
        (s_ref, smap_ref, umap_ref, p_ref, g_ref, mc_ref, ma_ref, vc_ref, va_ref,
         out_ref, mc_out, ma_out, vc_out, va_out) = refs
    elif has_p:
        (s_ref, smap_ref, umap_ref, g_ref, mc_ref, ma_ref, vc_ref, va_ref, p_ref,
         out_ref, mc_out, ma_out, vc_out, va_out) = refs
    else:
        (s_ref, smap_ref, umap_ref, g_ref, mc_ref, ma_ref, vc_ref, va_ref,
         out_ref, mc_out, ma_out, vc_out, va_out) = refs
        p_ref = None
    row = pl.program_id(0) * rows + jnp.arange(rows)
    idx = row[:, None] * QBLOCK + jnp.arange(QBLOCK)[None, :]
    rmask = row < nb
    mask = idx < n
    s = _scalars(s_ref)
    g = load(g_ref.at[idx], mask=mask, other=0.0, eviction_policy="evict_first").astype(jnp.float32)
    mc = load(mc_ref.at[idx], mask=mask, other=0, eviction_policy="evict_first").astype(jnp.int32)
    vc = load(vc_ref.at[idx], mask=mask, other=0, eviction_policy="evict_first").astype(jnp.int32)
    ma = load(ma_ref.at[row], mask=rmask, other=0.0)
    va = load(va_ref.at[row], mask=rmask, other=0.0)
    # Dequantize: a 256-entry table lookup (the table stays in L1) times the block's absmax.
    m = load(smap_ref.at[mc], eviction_policy="evict_last") * ma[:, None]
    v = load(umap_ref.at[vc], eviction_policy="evict_last") * va[:, None]
    p = None if p_ref is None else load(p_ref.at[idx], mask=mask, other=0.0, eviction_policy="evict_first").astype(
        jnp.float32)
    # Step, then requantize with each block's new absmax.
    u, ma_new, va_new, mc_new, vc_new = q8_step(g, m, v, p, s, mask)
    # Codes are stored for whole blocks: the padding past the tensor's end (zeros, see q8_step) is written
    # too, so a fresh output buffer never carries uninitialized bytes into the state.
    block_mask = jnp.broadcast_to(rmask[:, None], idx.shape)
    store(mc_out.at[idx], mc_new.astype(jnp.uint8), mask=block_mask)
    store(vc_out.at[idx], vc_new.astype(jnp.uint8), mask=block_mask)
    store(ma_out.at[row], ma_new, mask=rmask)
    store(va_out.at[row], va_new, mask=rmask)
    if inplace:
        store(out_ref.at[idx], (p + u).astype(out_ref.dtype), mask=mask)
    else:
        store(out_ref.at[idx], u.astype(out_ref.dtype), mask=mask)


@functools.partial(jax.jit, static_argnames=("inplace", "interpret", "rows", "num_warps", "u_dtype"))
def adam_q8(s, g, mc, ma, vc, va, p=None, *, inplace: bool, interpret: bool, rows: int | None = None,
            num_warps: int | None = None, u_dtype=None):
    """Fused step for 8-bit blockwise states. g, p flat (n,); mc, vc uint8 (blocks*256,); ma, va (blocks,).

    Returns (update or p, mc, ma, vc, va); with inplace=True the outputs are written over p and the
    state operands (donate them under jit). rows / num_warps default to QROWS / Q_NUM_WARPS.
    """
    n = g.shape[0]
    nb = ma.shape[0]
    rows = rows or QROWS
    has_p = p is not None
    smap = jnp.asarray(SIGNED_MAP.table)
    umap = jnp.asarray(UNSIGNED_MAP.table)
    state_shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (mc, ma, vc, va))
    if inplace:
        operands = (s, smap, umap, p, g, mc, ma, vc, va)
        out_shape = (jax.ShapeDtypeStruct(p.shape, p.dtype),) + state_shapes
        aliases = {3: 0, 5: 1, 6: 2, 7: 3, 8: 4}
    else:
        operands = (s, smap, umap, g, mc, ma, vc, va) + ((p,) if has_p else ())
        out_shape = (jax.ShapeDtypeStruct(g.shape, u_dtype or g.dtype),) + state_shapes
        aliases = {}
    kernel = functools.partial(_q8_kernel, n=n, nb=nb, rows=rows, has_p=has_p, inplace=inplace)
    return _backend.triton_call(
        kernel,
        out_shape=out_shape,
        grid=(_cdiv(nb, rows),),
        name="pallas_fused_adam8bit_step" if inplace else "pallas_fused_adam8bit_update",
        interpret=interpret,
        num_warps=num_warps or Q_NUM_WARPS,
        input_output_aliases=aliases,
    )(*operands)


def scalar_operand(values) -> jax.Array:
    """Pack the runtime scalars (see reference.py) into the kernel's fp32 operand."""
    return jnp.stack([jnp.asarray(x, jnp.float32).reshape(()) for x in values])

