"""Rotary position embeddings: the frequency-scaling specs and the plain-jnp reference.

Conventions (GPT-NeoX / Hugging Face):

    inv_freq[i] = base ** (-2 i / rotary_dim),  i < rotary_dim / 2         (then rescaled by a `RotaryScaling`)
    angle[t, i] = position[t] * inv_freq[i]      reduced modulo 2 pi without rounding error (`reduced_angle`)
    pair i      = (x[i], x[i + rotary_dim/2])   half-split (GPT-NeoX, Llama; interleaved=False)
                = (x[2i], x[2i + 1])            interleaved (GPT-J; interleaved=True)
    (x1, x2)   -> m * (x1 cos - x2 sin, x2 cos + x1 sin)                     m = attention factor (1 except YaRN)

Features at and past `rotary_dim` pass through unchanged.

The inverse frequencies depend only on static configuration (rotary_dim, base, scaling), so they are
computed here on the host in float64. The angle is never formed as an fp32 product: an fp32 position *
inv_freq carries the relative rounding errors of inv_freq and of the product (2^-24 each) times the angle, so
at position 2^20 the angle is off by up to ~0.1 rad and at 2^24 by whole radians (the position itself no longer
fits fp32's 24-bit mantissa). `reduced_angle` instead forms position * inv_freq / (2 pi) modulo 1 from exact
fp32 products (`angle_table`), so cos/sin are accurate to ~1e-6 absolute for every int32 position, negative
ones included. The reference (this file) and the Pallas kernel run the same arithmetic, so they agree to rounding.

This file knows nothing of Pallas; `reference_rotary` is also the "xla" implementation.
"""

from __future__ import annotations

import dataclasses
import decimal
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

LAYOUTS = ("bshd", "bhsd")


@dataclasses.dataclass(frozen=True)
class RotaryScaling:
    """A frequency-scaling spec for long contexts (hashable: it is static configuration).

    Build one with a constructor: `RotaryScaling.linear(8.0)`, `RotaryScaling.llama3(8.0)`,
    `RotaryScaling.yarn(4.0, original_max_position_embeddings=32768)`. Each follows the Hugging Face
    transformers function named in its docstring (`transformers/modeling_rope_utils.py`), so a model
    converted from a HF config rotates exactly as it did there.
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self):
        if self.kind not in ("linear", "llama3", "yarn"):
            raise ValueError(f"scaling: kind must be 'linear', 'llama3' or 'yarn', got {self.kind!r}")
        if not (self.factor > 0):
            raise ValueError(f"scaling: factor must be > 0, got {self.factor}")
        if self.kind == "llama3" and not (self.high_freq_factor > self.low_freq_factor > 0):
            raise ValueError("scaling: llama3 needs high_freq_factor > low_freq_factor > 0, got "
                             f"{self.high_freq_factor} and {self.low_freq_factor}")
        if self.original_max_position_embeddings <= 0:
            raise ValueError("scaling: original_max_position_embeddings must be > 0")

    @classmethod
    def linear(cls, factor: float) -> RotaryScaling:
        """Position interpolation (Chen et al. 2023; HF `_compute_linear_scaling_rope_parameters`):
        inv_freq /= factor, i.e. every position is divided by `factor`."""
        return cls("linear", float(factor))

    @classmethod
    def llama3(cls, factor: float = 8.0, low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
               original_max_position_embeddings: int = 8192) -> RotaryScaling:
        """Llama 3.1 scaling (HF `_compute_llama3_parameters`; defaults are Llama 3.1's).

        With L = original_max_position_embeddings and wavelen = 2 pi / inv_freq:
            wavelen < L / high_freq_factor  -> inv_freq unchanged            (high frequencies)
            wavelen > L / low_freq_factor   -> inv_freq / factor              (low frequencies)
            otherwise, with smooth = (L / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor):
                                             (1 - smooth) * inv_freq / factor + smooth * inv_freq
        """
        return cls("llama3", float(factor), low_freq_factor=float(low_freq_factor),
                   high_freq_factor=float(high_freq_factor),
                   original_max_position_embeddings=int(original_max_position_embeddings))

    @classmethod
    def yarn(cls, factor: float, original_max_position_embeddings: int, beta_fast: float = 32.0,
             beta_slow: float = 1.0, attention_factor: float | None = None, mscale: float | None = None,
             mscale_all_dim: float | None = None, truncate: bool = True) -> RotaryScaling:
        """YaRN (Peng et al. 2023, arXiv:2309.00071; HF `_compute_yarn_parameters`).

        With d = rotary_dim, L = original_max_position_embeddings and
        corr(r) = d * ln(L / (2 pi r)) / (2 ln base)  (the dimension that turns r times over L):
            low, high = floor(corr(beta_fast)), ceil(corr(beta_slow))     (no rounding if truncate=False)
            low, high = max(low, 0), min(high, d - 1); high += 0.001 if low == high
            ramp[i]   = clip((i - low) / (high - low), 0, 1),  i < d / 2
            inv_freq  = inv_freq / factor * ramp + inv_freq * (1 - ramp)
        Attention factor m, multiplied into cos and sin (so q.k scales by m^2):
            attention_factor if given; else get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
            if both mscale and mscale_all_dim are given (DeepSeek); else get_mscale(factor) = 0.1 ln(factor) + 1
            (1 when factor <= 1), where get_mscale(s, m) = 0.1 m ln(s) + 1.
        `factor` is used as given (HF may re-derive it from max_position_embeddings / L; pass that ratio).
        """
        return cls("yarn", float(factor), original_max_position_embeddings=int(original_max_position_embeddings),
                   beta_fast=float(beta_fast), beta_slow=float(beta_slow),
                   attention_factor=None if attention_factor is None else float(attention_factor),
                   mscale=None if mscale is None else float(mscale),
                   mscale_all_dim=None if mscale_all_dim is None else float(mscale_all_dim),
                   truncate=bool(truncate))

    def scale_inv_freq(self, inv_freq: np.ndarray, rotary_dim: int, base: float) -> np.ndarray:
        """Apply this spec to the default inverse frequencies (float64 in, float64 out)."""
        if self.kind == "linear":
            return inv_freq / self.factor
        if self.kind == "llama3":
            old_len = float(self.original_max_position_embeddings)
            low_wavelen = old_len / self.low_freq_factor
            high_wavelen = old_len / self.high_freq_factor
            wavelen = 2 * math.pi / inv_freq
            scaled = np.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
            smooth = (old_len / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            return np.where(medium, smoothed, scaled)
        # yarn
        d, old_len = rotary_dim, float(self.original_max_position_embeddings)

        def corr_dim(rotations):
            return d * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = corr_dim(self.beta_fast), corr_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001  # HF: avoid a division by zero
        ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
        return inv_freq / self.factor * ramp + inv_freq * (1.0 - ramp)

    def attention_scale(self) -> float:
        """The factor YaRN multiplies into cos and sin (1.0 for the other kinds)."""
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor

        def get_mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return get_mscale(self.factor, self.mscale) / get_mscale(self.factor, self.mscale_all_dim)
        return get_mscale(self.factor)


def inv_frequencies(rotary_dim: int, base: float = 10000.0, scaling: RotaryScaling | None = None) -> np.ndarray:
    """float64 inverse frequencies, shape (rotary_dim // 2,): base^(-2i/rotary_dim), then `scaling`."""
    inv_freq = 1.0 / (float(base) ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))
    if scaling is not None:
        inv_freq = scaling.scale_inv_freq(inv_freq, rotary_dim, float(base))
    return inv_freq


def attention_scale(scaling: RotaryScaling | None) -> float:
    return 1.0 if scaling is None else scaling.attention_scale()


def _rotate(x, cos, sin, rotary_dim: int, interleaved: bool, layout: str):
    """Rotate the leading `rotary_dim` features of x (any float dtype) by fp32 cos/sin of shape (B|1, S, R/2)."""
    if layout == "bshd":
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    else:
        cos, sin = cos[:, None, :, :], sin[:, None, :, :]
    xr = x[..., :rotary_dim].astype(jnp.float32)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
    else:
        x1, x2 = xr[..., : rotary_dim // 2], xr[..., rotary_dim // 2:]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if interleaved:
        out = jnp.stack([o1, o2], axis=-1).reshape(xr.shape)
    else:
        out = jnp.concatenate([o1, o2], axis=-1)
    out = out.astype(x.dtype)
    if rotary_dim < x.shape[-1]:
        out = jnp.concatenate([out, x[..., rotary_dim:]], axis=-1)
    return out


# Angle reduction. A position p (int32) is split into three parts exact in fp32, p = p2 2^22 + p1 2^11 + p0 with
# p0, p1 in [0, 2^11) and p2 in [-2^9, 2^9). Per frequency f the host stores, for each part j, the turns per unit
# c_j = frac(2^(11 j) f / (2 pi)) as c_j0 + c_j1: c_j0 a multiple of 2^-13 (so p_j c_j0 < 2^24 ulps is exact in
# fp32 and its fractional part too) and c_j1 < 2^-13 rounded to fp32 (p_j c_j1 < 0.25: its rounding is <= 2^-27
# turns). The fractional turn sum(frac(p_j c_j0)) + sum(p_j c_j1), reduced to [-0.5, 0.5], times 2 pi is the angle
# in [-pi, pi] to ~1e-7 turns (~6e-7 rad) at any position. Cost: ~24 fp32 ops per (token, pair), shared by all
# heads of q and k (the kernel is memory-bound: at Hq + Hk = 40 heads, bf16, 0.08 ops per byte moved), and
# cos/sin then run on |angle| <= pi, their fastest path.
_TWO_PI = decimal.Decimal("6.28318530717958647692528676655900576839433879875021")
POSITION_PART_BITS = 11
_WHOLE_BITS = 24 - POSITION_PART_BITS  # c_j0 = k / 2^13: |p_j| < 2^11 times k < 2^13 stays below 2^24, exact
TABLE_ROWS = 6


def angle_table(inv_freq) -> np.ndarray:
    """float32 (6, len(inv_freq)), read-only: rows (c_00, c_01, c_10, c_11, c_20, c_21) of the angle reduction (see
    above). Cached: the decimal arithmetic takes milliseconds, and eager calls would pay it every time."""
    return _angle_table(tuple(float(f) for f in np.asarray(inv_freq, np.float64).reshape(-1)))


@functools.lru_cache(maxsize=256)
def _angle_table(inv_freq: tuple[float, ...]) -> np.ndarray:
    rows = np.zeros((TABLE_ROWS, len(inv_freq)), np.float32)
    with decimal.localcontext() as ctx:
        ctx.prec = 60
        for i, f in enumerate(inv_freq):
            turns = decimal.Decimal(f) / _TWO_PI
            for j in range(3):
                c = (turns * (1 << (POSITION_PART_BITS * j))) % 1
                c0 = (c * (1 << _WHOLE_BITS)).to_integral_value(decimal.ROUND_FLOOR) / (1 << _WHOLE_BITS)
                rows[2 * j, i] = float(c0)  # exact: at most 13 significant bits
                rows[2 * j + 1, i] = float(c - c0)
    rows.flags.writeable = False
    return rows


def reduced_angle(pos, rows):
    """(position * inv_freq) modulo 2 pi in [-pi, pi], float32, from int32 positions `pos` (any shape) and the six
    `angle_table` rows (each broadcastable against pos): the same code runs in the reference and in the kernel."""
    mask = (1 << POSITION_PART_BITS) - 1
    parts = (pos & mask, (pos >> POSITION_PART_BITS) & mask, pos >> (2 * POSITION_PART_BITS))
    parts = [p.astype(jnp.float32) for p in parts]

    def frac(v):
        return v - jnp.floor(v)

    # The exact products' fractions are multiples of 2^-13 below 3: their sum and its reduction are exact.
    whole = frac(parts[0] * rows[0]) + frac(parts[1] * rows[2]) + frac(parts[2] * rows[4])
    whole = whole - jnp.floor(whole + 0.5)
    turns = whole + (parts[0] * rows[1] + parts[1] * rows[3] + parts[2] * rows[5])
    turns = turns - jnp.floor(turns + 0.5)
    return turns * np.float32(2 * np.pi)


def reference_cos_sin(positions, inv_freq, scale: float = 1.0, sign: float = 1.0):
    """fp32 cos/sin of shape (B|1, S, R/2) from int positions (S,) or (B, S) and host inv_freq."""
    if positions.ndim == 1:
        positions = positions[None, :]
    rows = [jnp.asarray(r) for r in angle_table(inv_freq)]
    angle = reduced_angle(positions.astype(jnp.int32)[..., None], rows)
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    if scale != 1.0:
        cos, sin = cos * np.float32(scale), sin * np.float32(scale)
    return cos, sign * sin


def reference_rotary(q, k, positions, *, rotary_dim: int, interleaved: bool = False, base: float = 10000.0,
                     scaling: RotaryScaling | None = None, layout: str = "bshd", inverse: bool = False):
    """Plain-jnp rotary embedding of q and k (k may be None); the ground truth and the "xla" implementation.

    `positions` must already be an integer array of shape (S,) or (B, S). `inverse=True` applies the
    transpose (conjugate rotation, same attention factor): that is the backward pass.
    """
    inv_freq = inv_frequencies(rotary_dim, base, scaling)
    cos, sin = reference_cos_sin(positions, inv_freq, attention_scale(scaling), -1.0 if inverse else 1.0)
    rot = lambda x: None if x is None else _rotate(x, cos, sin, rotary_dim, interleaved, layout)
    return rot(q), rot(k)


def default_positions(seq_len: int) -> jax.Array:
    return jnp.arange(seq_len, dtype=jnp.int32)
