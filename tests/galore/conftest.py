"""GaLore tests: without a GPU, the default up-projection configurations run on fp32 operands.

The tuned defaults (kernel.UP_CONFIG) multiply fp16 operands, as exact as the TF32 the GPU path is held to
(kernel.py's note at UpConfig). In interpret mode the XLA:CPU reference is exact fp32, so the tests that hold the
default path to fp32 accuracy run the same configurations (tiles, loops, prefetch) with f16/p16 off; the fp16
operands themselves are tested against TF32-rounded float64 products in test_splitk_f16.py. On a GPU the real
defaults run (the GPU tests use TF32 tolerances)."""

import pytest

from pallas_fused import _backend
from pallas_fused.galore import kernel


@pytest.fixture(autouse=True)
def _fp32_default_up_operands_on_cpu(monkeypatch):
    if _backend.gpu_device() is not None:
        return
    cfg = kernel.UP_CONFIG
    fp32 = lambda c: c._replace(f16=False, p16=False)  # noqa: E731
    monkeypatch.setattr(kernel, "UP_CONFIG", {k: fp32(c) for k, c in cfg.items()} if isinstance(cfg, dict)
                        else fp32(cfg))
