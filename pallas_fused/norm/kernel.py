"""RMSNorm forward and backward, one Pallas (Triton-lowered) kernel each.

Forward ("pallas_fused_rms_norm_fwd"): a program normalises `block_rows` whole rows (features padded to a
power of two and masked) held in registers: one read of x, one write of y, plus the per-row float32 rstd,
the only thing saved for the backward pass (x is a residual the caller already holds).

Backward ("pallas_fused_rms_norm_bwd"): with xhat = x rstd and g = dy scale,
    dx     = rstd (g - xhat mean(g xhat))           (per row)
    dscale = sum over rows of dy xhat                (per feature)
A fixed number of programs (a few per SM) each walks every `programs`-th block of rows, writes dx, and keeps
its share of dscale in registers; each program stores one float32 partial row and the caller sums the
(programs, D) partials, a small deterministic reduction instead of atomics or a second pass over dy and x.

All arithmetic is float32; x, dy, y and dx keep the caller's dtypes. Rows wider than `MAX_FEATURES` do not fit
one register tile: the api runs the reference for them (see `rms_norm`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_fused import _backend
from pallas_fused._backend import cdiv, next_pow2

MAX_FEATURES = 16384


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    block_rows: int  # rows per program (forward) or per loop step (backward); a power of two
    num_warps: int
    programs: int = 0  # backward only: how many programs share the rows (0: forward)


def choose_config(rows: int, features: int, backward: bool) -> LaunchConfig:
    """A pure function of the shapes and the SM count: ~4096 (forward) or ~2048 (backward: x, dy, dx and
    the dscale share live at once) elements a tile, 16 of them a thread at most."""
    width = next_pow2(features)
    block_rows = max(1, min(64, (2048 if backward else 4096) // width))
    num_warps = max(1, min(8, block_rows * width // 512))
    programs = min(cdiv(rows, block_rows), 4 * _backend.num_sms()) if backward else 0
    return LaunchConfig(block_rows, num_warps, max(programs, 1) if backward else 0)


def _at(r0, br, width):
    """Index arrays of rows [r0, r0 + br) x features [0, width): arrays rather than slices, because a padded
    width is a static slice past the array's end, which jax >= 0.12 refuses even under a mask."""
    return (r0 + jnp.arange(br))[:, None], jnp.arange(width)[None, :]


def _tile(ref, r0, br, width, rows, features, dtype=jnp.float32):
    """Load rows [r0, r0 + br) x [0, width) of a (rows, features) ref as float32, zero outside it."""
    r_ok = r0 + jnp.arange(br) < rows
    mask = r_ok[:, None] & (jnp.arange(width) < features)[None, :]
    return _backend.load(ref.at[_at(r0, br, width)], mask=mask, other=0).astype(dtype), mask, r_ok


def _fwd_kernel(*refs, rows, features, width, br, eps, has_scale):
    x_ref, scale_ref, y_ref, rstd_ref = refs if has_scale else (refs[0], None, *refs[1:])
    r0 = pl.program_id(0) * br
    x, mask, r_ok = _tile(x_ref, r0, br, width, rows, features)
    rstd = lax.rsqrt(jnp.sum(x * x, axis=1) / features + eps)
    mul = jnp.broadcast_to(rstd[:, None], (br, width))
    if has_scale:
        scale = _backend.load(scale_ref.at[jnp.arange(width)], mask=jnp.arange(width) < features, other=0)
        mul = mul * scale.astype(jnp.float32)[None, :]
    _backend.store(y_ref.at[_at(r0, br, width)], (x * mul).astype(y_ref.dtype), mask=mask)
    _backend.store(rstd_ref.at[pl.ds(r0, br)], rstd, mask=r_ok)


def _bwd_kernel(*refs, rows, features, width, br, iters, programs, has_scale):
    if has_scale:
        dy_ref, x_ref, rstd_ref, scale_ref, dx_ref, dscale_ref = refs
    else:
        (dy_ref, x_ref, rstd_ref, dx_ref), scale_ref, dscale_ref = refs, None, None
    pid = pl.program_id(0)
    f_ok = jnp.arange(width) < features
    scale = None
    if has_scale:
        scale = _backend.load(scale_ref.at[jnp.arange(width)], mask=f_ok, other=0).astype(jnp.float32)

    def body(i, dscale):
        r0 = (pid + i * programs) * br
        x, mask, r_ok = _tile(x_ref, r0, br, width, rows, features)
        dy, _, _ = _tile(dy_ref, r0, br, width, rows, features)
        rstd = _backend.load(rstd_ref.at[pl.ds(r0, br)], mask=r_ok, other=0)
        xhat = x * rstd[:, None]
        g = dy * scale[None, :] if has_scale else dy
        c = jnp.sum(g * xhat, axis=1) / features
        dx = rstd[:, None] * (g - xhat * c[:, None])
        _backend.store(dx_ref.at[_at(r0, br, width)], dx.astype(dx_ref.dtype), mask=mask)
        return dscale + jnp.sum(dy * xhat, axis=0) if has_scale else dscale

    dscale = lax.fori_loop(0, iters, body, jnp.zeros((width,), jnp.float32))
    if has_scale:
        _backend.store(dscale_ref.at[pid, jnp.arange(width)], dscale, mask=f_ok)


def rms_norm_fwd_pallas(x2, scale, *, eps: float, out_dtype, interpret: bool, config: LaunchConfig | None = None):
    """(y (R, D) in out_dtype, rstd (R,) float32) for x2 (R, D) and scale (D,) or None."""
    rows, features = x2.shape
    config = config or choose_config(rows, features, backward=False)
    br = config.block_rows
    kernel = functools.partial(_fwd_kernel, rows=rows, features=features, width=next_pow2(features), br=br,
                               eps=float(eps), has_scale=scale is not None)
    out_shape = (jax.ShapeDtypeStruct((rows, features), out_dtype), jax.ShapeDtypeStruct((rows,), jnp.float32))
    return _backend.triton_call(kernel, out_shape=out_shape, grid=(cdiv(rows, br),),
                                name="pallas_fused_rms_norm_fwd", interpret=interpret,
                                num_warps=config.num_warps)(*([x2] if scale is None else [x2, scale]))


def rms_norm_bwd_pallas(dy2, x2, rstd, scale, *, interpret: bool, config: LaunchConfig | None = None):
    """(dx (R, D) in x2's dtype, dscale (D,) float32 or None) for dy2, x2 (R, D), rstd (R,) and scale."""
    rows, features = x2.shape
    config = config or choose_config(rows, features, backward=True)
    br, programs = config.block_rows, config.programs
    has_scale = scale is not None
    kernel = functools.partial(_bwd_kernel, rows=rows, features=features, width=next_pow2(features), br=br,
                               iters=cdiv(cdiv(rows, br), programs), programs=programs, has_scale=has_scale)
    out_shape = [jax.ShapeDtypeStruct((rows, features), x2.dtype)]
    if has_scale:
        out_shape.append(jax.ShapeDtypeStruct((programs, features), jnp.float32))
    outs = _backend.triton_call(kernel, out_shape=tuple(out_shape), grid=(programs,),
                                name="pallas_fused_rms_norm_bwd", interpret=interpret,
                                num_warps=config.num_warps)(*([dy2, x2, rstd] + ([scale] if has_scale else [])))
    return outs[0], (jnp.sum(outs[1], axis=0) if has_scale else None)
