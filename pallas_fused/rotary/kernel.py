"""The fused rotary kernel: q and k in one Pallas (Triton-lowered) call, cos/sin computed in-kernel.

One program handles a block of `block_tokens` consecutive tokens of one batch row (and, when a token's
heads do not fit one tile, a slice of its heads: `num_chunks` > 1). It loads the block's positions,
computes angle = position * inv_freq and cos/sin in fp32 once, and applies them to all q heads and all
k heads of those tokens: the sin/cos work is shared by Hq + Hk heads, and q and k cost one launch.

Masked-off lanes are loaded without an `other` value (their contents are never stored), which also keeps
the loads free of constant-type conversions in the Triton lowering.

Rotary pairs are addressed by a pair index i < rotary_dim/2 (padded to a power of two and masked, since
every in-kernel array dimension must be a power of two): x[i] and x[i + rotary_dim/2] (half-split) or
x[2i] and x[2i+1] (interleaved). Features from rotary_dim to head_dim are copied.

Layouts: refs keep their 4-D shape and are indexed with broadcast index arrays, so "bshd" and "bhsd"
are the same kernel with the (s, h) index order swapped: no transpose is ever made.

The backward pass is the same kernel with sin negated (the conjugate rotation; `sign=-1`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_fused import _backend

# Elements (q and k, all features) one program holds at once; 16K keeps a tile in registers at 8 warps.
DEFAULT_TILE_ELEMENTS = 16384


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def _prev_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n).bit_length() - 1)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Static launch geometry (chosen by `choose_config`; tests and benchmarks may pass their own)."""

    block_tokens: int  # tokens per program (power of two)
    q_heads: int  # q heads per program (power of two)
    k_heads: int  # k heads per program (power of two; 0 when k is None)
    num_chunks: int  # programs along the head axis
    num_warps: int


def choose_config(batch: int, seq_len: int, n_q_heads: int, n_k_heads: int, features_per_head: int,
                  num_sms: int, tile_elements: int = DEFAULT_TILE_ELEMENTS,
                  num_warps: int | None = None) -> LaunchConfig:
    """Pick tokens-per-program and heads-per-program so a tile holds about `tile_elements` elements
    and the grid has enough programs to fill the GPU (>= 4 per SM where the problem allows)."""

    def heads_for(n):
        return _next_pow2(_cdiv(n_q_heads, n)), (_next_pow2(_cdiv(n_k_heads, n)) if n_k_heads else 0)

    chunks = 1
    hq, hk = heads_for(chunks)
    while (hq + hk) * features_per_head > tile_elements and max(hq, hk) > 1:
        chunks *= 2
        hq, hk = heads_for(chunks)
    per_token = (hq + hk) * features_per_head
    bt = min(_next_pow2(seq_len), _prev_pow2(max(tile_elements // per_token, 1)), 64)

    def programs():
        return _cdiv(seq_len, bt) * batch * chunks

    while bt > 1 and programs() < 4 * num_sms:
        bt //= 2
    # Few tokens (decode): spread a token's heads over more programs instead.
    while programs() < 2 * num_sms and max(hq, hk) > 1 and chunks < max(n_q_heads, n_k_heads):
        chunks *= 2
        hq, hk = heads_for(chunks)
    tile = bt * (hq + hk) * features_per_head
    if num_warps is None:
        num_warps = 8 if tile >= 8192 else 4 if tile >= 1024 else 2 if tile >= 256 else 1
    return LaunchConfig(bt, hq, hk, chunks, num_warps)


def _kernel(*refs, seq_len, head_dim, rotary_dim, n_heads, has_k, layout, interleaved, pos_mode,
            scale, sign, cfg: LaunchConfig, pairs, passthrough):
    refs = list(refs)
    pos_ref = refs.pop(0) if pos_mode != "none" else None
    inv_ref = refs.pop(0)
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
    inv_freq = _backend.load(inv_ref.at[jnp.arange(pairs, dtype=jnp.int32)])  # zero-padded on the host
    angle = pos.astype(jnp.float32)[:, None] * inv_freq[None, :]  # fp32, as the reference
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    if sign < 0:
        sin = -sin
    cos, sin = cos[:, None, :], sin[:, None, :]  # (bt, 1, pairs): broadcast over heads

    i = jnp.arange(pairs, dtype=jnp.int32)[None, None, :]
    i_mask = (i < half) if pairs != half else None
    d1, d2 = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
    j = rotary_dim + jnp.arange(max(passthrough, 1), dtype=jnp.int32)[None, None, :]
    j_mask = (j < head_dim) if rotary_dim + passthrough != head_dim else None
    s3 = s[:, None, None]
    s_mask3 = None if s_mask is None else s_mask[:, None, None]

    def both(*masks):
        masks = [m for m in masks if m is not None]
        out = masks[0] if masks else None
        for m in masks[1:]:
            out = out & m
        return out

    def index(h3, d):
        return (b, s3, h3, d) if layout == "bshd" else (b, h3, s3, d)

    def load(x_ref, total_heads, hb):
        h3 = (chunk * hb + jnp.arange(hb, dtype=jnp.int32))[None, :, None]
        row_mask = both(s_mask3, (h3 < total_heads) if cfg.num_chunks * hb != total_heads else None)
        mask, p_mask = both(row_mask, i_mask), both(row_mask, j_mask)
        x1 = _backend.load(x_ref.at[index(h3, d1)], mask=mask, eviction_policy="evict_first")
        x2 = _backend.load(x_ref.at[index(h3, d2)], mask=mask, eviction_policy="evict_first")
        xp = _backend.load(x_ref.at[index(h3, j)], mask=p_mask, eviction_policy="evict_first") if passthrough else None
        return h3, mask, p_mask, x1, x2, xp

    def rotate_and_store(o_ref, h3, mask, p_mask, x1, x2, xp):
        x1, x2 = x1.astype(jnp.float32), x2.astype(jnp.float32)
        _backend.store(o_ref.at[index(h3, d1)], (x1 * cos - x2 * sin).astype(o_ref.dtype), mask=mask)
        _backend.store(o_ref.at[index(h3, d2)], (x2 * cos + x1 * sin).astype(o_ref.dtype), mask=mask)
        if passthrough:
            _backend.store(o_ref.at[index(h3, j)], xp, mask=p_mask)

    # Every load is issued before any store: stores may alias loads as far as the compiler knows, so
    # this order is what lets all of a program's reads be in flight at once.
    q_tile = load(q_ref, n_heads[0], cfg.q_heads)
    k_tile = load(k_ref, n_heads[1], cfg.k_heads) if has_k else None
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
    pairs = _next_pow2(half)
    passthrough = _next_pow2(head_dim - rotary_dim) if head_dim > rotary_dim else 0
    if config is None:
        config = choose_config(batch, seq_len, n_q, n_k, 2 * pairs + passthrough, _backend.num_sms())
    pos_mode = "none" if positions is None else ("batched" if positions.ndim == 2 else "shared")
    inv = np.zeros((pairs,), np.float32)
    inv[:half] = np.asarray(inv_freq, np.float64).astype(np.float32)
    kernel = functools.partial(
        _kernel, seq_len=seq_len, head_dim=head_dim, rotary_dim=rotary_dim, n_heads=(n_q, n_k), has_k=has_k,
        layout=layout, interleaved=interleaved, pos_mode=pos_mode, scale=float(scale),
        sign=float(sign), cfg=config, pairs=pairs, passthrough=passthrough)
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    args = ([] if positions is None else [positions.astype(jnp.int32)]) + [jnp.asarray(inv), q]
    if has_k:
        out_shape.append(jax.ShapeDtypeStruct(k.shape, k.dtype))
        args.append(k)
    grid = (_cdiv(seq_len, config.block_tokens), batch, config.num_chunks)
    name = "pallas_fused_rotary_bwd" if sign < 0 else "pallas_fused_rotary_fwd"
    outs = _backend.triton_call(kernel, out_shape=tuple(out_shape), grid=grid, name=name, interpret=interpret,
                                num_warps=config.num_warps)(*args)
    return outs[0], (outs[1] if has_k else None)
