"""An independent float64 numpy ground truth for rotary embeddings (complex-number form).

Written separately from pallas_fused.rotary.reference: the rotation is a complex multiplication
z * m * exp(i angle) of the pair z = x1 + i x2, and the scaled frequencies are transcribed scalar by
scalar from Hugging Face transformers' `modeling_rope_utils.py` (`_compute_default_rope_parameters`,
`_compute_linear_scaling_rope_parameters`, `_compute_llama3_parameters`, `_compute_yarn_parameters`).
"""

from __future__ import annotations

import math

import numpy as np

from tests.helpers import to64


def hf_inv_freq(dim: int, base: float, kind: str | None = None, **kw) -> tuple[np.ndarray, float]:
    """(inv_freq float64 (dim/2,), attention factor) as HF computes them (loops, not vectorised)."""
    inv = [1.0 / base ** (2 * i / dim) for i in range(dim // 2)]
    attn = 1.0
    if kind == "linear":
        inv = [f / kw["factor"] for f in inv]
    elif kind == "llama3":
        factor, lo, hi, old = kw["factor"], kw["low_freq_factor"], kw["high_freq_factor"], kw["original"]
        out = []
        for f in inv:
            wavelen = 2 * math.pi / f
            if wavelen < old / hi:
                out.append(f)
            elif wavelen > old / lo:
                out.append(f / factor)
            else:
                smooth = (old / wavelen - lo) / (hi - lo)
                out.append((1 - smooth) * f / factor + smooth * f)
        inv = out
    elif kind == "yarn":
        factor, old = kw["factor"], kw["original"]
        beta_fast, beta_slow = kw.get("beta_fast", 32.0), kw.get("beta_slow", 1.0)

        def corr(rot):
            return (dim * math.log(old / (rot * 2 * math.pi))) / (2 * math.log(base))

        low, high = max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        out = []
        for i, f in enumerate(inv):
            ramp = min(max((i - low) / (high - low), 0.0), 1.0)
            extrapolation_factor = 1 - ramp
            out.append(f / factor * (1 - extrapolation_factor) + f * extrapolation_factor)
        inv = out

        def get_mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if kw.get("attention_factor") is not None:
            attn = kw["attention_factor"]
        elif kw.get("mscale") and kw.get("mscale_all_dim"):
            attn = get_mscale(factor, kw["mscale"]) / get_mscale(factor, kw["mscale_all_dim"])
        else:
            attn = get_mscale(factor)
    return np.array(inv, np.float64), attn


def positions64(positions, batch: int, seq_len: int) -> np.ndarray:
    if positions is None:
        return np.broadcast_to(np.arange(seq_len, dtype=np.float64), (batch, seq_len))
    pos = np.asarray(positions, np.float64)
    return np.broadcast_to(pos if pos.ndim == 2 else pos[None], (batch, seq_len))


def rope64(x, positions, inv_freq, *, rotary_dim: int, interleaved: bool = False, layout: str = "bshd",
           scale: float = 1.0, angle: np.ndarray | None = None) -> np.ndarray:
    """float64 rotary of x ((B,S,H,D) or (B,H,S,D)); `angle` (B,S,R/2) overrides position * inv_freq."""
    x = to64(x)
    if layout == "bhsd":
        x = x.transpose(0, 2, 1, 3)
    batch, seq_len = x.shape[:2]
    if angle is None:
        angle = positions64(positions, batch, seq_len)[..., None] * np.asarray(inv_freq, np.float64)
    half = rotary_dim // 2
    rot = x[..., :rotary_dim]
    if interleaved:
        z = rot[..., 0::2] + 1j * rot[..., 1::2]
    else:
        z = rot[..., :half] + 1j * rot[..., half:]
    z = z * scale * np.exp(1j * angle)[:, :, None, :]
    out = x.copy()
    if interleaved:
        out[..., 0:rotary_dim:2], out[..., 1:rotary_dim:2] = z.real, z.imag
    else:
        out[..., :half], out[..., half:rotary_dim] = z.real, z.imag
    if layout == "bhsd":
        out = out.transpose(0, 2, 1, 3)
    return out


def rope_fp32(x, positions, inv_freq, *, rotary_dim: int, interleaved: bool = False, layout: str = "bshd",
              scale: float = 1.0, sign: float = 1.0) -> np.ndarray:
    """The same-precision baseline, in numpy: fp32 angle, fp32 cos/sin and rotation, rounded once to x's dtype.

    It is what an exact fp32 implementation computes (cos/sin correctly rounded), so the kernel's error
    against float64 is compared to this baseline's (the `baseline=` of tests.helpers.assert_close).
    """
    dtype = np.dtype(x.dtype)
    xf = np.asarray(to64(x), np.float32)
    if layout == "bhsd":
        xf = xf.transpose(0, 2, 1, 3)
    batch, seq_len = xf.shape[:2]
    pos = positions64(positions, batch, seq_len).astype(np.float32)
    angle = pos[..., None] * np.asarray(inv_freq, np.float64).astype(np.float32)
    cos = np.cos(angle.astype(np.float64)).astype(np.float32) * np.float32(scale)
    sin = np.sin(angle.astype(np.float64)).astype(np.float32) * np.float32(scale * sign)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    half = rotary_dim // 2
    sl1, sl2 = (slice(0, rotary_dim, 2), slice(1, rotary_dim, 2)) if interleaved else (
        slice(0, half), slice(half, rotary_dim))
    x1, x2 = xf[..., sl1], xf[..., sl2]
    out = xf.copy()
    out[..., sl1], out[..., sl2] = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    if layout == "bhsd":
        out = out.transpose(0, 2, 1, 3)
    return out.astype(dtype)
