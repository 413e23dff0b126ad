"""Frozen base-weight formats: int8 (per-output-channel scales) and NF4 (bitsandbytes codebook, blocks of 64) for
QDoRA, and FP8 (e4m3 codes with one scale, or one per output feature) for a base whose GEMMs run in FP8.

Int8 and NF4 are pytrees that `dora_dense` accepts in place of the dense `kernel` (in, out). The kernels
dequantise tiles of them in registers; `dequantize` here is the plain-jnp ground truth. `Fp8Kernel` is what
`pallas_fused.fp8.frozen_fp8_matmul` multiplies by (LoRA / DoRA over an FP8 base: `dora.lora_fp8_dense`,
`dora.dora_fp8_dense`).

NF4 layout (ours, chosen so a GEMM tile never has to interleave nibbles): the input axis is padded to a
multiple of 128 (`in_padded`), split in two halves, and byte `packed[i, j]` holds the code of row
`i` in its high nibble and of row `i + in_padded // 2` in its low nibble. Blocks of 64 consecutive input
rows of one output column share one absmax (the bitsandbytes blocking of a (out, in) weight), so
`absmax` has shape (in_padded // 64, out). The codebook is bitsandbytes' NF4 table.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

NF4_BLOCK = 64
NF4_CODEBOOK = np.array(
    [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
     -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
     0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
     0.7229568362236023, 1.0],
    dtype=np.float32,
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int8Kernel:
    """W ~= q * scale[None, :]; q int8 (in, out), scale float32 (out,)."""

    q: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return (self.q.astype(jnp.float32) * self.scale[None, :]).astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NF4Kernel:
    """NF4 weight: packed uint8 (in_padded // 2, out), absmax float32 (in_padded // 64, out)."""

    packed: jax.Array
    absmax: jax.Array
    in_features: int = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int]:
        return (self.in_features, self.packed.shape[1])

    @property
    def in_padded(self) -> int:
        return 2 * self.packed.shape[0]

    def codes(self) -> jax.Array:
        """The 4-bit codes, (in_padded, out) int32."""
        p = self.packed.astype(jnp.int32)
        return jnp.concatenate([p >> 4, p & 15], axis=0)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        values = jnp.asarray(NF4_CODEBOOK)[self.codes()]
        scale = jnp.repeat(self.absmax, NF4_BLOCK, axis=0)
        return (values * scale)[: self.in_features].astype(dtype)


FP8_RECIPES = ("tensorwise", "rowwise")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Kernel:
    """W ~= codes * scale: codes float8_e4m3fn (in, out); scale float32, one for the whole weight (shape ()) with
    `recipe` "tensorwise", one per output feature (out,) with "rowwise" (torchao's recipe names: the weight's
    operand in the forward GEMM, W^T, is scaled per row). One byte per weight element."""

    codes: jax.Array
    scale: jax.Array
    recipe: str = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        from pallas_fused.fp8 import reference as fp8_reference  # here: pallas_fused.fp8 imports this module

        return fp8_reference.dequantize(self.codes, self.scale if self.scale.ndim == 0 else self.scale[None, :], dtype)


def quantize_int8(kernel: jax.Array) -> Int8Kernel:
    """Symmetric int8 with one scale per output feature (column of the (in, out) kernel)."""
    w = jnp.asarray(kernel, jnp.float32)
    if w.ndim != 2:
        raise ValueError(f"quantize_int8: kernel must be 2-D (in, out), got shape {w.shape}")
    amax = jnp.max(jnp.abs(w), axis=0)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    q = jnp.clip(jnp.round(w / scale[None, :]), -127, 127).astype(jnp.int8)
    return Int8Kernel(q=q, scale=scale)


def quantize_nf4(kernel: jax.Array) -> NF4Kernel:
    """NF4 with the bitsandbytes codebook and one absmax per 64 input rows of each output column."""
    w = jnp.asarray(kernel, jnp.float32)
    if w.ndim != 2:
        raise ValueError(f"quantize_nf4: kernel must be 2-D (in, out), got shape {w.shape}")
    fin, fout = w.shape
    in_padded = -(-fin // (2 * NF4_BLOCK)) * (2 * NF4_BLOCK)
    w = jnp.pad(w, ((0, in_padded - fin), (0, 0)))
    blocks = w.reshape(in_padded // NF4_BLOCK, NF4_BLOCK, fout)
    absmax = jnp.max(jnp.abs(blocks), axis=1)
    safe = jnp.where(absmax > 0, absmax, 1.0)
    normed = blocks / safe[:, None, :]
    codes = jnp.argmin(jnp.abs(normed[..., None] - jnp.asarray(NF4_CODEBOOK)), axis=-1)
    codes = codes.reshape(in_padded, fout).astype(jnp.uint8)
    half = in_padded // 2
    packed = (codes[:half] << 4) | codes[half:]
    return NF4Kernel(packed=packed.astype(jnp.uint8), absmax=absmax, in_features=fin)


def quantize_fp8(kernel: jax.Array, recipe: str = "rowwise") -> Fp8Kernel:
    """e4m3 codes with one scale (`recipe` "tensorwise") or one per output feature ("rowwise", power-of-2 scales, as
    torchao's rowwise recipe rounds them); the scales as `pallas_fused.fp8.quantize` takes them (amax over the finite
    values, saturating cast)."""
    if recipe not in FP8_RECIPES:
        raise ValueError(f"quantize_fp8: recipe must be one of {FP8_RECIPES}, got {recipe!r}")
    w = jnp.asarray(kernel)
    if w.ndim != 2 or not jnp.issubdtype(w.dtype, jnp.floating):
        raise ValueError(f"quantize_fp8: kernel must be a 2-D float (in, out) array, got shape {w.shape} "
                         f"dtype {w.dtype}")
    from pallas_fused.fp8 import reference as fp8_reference  # here: pallas_fused.fp8 imports this module

    rowwise = recipe == "rowwise"
    codes, scale = fp8_reference.quantize_reference(w, jnp.float8_e4m3fn, 0 if rowwise else None, rowwise)
    # -0 codes become +0: a zero update (optax.set_to_zero on a frozen weight) then leaves every code's bits as
    # they are (-0 + 0 is +0).
    codes = jnp.where(codes == 0, jnp.zeros_like(codes), codes)
    return Fp8Kernel(codes=codes, scale=scale.reshape(-1) if rowwise else scale, recipe=recipe)


def is_quantized(kernel) -> bool:
    return isinstance(kernel, (Int8Kernel, NF4Kernel, Fp8Kernel))


def dequantize(kernel, dtype=jnp.float32) -> jax.Array:
    """Full-precision (in, out) weight of any supported kernel format (reference / tests / merge only)."""
    if is_quantized(kernel):
        return kernel.dequantize(dtype)
    return jnp.asarray(kernel).astype(dtype)
