"""Rotary position embeddings: the frequency-scaling specs and the plain-jnp reference.

Conventions (GPT-NeoX / Hugging Face):

    inv_freq[i] = base ** (-2 i / rotary_dim),  i < rotary_dim / 2         (then rescaled by a `RotaryScaling`)
    angle[t, i] = position[t] * inv_freq[i]                                  (fp32)
    pair i      = (x[i], x[i + rotary_dim/2])   half-split (GPT-NeoX, Llama; interleaved=False)
                = (x[2i], x[2i + 1])            interleaved (GPT-J; interleaved=True)
    (x1, x2)   -> m * (x1 cos - x2 sin, x2 cos + x1 sin)                     m = attention factor (1 except YaRN)

Features at and past `rotary_dim` pass through unchanged.

The inverse frequencies depend only on static configuration (rotary_dim, base, scaling), so they are
computed here on the host in float64 and rounded once to float32. The angles and cos/sin are always
computed in float32 from the positions: the reference (this file) and the Pallas kernel do the same
arithmetic, so they agree to rounding.

This file knows nothing of Pallas; `reference_rotary` is also the "xla" implementation.
"""

from __future__ import annotations

import dataclasses
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


def reference_cos_sin(positions, inv_freq, scale: float = 1.0, sign: float = 1.0):
    """fp32 cos/sin of shape (B|1, S, R/2) from int positions (S,) or (B, S) and host inv_freq."""
    if positions.ndim == 1:
        positions = positions[None, :]
    angle = positions.astype(jnp.float32)[..., None] * jnp.asarray(np.asarray(inv_freq, np.float32))
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
