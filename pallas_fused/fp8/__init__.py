"""FP8 training: dynamic tensorwise/axiswise/blockwise scaled matmuls with per-GEMM-argument configuration
(torchao's float8 recipes), Pallas kernels, and Flax drop-ins."""

from pallas_fused.fp8.api import fp8_linear, quantize, scaled_matmul, scaled_matmul_nt
from pallas_fused.fp8.config import RECIPES, CastConfig, Float8Config, GemmConfig
from pallas_fused.fp8.flax import Float8Dense, Float8DotGeneral
from pallas_fused.fp8.frozen import frozen_fp8_matmul

__all__ = [
    "RECIPES",
    "CastConfig",
    "Float8Config",
    "Float8Dense",
    "Float8DotGeneral",
    "GemmConfig",
    "fp8_linear",
    "frozen_fp8_matmul",
    "quantize",
    "scaled_matmul",
    "scaled_matmul_nt",
]
