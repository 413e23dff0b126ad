"""The fused fp32/bf16-state Adam(W) step on Pallas' Mosaic GPU backend (`implementation="pallas:sm90"`).

The pilot of moving the memory-bound kernels off the deprecated Triton backend (docs/triton_to_mosaic_gpu.md).
Same operands, math (`reference.adam_math`) and results as `kernel.adam_fp32`; only the launch differs:

- The flat vector is seen as rows of 128 and cut into blocks of `block` elements ((block / 128, 128) tiles).
  `programs` CTAs (one warpgroup of 128 threads each) each walk `steps` consecutive blocks with
  `plgpu.emit_pipeline`, which keeps the copies of `concurrent` blocks in flight (TMA copies GMEM -> SMEM of
  every operand and of the runtime scalars, compute from SMEM into registers, bulk copies SMEM -> GMEM of the
  results). block / steps / concurrent are a `MosaicLaunch`, tuning data (the "adam_mosaic" section of
  pallas_fused/tuning/<device>.json, which benchmarks/mosaic_pilot.py sweeps). Triton instead
  has every thread load its elements straight into registers, with no shared memory.
- The blocks tile the tensor exactly (`launch_shape` picks the block and steps per tensor); a tensor whose size is
  not a multiple of 128 x VEC elements is stepped by the jnp reference. No tail is patched into the kernel's
  results afterwards: XLA (0.11.2, GPU) rejects a dynamic-update-slice into the output of this custom call
  ("DynamicSliceFusion: DUS target must be a fusion parameter").

Needs jax >= 0.11 (the "pallas:sm90" entry of `api.VARIANTS`): `plgpu.kernel` taking refs (`jax.new_ref`) that it
writes in place. Checked on an H200 with jax 0.11.2 against the reference (see tests/adam/test_mosaic.py).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_fused import _backend
from pallas_fused.adam.kernel import fp32_refs, fp32_step
from pallas_fused.adam.reference import NUM_SCALARS, adam_leaf_reference

VEC = 4  # elements per thread per register vector: fp32 and bf16 operands share one strided layout
LANES = 128  # the flat vector is seen as rows of LANES elements (a TMA box holds at most 256 per dimension)
# Each pipeline step copies the runtime scalars into shared memory with the data, padded to 32 floats: a TMA
# destination must be 128-byte aligned (with 64-byte slots the second slot faulted on the H200).
SCALARS_PADDED = 32


@dataclasses.dataclass(frozen=True)
class MosaicLaunch:
    """The largest launch (`launch_shape` fits it to each tensor); the defaults are a GPU's without a tuning table,
    the H200's (its sweep: docs/performance.md, "Tuning tables")."""

    block: int = 1024  # elements per pipeline step
    steps: int = 32  # blocks per program
    concurrent: int = 6  # pipeline steps in flight per program

    def __post_init__(self):
        if self.block % (128 * VEC) or not 0 < self.block <= 256 * LANES:
            raise ValueError(f"block: expected a multiple of {128 * VEC} (a warpgroup's vectors) of at most "
                             f"{256 * LANES} elements, got {self.block}")
        if self.steps < 1 or self.concurrent < 1:
            raise ValueError(f"steps, concurrent: expected >= 1, got {self.steps}, {self.concurrent}")


HEURISTIC = {"fp32": dataclasses.asdict(MosaicLaunch())}


def default_launch() -> MosaicLaunch:
    """This device kind's launch (pallas_fused/tuning/<device>.json, else `MosaicLaunch()`)."""
    return MosaicLaunch(**_backend.tuned("adam_mosaic", HEURISTIC)["fp32"])


def _kernel(*refs, has_p, inplace, block):
    s_ref, p_ref, g_ref, m_ref, v_ref, out_ref, m_out, v_out = fp32_refs(refs, has_p=has_p, inplace=inplace)
    plgpu = _backend.mosaic_gpu()
    layout = plgpu.Layout.WG_STRIDED((block // LANES, LANES), vec_size=VEC)

    def load(ref):
        return plgpu.load(ref, layout=layout).astype(jnp.float32)

    s = [s_ref[i] for i in range(NUM_SCALARS)]
    p = None if p_ref is None else load(p_ref)
    out, m2, v2 = fp32_step(p, load(g_ref), load(m_ref), load(v_ref), s, inplace=inplace)
    for ref, x in ((m_out, m2), (v_out, v2), (out_ref, out)):
        ref[...] = x.astype(ref.dtype)


def adam_fp32(s, g, m, v, p=None, *, inplace: bool, u_dtype=None, launch: MosaicLaunch | None = None):
    """`kernel.adam_fp32` (same operands and returns: flat 1-D, one length n) on the Mosaic GPU backend, with
    `launch` (default: this device kind's, `default_launch`)."""
    launch = launch or default_launch()
    return _adam_fp32(s, g, m, v, p, inplace=inplace, u_dtype=u_dtype, block=launch.block, steps=launch.steps,
                      concurrent=launch.concurrent)


def _launch(s_pad, g, p, m, v, *, inplace, u_dtype, block, steps, concurrent, programs):
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
        ins, in_specs = (s_g, *ins), [pl.BlockSpec((SCALARS_PADDED,), lambda j: (0,))] + [blk] * len(ins)
        plgpu.emit_pipeline(lambda _, *smem: kern(*smem), grid=(steps,), in_specs=in_specs, out_specs=[blk] * 3,
                            max_concurrent_steps=concurrent)(*ins, *outs)

    if inplace:
        plgpu.kernel(body, out_type=(), grid=(programs,), grid_names=("programs",))(s_pad, g, p_ref, m_ref, v_ref)
        return p_ref[...], m_ref[...], v_ref[...]
    u_type = jax.ShapeDtypeStruct(g.shape, u_dtype or g.dtype)
    u = plgpu.kernel(body, out_type=u_type, grid=(programs,), grid_names=("programs",))(
        s_pad, g, *((p,) if has_p else ()), m_ref, v_ref)
    return u, m_ref[...], v_ref[...]


def launch_shape(n: int, block: int, steps: int) -> tuple[int, int, int] | None:
    """(block, steps, programs) whose blocks tile all n elements exactly: the largest block of `block`, block / 2,
    ... (at least a warpgroup's 128 x VEC elements) that divides n, and the most steps <= `steps` that divide
    the number of blocks. None when no such block divides n (the reference steps the tensor)."""
    while block >= 128 * VEC:
        if n % block == 0:
            blocks = n // block
            most = max(d for d in range(1, min(steps, blocks) + 1) if blocks % d == 0)
            return block, most, blocks // most
        block //= 2
    return None


@functools.partial(jax.jit, static_argnames=("inplace", "u_dtype", "block", "steps", "concurrent"))
def _adam_fp32(s, g, m, v, p, *, inplace, u_dtype, block, steps, concurrent):
    n = g.shape[0]
    shape = launch_shape(n, block, steps)
    if shape is None:
        return adam_leaf_reference(g, m, v, s, p, inplace=inplace, u_dtype=u_dtype)
    block, steps, programs = shape
    s_pad = jnp.pad(s, (0, SCALARS_PADDED - s.shape[0]))
    rows = lambda x: None if x is None else x.reshape(n // LANES, LANES)  # noqa: E731 (free: row-major)
    out = _launch(s_pad, rows(g), rows(p), rows(m), rows(v), inplace=inplace, u_dtype=u_dtype, block=block,
                  steps=steps, concurrent=concurrent, programs=programs)
    return tuple(x.reshape(n) for x in out)
