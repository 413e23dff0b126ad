"""An FP8 GEMM by a frozen weight: ``y = x W`` and ``dx = dy W^T`` with W an `Fp8Kernel` (e4m3 codes Q and their
scales, quantized once), and no weight gradient.

Forward: x quantized per row ("rowwise") or per tensor ("tensorwise") as the recipe's input, one FP8 GEMM with
the codes. Backward: W = Q diag(s), s one scale per output feature (or one scalar), so dx = (dy diag(s)) Q^T: dy's
columns scaled by s in fp32, quantized per row with the recipe's grad_output dtype, one FP8 GEMM against the same
codes, which are K-major for it as stored ((K, N): the contraction runs over N). Tensorwise: dy quantized per
tensor and the weight's scalar taken in the GEMM's epilogue. W is never held twice, nor x kept for the backward.

The dtypes, power-of-2 scales and fast accumulation are torchao's recipes' (`Float8Config.from_recipe`): rowwise
e4m3 everywhere with power-of-2 scales, tensorwise e4m3 for x and e5m2 for dy.

x and dy are quantized by XLA (`reference.quantize_reference`: an amax reduction and a cast, two fusions) under
every implementation; `implementation` picks the GEMMs. Per element of a 16-bit x that moves the bytes of the
Pallas quantize (`fp8.quantize`: XLA's amax, then its cast kernel: read 2 + read 2 + write 1), and fewer for dy:
XLA computes dy diag(s) inside both of its fusions (read 2 + read 2 + write 1), where a Pallas kernel needs its
operand in memory, so dy diag(s) would be written in float32 first and read twice (read 2 + write 4 + read 4 +
read 4 + write 1). XLA may also fuse the producer of x or dy (an activation, DoRA's column scale) into both.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_fused.dora.quant import Fp8Kernel
from pallas_fused.fp8.api import _resolve, scaled_matmul, scaled_matmul_nt
from pallas_fused.fp8.config import Float8Config
from pallas_fused.fp8.reference import quantize_reference


def _forward(statics, x, codes, scale):
    recipe, impl, out_dtype = statics
    config = Float8Config.from_recipe(recipe)
    cast, rowwise = config.cast_config_input, recipe == "rowwise"
    xq, sx = quantize_reference(x, cast.dtype, 1 if rowwise else None, config.round_scales_to_power_of_2)
    sw = scale[None, :] if rowwise else scale
    return scaled_matmul(xq, codes, sx, sw, out_dtype=out_dtype, fast_accum=config.gemm_config_output.fast_accum,
                         implementation=impl)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _frozen_2d(statics, x, codes, scale):
    return _forward(statics, x, codes, scale)


def _frozen_2d_fwd(statics, x, codes, scale):
    return _forward(statics, x, codes, scale), (codes, scale, jnp.zeros((0,), x.dtype))


def _frozen_2d_bwd(statics, res, dy):
    recipe, impl, _ = statics
    codes, scale, x_proto = res
    config = Float8Config.from_recipe(recipe)
    cast, pow2 = config.cast_config_grad_output, config.round_scales_to_power_of_2
    fast = config.gemm_config_grad_input.fast_accum
    if recipe == "rowwise":  # dy diag(s), rowwise; the codes' scale folded in, so the GEMM takes 1 for them
        dyq, sdy = quantize_reference(dy.astype(jnp.float32) * scale[None, :], cast.dtype, 1, pow2)
        sw = jnp.ones((), jnp.float32)
    else:
        dyq, sdy = quantize_reference(dy, cast.dtype, None, pow2)
        sw = scale
    dx = scaled_matmul_nt(dyq, codes, sdy, sw, out_dtype=x_proto.dtype, fast_accum=fast, implementation=impl)
    return dx, jnp.zeros_like(codes), jnp.zeros_like(scale)


_frozen_2d.defvjp(_frozen_2d_fwd, _frozen_2d_bwd)


def frozen_fp8_matmul(x, w8: Fp8Kernel, *, out_dtype=None, implementation: str | None = None):
    """y = x W for a frozen FP8 weight `w8` (an `Fp8Kernel`, from `pallas_fused.dora.quantize_fp8`), both the
    forward and the input gradient as FP8 GEMMs (see the module docstring); W gets a zero cotangent.

    x: (..., in) float32 / bfloat16 / float16. out_dtype: the result's dtype (default x's; dx is x's).
    implementation: as `scaled_matmul`'s: None, "xla", "pallas", "pallas:sm90", "pallas:triton", "interpret"."""
    op = "fp8.frozen_fp8_matmul"
    if not isinstance(w8, Fp8Kernel):
        raise ValueError(f"{op}: w8 must be an Fp8Kernel (pallas_fused.dora.quantize_fp8), got {type(w8).__name__}")
    x = jnp.asarray(x)
    fin, fout = w8.shape
    if not jnp.issubdtype(x.dtype, jnp.floating) or jnp.dtype(x.dtype).itemsize < 2:
        raise ValueError(f"{op}: x must be float32/bfloat16/float16, got {x.dtype}")
    if x.ndim < 1 or x.shape[-1] != fin:
        raise ValueError(f"{op}: x must be (..., {fin}) to match w8 {w8.shape}, got {x.shape}")
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    impl = _resolve(implementation, op)
    lead = x.shape[:-1]
    y = _frozen_2d((w8.recipe, impl, out_dtype), x.reshape(math.prod(lead), fin), w8.codes, w8.scale)
    return y.reshape(*lead, fout)
