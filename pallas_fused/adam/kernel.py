"""Pallas (Triton lowering) kernels for the fused Adam(W) step: one pass per tensor.

Each tensor is seen as a flat vector (reshapes are free); a program handles `block` consecutive
elements with a mask for the tail. All arithmetic is fp32; loads and stores are in the arrays' own
dtypes. The runtime hyperparameters arrive as one small fp32 operand (see reference.py), so changing
them never recompiles.

Two modes, both one pass:
- direction (`inplace=False`): reads g, m, v (and p for weight decay), writes the update, m, v.
- in place (`inplace=True`): reads p, g, m, v; writes p, m, v over their inputs
  (`input_output_aliases`): 7 passes over memory for fp32 state, the floor of an Adam step.

The 8-bit kernel takes one quantization block (256 elements) per program: dequantize m and v by table
lookup, step, take the block's new absmax, requantize.

Each launch is described by a `Launch` (elements per program, warps, load mode), passed in by the caller
(`default_launch` gives this device kind's: pallas_fused/tuning/<device>.json, else `HEURISTIC`).

How the streaming loads are issued (`Launch.load_mode`): "evict_first" (L1/L2 evict-first hints),
"plain", or "volatile". Why "volatile" exists: in the SASS that ptxas makes for sm_90 from the plain and
evict_first kernels, the loads of p (and of the weight-decay / lr scalars) are issued only after the
g, m, v loads have returned and their math has started, because p is used last: every program waits for
two DRAM round trips instead of one (checked for blocks of 512 to 4096 elements; a bar.sync after the
loads does not stop it, ptxas moves the math above the barrier). Volatile loads keep their program order
(p is loaded first), so all of a program's loads are in flight at once; they are system-scope strong
loads (LDG.E.128.STRONG.SYS: L2, no L1), which streaming data does not mind. The GPU sweep in
benchmarks/bench_adam.py decides the default.

Cost of the 8-bit kernel (sm_90 SASS from an offline compile, 105M params, instructions per element =
per-thread SASS instructions / elements per thread; no loops, so static = dynamic). An earlier kernel over
rows of 256 that encoded by select chains took 148 per element (1 row, 1 warp), instruction-issue bound
(105M x 148 / 32 lanes is ~0.47 ms of issue at a perfect 4 warp-instructions per clock per SM): ~40% the
encode's select chains (FSEL/SEL/FSETP per decade), ~15% layout conversions through shared memory. This one
(see _q8_kernel) sees a block as a (64, 4) tile, so lookups and vector loads share one register layout (0
bar.sync, no shared memory), encodes with a few table lookups (`encode_binade`) and uses
`adam_math(fast=True)`: 92 instructions per element, 72 registers.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_fused import _backend
from pallas_fused._backend import cdiv, next_pow2
from pallas_fused.adam.reference import (
    NUM_SCALARS,
    QBLOCK,
    SIGNED_BINADES,
    SIGNED_MAP,
    UNSIGNED_BINADES,
    UNSIGNED_MAP,
    adam_math,
    encode_binade,
    q8_step,
)

load, store = _backend.load, _backend.store

LOAD_MODES = ("evict_first", "plain", "volatile")


@dataclasses.dataclass(frozen=True)
class Launch:
    """How one kernel is launched: elements per program, warps, and how its streaming loads are issued."""

    block: int = 1024  # elements per program (the 8-bit kernel: one quantization block, QBLOCK)
    num_warps: int = 4
    load_mode: str = "volatile"  # one of LOAD_MODES (see the module docstring)

    def __post_init__(self):
        if self.load_mode not in LOAD_MODES:
            raise ValueError(f"load_mode: expected one of {LOAD_MODES}, got {self.load_mode!r}")


# The launches of a GPU without a tuning table: the H200's (from its sweeps at 105M params in place, see
# docs/performance.md, "Tuning tables"). On the H200 the 8-bit kernel encoding with five lookups per code beat
# three lookups (0.4844 against 0.4957 ms) and select chains over rows of 256 (0.7113). A revision with 2 blocks per
# program, m decoded by magnitude and the update stored before requantizing (86.5 instead of 96 SASS instructions
# per element) measured 0.69 ms and was set aside: fewer instructions did not mean faster here.
HEURISTIC = {"fp32": dict(block=1024, num_warps=4, load_mode="volatile"),
             "q8": dict(block=QBLOCK, num_warps=1, load_mode="volatile")}


def default_launch(kernel: str) -> Launch:
    """This device kind's launch of the "fp32" or "q8" kernel."""
    return Launch(**_backend.tuned("adam_launch", HEURISTIC)[kernel])


# The direction kernels (inplace=False) also write the moments over their inputs. Without the aliasing, a
# jitted optax step that donates its state makes XLA put the kernel's fresh m, v outputs in new buffers and
# then copy them into the donated ones (two extra passes over each moment: measured 1.42 ms against 0.73 for
# the in-place step at 105M fp32 params, H200). Each program reads its elements before writing them, so the
# in-place write is safe; when the caller does not donate the state, XLA copies the inputs first.
STATE_ALIASES = {4: 1, 5: 2, 6: 3, 7: 4}  # 8-bit operands (s, fp32 tables, int32 tables, g, mc, ma, vc, va, [p])


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


@functools.partial(jax.jit, static_argnames=("inplace", "interpret", "launch", "u_dtype"))
def adam_fp32(s, g, m, v, p=None, *, inplace: bool, interpret: bool, launch: Launch | None = None, u_dtype=None):
    """Fused step for fp32/bf16 states. Flat 1-D operands of one length n.

    inplace=False: returns (update in u_dtype (default g's dtype), m, v); p (optional) enables weight decay.
    inplace=True: returns (p, m, v), written over the p, m, v operands (donate them under jit).
    launch: None for `default_launch("fp32")`.
    """
    launch = launch or default_launch("fp32")
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
    block = min(launch.block, max(128, next_pow2(n)))
    kernel = functools.partial(_fp32_kernel, n=n, block=block, has_p=has_p, inplace=inplace,
                               load_mode=launch.load_mode)
    return _backend.triton_call(
        kernel,
        out_shape=out_shape,
        grid=(cdiv(n, block),),
        name="pallas_fused_adam_step" if inplace else "pallas_fused_adam_update",
        interpret=interpret,
        num_warps=launch.num_warps if block >= 2048 else min(launch.num_warps, 4),
        input_output_aliases=aliases,
    )(*operands)


def _q8_refs(refs, inplace, has_p):
    """The 8-bit kernel's refs in one order: (scalars, two tables, p or None, g, mc, ma, vc, va, then the five
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


# The 8-bit kernel. Why a (64, 4) tile: Triton gives every load its own register layout, from the contiguity of
# its addresses. A table lookup (addresses from data) gets one element per thread, the streaming loads a vector per
# thread; on a (1, 256) tile those put different elements in each thread, so every tile crosses shared memory on
# its way between them (23 bar.sync per program). On a (64, 4) tile with rows of 4 contiguous elements, the
# vector layout is thread t holding rows t, t + 32, ..., and the lookup layout (threads along dim 0 first) is the
# same mapping: no conversion at all, so the encoder can afford lookups too: `encode_binade` (5 lookups: bound,
# coef_a, coef_c, top, magic). Tables: one fp32 operand (the two decode maps, then the encoders' fp32 tables) and
# one int32 operand.


def _q8_tables():
    """(fp32 table, int32 table, fp32 offsets (the two decode maps, then each map's encoder tables),
    int32 offsets (each map's))."""
    m, v = SIGNED_BINADES, UNSIGNED_BINADES
    fparts = [m.coef_a, m.coef_c, m.top, m.magic, v.coef_a, v.coef_c, v.top, v.magic]
    iparts = [m.bound, v.bound]
    fparts = [SIGNED_MAP.table, UNSIGNED_MAP.table] + fparts
    foffs = np.cumsum([0] + [x.size for x in fparts])[:-1].tolist()
    ioffs = np.cumsum([0] + [x.size for x in iparts])[:-1].tolist()
    f = np.concatenate(fparts).astype(np.float32)
    i = np.concatenate(iparts).astype(np.int32)
    return jnp.asarray(f), jnp.asarray(i), foffs, ioffs


def _q8_kernel(*refs, n, has_p, inplace, load_mode):
    (s_ref, f_ref, i_ref, p_ref, g_ref, mc_ref, ma_ref, vc_ref, va_ref,
     out_ref, mc_out, ma_out, vc_out, va_out) = _q8_refs(refs, inplace, has_p)
    b = pl.program_id(0)
    idx = b * QBLOCK + (jnp.arange(QBLOCK // 4) * 4)[:, None] + jnp.arange(4)[None, :]
    mask = None if n % QBLOCK == 0 else idx < n  # no mask when the blocks are full (n is static)
    s = _scalars(s_ref)
    _, _, foffs, ioffs = _q8_tables()

    def lookup(ref, offset):
        return lambda i: load(ref.at[i + offset], eviction_policy="evict_last")

    p = None if p_ref is None else _stream_load(p_ref, idx, mask, 0.0, load_mode).astype(jnp.float32)
    g = _stream_load(g_ref, idx, mask, 0.0, load_mode).astype(jnp.float32)
    mc = _stream_load(mc_ref, idx, mask, 0, load_mode).astype(jnp.int32)
    vc = _stream_load(vc_ref, idx, mask, 0, load_mode).astype(jnp.int32)
    m = lookup(f_ref, foffs[0])(mc) * ma_ref[b]
    v = lookup(f_ref, foffs[1])(vc) * va_ref[b]
    fm, fv = [[lookup(f_ref, o) for o in foffs[k:k + 4]] for k in (2, 6)]
    encoders = (lambda a: encode_binade(a, lookup(i_ref, ioffs[0]), *fm),
                lambda a: encode_binade(a, lookup(i_ref, ioffs[1]), *fv))
    u, ma_new, va_new, mc_new, vc_new = q8_step(g, m, v, p, s, mask, axis=None, encoders=encoders)
    # The grid covers whole blocks: codes are stored unmasked, the padding past the tensor's end included.
    store(mc_out.at[idx], mc_new.astype(jnp.uint8))
    store(vc_out.at[idx], vc_new.astype(jnp.uint8))
    ma_out[b] = ma_new
    va_out[b] = va_new
    out = p + u if inplace else u
    store(out_ref.at[idx], out.astype(out_ref.dtype), mask=mask)


@functools.partial(jax.jit, static_argnames=("inplace", "interpret", "launch", "u_dtype"))
def adam_q8(s, g, mc, ma, vc, va, p=None, *, inplace: bool, interpret: bool, launch: Launch | None = None,
            u_dtype=None):
    """Fused step for 8-bit blockwise states. g, p flat (n,); mc, vc uint8 (blocks*256,); ma, va (blocks,).

    Returns (update or p, mc, ma, vc, va); with inplace=True the outputs are written over p and the
    state operands (donate them under jit). One quantization block per program: `launch.block` must be QBLOCK
    (None: `default_launch("q8")`).
    """
    launch = launch or default_launch("q8")
    if launch.block != QBLOCK:
        raise ValueError(f"launch: the 8-bit kernel handles one block of {QBLOCK} elements per program, got "
                         f"block={launch.block}")
    n = g.shape[0]
    has_p = p is not None
    ftab, itab, _, _ = _q8_tables()
    operands, out_shape, aliases = _q8_launch_args((ftab, itab), s, g, mc, ma, vc, va, p, inplace, u_dtype)
    kernel = functools.partial(_q8_kernel, n=n, has_p=has_p, inplace=inplace, load_mode=launch.load_mode)
    return _backend.triton_call(
        kernel,
        out_shape=out_shape,
        grid=(ma.shape[0],),
        name="pallas_fused_adam8bit_step" if inplace else "pallas_fused_adam8bit_update",
        interpret=interpret,
        num_warps=launch.num_warps,
        input_output_aliases=aliases,
    )(*operands)


def scalar_operand(values) -> jax.Array:
    """Pack the runtime scalars (see reference.py) into the kernel's fp32 operand."""
    return jnp.stack([jnp.asarray(x, jnp.float32).reshape(()) for x in values])

