"""SwiGLU's gating product silu(gate) * up, one fused Pallas kernel each way; `SwiGLUMLP` / `NNXSwiGLUMLP` are
the Llama MLP around it (three Dense projections `gate`, `up`, `down`, a plain Llama MLP's params).

    from pallas_fused.swiglu import swiglu, SwiGLUMLP
    h = swiglu(gate, up)   # silu(gate) * up, in gate's dtype
"""

from pallas_fused.swiglu.api import swiglu
from pallas_fused.swiglu.flax import NNXSwiGLUMLP, SwiGLUMLP
from pallas_fused.swiglu.reference import swiglu_reference

__all__ = ["NNXSwiGLUMLP", "SwiGLUMLP", "swiglu", "swiglu_reference"]
