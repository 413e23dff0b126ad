"""`swiglu`: the public SwiGLU gating op (argument checks, implementation choice, custom_vjp)."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from pallas_fused import _backend, _sharding
from pallas_fused.swiglu import kernel as _kernel
from pallas_fused.swiglu.reference import swiglu_reference

DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class _Static:
    interpret: bool
    fwd_config: _kernel.LaunchConfig | None = None
    bwd_config: _kernel.LaunchConfig | None = None


def _rows(x):
    """x as the kernels' 2-D (rows, F) view (a scalar is one row of one)."""
    cols = x.shape[-1] if x.ndim else 1
    return x.reshape(math.prod(x.shape[:-1]) if x.ndim else 1, cols)


def _rule(ndim: int, n_in: int, n_out: int) -> str:
    """The sharding rule of an elementwise op: every axis of every operand and result a shared, splittable factor."""
    term = " ".join(f"a{i}" for i in range(ndim))
    return ", ".join([term] * n_in) + " -> " + ", ".join([term] * n_out)


def _forward(gate, up, st: _Static):
    def local(gate, up):
        out = _kernel.swiglu_fwd_pallas(_rows(gate), _rows(up), interpret=st.interpret, config=st.fwd_config)
        return out.reshape(gate.shape)

    return _sharding.partitioned(local, _rule(gate.ndim, 2, 1))(gate, up)


def _backward(gate, up, dout, st: _Static):
    def local(gate, up, dout):
        dgate, dup = _kernel.swiglu_bwd_pallas(_rows(gate), _rows(up), _rows(dout), interpret=st.interpret,
                                               config=st.bwd_config)
        return dgate.reshape(gate.shape), dup.reshape(up.shape)

    return _sharding.partitioned(local, _rule(gate.ndim, 3, 2))(gate, up, dout)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _swiglu(gate, up, st: _Static):
    return _forward(gate, up, st)


def _swiglu_fwd(gate, up, st: _Static):
    return _forward(gate, up, st), (gate, up)  # the backward kernel recomputes the sigmoid from gate


def _swiglu_bwd(st: _Static, res, dout):
    gate, up = res
    return _backward(gate, up, dout.astype(gate.dtype), st)


_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def _check(name: str, x) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"{name}: expected an array, got {type(x).__name__}")
    if jnp.dtype(x.dtype) not in DTYPES:
        raise ValueError(f"{name}: expected a float32, bfloat16 or float16 array, got {x.dtype}")


def swiglu(gate, up, *, implementation: str | None = None):
    """SwiGLU's gating product silu(gate) * up = gate * sigmoid(gate) * up, elementwise.

    In a Llama MLP, `down(swiglu(gate(x), up(x)))` (see `SwiGLUMLP`).

    Args:
      gate: float32, bfloat16 or float16 array of any shape (..., F).
      up: an array of gate's shape and dtype.
      implementation: None (the kernel on a GPU, the XLA reference elsewhere), "pallas", "xla" or "interpret".

    Returns:
      silu(gate) * up in gate's dtype.

    All arithmetic is float32, rounded once to the inputs' dtype. "xla" is `swiglu_reference` and its autodiff;
    "pallas" / "interpret" run one fused kernel forward and one backward that writes both gradients (the sigmoid
    recomputed from gate, so only gate and up are saved for it). Differentiable in gate and up; works under jit,
    vmap and remat; sharded inputs stay sharded along every axis (each device runs the kernels on its shard);
    empty inputs give an empty result.

    Raises:
      ValueError: naming the argument, for a dtype other than float32, bfloat16 or float16, or an `up` whose shape
        or dtype differs from gate's.
    """
    return swiglu_with_config(gate, up, implementation=implementation)


def swiglu_with_config(gate, up, *, implementation: str | None = None, fwd_config: _kernel.LaunchConfig | None = None,
                       bwd_config: _kernel.LaunchConfig | None = None):
    """`swiglu` with explicit kernel launch geometries (benchmarks and tests; None = this device's tuning)."""
    _check("gate", gate)
    _check("up", up)
    if tuple(up.shape) != tuple(gate.shape):
        raise ValueError(f"up: expected gate's shape {tuple(gate.shape)}, got {tuple(up.shape)}")
    if up.dtype != gate.dtype:
        raise ValueError(f"up: expected gate's dtype {gate.dtype}, got {up.dtype}")
    impl = _backend.resolve_implementation(implementation, op="swiglu")
    gate, up = jnp.asarray(gate), jnp.asarray(up)
    if impl == "xla" or gate.size == 0:
        return swiglu_reference(gate, up)
    return _swiglu(gate, up, _Static(impl == "interpret", fwd_config, bwd_config))
