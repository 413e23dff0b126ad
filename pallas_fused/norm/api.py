"""`rms_norm`: the public RMSNorm op (argument checks, implementation choice, custom_vjp)."""

from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp

from pallas_fused import _backend, _sharding
from pallas_fused.norm import kernel as _kernel
from pallas_fused.norm.reference import output_dtype, reference_rms_norm


@dataclasses.dataclass(frozen=True)
class _Static:
    eps: float
    out_dtype: jnp.dtype
    interpret: bool


def _forward(x2, scale, st: _Static):
    def local(*args):
        return _kernel.rms_norm_fwd_pallas(args[0], args[1] if len(args) > 1 else None, eps=st.eps,
                                           out_dtype=st.out_dtype, interpret=st.interpret)

    if scale is None:
        return _sharding.partitioned(local, "r d -> r d, r", replicated=("d",))(x2)
    return _sharding.partitioned(local, "r d, d -> r d, r", replicated=("d",))(x2, scale)


def _backward(dy2, x2, rstd, scale, st: _Static):
    if scale is None:
        def local(dy2, x2, rstd):
            return _kernel.rms_norm_bwd_pallas(dy2, x2, rstd, None, interpret=st.interpret)[0]

        return _sharding.partitioned(local, "r d, r d, r -> r d", replicated=("d",))(dy2, x2, rstd), None

    def local_scaled(dy2, x2, rstd, scale):
        return _kernel.rms_norm_bwd_pallas(dy2, x2, rstd, scale, interpret=st.interpret)

    def summed_over(axes):  # rows sharded: each shard's (D,) dscale is all-reduced; dx stays sharded
        def run(*args):
            dx, dscale = local_scaled(*args)
            return dx, jax.lax.psum(dscale, axes)

        return run

    return _sharding.partitioned(local_scaled, "r d, r d, r, d -> r d, d", replicated=("d",), reduced=("r",),
                                 reduced_fn=summed_over)(dy2, x2, rstd, scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _rms_norm(x2, scale, st: _Static):
    return _forward(x2, scale, st)[0]


def _rms_norm_fwd(x2, scale, st: _Static):
    y, rstd = _forward(x2, scale, st)
    return y, (x2, scale, rstd)  # rstd: one float32 a row, so the backward pass need not reduce x again


def _rms_norm_bwd(st: _Static, res, dy):
    x2, scale, rstd = res
    dx, dscale = _backward(dy, x2, rstd, scale, st)
    return dx, None if scale is None else dscale.astype(scale.dtype)


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def rms_norm(x, scale=None, *, epsilon: float = 1e-6, dtype=None, implementation: str | None = None):
    """RMSNorm over the last axis: x * rsqrt(mean(x^2) + epsilon) * scale, as `flax.linen.RMSNorm` computes it.

    Args:
      x: floating-point array (..., D).
      scale: None or a (D,) floating-point array (nn.RMSNorm's `scale` param).
      epsilon: added to the mean square (a Python number: static configuration; nn.RMSNorm's default).
      dtype: the result dtype (None: the promotion of x's and scale's dtypes, as nn.RMSNorm).
      implementation: None (the kernel on a GPU, the XLA reference elsewhere), "pallas", "xla" or "interpret".

    All arithmetic is float32. "xla" is `reference_rms_norm` (nn.RMSNorm's own arithmetic) and its autodiff;
    "pallas" / "interpret" run one fused kernel forward (saving only a float32 rstd per row) and one backward
    (dx and per-program partial dscale, summed after). Rows wider than `kernel.MAX_FEATURES` (16384) features
    run the reference under every implementation: they do not fit the kernel's one-tile-per-row design.
    Differentiable in x and scale; works under jit and vmap; empty x gives an empty result.
    """
    if not hasattr(x, "shape") or not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x: expected a floating-point array, got {getattr(x, 'dtype', type(x).__name__)}")
    if x.ndim < 1:
        raise ValueError(f"x: expected at least 1 dimension (..., features), got shape {x.shape}")
    if scale is not None:
        if not hasattr(scale, "dtype") or not jnp.issubdtype(scale.dtype, jnp.floating):
            raise ValueError(f"scale: expected None or a floating-point array, got "
                             f"{getattr(scale, 'dtype', type(scale).__name__)}")
        if scale.shape != x.shape[-1:]:
            raise ValueError(f"scale: expected shape {x.shape[-1:]} (x's last axis), got {scale.shape}")
    if isinstance(epsilon, bool) or not isinstance(epsilon, numbers.Real) or not epsilon >= 0:
        raise ValueError(f"epsilon: expected a Python number >= 0, got {epsilon!r}")
    if dtype is not None and not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
        raise ValueError(f"dtype: expected None or a floating-point dtype, got {dtype}")
    impl = _backend.resolve_implementation(implementation, op="rms_norm")
    features = x.shape[-1]
    if impl == "xla" or x.size == 0 or features > _kernel.MAX_FEATURES:
        return reference_rms_norm(x, scale, epsilon, dtype)
    st = _Static(float(epsilon), jnp.dtype(output_dtype(x, scale, dtype)), impl == "interpret")
    y = _rms_norm(x.reshape(-1, features), scale, st)
    return y.reshape(x.shape)
