"""The fused fp32/bf16-state Adam(W) step on Pallas' Mosaic GPU backend (`implementation="pallas:mosaic"`).

The pilot of moving the memory-bound kernels off the deprecated Triton backend (docs/triton_to_mosaic_gpu.md).
Same operands, math (`reference.adam_math`) and results as `kernel.adam_fp32`; only the launch differs:

- The flat vector is cut into blocks of `block` elements. `programs` CTAs (one warpgroup of 128 threads each)
  each walk `steps` consecutive blocks with `plgpu.emit_pipeline`, which keeps the copies of `concurrent`
  blocks in flight (bulk async copies GMEM -> SMEM of every operand, compute from SMEM
  into registers, bulk copies SMEM -> GMEM of the results). Triton instead has every thread load its elements
  straight into registers, with no shared memory.
- The programs cover whole groups of `steps` blocks only (a bulk copy past the end of the array would be
  clamped, but the pipeline's block indexing is not masked). The remaining elements (fewer than block * steps) are
  stepped by the jnp reference and written into the kernel's outputs in place (a dynamic-update-slice of the
  aliased buffers), reading p, m, v from those outputs, where the kernel left them untouched.

Needs jax >= 0.11 (`_backend.resolve_mosaic`): `plgpu.kernel` taking refs (`jax.new_ref`) that it writes in
place, and contiguous 1-D blocks copied with cp.async.bulk (no 256-element TMA box limit).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_fused import _backend
from pallas_fused.adam.reference import NUM_SCALARS, adam_leaf_reference, adam_math

# Launch configuration (set from the GPU sweep in benchmarks/mosaic_pilot.py).
BLOCK = 2048  # elements per pipeline step
STEPS = 8  # blocks per program
CONCURRENT = 2  # pipeline steps in flight per program
VEC = 4  # elements per thread per register vector: fp32 and bf16 operands share one strided layout
LANES = 128  # the flat vector is seen as rows of LANES elements (a TMA box dimension holds at most 256)
# Where the kernel reads the runtime scalars: "smem" (each pipeline step copies them into shared memory with
# the data, padded to 128 bytes: a TMA destination must be 128-byte aligned) or "gmem" (scalar global loads).
SCALARS = "smem"
SCALARS_PADDED = 32


def _kernel(*refs, has_p, inplace, block):
    if inplace:
        s_ref, p_ref, g_ref, m_ref, v_ref, p_out, m_out, v_out = refs
    elif has_p:
        s_ref, g_ref, m_ref, v_ref, p_ref, u_out, m_out, v_out = refs
    else:
        s_ref, g_ref, m_ref, v_ref, u_out, m_out, v_out = refs
        p_ref = None
    plgpu = _backend.mosaic_gpu()
    layout = plgpu.Layout.WG_STRIDED((block // LANES, LANES), vec_size=VEC)

    def load(ref):
        return plgpu.load(ref, layout=layout).astype(jnp.float32)

    s = [s_ref[i] for i in range(NUM_SCALARS)]
    p = None if p_ref is None else load(p_ref)
    g, m, v = load(g_ref), load(m_ref), load(v_ref)
    u, m_new, v_new, ok = adam_math(g, m, v, p, s)
    u = jnp.where(ok, u, 0.0)
    m_out[...] = jnp.where(ok, m_new, m).astype(m_out.dtype)
    v_out[...] = jnp.where(ok, v_new, v).astype(v_out.dtype)
    if inplace:
        p_out[...] = (p + u).astype(p_out.dtype)
    else:
        u_out[...] = u.astype(u_out.dtype)


def adam_fp32(s, g, m, v, p=None, *, inplace: bool, u_dtype=None, block: int | None = None,
              steps: int | None = None, concurrent: int | None = None):
    """`kernel.adam_fp32` (same operands and returns: flat 1-D, one length n) on the Mosaic GPU backend.
    block / steps / concurrent default to BLOCK / STEPS / CONCURRENT (read at call time)."""
    block, steps, concurrent = block or BLOCK, steps or STEPS, concurrent or CONCURRENT
    if block % (128 * VEC) or block > 256 * LANES:
        raise ValueError(f"block: expected a multiple of {128 * VEC} (a warpgroup's vectors) of at most "
                         f"{256 * LANES} elements, got {block}")
    return _adam_fp32(s, g, m, v, p, inplace=inplace, u_dtype=u_dtype, block=block, steps=steps,
                      concurrent=concurrent)


def _launch(s16, g, p, m, v, *, inplace, u_dtype, block, steps, concurrent, programs):
    """One `plgpu.kernel` over `programs` CTAs, each an `emit_pipeline` over its `steps` blocks. The state (and p
    in place) goes in as refs (`jax.new_ref`), which the kernel writes: the launch aliases them to its results,
    so a donated step writes over its inputs with no copy (as `input_output_aliases` does for the Triton kernel).
    Returns (update or p, m, v)."""
    plgpu = _backend.mosaic_gpu()
    has_p = p is not None
    m_ref, v_ref = jax.new_ref(m), jax.new_ref(v)
    p_ref = jax.new_ref(p) if inplace else None

    def body(*refs):
        s_g = refs[0]
        if inplace:
            _, g_g, p_g, m_g, v_g = refs
            ins, outs = (p_g, g_g, m_g, v_g), (p_g, m_g, v_g)
        else:
            _, g_g, *p_g, m_g, v_g, u_g = refs
            ins, outs = (g_g, m_g, v_g, *p_g), (u_g, m_g, v_g)
        first = lax.axis_index("programs") * steps
        blk = pl.BlockSpec((block // LANES, LANES), lambda j: (first + j, 0))
        kern = functools.partial(_kernel, has_p=has_p, inplace=inplace, block=block)
        if SCALARS == "smem":
            ins, in_specs = (s_g, *ins), [pl.BlockSpec((SCALARS_PADDED,), lambda j: (0,))] + [blk] * len(ins)
            step = lambda _, *smem: kern(*smem)  # noqa: E731
        else:
            in_specs = [blk] * len(ins)
            step = lambda _, *smem: kern(s_g, *smem)  # noqa: E731
        plgpu.emit_pipeline(step, grid=(steps,), in_specs=in_specs, out_specs=[blk] * 3,
                            max_concurrent_steps=concurrent)(*ins, *outs)

    if inplace:
        plgpu.kernel(body, out_type=(), grid=(programs,), grid_names=("programs",))(s16, g, p_ref, m_ref, v_ref)
        return p_ref[...], m_ref[...], v_ref[...]
    u_type = jax.ShapeDtypeStruct(g.shape, u_dtype or g.dtype)
    u = plgpu.kernel(body, out_type=u_type, grid=(programs,), grid_names=("programs",))(
        s16, g, *((p,) if has_p else ()), m_ref, v_ref)
    return u, m_ref[...], v_ref[...]


@functools.partial(jax.jit, static_argnames=("inplace", "u_dtype", "block", "steps", "concurrent"))
def _adam_fp32(s, g, m, v, p, *, inplace, u_dtype, block, steps, concurrent):
    n = g.shape[0]
    programs = n // (block * steps)
    if programs == 0 or n % LANES:  # smaller than one program's share, or not whole rows: the reference
        return adam_leaf_reference(g, m, v, s, p, inplace=inplace, u_dtype=u_dtype)
    s16 = jnp.pad(s, (0, SCALARS_PADDED - s.shape[0]))
    rows = lambda x: None if x is None else x.reshape(n // LANES, LANES)  # noqa: E731 (free: row-major)
    out, m2, v2 = _launch(s16, rows(g), rows(p), rows(m), rows(v), inplace=inplace, u_dtype=u_dtype, block=block,
                          steps=steps, concurrent=concurrent, programs=programs)
    out, m2, v2 = out.reshape(n), m2.reshape(n), v2.reshape(n)
    done = programs * block * steps
    if done == n:
        return out, m2, v2
    # The tail: p (in place), m and v are read from the kernel's results, which hold their inputs there.
    p_tail = out[done:] if inplace else (None if p is None else p[done:])
    t_out, t_m, t_v = adam_leaf_reference(g[done:], m2[done:], v2[done:], s, p_tail, inplace=inplace,
                                          u_dtype=u_dtype)
    return out.at[done:].set(t_out), m2.at[done:].set(t_m), v2.at[done:].set(t_v)
