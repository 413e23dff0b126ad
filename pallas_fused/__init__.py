"""pallas_fused: fused GPU kernels for training in JAX, written in Pallas.

Capabilities (one subpackage each): `rotary` (q and k rotated in one kernel), `dora` (DoRA layers),
`galore` (GaLore Adam), `adam` (fused AdamW, 8-bit states), `fp8` (FP8 scaled matmuls and Dense),
`embed` (embedding lookup with a one-hot GEMM gradient), `norm` (fused RMSNorm), `swiglu` (SwiGLU's gating
product and the Llama MLP around it), `loss` (the LM head and its cross-entropy in one op, without the logits);
`optim` gathers the optax transforms. Every op takes `implementation=None | "pallas" | "xla" |
"interpret"` (see `pallas_fused._backend`). `tune(fn, *example_args)` times the ops' candidates at the shapes `fn`
runs on this GPU and keeps the fastest in a per-device cache (`python -m pallas_fused.tune` for a model's shapes).
"""

from pallas_fused import adam, dora, embed, fp8, galore, loss, norm, optim, rotary, swiglu
from pallas_fused._backend import IMPLEMENTATIONS, ImplementationError, resolve_implementation
from pallas_fused.tune import tune  # the function; its module stays importable as `from pallas_fused.tune import ...`

__version__ = "0.2.0"

__all__ = ["IMPLEMENTATIONS", "ImplementationError", "adam", "dora", "embed", "fp8", "galore", "loss", "norm", "optim",
           "resolve_implementation", "rotary", "swiglu", "tune"]
