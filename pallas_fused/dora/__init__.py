"""DoRA (weight-decomposed low-rank adaptation): fused column-norm and epilogue-GEMM kernels, QDoRA, Flax; and
plain LoRA fused (`lora_dense`), the layer DoRA is measured against; LoRA / DoRA over an FP8 base."""

from pallas_fused.dora.api import column_scale, dora_dense, dora_dense_dropout
from pallas_fused.dora.config import (
    ColumnsConfig,
    Config,
    EpilogueConfig,
    GemmConfig,
    MergeConfig,
    NormConfig,
    NormTiles,
)
from pallas_fused.dora.flax import DoRADense, DoRALinear, LoRADense, dense_to_dora_params, lora_scale, merge
from pallas_fused.dora.fp8_base import dora_fp8_dense, lora_fp8_dense
from pallas_fused.dora.lora import lora_dense, lora_dense_reference
from pallas_fused.dora.quant import (
    Fp8Kernel,
    Int8Kernel,
    NF4Kernel,
    dequantize,
    quantize_fp8,
    quantize_int8,
    quantize_nf4,
)
from pallas_fused.dora.reference import column_scale_reference, dora_dense_reference

__all__ = [
    "ColumnsConfig",
    "Config",
    "EpilogueConfig",
    "GemmConfig",
    "MergeConfig",
    "NormConfig",
    "NormTiles",
    "DoRADense",
    "DoRALinear",
    "Fp8Kernel",
    "Int8Kernel",
    "LoRADense",
    "NF4Kernel",
    "column_scale",
    "column_scale_reference",
    "dense_to_dora_params",
    "dequantize",
    "dora_dense",
    "dora_dense_dropout",
    "dora_dense_reference",
    "dora_fp8_dense",
    "lora_dense",
    "lora_dense_reference",
    "lora_fp8_dense",
    "lora_scale",
    "merge",
    "quantize_fp8",
    "quantize_int8",
    "quantize_nf4",
]
