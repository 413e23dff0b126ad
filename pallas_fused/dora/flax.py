"""Flax drop-ins: linen `DoRADense` (for nn.Dense), NNX `DoRALinear` (for nnx.Linear), param converters; linen
`LoRADense`, the same layer as plain LoRA.

These modules only hold parameters and call `pallas_fused.dora.api`; they know nothing of Pallas.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from pallas_fused.dora.api import dora_dense, dora_dense_dropout
from pallas_fused.dora.lora import lora_dense
from pallas_fused.dora.quant import dequantize, quantize_int8, quantize_nf4
from pallas_fused.dora.reference import column_norm_reference, floored_norm

Dtype = Any
_QUANTIZERS: dict[str | None, Any] = {None: None, "int8": quantize_int8, "nf4": quantize_nf4}
_HE_UNIFORM = nn.initializers.he_uniform()  # nnx.LoRA's default for the fan-in matrix
_ZEROS = nn.initializers.zeros_init()


def lora_scale(rank: int, alpha: float | None = None, use_rslora: bool = False) -> float:
    """s = alpha / rank, or alpha / sqrt(rank) with rsLoRA; alpha=None means alpha = rank."""
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    alpha = float(rank) if alpha is None else float(alpha)
    return alpha / (rank ** 0.5 if use_rslora else rank)


def _check_quantize(quantize):
    if quantize not in _QUANTIZERS:
        raise ValueError(f"quantize must be None, 'int8' or 'nf4', got {quantize!r}")


class _AdapterDense(nn.Module):
    """The fields an adapter drop-in for nn.Dense shares: nn.Dense's, the rank and the LoRA scale's."""

    features: int
    rank: int
    alpha: float | None = None
    use_rslora: bool = False
    use_bias: bool = True
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    kernel_init: Any = nn.linear.default_kernel_init
    bias_init: Any = nn.initializers.zeros_init()
    lora_a_init: Any = _HE_UNIFORM
    lora_b_init: Any = _ZEROS


class LoRADense(_AdapterDense):
    """A plain-LoRA drop-in for `flax.linen.Dense` (`lora_dense`): ``y = x W + s (x A) B + b``.

    Params: ``kernel`` (in, features) and ``bias`` exactly as nn.Dense (train them frozen), ``lora_a`` (in, rank) and
    ``lora_b`` (rank, features, zero-initialised): nn.Dense params plus the two adapters apply unchanged.
    """

    implementation: str | None = None  # as lora_dense: None, "pallas", "xla", "interpret"

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        fin = jnp.shape(inputs)[-1]
        if self.rank < 1 or self.rank > min(fin, self.features):
            raise ValueError(f"LoRADense: rank must be in [1, min(in, features) = {min(fin, self.features)}], "
                             f"got {self.rank}")
        kernel = self.param("kernel", self.kernel_init, (fin, self.features), self.param_dtype)
        lora_a = self.param("lora_a", self.lora_a_init, (fin, self.rank), self.param_dtype)
        lora_b = self.param("lora_b", self.lora_b_init, (self.rank, self.features), self.param_dtype)
        bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype) if self.use_bias else None
        dtype = self.dtype or jnp.result_type(inputs, self.param_dtype)
        return lora_dense(jnp.asarray(inputs, dtype), kernel, lora_a, lora_b, bias,
                          scale=lora_scale(self.rank, self.alpha, self.use_rslora), implementation=self.implementation)


class DoRADense(_AdapterDense):
    """A DoRA drop-in for `flax.linen.Dense`.

    Params: ``kernel`` (in, features) and ``bias`` (features,) exactly as nn.Dense (train them frozen), plus
    ``lora_a`` (in, rank), ``lora_b`` (rank, features, zero-initialised) and ``magnitude`` (features,)
    initialised to ||W + s A B|| per output feature. Pretrained nn.Dense params are converted with
    `dense_to_dora_params` (kernel and bias kept as they are, the adapters added so that the layer starts out
    equal to the Dense); applying the layer to Dense params without the adapters raises a ValueError saying so.
    `merge_params` folds trained params back into nn.Dense params with this layer's own scale.
    With ``quantize="int8"|"nf4"`` the ``kernel`` param is an `Int8Kernel` / `NF4Kernel` (QDoRA).

    Dropout (``dropout > 0`` and not deterministic) follows peft:
    ``y = x W + b + (g - 1) (x_d W) + g s (x_d A) B``; it needs a 'dropout' rng.
    """

    dropout: float = 0.0
    deterministic: bool | None = None
    quantize: str | None = None
    exact_norm_grad: bool = False
    implementation: str | None = None  # as dora_dense: None, "pallas", "pallas:<variant>", "xla", "interpret"
    # see dora_dense: keep the merged weight for the backward (memory) or form it again; None: for a dense W only
    save_merged: bool | None = None

    @nn.compact
    def __call__(self, inputs: jax.Array, deterministic: bool | None = None) -> jax.Array:
        _check_quantize(self.quantize)
        fin = jnp.shape(inputs)[-1]
        if self.rank < 1 or self.rank > min(fin, self.features):
            raise ValueError(f"DoRADense: rank must be in [1, min(in, features) = {min(fin, self.features)}], "
                             f"got {self.rank}")
        s = lora_scale(self.rank, self.alpha, self.use_rslora)
        quantizer = _QUANTIZERS[self.quantize]
        if not self.is_mutable_collection("params"):
            missing = [k for k in ("lora_a", "lora_b", "magnitude") if not self.has_variable("params", k)]
            if missing and self.has_variable("params", "kernel"):
                raise ValueError(
                    f"DoRADense: params have no {missing} (got {sorted(self.variables.get('params', {}))}). nn.Dense "
                    f"params need the DoRA adapters first: params = dense_to_dora_params(dense_params, {self.rank}, "
                    f"key=key, alpha={self.alpha}) keeps kernel and bias and adds lora_a, lora_b = 0 and magnitude.")

        def kernel_init(key, shape, dtype):
            w = self.kernel_init(key, shape, dtype)
            return w if quantizer is None else quantizer(w)

        kernel = self.param("kernel", kernel_init, (fin, self.features), self.param_dtype)
        lora_a = self.param("lora_a", self.lora_a_init, (fin, self.rank), self.param_dtype)
        lora_b = self.param("lora_b", self.lora_b_init, (self.rank, self.features), self.param_dtype)
        magnitude = self.param(
            "magnitude",
            lambda _: column_norm_reference(kernel, lora_a, lora_b, s, jnp.float32).astype(self.param_dtype),
        )
        bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype) if self.use_bias else None

        dtype = self.dtype or jnp.result_type(inputs, self.param_dtype)
        x = jnp.asarray(inputs, dtype)
        if quantizer is None:
            kernel = jnp.asarray(kernel, dtype)
        kw: dict[str, Any]
        kw = dict(scale=s, exact_norm_grad=self.exact_norm_grad, implementation=self.implementation,
                  save_merged=self.save_merged)
        deterministic = nn.merge_param("deterministic", self.deterministic, deterministic) \
            if self.dropout > 0 else True
        if self.dropout > 0 and not deterministic:
            x_d = nn.Dropout(rate=self.dropout, deterministic=False)(x)
            return dora_dense_dropout(x, x_d, kernel, lora_a, lora_b, magnitude, bias, **kw)
        return dora_dense(x, kernel, lora_a, lora_b, magnitude, bias, **kw)

    def merge_params(self, params) -> dict:
        """This layer's trained params -> nn.Dense params (see `merge`), with this layer's alpha and rsLoRA."""
        if params.get("lora_a") is not None and jnp.shape(params["lora_a"])[-1] != self.rank:
            raise ValueError(f"DoRADense.merge_params: params['lora_a'] has rank {jnp.shape(params['lora_a'])[-1]}, "
                             f"this layer has rank {self.rank}")
        return merge(params, alpha=self.alpha, use_rslora=self.use_rslora)


def dense_to_dora_params(dense_params, rank: int, *, key: jax.Array, alpha: float | None = None,
                         use_rslora: bool = False, lora_a_init=_HE_UNIFORM,
                         quantize: str | None = None) -> dict:
    """Params of an nn.Dense ({'kernel', 'bias'?}) -> params of a DoRADense (B = 0, so outputs match)."""
    _check_quantize(quantize)
    kernel = dense_params["kernel"]
    if jnp.ndim(kernel) != 2:
        raise ValueError(f"dense_params['kernel'] must be 2-D (in, out), got shape {jnp.shape(kernel)}")
    fin, fout = kernel.shape
    if rank < 1 or rank > min(fin, fout):
        raise ValueError(f"rank must be in [1, min(in, out) = {min(fin, fout)}], got {rank}")
    dt = kernel.dtype
    lora_a = lora_a_init(key, (fin, rank), dt)
    lora_b = jnp.zeros((rank, fout), dt)
    s = lora_scale(rank, alpha, use_rslora)
    stored = kernel if quantize is None else _QUANTIZERS[quantize](kernel)
    out = dict(dense_params)
    out.update(kernel=stored, lora_a=lora_a, lora_b=lora_b,
               magnitude=column_norm_reference(stored, lora_a, lora_b, s, jnp.float32).astype(dt))
    return out


_REQUIRED: Any = object()  # a sentinel: `merge` has no usable default for alpha


def merge(dora_params, *, alpha: float | None = _REQUIRED, use_rslora: bool = False) -> dict:
    """DoRADense params -> nn.Dense params for inference: kernel = (W + s A B) * m / ||W + s A B||.

    `alpha` (None meaning alpha = rank) and `use_rslora` must be the module's: the params do not record the scale
    s, and another alpha gives another kernel, so `alpha` has no default (`DoRADense.merge_params` passes the
    layer's own). The rank is read from ``lora_a``.
    """
    if alpha is _REQUIRED:
        raise ValueError("merge: pass alpha (None meaning alpha = rank) and use_rslora as the DoRADense was built "
                         "with, or call layer.merge_params(params): the params do not record the scale alpha / rank")
    a, b, m = dora_params["lora_a"], dora_params["lora_b"], dora_params["magnitude"]
    s = lora_scale(a.shape[1], alpha, use_rslora)
    return _merged(dora_params["kernel"], a, b, m, dora_params.get("bias"), s)


def _merged(kernel, a, b, m, bias, s) -> dict:
    """{'kernel': (W + s A B) m / max(||W + s A B||, floor) in A's dtype, 'bias'?}."""
    w = dequantize(kernel, jnp.float32)
    v = w + s * (a.astype(jnp.float32) @ b.astype(jnp.float32))
    g = m.astype(jnp.float32) / floored_norm(jnp.sum(v * v, axis=0))
    out_dtype = a.dtype
    merged = {"kernel": (v * g[None, :]).astype(out_dtype)}
    if bias is not None:
        merged["bias"] = bias
    return merged


class DoRALinear(nnx.Linear):
    """An `nnx.Linear` with DoRA, in the style of `nnx.LoRALinear` (state compatible with nnx.Linear).

    ``lora_a``, ``lora_b`` and ``magnitude`` are `nnx.LoRAParam`s, so
    ``nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)`` trains only them; ``kernel``/``bias`` stay `nnx.Param`.

    Pretrained weights: ``DoRALinear.from_linear(linear, rank=..., rngs=...)`` wraps an `nnx.Linear` (its kernel
    and bias, magnitude = ||W||, B = 0: the same outputs), and ``to_linear()`` merges back into an `nnx.Linear`.
    Loading a Linear's state with ``nnx.update`` replaces the kernel but not the magnitude computed from the old
    one: call ``reset_magnitude()`` after it.
    """

    def __init__(self, in_features: int, out_features: int, *, rank: int, alpha: float | None = None,
                 use_rslora: bool = False, dropout: float = 0.0, a_initializer=_HE_UNIFORM,
                 b_initializer=_ZEROS, exact_norm_grad: bool = False,
                 implementation: str | None = None, save_merged: bool | None = None, rngs: nnx.Rngs,
                 **kwargs):
        super().__init__(in_features, out_features, rngs=rngs, **kwargs)
        if rank < 1 or rank > min(in_features, out_features):
            raise ValueError(f"DoRALinear: rank must be in [1, min(in, out) = {min(in_features, out_features)}], "
                             f"got {rank}")
        pdt = self.param_dtype
        self.scale = lora_scale(rank, alpha, use_rslora)
        self.lora_a = nnx.LoRAParam(a_initializer(rngs.params(), (in_features, rank), pdt))
        self.lora_b = nnx.LoRAParam(b_initializer(rngs.params(), (rank, out_features), pdt))
        norm = column_norm_reference(self.kernel[...], self.lora_a[...], self.lora_b[...], self.scale, jnp.float32)
        self.magnitude = nnx.LoRAParam(norm.astype(pdt))
        self.dropout = nnx.Dropout(dropout, rngs=rngs) if dropout > 0 else None
        self.rank = rank
        self.exact_norm_grad = exact_norm_grad
        self.implementation = implementation
        self.save_merged = save_merged

    @classmethod
    def from_linear(cls, linear: nnx.Linear, *, rank: int, rngs: nnx.Rngs, **kwargs) -> DoRALinear:
        """A DoRALinear around a (pretrained) `nnx.Linear`: its kernel and bias, its dtype, param_dtype,
        precision and initializers; B = 0 and magnitude = ||W||, so it computes what `linear` computes.
        `kwargs` go to the constructor (alpha, use_rslora, dropout, implementation, ...)."""
        if not isinstance(linear, nnx.Linear):
            raise ValueError(f"DoRALinear.from_linear: linear must be an nnx.Linear, got {type(linear).__name__}")
        fin, fout = linear.in_features, linear.out_features
        kwargs.setdefault("use_bias", linear.bias is not None)
        for name in ("dtype", "param_dtype", "precision", "kernel_init", "bias_init"):
            if hasattr(linear, name):
                kwargs.setdefault(name, getattr(linear, name))
        layer = cls(fin, fout, rank=rank, rngs=rngs, **kwargs)
        layer.kernel = nnx.Param(jnp.asarray(linear.kernel[...]))
        if linear.bias is not None and layer.bias is not None:
            layer.bias = nnx.Param(jnp.asarray(linear.bias[...]))
        layer.reset_magnitude()
        return layer

    def reset_magnitude(self) -> None:
        """magnitude = ||W + s A B|| per output feature (after loading a kernel, e.g. with nnx.update)."""
        norm = column_norm_reference(self.kernel[...], self.lora_a[...], self.lora_b[...], self.scale, jnp.float32)
        self.magnitude = nnx.LoRAParam(norm.astype(self.magnitude[...].dtype))

    def to_linear(self) -> nnx.Linear:
        """An `nnx.Linear` with the merged kernel (W + s A B) m / ||W + s A B|| and this layer's bias."""
        merged = _merged(self.kernel[...], self.lora_a[...], self.lora_b[...], self.magnitude[...],
                         None if self.bias is None else self.bias[...], self.scale)
        linear = nnx.Linear(self.in_features, self.out_features, use_bias=self.bias is not None, dtype=self.dtype,
                            param_dtype=self.param_dtype, precision=self.precision, rngs=nnx.Rngs(0))
        linear.kernel = nnx.Param(merged["kernel"].astype(self.kernel[...].dtype))
        if self.bias is not None:
            linear.bias = nnx.Param(jnp.asarray(merged["bias"]))
        return linear

    def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
        del out_sharding
        dtype = self.dtype or jnp.result_type(inputs, self.param_dtype)
        x = jnp.asarray(inputs, dtype)
        bias = self.bias[...] if self.bias is not None else None
        args = (jnp.asarray(self.kernel[...], dtype), self.lora_a[...], self.lora_b[...], self.magnitude[...], bias)
        kw: dict[str, Any]
        kw = dict(scale=self.scale, exact_norm_grad=self.exact_norm_grad, implementation=self.implementation,
                  save_merged=self.save_merged)
        if self.dropout is not None and not self.dropout.deterministic:
            return dora_dense_dropout(x, self.dropout(x), *args, **kw)
        return dora_dense(x, *args, **kw)
