"""FP8 training configuration: one cast config per GEMM argument, one GEMM config per GEMM.

A linear layer y = x W (Flax layout: x (tokens, in), W (in, out)) runs three GEMMs:

    output       y  = x   @ W      cast configs: input,                 weight
    grad_input   dx = dy  @ W^T    cast configs: grad_output,           weight_for_grad_input
    grad_weight  dW = x^T @ dy     cast configs: input_for_grad_weight, grad_output_for_grad_weight

Each argument of each GEMM is scaled "tensorwise" (one fp32 scale), "axiswise" (one scale per row or
column: the amax is taken over that GEMM's contraction axis), "blockwise" (one scale per tile of `block`) or
"disabled" (kept in high precision). This mirrors torchao's `Float8LinearConfig` (pytorch/ao PR 940).

Blockwise scaling (DeepSeek-V3's recipe, `Float8Config.from_recipe("blockwise")`): a `block` is given in the
argument's K-major form, (rows, cols) = (along the GEMM's free axis, along its contraction axis). Activations
and output gradients take (1, 128), a 1 x 128 tile along the contraction axis of the GEMM they feed; weights
take (128, 128). Each GEMM needs its own operands' blocks along *its* contraction axis, so an argument used by
two GEMMs is quantized twice from the high-precision tensor, as torchao and DeepSeek-V3 do (re-quantizing the
fp8 copy would round twice): x is blocked 1 x 128 along `in` for y = x W and along the tokens for
dW = x^T dy; dy along `out` for dx = dy W^T and along the tokens for dW. A square weight block covers the
same elements in W and W^T, so the two weight operands share one quantization (the scales transposed).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

SCALINGS = ("tensorwise", "axiswise", "blockwise", "disabled")
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "blockwise")


@dataclasses.dataclass(frozen=True)
class CastConfig:
    """How one GEMM argument is cast: `scaling` in SCALINGS and the fp8 `dtype` (e4m3fn or e5m2).

    `block` (blockwise scaling only, where it is required): the tile that shares one scale, as (rows, cols) of
    the argument in K-major form: rows along the GEMM's free axis, cols along its contraction axis. E.g.
    `CastConfig("blockwise", E4M3, block=(1, 128))` for activations, `block=(128, 128)` for weights. A ragged
    last tile is a tile of its own.
    """

    scaling: str = "tensorwise"
    dtype: object = jnp.float8_e4m3fn
    block: tuple[int, int] | None = None

    def __post_init__(self):
        if self.scaling not in SCALINGS:
            raise ValueError(f"CastConfig: scaling must be one of {SCALINGS}, got {self.scaling!r}")
        dtype = jnp.dtype(self.dtype)
        if dtype not in FP8_DTYPES:
            raise ValueError(f"CastConfig: dtype must be float8_e4m3fn or float8_e5m2, got {dtype}")
        object.__setattr__(self, "dtype", dtype)
        if self.scaling != "blockwise":
            if self.block is not None:
                raise ValueError(f"CastConfig: block is for scaling='blockwise' only, got block={self.block!r} with "
                                 f"scaling={self.scaling!r}")
            return
        block = self.block
        if not (isinstance(block, tuple | list) and len(block) == 2
                and all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block)):
            raise ValueError(f"CastConfig: block must be a pair of positive ints (rows, cols) for "
                             f"scaling='blockwise', got {block!r}")
        object.__setattr__(self, "block", tuple(block))

    @property
    def disabled(self) -> bool:
        return self.scaling == "disabled"


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """One GEMM's settings: `fast_accum` lets the tensor cores accumulate fp8 products in their
    reduced-precision accumulator (faster; the error grows with K)."""

    fast_accum: bool = True


E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2


@dataclasses.dataclass(frozen=True)
class Float8Config:
    """Per-GEMM-argument FP8 configuration of a linear layer (see the module docstring).

    `round_scales_to_power_of_2` rounds every scale up to a power of two, so that scaling is exact
    (only the exponent changes). Build the standard recipes with `Float8Config.from_recipe(name)`.
    """

    cast_config_input: CastConfig = CastConfig("tensorwise", E4M3)
    cast_config_weight: CastConfig = CastConfig("tensorwise", E4M3)
    cast_config_grad_output: CastConfig = CastConfig("tensorwise", E5M2)
    cast_config_input_for_grad_weight: CastConfig = CastConfig("tensorwise", E4M3)
    cast_config_weight_for_grad_input: CastConfig = CastConfig("tensorwise", E4M3)
    cast_config_grad_output_for_grad_weight: CastConfig = CastConfig("tensorwise", E5M2)
    gemm_config_output: GemmConfig = GemmConfig(True)
    gemm_config_grad_input: GemmConfig = GemmConfig(False)
    gemm_config_grad_weight: GemmConfig = GemmConfig(False)
    round_scales_to_power_of_2: bool = False

    @property
    def blockwise(self) -> bool:
        """Whether any argument is scaled blockwise (the quantize passes are then the blockwise kernel's on the
        Pallas paths; the GEMMs run on the Hopper blockwise kernel or as the fp32 product of the dequantized
        operands)."""
        return any(getattr(self, f.name).scaling == "blockwise" for f in dataclasses.fields(self)
                   if f.name.startswith("cast_config"))

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name.startswith("cast_config") and not isinstance(value, CastConfig):
                raise ValueError(f"Float8Config: {field.name} must be a CastConfig, got {value!r}")
            if field.name.startswith("gemm_config") and not isinstance(value, GemmConfig):
                raise ValueError(f"Float8Config: {field.name} must be a GemmConfig, got {value!r}")

    @classmethod
    def from_recipe(cls, name: str) -> Float8Config:
        """The torchao recipes.

        - "tensorwise": tensorwise scales; e4m3 for inputs and weights, e5m2 for gradients.
        - "rowwise": every argument axiswise, e4m3, power-of-2 scales.
        - "rowwise_with_gw_hp": output: x and W axiswise; grad_input: dy axiswise, W tensorwise;
          grad_weight in high precision (x^T and dy stay bf16). Power-of-2 scales.
        - "blockwise": DeepSeek-V3's: e4m3 everywhere; x and dy in 1 x 128 tiles along each GEMM's
          contraction axis, W in 128 x 128 blocks; fp32 scales (set `round_scales_to_power_of_2` for
          power-of-2 ones). Quantized by the one-pass blockwise kernel on the Pallas paths; the GEMMs run on
          Hopper's Mosaic GPU kernel with per-K-block scale promotion ("pallas"), elsewhere as the exact fp32
          product of the dequantized operands.

        Accumulation as torchao's recipes: "tensorwise" (the class defaults) uses the tensor cores' fast
        accumulation for the output GEMM only; its two gradient GEMMs, whose contraction runs over all tokens
        for the weight gradient, accumulate in fp32. The axiswise recipes use fast accumulation in all three.
        Set `gemm_config_*` to change it. The blockwise GEMMs ignore it: the kernel's fast accumulation never
        runs past one 128-wide K block before its fp32 promotion, and the XLA path accumulates in fp32.
        """
        if name == "tensorwise":
            return cls()
        axis, fast = CastConfig("axiswise", E4M3), GemmConfig(True)
        if name == "rowwise":
            return cls(axis, axis, axis, axis, axis, axis, fast, fast, fast, round_scales_to_power_of_2=True)
        if name == "rowwise_with_gw_hp":
            off = CastConfig("disabled", E4M3)
            return cls(axis, axis, axis, off, CastConfig("tensorwise", E4M3), off, fast, fast, fast,
                       round_scales_to_power_of_2=True)
        if name == "blockwise":
            act, weight = CastConfig("blockwise", E4M3, block=(1, 128)), CastConfig("blockwise", E4M3, block=(128, 128))
            return cls(act, weight, act, act, weight, act)
        raise ValueError(f"Float8Config.from_recipe: name must be one of {RECIPES}, got {name!r}")


def as_config(config) -> Float8Config:
    """A Float8Config from a config or a recipe name."""
    if isinstance(config, Float8Config):
        return config
    if isinstance(config, str):
        return Float8Config.from_recipe(config)
    raise ValueError(f"config must be a Float8Config or a recipe name in {RECIPES}, got {config!r}")
