"""Plain-jnp ground truth for FP8 quantization and scaled matmuls; also the "xla" implementation.

Convention: x ~= x_fp8.astype(float32) * scale, with scale = amax * (1 / fp8_max) (fp32). amax = 0 gives
scale = AMAX_FLOOR / fp8_max (finite, positive); the cast saturates at +-fp8_max.

Non-finite input: the amax is taken over the finite values only, so one inf or NaN never reaches the scale;
in the cast +-inf saturates to +-fp8_max (as any value beyond the range) and NaN stays NaN, element by
element. (torchao takes the amax over everything, torch.max(abs(x)) in torchao/float8/float8_utils.py: one inf
makes its scale fp8_max / amax 0 and one NaN makes it NaN, so the whole tensor dequantizes to NaN.) An empty
tensor has amax 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Smallest amax used for a scale: an all-zero tensor still gets a finite, positive scale.
AMAX_FLOOR = 1e-12


def fp8_max(dtype) -> float:
    return float(jnp.finfo(dtype).max)


def round_up_pow2(scale: jax.Array) -> jax.Array:
    """The smallest power of two >= scale (positive, normal fp32), by rounding the mantissa bits up."""
    bits = jax.lax.bitcast_convert_type(scale.astype(jnp.float32), jnp.int32)
    bits = (bits + 0x7FFFFF) & jnp.int32(-0x800000)  # -0x800000 == 0xFF800000: sign + exponent
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def finite_abs(x: jax.Array) -> jax.Array:
    """|x| in fp32 with inf and NaN replaced by 0 (what the amax sees; also used inside the kernels)."""
    a = jnp.abs(x.astype(jnp.float32))
    return jnp.where(a <= jnp.finfo(jnp.float32).max, a, 0.0)  # False for inf and NaN


def finite_amax(x: jax.Array, axis=None) -> jax.Array:
    """max |x| over `axis` (keepdims when an axis is given) in fp32, ignoring inf and NaN; 0 if nothing is left."""
    return jnp.max(finite_abs(x), axis=axis, keepdims=axis is not None, initial=0.0)


def scale_from_amax(amax: jax.Array, dtype, power_of_2: bool) -> jax.Array:
    """amax / fp8_max as the product by fp8_max's fp32 reciprocal, floored at AMAX_FLOOR / fp8_max.

    Every scale (tensorwise, rowwise, blockwise) is defined by that product so that every backend computes it bit
    for bit alike: whether XLA's simplifier turns a division by a constant into the product by its (inexact)
    reciprocal differs between programs and between XLA releases (jax 0.12.1 keeps the division in a plain jitted
    function and rewrites it in an interpret-mode kernel's), and Triton's fp32 division is approximate (div.full).
    A product leaves no compiler a choice."""
    scale = jnp.maximum(amax.astype(jnp.float32), AMAX_FLOOR) * jnp.float32(1.0 / fp8_max(dtype))
    return round_up_pow2(scale) if power_of_2 else scale


def saturate(v: jax.Array, dtype) -> jax.Array:
    """An fp32 v clamped to the fp8 range, then cast: +-inf saturates, NaN stays NaN."""
    limit = fp8_max(dtype)
    return jnp.where(v == v, jnp.clip(v, -limit, limit), v).astype(dtype)


def saturating_cast(x: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """x / scale clamped to the fp8 range, then cast: never inf or NaN from an overflow, +-inf saturates, NaN
    stays NaN."""
    return saturate(x.astype(jnp.float32) / scale, dtype)


def quantize_reference(x: jax.Array, dtype=jnp.float8_e4m3fn, axis: int | None = None, power_of_2: bool = False):
    """(x_fp8, scale): tensorwise (axis=None, scalar scale) or the amax over `axis` (keepdims)."""
    scale = scale_from_amax(finite_amax(x, axis), dtype, power_of_2)
    return saturating_cast(x, scale, dtype), scale


def scaled_matmul_reference(a, b, a_scale, b_scale, *, out_dtype=jnp.bfloat16, fast_accum: bool = True):
    """(a * a_scale) @ (b * b_scale) as XLA's fp8 dot (fp32 result) and an fp32 rescale.

    `fast_accum=False` asks for the highest precision, which keeps XLA's cuBLAS call off its
    fast-accumulation mode.
    """
    precision = None if fast_accum else jax.lax.Precision.HIGHEST
    acc = jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)
    return (acc * jnp.asarray(a_scale, jnp.float32) * jnp.asarray(b_scale, jnp.float32)).astype(out_dtype)


def dequantize(x_fp8: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    # The barrier keeps the fp8 rounding: under jit XLA may otherwise fold a cast to fp8 and this cast back into
    # nothing (GPUs allow excess precision by default) and compute with the unrounded values.
    return (jax.lax.optimization_barrier(x_fp8).astype(jnp.float32) * scale).astype(dtype)


# ----------------------------------------------------------------------------------------------
# blockwise: one scale per (bm, bk) tile of a 2-D operand


def quantize_blockwise_reference(x: jax.Array, dtype=jnp.float8_e4m3fn, block=(1, 128), power_of_2: bool = False):
    """(x_fp8, scales) with one scale per `block` = (bm, bk) tile of the 2-D x (M, K): scales has shape
    (ceil(M / bm), ceil(K / bk)), a ragged last tile being a tile of its own. Per tile, the same rule as
    `quantize_reference`: an all-zero tile gets the finite floor scale (and quantizes to zeros), the cast
    saturates at +-fp8_max, inf and NaN stay out of the amax."""
    (m, k), (bm, bk) = x.shape, block
    mb, kb = -(-m // bm), -(-k // bk)
    # Zero padding leaves every amax as it is (|x| >= 0), and makes the tiles a reshape.
    a = jnp.pad(finite_abs(x), ((0, mb * bm - m), (0, kb * bk - k)))
    amax = jnp.max(a.reshape(mb, bm, kb, bk), axis=(1, 3), initial=0.0)
    scales = scale_from_amax(amax, dtype, power_of_2)
    return saturate(x.astype(jnp.float32) * expand_block_scales(1.0 / scales, block, x.shape), dtype), scales


def expand_block_scales(scales: jax.Array, block, shape) -> jax.Array:
    """Per-tile scales (ceil(M / bm), ceil(K / bk)) -> one per element, shape (M, K)."""
    (bm, bk), (m, k) = block, shape
    return jnp.repeat(jnp.repeat(scales, bm, axis=0), bk, axis=1)[:m, :k]


def dequantize_blockwise(x_fp8: jax.Array, scales: jax.Array, block, dtype=jnp.float32) -> jax.Array:
    return dequantize(x_fp8, expand_block_scales(scales, block, x_fp8.shape), dtype)


def matmul_nt_fp32(a: jax.Array, bt: jax.Array, out_dtype) -> jax.Array:
    """a (M, K) @ bt (N, K)^T accumulated in full fp32 (no TF32 or bf16 passes), rounded once to `out_dtype`."""
    return jax.lax.dot_general(a.astype(jnp.float32), bt.astype(jnp.float32), (((1,), (1,)), ((), ())),
                               precision=jax.lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32).astype(out_dtype)


def blockwise_scaled_matmul_nt_reference(a, bt, a_scales, b_scales, a_block=(1, 128), b_block=(128, 128), *,
                                         out_dtype=jnp.bfloat16):
    """(a dequantized) @ (bt dequantized)^T with per-tile scales: a (M, K), bt (N, K) fp8, both K-major.

    The exact product of the dequantized operands in fp32, which is what a GEMM that promotes each K-block's
    partial sum to fp32 and applies that block's two scales there computes (DeepSeek-V3's per-128 promotion),
    up to the order of the fp32 additions."""
    return matmul_nt_fp32(dequantize_blockwise(a, a_scales, a_block), dequantize_blockwise(bt, b_scales, b_block),
                          out_dtype)
