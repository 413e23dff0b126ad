"""The fused rotary kernel: q and k in one Pallas (Triton-lowered) call, cos/sin computed in-kernel.

One program handles a block of `block_tokens` consecutive tokens of one batch row (and, when a token's
heads do not fit one tile, a slice of its heads: `num_chunks` > 1). It loads the block's positions,
computes angle = position * inv_freq and cos/sin in fp32 once, and applies them to all q heads and all
k heads of those tokens: the sin/cos work is shared by Hq + Hk heads, and q and k cost one launch.

Masked-off lanes are loaded without an `other` value (their contents are never stored), which also keeps
the loads free of constant-type conversions in the Triton lowering.

Rotary pairs are addressed by a pair index i < rotary_dim/2 (padded to a power of two and masked, since
every in-kernel array dimension must be a power of two). Half-split: x[i] and x[i + rotary_dim/2] are two
contiguous loads. Interleaved: the leading rotary_dim features are one contiguous load, split into
even/odd in registers (reshape + unstack, Triton's split) and joined back for one contiguous store, so
both conventions move 16-byte vectors. Features from rotary_dim to head_dim are copied.

Why the tile is (tokens, heads, pairs) with ~4 tokens: Triton vectorizes along pairs, puts lanes on tokens
next and warps on heads (see `choose_config`), so each thread computes cos/sin for one (token, 8 pairs)
slice and reuses them for all of its heads of q and of k (checked in the generated PTX for sm_90: 8 sinf
and 8 cosf per thread for 80 elements, 16-byte loads and stores, no spills).

Layouts: refs keep their 4-D shape and are indexed with broadcast index arrays, so "bshd" and "bhsd"
are the same kernel with the (s, h) index order swapped: no transpose is ever made.

The backward pass is the same kernel with sin negated (the conjugate rotation; `sign=-1`).

Angles: position * inv_freq is reduced modulo 2 pi by `reference.reduced_angle` from exact fp32 products of
the position's three 11-bit parts with a per-frequency table (`reference.angle_table`, 6 rows of pairs floats
read by every program from L1/L2), so the angle is accurate to ~6e-7 rad at every int32 position (an fp32
product loses ~0.1 rad at position 2^20 and whole radians at 2^24). That costs ~24 fp32 ops per (token, pair)
(the position split is per token) in place of 1 multiply, shared by all Hq + Hk heads: for B4 S4096 Hq32 Hk8 D128
bf16, 64 x 24 ~ 1540 ops per token against 20 KiB of q/k read and written, 0.08 ops per byte (q alone, one head:
3 per byte), where an H200 issues ~7 fp32 instructions per byte of HBM bandwidth. trig="fast" drops its former
Cody-Waite reduction (~10 ops per pair) in exchange.

cos/sin (`LaunchConfig.trig`): "precise" is jnp.cos/jnp.sin, i.e. libdevice's cosf/sinf, which on the reduced
angle (|angle| <= pi) always take their fast path. "fast" uses the hardware sin.approx / cos.approx (MUFU,
absolute error ~5e-7 on [-pi, pi]). It is meant for bf16 / fp16 q and k, whose rounding (4e-3 / 5e-4) dwarfs
that error; fp32 inputs keep "precise". In interpret mode "fast" runs jnp.cos/jnp.sin.
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
from pallas_fused.rotary.reference import TABLE_ROWS, angle_table, reduced_angle

# Most elements (q and k tiles, all features) one thread holds: more spills registers (checked with ptxas
# for sm_90: 4 tokens x 40 heads x 128 features over 8 warps = 80 per thread uses 79 registers, no spills).
MAX_ELEMENTS_PER_THREAD = 96
# Whether choose_config picks trig="fast" for 16-bit q/k (see the module docstring); decided by the GPU sweep
# in benchmarks/bench_rotary.py. H200, B4 S4096 Hq32 Hk8 D128 bf16: fast + volatile loads fwd 0.094 ms, fwd+bwd
# 0.178 (precise + plain: 0.108 / 0.206; XLA 0.096 / 0.296); MHA B8 S2048: 0.144 / 0.278
# (benchmarks/results/nvidia_h200.json).
FAST_TRIG_16BIT = True
TRIGS = ("precise", "fast")
# How q/k are loaded. The kernel issues them before any math (see the comment at the loads); "plain" keeps
# that order in the sm_90 SASS. "evict_first" (this kernel's first default) lets LLVM sink the loads below
# the libdevice cos/sin branches (its cache-policy asm is free to move; seen in the PTX), so every program
# computed its cos/sin before its first q/k load left. "volatile" pins the loads in program order whatever
# the scheduler thinks (strong system-scope loads: L2, no L1, which data read once does not mind).
_LOAD_KW = {"evict_first": {"eviction_policy": "evict_first"}, "plain": {}, "volatile": {"volatile": True}}
LOAD_MODE = "volatile"


def _prev_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n).bit_length() - 1)


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Static launch geometry (chosen by `choose_config`; tests and benchmarks may pass their own)."""

    block_tokens: int  # tokens per program (power of two)
    q_heads: int  # q heads per program (power of two)
    k_heads: int  # k heads per program (power of two; 0 when k is None)
    num_chunks: int  # programs along the head axis
    num_warps: int
    trig: str = "precise"  # "precise" or "fast" cos/sin (see the module docstring)
    load_mode: str = LOAD_MODE  # q/k loads: "evict_first" hints, "plain", or "volatile" (see _LOAD_KW)


def choose_config(batch: int, seq_len: int, n_q_heads: int, n_k_heads: int, pairs: int, passthrough: int,
                  itemsize: int, num_sms: int, *, block_tokens: int | None = None,
                  num_warps: int | None = None, trig: str | None = None,
                  load_mode: str | None = None) -> LaunchConfig:
    """Pick the launch geometry.

    One token per program by default, with all of its q and k heads, so the token's cos/sin are computed
    once and serve every head; warps are chosen for ~32-64 elements per thread. Heads are split over
    programs (chunks) only when a tile would not fit in registers, or when the grid would not fill the
    GPU (decode). `itemsize` (the widest of q's and k's) picks trig: "fast" only for 16-bit q and k, and only
    when FAST_TRIG_16BIT is set (a "fast" request with fp32 falls back to "precise").
    """
    fast_ok = itemsize <= 2
    trig = ("fast" if FAST_TRIG_16BIT and fast_ok else "precise") if trig is None else trig
    if trig not in TRIGS:
        raise ValueError(f"trig: expected one of {TRIGS}, got {trig!r}")
    trig = trig if fast_ok else "precise"
    load_mode = load_mode or LOAD_MODE
    if load_mode not in _LOAD_KW:
        raise ValueError(f"load_mode: expected one of {tuple(_LOAD_KW)}, got {load_mode!r}")
    # Measured on an H200 (a tile sweep of this kernel, B4 S4096 Hq32 Hk8 D128 bf16): one token per program ran
    # 2.7x faster than 4 tokens x 8 warps (0.10 vs 0.27 ms fwd, B4 S4096 Hq32 Hk8 D128 bf16); with one
    # token, 4 warps beat 2 there (40 elements per thread) and 8 beat 4 for Hq=Hk=32 (32 per thread).
    bt = block_tokens or 1
    bt = min(bt, next_pow2(seq_len))
    features = 2 * pairs + passthrough

    def heads_for(n):
        return next_pow2(cdiv(n_q_heads, n)), (next_pow2(cdiv(n_k_heads, n)) if n_k_heads else 0)

    def programs():
        return cdiv(seq_len, bt) * batch * chunks

    warps = num_warps or 8
    chunks = 1
    hq, hk = heads_for(chunks)
    while bt * (hq + hk) * features > MAX_ELEMENTS_PER_THREAD * 32 * warps and max(hq, hk) > 1:
        chunks *= 2
        hq, hk = heads_for(chunks)
    while block_tokens is None and bt > 1 and programs() < 4 * num_sms:
        bt //= 2
    # Few tokens (decode): spread a token's heads over more programs instead.
    while programs() < 2 * num_sms and max(hq, hk) > 1 and chunks < max(n_q_heads, n_k_heads):
        chunks *= 2
        hq, hk = heads_for(chunks)
    if num_warps is None:  # ~32-64 elements per thread (see the measurement above)
        while warps > 1 and bt * (hq + hk) * features < 32 * 32 * warps:
            warps //= 2
    return LaunchConfig(bt, hq, hk, chunks, warps, trig, load_mode)


def _sincos(angle, trig: str, interpret: bool):
    """(cos, sin) of an fp32 angle tensor in [-pi, pi]."""
    if trig == "precise" or interpret:
        return jnp.cos(angle), jnp.sin(angle)

    def approx(op):
        return _backend.pl_triton.elementwise_inline_asm(
            f"{op}.approx.ftz.f32 $0, $1;", args=[angle], constraints="=f,f", pack=1,
            result_shape_dtypes=[jax.ShapeDtypeStruct(angle.shape, jnp.float32)])[0]

    return approx("cos"), approx("sin")


def _kernel(*refs, seq_len, head_dim, rotary_dim, n_heads, has_k, layout, interleaved, pos_mode,
            scale, sign, cfg: LaunchConfig, pairs, passthrough, interpret):
    refs = list(refs)
    pos_ref = refs.pop(0) if pos_mode != "none" else None
    table_ref = refs.pop(0)
    if has_k:
        q_ref, k_ref, oq_ref, ok_ref = refs
    else:
        (q_ref, oq_ref), k_ref, ok_ref = refs, None, None
    bt = cfg.block_tokens
    s_blk, b, chunk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    half = rotary_dim // 2

    s = s_blk * bt + jnp.arange(bt, dtype=jnp.int32)
    s_mask = (s < seq_len) if seq_len % bt else None
    if pos_mode == "none":  # positions = arange(S): nothing to read
        pos = s
    else:
        pos = _backend.load(pos_ref.at[(b, s) if pos_mode == "batched" else (s,)], mask=s_mask)
    # The angle table's rows (zero-padded to `pairs` on the host), each broadcast over the block's tokens.
    rows = [_backend.load(table_ref.at[r * pairs + jnp.arange(pairs, dtype=jnp.int32)])[None, :]
            for r in range(TABLE_ROWS)]

    def at(v, axis, ndim):
        """1-D `v` placed on `axis` of an ndim-D broadcastable array (None stays None)."""
        return None if v is None else v[(None,) * axis + (slice(None),) + (None,) * (ndim - axis - 1)]

    def both(*masks):
        masks = [m for m in masks if m is not None]
        out = masks[0] if masks else None
        for m in masks[1:]:
            out = out & m
        return out

    def index(h, d, ndim):
        s_, h_ = at(s, 0, ndim), at(h, 1, ndim)
        return (b, s_, h_, d) if layout == "bshd" else (b, h_, s_, d)

    pair = jnp.arange(pairs, dtype=jnp.int32)
    pair_mask = (pair < half) if pairs != half else None
    j = rotary_dim + jnp.arange(max(passthrough, 1), dtype=jnp.int32)
    j_mask = (j < head_dim) if rotary_dim + passthrough != head_dim else None
    if interleaved:
        # Load the rotated features as one contiguous (tokens, heads, 2 * pairs) tile (16-byte vectors), then
        # split even/odd in registers (reshape + unstack: Triton's split) and join them back for the store.
        rot = jnp.arange(2 * pairs, dtype=jnp.int32)
        rot_d, rot_mask = at(rot, 2, 3), at((rot < rotary_dim) if pairs != half else None, 2, 3)
    else:
        x1_d, x2_d = at(pair, 2, 3), at(pair, 2, 3) + half
        rot_mask = at(pair_mask, 2, 3)

    hint = _LOAD_KW[cfg.load_mode]

    def load(x_ref, total_heads, hb):
        h = chunk * hb + jnp.arange(hb, dtype=jnp.int32)
        h_mask = (h < total_heads) if cfg.num_chunks * hb != total_heads else None
        mask = both(at(s_mask, 0, 3), at(h_mask, 1, 3), rot_mask)
        if interleaved:
            xs = (_backend.load(x_ref.at[index(h, rot_d, 3)], mask=mask, **hint),)
        else:
            xs = tuple(_backend.load(x_ref.at[index(h, d, 3)], mask=mask, **hint) for d in (x1_d, x2_d))
        p_mask = both(at(s_mask, 0, 3), at(h_mask, 1, 3), at(j_mask, 2, 3))
        xp = None
        if passthrough:
            xp = _backend.load(x_ref.at[index(h, at(j, 2, 3), 3)], mask=p_mask, **hint)
        return h, mask, p_mask, xs, xp

    def rotate_and_store(o_ref, h, mask, p_mask, xs, xp):
        if interleaved:
            x = xs[0].astype(jnp.float32)
            tile = x.shape[:2]
            x1, x2 = jax.lax.unstack(x.reshape(*tile, pairs, 2), axis=3)
            out = jax.lax.stack([x1 * cos3 - x2 * sin3, x2 * cos3 + x1 * sin3], axis=3).reshape(*tile, 2 * pairs)
            _backend.store(o_ref.at[index(h, rot_d, 3)], out.astype(o_ref.dtype), mask=mask)
        else:
            x1, x2 = xs[0].astype(jnp.float32), xs[1].astype(jnp.float32)
            _backend.store(o_ref.at[index(h, x1_d, 3)], (x1 * cos3 - x2 * sin3).astype(o_ref.dtype), mask=mask)
            _backend.store(o_ref.at[index(h, x2_d, 3)], (x2 * cos3 + x1 * sin3).astype(o_ref.dtype), mask=mask)
        if passthrough:
            _backend.store(o_ref.at[index(h, at(j, 2, 3), 3)], xp, mask=p_mask)

    # Every load is issued before any store: stores may alias loads as far as the compiler knows, so
    # this order is what lets all of a program's reads be in flight at once. The loads also come before the
    # cos/sin code: libdevice's sinf/cosf branch (to their slow path), and ptxas does not hoist loads above
    # those branches, so loading after them (as this kernel once did) made every program wait for its cos/sin
    # before its first q/k load left (seen in the sm_90 SASS). k before q: with GQA the k tile has its own
    # layout, and ptxas scheduled k's loads after q's cos/sin math when they came second (with trig="fast");
    # in this order every load of the program is issued before any math.
    k_tile = load(k_ref, n_heads[1], cfg.k_heads) if has_k else None
    q_tile = load(q_ref, n_heads[0], cfg.q_heads)
    angle = reduced_angle(pos[:, None], rows)  # as the reference: exact reduction, |angle| <= pi
    cos, sin = _sincos(angle, cfg.trig, interpret)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    if sign < 0:
        sin = -sin
    cos3, sin3 = cos[:, None, :], sin[:, None, :]  # (bt, 1, pairs): broadcast over heads
    rotate_and_store(oq_ref, *q_tile)
    if has_k:
        rotate_and_store(ok_ref, *k_tile)


def rotary_pallas(q, k, positions, inv_freq: np.ndarray, *, rotary_dim: int, interleaved: bool, layout: str,
                  scale: float = 1.0, sign: float = 1.0, interpret: bool = False,
                  config: LaunchConfig | None = None):
    """Rotate q and k (k may be None) in one pallas_call; returns (q_rot, k_rot).

    q: (B, S, Hq, D) for layout "bshd" or (B, Hq, S, D) for "bhsd"; k likewise with Hk heads.
    positions: int32 (S,) or (B, S), or None for arange(S) (then nothing is read).
    inv_freq: host float array of rotary_dim // 2 frequencies.
    scale multiplies cos and sin (YaRN's attention factor); sign=-1 gives the inverse rotation.
    Arguments are assumed validated (see api.py).
    """
    if layout == "bshd":
        batch, seq_len, n_q, head_dim = q.shape
    else:
        batch, n_q, seq_len, head_dim = q.shape
    has_k = k is not None
    n_k = 0 if k is None else (k.shape[2] if layout == "bshd" else k.shape[1])
    half = rotary_dim // 2
    pairs = next_pow2(half)
    passthrough = next_pow2(head_dim - rotary_dim) if head_dim > rotary_dim else 0
    if config is None:
        itemsize = max(q.dtype.itemsize, k.dtype.itemsize if has_k else 0)
        config = choose_config(batch, seq_len, n_q, n_k, pairs, passthrough, itemsize, _backend.num_sms())
    if config.trig == "fast" and max(q.dtype.itemsize, k.dtype.itemsize if has_k else 0) > 2:
        config = dataclasses.replace(config, trig="precise")  # fp32 outputs would see the approximation
    pos_mode = "none" if positions is None else ("batched" if positions.ndim == 2 else "shared")
    table = np.zeros((TABLE_ROWS, pairs), np.float32)
    table[:, :half] = angle_table(inv_freq)
    kernel = functools.partial(
        _kernel, seq_len=seq_len, head_dim=head_dim, rotary_dim=rotary_dim, n_heads=(n_q, n_k), has_k=has_k,
        layout=layout, interleaved=interleaved, pos_mode=pos_mode, scale=float(scale),
        sign=float(sign), cfg=config, pairs=pairs, passthrough=passthrough, interpret=interpret)
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    args = ([] if positions is None else [positions.astype(jnp.int32)]) + [jnp.asarray(table.reshape(-1)), q]
    if has_k:
        out_shape.append(jax.ShapeDtypeStruct(k.shape, k.dtype))
        args.append(k)
    grid = (cdiv(seq_len, config.block_tokens), batch, config.num_chunks)
    name = "pallas_fused_rotary_bwd" if sign < 0 else "pallas_fused_rotary_fwd"
    outs = _backend.triton_call(kernel, out_shape=tuple(out_shape), grid=grid, name=name, interpret=interpret,
                                num_warps=config.num_warps)(*args)
    return outs[0], (outs[1] if has_k else None)
