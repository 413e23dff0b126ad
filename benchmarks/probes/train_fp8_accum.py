"""Backs the grad_gemms_fp32 row of fp8_dev/2026-11-25_fp8_loss_probe.md (fp32-accumulated gradients).

examples/train_llama.py with the FP8 recipe's gradient GEMMs (grad_input, grad_weight) accumulating in fp32
instead of the tensor cores' fast accumulation (torchao's Float8LinearConfig default: fast accumulation for
the output GEMM only; the tensorwise recipe's default since). Dev probe for the FP8 run's loss gap; the
arguments are train_llama.py's.
"""
import dataclasses
import runpy
import sys

from pallas_fused.fp8.config import Float8Config, GemmConfig

_from_recipe = Float8Config.from_recipe.__func__


def _torchao_accumulation(cls, name):
    return dataclasses.replace(_from_recipe(cls, name), gemm_config_grad_input=GemmConfig(False),
                               gemm_config_grad_weight=GemmConfig(False))


Float8Config.from_recipe = classmethod(_torchao_accumulation)
sys.argv = ["examples/train_llama.py", *sys.argv[1:]]
runpy.run_path("examples/train_llama.py", run_name="__main__")
