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
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

NUM_SCALARS = 10
QBLOCK = 256  # elements per quantization block
MIN_QUANTIZED_SIZE = 4096  # smaller tensors keep fp32 moments (as bitsandbytes / torchao do)


# ----------------------------------------------------------------------------------------------
# Adam math, one element at a time (fp32 in, fp32 out)


def adam_math(g, m, v, p, s, *, exact_division=True):
    """One Adam(W) step on fp32 values. Returns (update, m_new, v_new, ok).

    `update` already includes -lr and the decoupled weight decay (when `p` is given), in optax's
    order of operations: u = -lr * (mhat / (sqrt(vhat + eps_root) + eps) + wd * p).
    exact_division=False multiplies by the reciprocals of the bias corrections (computed once per
    program) instead of dividing each element: one ulp off optax, two divisions fewer per element;
    the 8-bit kernels use it (their quantization error dwarfs an ulp).
    `ok` is False where the new moments are not finite (a non-finite gradient, or g*g overflowing):
    callers keep the old parameter and moments there, so a bad gradient never poisons the state.
    """
    neg_lr, b1, omb1, b2, omb2, eps, eps_root, wd, bc1, bc2 = (s[i] for i in range(NUM_SCALARS))
    m_new = omb1 * g + b1 * m
    v_new = omb2 * (g * g) + b2 * v
    if exact_division:
        u = (m_new / bc1) / (jnp.sqrt(v_new / bc2 + eps_root) + eps)
    else:
        u = (m_new * (1.0 / bc1)) / (jnp.sqrt(v_new * (1.0 / bc2) + eps_root) + eps)
    if p is not None:
        u = u + wd * p
    u = neg_lr * u
    # |x| < inf is isfinite(x) (NaN compares false) in two instructions; Triton lowers isfinite to ~10.
    ok = (jnp.abs(m_new) < jnp.inf) & (jnp.abs(v_new) < jnp.inf)
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
    code = encode(jnp.abs(x) * inv_absmax, dmap)
    if dmap.signed:
        code = jnp.where(x < 0, code + 128, code)
    return code


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


def q8_step(g, m, v, p, s, valid):
    """The 8-bit step on (blocks, 256) fp32 tiles, shared by the kernel and the reference: Adam on the
    dequantized moments (elements whose new moments are not finite keep the old ones, update 0), then
    each block's new absmax and codes. `valid` masks elements past the tensor's end.
    Returns (update, m_absmax, v_absmax, m_codes, v_codes); codes are int32."""
    u, m_new, v_new, ok = adam_math(g, m, v, p, s, exact_division=False)
    ok = ok & valid
    m_new = jnp.where(ok, m_new, jnp.where(valid, m, 0.0))
    v_new = jnp.where(ok, v_new, jnp.where(valid, v, 0.0))
    u = jnp.where(ok, u, 0.0)
    ma_new = jnp.max(jnp.abs(m_new), axis=1)
    va_new = jnp.max(v_new, axis=1)
    mc_new = encode_signed(m_new, block_inv_absmax(ma_new)[:, None], SIGNED_MAP)
    vc_new = encode_signed(v_new, block_inv_absmax(va_new)[:, None], UNSIGNED_MAP)
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

