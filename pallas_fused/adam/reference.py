"""Plain-jnp ground truth for the fused Adam(W) step, and the 8-bit blockwise state codec.

Everything here is ordinary jax.numpy: it is the "xla" implementation, and the Pallas kernels call the
same small element functions (`adam_math`, `encode`) so that the two cannot drift apart in formula.
(The formulas themselves are checked against optax in tests/adam.)

The scalar operand. Every runtime hyperparameter travels as one fp32 vector `s` of `NUM_SCALARS`:

    s = [-lr, b1, 1 - b1, b2, 1 - b2, eps, eps_root, weight_decay, 1 - b1**t, 1 - b2**t]

`1 - b1` and the bias corrections are computed by the caller exactly as optax computes them, so the
numbers match optax to the bit in fp32. A pure Adam direction (optax.scale_by_adam) uses -lr = 1.

The 8-bit codec (bitsandbytes-style "dynamic" maps). A moment is cut into blocks of 256 elements; each
block stores its absmax in fp32 and each element one byte: the index of the nearest value of a fixed
map to `x / absmax`. The maps follow bitsandbytes' `create_dynamic_map`: decade d covers
[10**(d-7), 10**(d-6)] with values spaced linearly inside the decade, more values in the upper
decades; so small and large magnitudes both keep ~2-3 significant digits.

- unsigned (second moment v): 0, decades 0..6 with 2, 4, ..., 128 values, 1.0 (256 codes; exactly
  the bitsandbytes unsigned map).
- signed (first moment m): a sign bit and 128 magnitudes: 0, decades 1..6 with 2, ..., 64 values,
  1.0. This is bitsandbytes' signed map with its single 1e-6 value replaced by an exact zero and
  made symmetric (bitsandbytes lacks -1.0), so a block's extreme element is stored exactly.

Encoding is arithmetic (no search): the decade is found by comparing with the fixed midpoints between
decades, the index inside it by one multiply-add and a floor; decoding is a 256-entry table lookup.
`encode` is the definition; `encode_binade` computes the same codes (bit for bit) with five small table
lookups instead of a compare-and-select chain per decade, for the kernel (see `BinadeTables`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

NUM_SCALARS = 10
QBLOCK = 256  # elements per quantization block
MIN_QUANTIZED_SIZE = 4096  # smaller tensors keep fp32 moments (as bitsandbytes / torchao do)


# ----------------------------------------------------------------------------------------------
# Adam math, one element at a time (fp32 in, fp32 out)


def adam_math(g, m, v, p, s, *, fast=False):
    """One Adam(W) step on fp32 values. Returns (update, m_new, v_new, ok).

    `update` already includes -lr and the decoupled weight decay (when `p` is given), in optax's
    order of operations: u = -lr * (mhat / (sqrt(vhat + eps_root) + eps) + wd * p).
    `ok` is False where the new moments are not finite (a non-finite gradient, or g*g overflowing):
    callers keep the old parameter and moments there, so a bad gradient never poisons the state.
    fast=True (the 8-bit kernels, whose quantization error dwarfs an ulp) trades ulps for instructions:
    the bias corrections are multiplied by their reciprocals (computed once per program), the
    division by d = sqrt(vhat + eps_root) + eps is a multiply by rsqrt(d * d) (a few ulps; Triton's
    fp32 division is ~8 instructions with its range fix-ups), and one test v_new + |m_new| < inf
    replaces the two finiteness tests (v_new >= 0; the sum overflows only where the moments are ~1e38,
    where skipping the step is as good).
    """
    neg_lr, b1, omb1, b2, omb2, eps, eps_root, wd, bc1, bc2 = (s[i] for i in range(NUM_SCALARS))
    m_new = omb1 * g + b1 * m
    v_new = omb2 * (g * g) + b2 * v
    if fast:
        d = jnp.sqrt(v_new * (1.0 / bc2) + eps_root) + eps
        u = (m_new * (1.0 / bc1)) * jax.lax.rsqrt(d * d)
        ok = v_new + jnp.abs(m_new) < jnp.inf
    else:
        u = (m_new / bc1) / (jnp.sqrt(v_new / bc2 + eps_root) + eps)
        # |x| < inf is isfinite(x) (NaN compares false) in two instructions; Triton lowers isfinite to ~10.
        ok = (jnp.abs(m_new) < jnp.inf) & (jnp.abs(v_new) < jnp.inf)
    if p is not None:
        u = u + wd * p
    u = neg_lr * u
    return u, m_new, v_new, ok


def _f32(x):
    return x.astype(jnp.float32)


def adam_leaf_reference(g, m, v, s, p=None, *, inplace=False, u_dtype=None):
    """The fp32-state leaf step in jnp: (update or new param, new m, new v) in the callers' dtypes.

    inplace=False returns the update (in u_dtype, default the grad's); inplace=True returns p + update
    rounded once to p's dtype. Elements whose new moments would be non-finite keep p, m and v (update 0).
    """
    u, m_new, v_new, ok = adam_math(_f32(g), _f32(m), _f32(v), None if p is None else _f32(p), s)
    m_out = jnp.where(ok, m_new, _f32(m)).astype(m.dtype)
    v_out = jnp.where(ok, v_new, _f32(v)).astype(v.dtype)
    u = jnp.where(ok, u, 0.0)
    if inplace:
        return (_f32(p) + u).astype(p.dtype), m_out, v_out
    return u.astype(u_dtype or g.dtype), m_out, v_out


# ----------------------------------------------------------------------------------------------
# The dynamic maps


class DynamicMap(NamedTuple):
    """A magnitude map: per decade (count n, first code, scale); plus the fixed tables."""

    signed: bool
    table: np.ndarray  # (256,) fp32: the value of each byte code
    # Encoding constants, one row per decade (lowest first): lower boundary (fp32 midpoint to the
    # decade below; the first row's is the midpoint to zero), A, C, lo, hi with
    # code = min(floor(a * A + C), hi) (>= lo by construction).
    bounds: tuple[float, ...]
    coef_a: tuple[float, ...]
    coef_c: tuple[float, ...]
    lo: tuple[int, ...]
    hi: tuple[int, ...]
    one_bound: float  # a >= one_bound encodes as 1.0
    one_code: int


def _make_map(signed: bool) -> DynamicMap:
    decades = range(1, 7) if signed else range(7)
    first = 1  # code 0 is zero
    values = [0.0]
    bounds, coef_a, coef_c, lo, hi = [], [], [], [], []
    for d in decades:
        n = 2**d if signed else 2 ** (d + 1)
        scale = 10.0 ** (d - 6)
        step = scale * 0.9 / n  # spacing of the values inside the decade
        start = scale * (0.1 + 0.45 / n)  # its first value
        bounds.append((values[-1] + start) / 2)
        # nearest k: floor((a - start) / step + 0.5); the code is first + k
        coef_a.append(1.0 / step)
        coef_c.append(first + 0.5 - start / step)
        lo.append(first)
        hi.append(first + n - 1)
        values += [start + k * step for k in range(n)]
        first += n
    one_bound = (values[-1] + 1.0) / 2
    values.append(1.0)
    assert len(values) == (128 if signed else 256), len(values)
    mags = np.asarray(values, np.float64)
    table = np.concatenate([mags, -mags]) if signed else mags
    f32 = lambda xs: tuple(float(np.float32(x)) for x in xs)  # noqa: E731
    return DynamicMap(signed, table.astype(np.float32), f32(bounds), f32(coef_a), f32(coef_c),
                      tuple(lo), tuple(hi), float(np.float32(one_bound)), len(values) - 1)


SIGNED_MAP = _make_map(signed=True)
UNSIGNED_MAP = _make_map(signed=False)


def encode(a, dmap: DynamicMap):
    """Byte code (int32) of the map value nearest to each magnitude `a` in [0, 1] (fp32)."""
    coef_a = jnp.full_like(a, dmap.coef_a[0])
    coef_c = jnp.full_like(a, dmap.coef_c[0])
    hi = jnp.full(a.shape, dmap.hi[0], jnp.int32)
    for i in range(1, len(dmap.bounds)):
        up = a >= dmap.bounds[i]
        coef_a = jnp.where(up, dmap.coef_a[i], coef_a)
        coef_c = jnp.where(up, dmap.coef_c[i], coef_c)
        hi = jnp.where(up, dmap.hi[i], hi)
    # No lower clip: at a decade's lower boundary a * A + C is already >= 0.2 (the midpoint to the decade
    # below lies 0.3 of a step under the first value); the upper boundary lies 1.5 steps over the last.
    code = jnp.minimum(jnp.floor(a * coef_a + coef_c).astype(jnp.int32), hi)
    code = jnp.where(a < dmap.bounds[0], 0, code)
    return jnp.where(a >= dmap.one_bound, dmap.one_code, code)


def encode_signed(x, inv_absmax, dmap: DynamicMap):
    """Codes of x * inv_absmax (signed map: sign in bit 7; unsigned map: x must be >= 0)."""
    a = jnp.abs(x) * inv_absmax
    code = encode(a, dmap)
    if dmap.signed:
        code = jnp.where(x < 0, code + 128, code)
    return code


# ----------------------------------------------------------------------------------------------
# The same encoder by table lookups (for the kernel)


class SegmentTables(NamedTuple):
    """`encode` as a piecewise-linear function of `a` (the step from which `BinadeTables` are built).

    The boundaries of `encode` (bounds[0], the decade bounds, one_bound) cut [0, 1] into segments
    s = 0 (code 0), 1.. (one per decade), last (code one_code). Segment s has code
    min(floor(a * coef_a[s] + coef_c[s]), (2 << s) - 2), the same constants and rounding as `encode`
    (segment 0 and the last have coef_a = 0; the clip (2 << s) - 2 is each decade's last code).
    No binade [2**e, 2**(e+1)) holds two boundaries, so the segment of `a` is found from its fp32 bits:
    `binade[e]` packs the segment of the binade's start (bits 24..31) and the mantissa bits of the one
    boundary inside it (bits 0..23; 2**23, never reached, if none): s = (t >> 24) + (mantissa >= (t & 0xFFFFFF)).
    """

    binade: np.ndarray  # (256,) int32, indexed by the biased exponent of a
    coef_a: np.ndarray  # (16,) fp32, indexed by segment (zero padded)
    coef_c: np.ndarray  # (16,) fp32


def _segment_tables(dmap: DynamicMap) -> SegmentTables:
    cuts = [int(np.float32(b).view(np.uint32)) for b in (*dmap.bounds, dmap.one_bound)]
    binade = np.zeros(256, np.int64)
    for e in range(256):
        start, stop = e << 23, (e + 1) << 23
        inside = [c for c in cuts if start < c < stop]
        assert len(inside) <= 1, (e, inside)
        below = sum(c <= start for c in cuts)
        binade[e] = (below << 24) | ((inside[0] & 0x7FFFFF) if inside else 1 << 23)
    coef_a = np.zeros(16, np.float32)
    coef_c = np.zeros(16, np.float32)
    nseg = len(cuts) + 1
    coef_a[1:nseg - 1] = dmap.coef_a
    coef_c[1:nseg - 1] = dmap.coef_c
    coef_c[nseg - 1] = dmap.one_code
    # the clip (2 << s) - 2 is each decade's last code, and no clip for the first and last segments
    assert [(2 << s) - 2 for s in range(1, nseg - 1)] == list(dmap.hi)
    assert (2 << (nseg - 1)) - 2 >= dmap.one_code
    return SegmentTables(binade.astype(np.int32), coef_a, coef_c)




def table_lookups(tables):
    """The lookups of `encode_binade` (one per table of the NamedTuple) by jnp indexing."""

    def lookup(table):
        table = jnp.asarray(table)
        return lambda i: table[i]

    return tuple(lookup(t) for t in tables)


class BinadeTables(NamedTuple):
    """`encode_signed(x, inv_absmax, dmap)` as lookups indexed by the binade of a = x * inv_absmax (its
    fp32 sign and exponent bits, e = bits >> 23, 0..511) and by which side of the one segment boundary
    inside that binade (`SegmentTables`) it lies: i = 2 e + (bits >= bound[e], unsigned). Row i holds its
    segment's coef_a (negated for negative a, so a * coef_a is |a| * A exactly), coef_c, top (the clip, as
    fp32) and magic = 2**23 (+ 128 for negative a with the signed map): floor(t) clipped plus magic is an
    fp32 whose low byte is the code, sign bit included. No abs, no integer conversion, one compare.
    Negative a with the unsigned map (never produced: v >= 0) gets code 0; so do -0 and negative
    denormals with the signed map (as `encode_signed` on XLA:CPU, which treats denormals as zero)."""

    bound: np.ndarray  # (512,) uint32 as int32: bits of the boundary inside binade e, or of the next binade
    coef_a: np.ndarray  # (1024,) fp32
    coef_c: np.ndarray  # (1024,) fp32
    top: np.ndarray  # (1024,) fp32
    magic: np.ndarray  # (1024,) fp32


def _binade_tables(dmap: DynamicMap, seg: SegmentTables) -> BinadeTables:
    bound = np.zeros(512, np.uint32)
    coef_a, coef_c, top = (np.zeros(1024, np.float32) for _ in range(3))
    magic = np.full(1024, 2.0**23, np.float32)
    tops = [(2 << s) - 2 for s in range(16)]
    tops[int(np.count_nonzero(seg.coef_a)) + 1] = dmap.one_code  # the last segment: its code is coef_c
    for e in range(512):
        neg, exp = e >> 8, e & 255
        t = int(seg.binade[exp])
        below, thr = t >> 24, t & 0xFFFFFF
        bits = (exp << 23) | thr if thr < (1 << 23) else min((exp + 1) << 23, 0x80000000)
        bound[e] = bits | (neg << 31)
        if neg and not dmap.signed:
            continue  # code 0
        for up in (0, 1):
            s_ = min(below + up, 15)
            i = 2 * e + up
            coef_a[i] = -seg.coef_a[s_] if neg else seg.coef_a[s_]
            coef_c[i], top[i] = seg.coef_c[s_], tops[s_]
            magic[i] += 128 * (neg and exp > 0)  # -0 and negative denormals: code 0, as x < 0 is False (DAZ)
    return BinadeTables(bound.view(np.int32), coef_a, coef_c, top, magic)


SIGNED_BINADES = _binade_tables(SIGNED_MAP, _segment_tables(SIGNED_MAP))
UNSIGNED_BINADES = _binade_tables(UNSIGNED_MAP, _segment_tables(UNSIGNED_MAP))


def encode_binade(a, bound, coef_a, coef_c, top, magic):
    """`encode_signed` of a = x * inv_absmax (fp32, |a| <= 1) from the map's `BinadeTables`, bit for bit.

    The five arguments are lookups (functions from an int32 index array to the table's values)."""
    bits = jax.lax.bitcast_convert_type(a, jnp.uint32)
    e = jax.lax.shift_right_logical(bits, jnp.uint32(23)).astype(jnp.int32)
    up = bits >= jax.lax.bitcast_convert_type(bound(e), jnp.uint32)
    i = 2 * e + up.astype(jnp.int32)
    code = jnp.minimum(jnp.floor(a * coef_a(i) + coef_c(i)), top(i)) + magic(i)
    return jax.lax.bitcast_convert_type(code, jnp.int32) & 0xFF


def block_inv_absmax(absmax):
    """1 / absmax, and 0 for an all-zero block (its codes are then all 0, the value zero)."""
    return jnp.where(absmax > 0, 1.0 / jnp.where(absmax > 0, absmax, 1.0), 0.0)


def num_blocks(n: int) -> int:
    return -(-n // QBLOCK)


def quantize_blockwise(x, signed: bool):
    """Flatten and quantize `x` (any shape, n elements): (codes uint8 (blocks*256,), absmax fp32 (blocks,))."""
    dmap = SIGNED_MAP if signed else UNSIGNED_MAP
    flat = x.reshape(-1).astype(jnp.float32)
    n = flat.shape[0]
    nb = num_blocks(n)
    blocks = jnp.pad(flat, (0, nb * QBLOCK - n)).reshape(nb, QBLOCK)
    absmax = jnp.max(jnp.abs(blocks), axis=1)
    codes = encode_signed(blocks, block_inv_absmax(absmax)[:, None], dmap)
    return codes.astype(jnp.uint8).reshape(-1), absmax


def dequantize_blockwise(codes, absmax, shape, signed: bool):
    """Inverse of `quantize_blockwise` (up to the map's rounding): fp32 array of `shape`."""
    table = jnp.asarray((SIGNED_MAP if signed else UNSIGNED_MAP).table)
    n = int(np.prod(shape))
    vals = table[codes.astype(jnp.int32)].reshape(-1, QBLOCK) * absmax[:, None]
    return vals.reshape(-1)[:n].reshape(shape)


def q8_step(g, m, v, p, s, valid, *, axis=1, encoders=(None, None)):
    """The 8-bit step on fp32 tiles, shared by the kernels and the reference: Adam on the dequantized
    moments (elements whose new moments are not finite keep the old ones, update 0), then each block's
    new absmax and codes. `valid` masks elements past the tensor's end (None: all valid). A block is a
    row of a (blocks, 256) tile (axis=1) or the whole tile (axis=None). encoders: for m and v, a function of
    x * inv_absmax that replaces `encode_signed` (the kernel's `encode_binade` with its table loads; None:
    `encode_signed`).
    Returns (update, m_absmax, v_absmax, m_codes, v_codes); codes are int32, absmaxes (blocks,) or scalars."""
    u, m_new, v_new, ok = adam_math(g, m, v, p, s, fast=True)
    if valid is not None:
        ok = ok & valid
        m, v = jnp.where(valid, m, 0.0), jnp.where(valid, v, 0.0)
    m_new = jnp.where(ok, m_new, m)
    v_new = jnp.where(ok, v_new, v)
    u = jnp.where(ok, u, 0.0)
    keep = axis is not None
    ma_new = jnp.max(jnp.abs(m_new), axis=axis, keepdims=keep)
    va_new = jnp.max(v_new, axis=axis, keepdims=keep)
    codes = []
    for x, absmax, dmap, encoder in ((m_new, ma_new, SIGNED_MAP, encoders[0]), (v_new, va_new, UNSIGNED_MAP,
                                                                                encoders[1])):
        inv = block_inv_absmax(absmax)
        codes.append(encode_signed(x, inv, dmap) if encoder is None else encoder(x * inv))
    mc_new, vc_new = codes
    if keep:
        ma_new, va_new = ma_new.squeeze(axis), va_new.squeeze(axis)
    return u, ma_new, va_new, mc_new, vc_new


def adam_leaf_reference_q8(g, mc, ma, vc, va, s, p=None, *, inplace=False, u_dtype=None):
    """The 8-bit-state leaf step in jnp (dequantize, step, requantize), mirroring the kernel.

    Returns (update or new param, m_codes, m_absmax, v_codes, v_absmax).
    """
    shape = g.shape
    n = g.size
    nb = ma.shape[0]
    pad = nb * QBLOCK - n

    def blocks(x):
        return jnp.pad(_f32(x).reshape(-1), (0, pad)).reshape(nb, QBLOCK)

    valid = (jnp.arange(nb * QBLOCK) < n).reshape(nb, QBLOCK)
    sm, um = jnp.asarray(SIGNED_MAP.table), jnp.asarray(UNSIGNED_MAP.table)
    m = sm[mc.astype(jnp.int32).reshape(nb, QBLOCK)] * ma[:, None]
    v = um[vc.astype(jnp.int32).reshape(nb, QBLOCK)] * va[:, None]
    pb = None if p is None else blocks(p)
    u, ma_new, va_new, mc_new, vc_new = q8_step(blocks(g), m, v, pb, s, valid)
    # Codes are written for whole blocks, the padding past the tensor's end included (as the kernel does).
    mc_new = mc_new.astype(jnp.uint8).reshape(-1)
    vc_new = vc_new.astype(jnp.uint8).reshape(-1)
    u = u.reshape(-1)[:n].reshape(shape)
    if inplace:
        out = (_f32(p) + u).astype(p.dtype)
    else:
        out = u.astype(u_dtype or g.dtype)
    return out, mc_new, ma_new, vc_new, va_new

