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

How the streaming loads are issued (`LOAD_MODE`, `Q_LOAD_MODE`): "evict_first" (L1/L2 evict-first hints),
"plain", or "volatile". Why "volatile" exists: in the SASS that ptxas makes for sm_90 from the plain and
evict_first kernels, the loads of p (and of the weight-decay / lr scalars) are issued only after the
g, m, v loads have returned and their math has started, because p is used last: every program waits for
two DRAM round trips instead of one (checked for blocks of 512 to 4096 elements; a bar.sync after the
loads does not stop it, ptxas moves the math above the barrier). Volatile loads keep their program order
(p is loaded first), so all of a program's loads are in flight at once; they are system-scope strong
loads (LDG.E.128.STRONG.SYS: L2, no L1), which streaming data does not mind. The GPU sweep in
benchmarks/bench_adam.py decides the default.

Cost of the 8-bit kernels (sm_90 SASS from an offline compile, 105M params, instructions per element =
per-thread SASS instructions / elements per thread; no loops, so static = dynamic). The session-2 "table"
kernel: 148 per element (1 row, 1 warp), instruction-issue bound (105M x 148 / 32 lanes is ~0.47 ms of
issue at a perfect 4 warp-instructions per clock per SM): ~40% the encode's select chains (FSEL/SEL/FSETP
per decade), ~15% layout conversions through shared memory (8 bar.sync per program at 1 warp, 23 at 2+).
The "segments" / "binade" kernels (see _q8_lookup_kernel) see a block as a (64, 4) tile, so lookups and
vector loads share one register layout (0 bar.sync, no shared memory), encode with a few table lookups
instead of select chains, and use `adam_math(fast=True)`: 102 / 92 instructions per element, 72 registers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_fused import _backend
from pallas_fused.adam.reference import (
    NUM_SCALARS,
    QBLOCK,
    SIGNED_BINADES,
    SIGNED_MAP,
    SIGNED_SEGMENTS,
    UNSIGNED_BINADES,
    UNSIGNED_MAP,
    UNSIGNED_SEGMENTS,
    adam_math,
    encode_binade,
    encode_segments,
    q8_step,
)

load, store = _backend.load, _backend.store

# Defaults from the H200 sweeps, 105M params in place (session 3's timing: the step returns (params, state), so no
# gradient copies are timed; benchmarks/results/logs/h200_s3_call2_adam.log): fp32 b1024 w4 volatile 0.7223 ms,
# at the measured HBM ceiling (XLA's fused step 0.7205, torch fused AdamW 0.8517); 8-bit "binade" 1 block per
# program, 1 warp, volatile 0.4844 ms ("segments" 0.4957, the session-2 "table" kernel 0.7113). A later revision of
# the lookup kernels (2 blocks per program, m decoded by magnitude, the update stored before requantizing; 86.5
# instead of 96 SASS instructions per element) measured 0.69 ms for every lookup variant in session 3's call 3
# (h200_s3_call3_adam.log) and was set aside: fewer instructions did not mean faster here.
BLOCK = 1024  # elements per program, fp32-state kernels
NUM_WARPS = 4
QROWS = 1  # quantization blocks (rows of 256) per program, 8-bit kernels
Q_NUM_WARPS = 1
# How streaming loads are issued (see the module docstring); read at call time so a benchmark can sweep them.
LOAD_MODES = ("evict_first", "plain", "volatile")
LOAD_MODE = "volatile"
Q_LOAD_MODE = "volatile"
# 8-bit kernel variant (see adam_q8): "segments" / "binade" (one block per program as a (64, 4) tile,
# encode by table lookups, see _q8_lookup_kernel) or "table" (the session-2 kernel: rows of 256, encode by
# select chains).
Q_VARIANTS = ("segments", "binade", "table")
Q_VARIANT = "binade"


# The direction kernels (inplace=False) also write the moments over their inputs. Without the aliasing, a
# jitted optax step that donates its state makes XLA put the kernel's fresh m, v outputs in new buffers and
# then copy them into the donated ones (two extra passes over each moment: measured 1.42 ms against 0.73 for
# the in-place step at 105M fp32 params, H200). Each program reads its elements before writing them, so the
# in-place write is safe; when the caller does not donate the state, XLA copies the inputs first.
STATE_ALIASES = {4: 1, 5: 2, 6: 3, 7: 4}  # 8-bit operands (s, table, table, g, mc, ma, vc, va, [p])


def _stream_load(ref, idx, mask, other, mode):
    """A load of data used once: with evict-first hints, plain, or volatile (kept in program order)."""
    kw = {"evict_first": {"eviction_policy": "evict_first"}, "plain": {}, "volatile": {"volatile": True}}[mode]
    if mask is None:
        return load(ref.at[idx], **kw)
    return load(ref.at[idx], mask=mask, other=other, **kw)


def _scalars(s_ref):
    # Scalar loads (every thread reads the same word, as jax's paged_attention reads lengths_ref[0]).
    return [s_ref[i] for i in range(NUM_SCALARS)]


def fp32_refs(refs, *, has_p: bool, inplace: bool):
    """The fp32-state kernels' refs in one order, (s, p or None, g, m, v, out, m_out, v_out), from the order the
    launchers pass them: p first in place (out is p's), last or absent otherwise (out is the update's)."""
    if inplace:
        s_ref, p_ref, g_ref, m_ref, v_ref, out, m_out, v_out = refs
    elif has_p:
        s_ref, g_ref, m_ref, v_ref, p_ref, out, m_out, v_out = refs
    else:
        s_ref, g_ref, m_ref, v_ref, out, m_out, v_out = refs
        p_ref = None
    return s_ref, p_ref, g_ref, m_ref, v_ref, out, m_out, v_out


def fp32_step(p, g, m, v, s, *, inplace: bool):
    """fp32 values in, (p + update in place or the update, m', v') out; elements whose new moments are not
    finite keep p, m and v (update 0)."""
    u, m_new, v_new, ok = adam_math(g, m, v, p, s)
    u = jnp.where(ok, u, 0.0)
    return (p + u if inplace else u), jnp.where(ok, m_new, m), jnp.where(ok, v_new, v)


def _fp32_kernel(*refs, n, block, has_p, inplace, load_mode):
    s_ref, p_ref, g_ref, m_ref, v_ref, out_ref, m_out, v_out = fp32_refs(refs, has_p=has_p, inplace=inplace)
    idx = pl.program_id(0) * block + jnp.arange(block)
    mask = idx < n
    s = _scalars(s_ref)

    def stream(ref):
        return _stream_load(ref, idx, mask, 0.0, load_mode).astype(jnp.float32)

    # p first: with volatile loads this order is kept, so p's load does not wait behind g, m, v's math.
    p = None if p_ref is None else stream(p_ref)
    g, m, v = stream(g_ref), stream(m_ref), stream(v_ref)
    out, m2, v2 = fp32_step(p, g, m, v, s, inplace=inplace)
    for ref, x in ((m_out, m2), (v_out, v2), (out_ref, out)):  # the moments first, as tuned
        store(ref.at[idx], x.astype(ref.dtype), mask=mask)


def adam_fp32(s, g, m, v, p=None, *, inplace: bool, interpret: bool, block: int | None = None,
              num_warps: int | None = None, u_dtype=None, load_mode: str | None = None):
    """Fused step for fp32/bf16 states. Flat 1-D operands of one length n.

    inplace=False: returns (update in u_dtype (default g's dtype), m, v); p (optional) enables weight decay.
    inplace=True: returns (p, m, v), written over the p, m, v operands (donate them under jit).
    block / num_warps / load_mode default to the module's BLOCK / NUM_WARPS / LOAD_MODE (read at call time,
    so a benchmark can sweep them).
    """
    load_mode = _check_mode(load_mode or LOAD_MODE)
    return _adam_fp32(s, g, m, v, p, inplace=inplace, interpret=interpret, block=block or BLOCK,
                      num_warps=num_warps or NUM_WARPS, u_dtype=u_dtype, load_mode=load_mode)


def _check_mode(mode: str) -> str:
    if mode not in LOAD_MODES:
        raise ValueError(f"load_mode: expected one of {LOAD_MODES}, got {mode!r}")
    return mode


@functools.partial(jax.jit, static_argnames=("inplace", "interpret", "block", "num_warps", "u_dtype", "load_mode"))
def _adam_fp32(s, g, m, v, p, *, inplace, interpret, block, num_warps, u_dtype, load_mode):
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
        aliases = {2: 1, 3: 2}  # m, v written over their inputs: see STATE_ALIASES
    block = min(block, max(128, _next_pow2(n)))
    kernel = functools.partial(_fp32_kernel, n=n, block=block, has_p=has_p, inplace=inplace, load_mode=load_mode)
    return _backend.triton_call(
        kernel,
        out_shape=out_shape,
        grid=(_cdiv(n, block),),
        name="pallas_fused_adam_step" if inplace else "pallas_fused_adam_update",
        interpret=interpret,
        num_warps=num_warps if block >= 2048 else min(num_warps, 4),
        input_output_aliases=aliases,
    )(*operands)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _q8_refs(refs, inplace, has_p):
    """The 8-bit kernels' refs in one order: (scalars, two tables, p or None, g, mc, ma, vc, va, then the five
    outputs). The operands arrive as the launchers pass them: p first in place, last (or absent) otherwise."""
    if inplace:
        s, t1, t2, p, g, *rest = refs
    elif has_p:
        s, t1, t2, g, mc, ma, vc, va, p, *outs = refs
        rest = [mc, ma, vc, va, *outs]
    else:
        s, t1, t2, g, *rest = refs
        p = None
    return (s, t1, t2, p, g, *rest)


def _q8_launch_args(tables, s, g, mc, ma, vc, va, p, inplace, u_dtype):
    """(operands, out_shape, input_output_aliases) of an 8-bit launch, in the order `_q8_refs` reads."""
    state_shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (mc, ma, vc, va))
    if inplace:
        return ((s, *tables, p, g, mc, ma, vc, va), (jax.ShapeDtypeStruct(p.shape, p.dtype),) + state_shapes,
                {3: 0, 5: 1, 6: 2, 7: 3, 8: 4})
    operands = (s, *tables, g, mc, ma, vc, va) + (() if p is None else (p,))
    return operands, (jax.ShapeDtypeStruct(g.shape, u_dtype or g.dtype),) + state_shapes, STATE_ALIASES


def _q8_kernel(*refs, n, nb, rows, has_p, inplace, load_mode):
    (s_ref, smap_ref, umap_ref, p_ref, g_ref, mc_ref, ma_ref, vc_ref, va_ref,
     out_ref, mc_out, ma_out, vc_out, va_out) = _q8_refs(refs, inplace, has_p)
    row = pl.program_id(0) * rows + jnp.arange(rows)
    idx = row[:, None] * QBLOCK + jnp.arange(QBLOCK)[None, :]
    rmask = row < nb
    mask = idx < n
    s = _scalars(s_ref)
    # p first (see the module docstring on load modes).
    p = None if p_ref is None else _stream_load(p_ref, idx, mask, 0.0, load_mode).astype(jnp.float32)
    g = _stream_load(g_ref, idx, mask, 0.0, load_mode).astype(jnp.float32)
    mc = _stream_load(mc_ref, idx, mask, 0, load_mode).astype(jnp.int32)
    vc = _stream_load(vc_ref, idx, mask, 0, load_mode).astype(jnp.int32)
    ma = load(ma_ref.at[row], mask=rmask, other=0.0)
    va = load(va_ref.at[row], mask=rmask, other=0.0)
    # Dequantize: a 256-entry table lookup (the table stays in L1) times the block's absmax.
    m = load(smap_ref.at[mc], eviction_policy="evict_last") * ma[:, None]
    v = load(umap_ref.at[vc], eviction_policy="evict_last") * va[:, None]
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


def adam_q8(s, g, mc, ma, vc, va, p=None, *, inplace: bool, interpret: bool, rows: int | None = None,
            num_warps: int | None = None, u_dtype=None, load_mode: str | None = None, variant: str | None = None):
    """Fused step for 8-bit blockwise states. g, p flat (n,); mc, vc uint8 (blocks*256,); ma, va (blocks,).

    Returns (update or p, mc, ma, vc, va); with inplace=True the outputs are written over p and the
    state operands (donate them under jit). rows / num_warps / load_mode / variant default to QROWS /
    Q_NUM_WARPS / Q_LOAD_MODE / Q_VARIANT (read at call time). Both variants compute the same codes
    (`encode_segments` / `encode_binade` are `encode` bit for bit); "segments" and "binade" handle one block
    per program (rows must be 1).
    """
    load_mode = _check_mode(load_mode or Q_LOAD_MODE)
    variant = variant or Q_VARIANT
    if variant not in Q_VARIANTS:
        raise ValueError(f"variant: expected one of {Q_VARIANTS}, got {variant!r}")
    rows = rows or QROWS
    if variant != "table":
        if rows != 1:
            raise ValueError(f"rows: the {variant!r} variant handles one block per program, got rows={rows}")
        return _adam_q8_lookup(s, g, mc, ma, vc, va, p, inplace=inplace, interpret=interpret,
                               num_warps=num_warps or Q_NUM_WARPS, u_dtype=u_dtype, load_mode=load_mode,
                               variant=variant)
    return _adam_q8(s, g, mc, ma, vc, va, p, inplace=inplace, interpret=interpret, rows=rows,
                    num_warps=num_warps or Q_NUM_WARPS, u_dtype=u_dtype, load_mode=load_mode)


@functools.partial(jax.jit, static_argnames=("inplace", "interpret", "rows", "num_warps", "u_dtype", "load_mode"))
def _adam_q8(s, g, mc, ma, vc, va, p, *, inplace, interpret, rows, num_warps, u_dtype, load_mode):
    n = g.shape[0]
    nb = ma.shape[0]
    has_p = p is not None
    smap = jnp.asarray(SIGNED_MAP.table)
    umap = jnp.asarray(UNSIGNED_MAP.table)
    operands, out_shape, aliases = _q8_launch_args((smap, umap), s, g, mc, ma, vc, va, p, inplace, u_dtype)
    kernel = functools.partial(_q8_kernel, n=n, nb=nb, rows=rows, has_p=has_p, inplace=inplace, load_mode=load_mode)
    return _backend.triton_call(
        kernel,
        out_shape=out_shape,
        grid=(_cdiv(nb, rows),),
        name="pallas_fused_adam8bit_step" if inplace else "pallas_fused_adam8bit_update",
        interpret=interpret,
        num_warps=num_warps,
        input_output_aliases=aliases,
    )(*operands)


# The "segments" and "binade" 8-bit kernels. Why a (64, 4) tile: Triton gives every load its own register
# layout, from the contiguity of its addresses. A table lookup (addresses from data) gets one element per
# thread, the streaming loads a vector per thread; on a (1, 256) tile those put different elements in each
# thread, so every tile crosses shared memory on its way between them (23 bar.sync per program in the
# "table" kernel). On a (64, 4) tile with rows of 4 contiguous elements, the vector layout is thread t
# holding rows t, t + 32, ..., and the lookup layout (threads along dim 0 first) is the same mapping: no
# conversion at all, so the encoder can afford lookups too. The two differ in the encoder:
# - "segments": `encode_segments` (3 lookups per code: binade, coef_a, coef_c; abs, clip and sign in ALU),
# - "binade": `encode_binade` (5 lookups: bound, coef_a, coef_c, top, magic; ~6 instructions fewer).
# Tables: one fp32 operand (the two decode maps, then the encoders' fp32 tables) and one int32 operand.


def _q8_tables(variant):
    """(fp32 table, int32 table, fp32 offsets (the two decode maps, then each map's encoder tables),
    int32 offsets (each map's))."""
    if variant == "segments":
        m, v = SIGNED_SEGMENTS, UNSIGNED_SEGMENTS
        fparts = [m.coef_a, m.coef_c, v.coef_a, v.coef_c]
        iparts = [m.binade, v.binade]
    else:
        m, v = SIGNED_BINADES, UNSIGNED_BINADES
        fparts = [m.coef_a, m.coef_c, m.top, m.magic, v.coef_a, v.coef_c, v.top, v.magic]
        iparts = [m.bound, v.bound]
    fparts = [SIGNED_MAP.table, UNSIGNED_MAP.table] + fparts
    foffs = np.cumsum([0] + [x.size for x in fparts])[:-1].tolist()
    ioffs = np.cumsum([0] + [x.size for x in iparts])[:-1].tolist()
    f = np.concatenate(fparts).astype(np.float32)
    i = np.concatenate(iparts).astype(np.int32)
    return jnp.asarray(f), jnp.asarray(i), foffs, ioffs


def _q8_lookup_kernel(*refs, n, has_p, inplace, load_mode, variant):
    (s_ref, f_ref, i_ref, p_ref, g_ref, mc_ref, ma_ref, vc_ref, va_ref,
     out_ref, mc_out, ma_out, vc_out, va_out) = _q8_refs(refs, inplace, has_p)
    b = pl.program_id(0)
    idx = b * QBLOCK + (jnp.arange(QBLOCK // 4) * 4)[:, None] + jnp.arange(4)[None, :]
    mask = None if n % QBLOCK == 0 else idx < n  # no mask when the blocks are full (n is static)
    s = _scalars(s_ref)
    _, _, foffs, ioffs = _q8_tables(variant)

    def lookup(ref, offset):
        return lambda i: load(ref.at[i + offset], eviction_policy="evict_last")

    p = None if p_ref is None else _stream_load(p_ref, idx, mask, 0.0, load_mode).astype(jnp.float32)
    g = _stream_load(g_ref, idx, mask, 0.0, load_mode).astype(jnp.float32)
    mc = _stream_load(mc_ref, idx, mask, 0, load_mode).astype(jnp.int32)
    vc = _stream_load(vc_ref, idx, mask, 0, load_mode).astype(jnp.int32)
    m = lookup(f_ref, foffs[0])(mc) * ma_ref[b]
    v = lookup(f_ref, foffs[1])(vc) * va_ref[b]
    if variant == "segments":
        fm, fv = [[lookup(f_ref, o) for o in foffs[k:k + 2]] for k in (2, 4)]
        encoders = (lambda a: encode_segments(a, lookup(i_ref, ioffs[0]), *fm),
                    lambda a: encode_segments(a, lookup(i_ref, ioffs[1]), *fv))
        kw = {"encoders": encoders}
    else:
        fm, fv = [[lookup(f_ref, o) for o in foffs[k:k + 4]] for k in (2, 6)]
        signed = (lambda a: encode_binade(a, lookup(i_ref, ioffs[0]), *fm),
                  lambda a: encode_binade(a, lookup(i_ref, ioffs[1]), *fv))
        kw = {"signed_encoders": signed}
    u, ma_new, va_new, mc_new, vc_new = q8_step(g, m, v, p, s, mask, axis=None, **kw)
    # The grid covers whole blocks: codes are stored unmasked, the padding past the tensor's end included.
    store(mc_out.at[idx], mc_new.astype(jnp.uint8))
    store(vc_out.at[idx], vc_new.astype(jnp.uint8))
    ma_out[b] = ma_new
    va_out[b] = va_new
    out = p + u if inplace else u
    store(out_ref.at[idx], out.astype(out_ref.dtype), mask=mask)


@functools.partial(jax.jit, static_argnames=("inplace", "interpret", "num_warps", "u_dtype", "load_mode", "variant"))
def _adam_q8_lookup(s, g, mc, ma, vc, va, p, *, inplace, interpret, num_warps, u_dtype, load_mode, variant):
    n = g.shape[0]
    nb = ma.shape[0]
    has_p = p is not None
    ftab, itab, _, _ = _q8_tables(variant)
    operands, out_shape, aliases = _q8_launch_args((ftab, itab), s, g, mc, ma, vc, va, p, inplace, u_dtype)
    kernel = functools.partial(_q8_lookup_kernel, n=n, has_p=has_p, inplace=inplace, load_mode=load_mode,
                               variant=variant)
    return _backend.triton_call(
        kernel,
        out_shape=out_shape,
        grid=(nb,),
        name="pallas_fused_adam8bit_step" if inplace else "pallas_fused_adam8bit_update",
        interpret=interpret,
        num_warps=num_warps,
        input_output_aliases=aliases,
    )(*operands)


def scalar_operand(values) -> jax.Array:
    """Pack the runtime scalars (see reference.py) into the kernel's fp32 operand."""
    return jnp.stack([jnp.asarray(x, jnp.float32).reshape(()) for x in values])

