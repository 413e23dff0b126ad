"""`linear_cross_entropy`: the public fused LM-head loss (argument checks, implementation choice, custom_vjp)."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import jax
import jax.numpy as jnp
from jax import lax

from pallas_fused import _backend
from pallas_fused.loss import kernel as _kernel
from pallas_fused.loss.reference import (
    REDUCTIONS,
    LossConfig,
    chunked_token_loss,
    grad_coefficients,
    reduce_loss,
    token_loss,
)

DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
LAYOUTS = ("vd", "dv")


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything static about one call of the Pallas path, decided once from the shapes."""

    cfg: LossConfig
    interpret: bool
    fwd: _kernel.LaunchConfig
    bwd: _kernel.LaunchConfig
    width: int  # the backward's vocabulary chunk


def _plan(tokens: int, vocab: int, features: int, itemsize: int, cfg: LossConfig, interpret: bool,
          fwd: _kernel.LaunchConfig | None, bwd: _kernel.LaunchConfig | None, width: int | None) -> _Plan:
    fwd = fwd or _kernel.choose_config(tokens, vocab, features, backward=False)
    bwd = bwd or _kernel.choose_config(tokens, vocab, features, backward=True)
    width = min(vocab, width or _kernel.chunk_width(tokens, vocab, itemsize, bwd.block_vocab))
    return _Plan(cfg, interpret, fwd, bwd, width)


def _stats(hidden2, weight, labels, plan: _Plan):
    cfg = plan.cfg
    return _kernel.logit_stats_pallas(hidden2, weight, labels, layout=cfg.layout, cap=cfg.logit_soft_cap,
                                      smoothing=bool(cfg.label_smoothing), interpret=plan.interpret,
                                      config=plan.fwd)


def _chunk_grads(hidden2, weight, labels, lse, coefs, chunk, width: int, offset: int, plan: _Plan):
    """(dh contribution float32 (N, d), dW of the columns [start, start + width) in weight's dtype, in weight's
    layout) of one vocabulary chunk, start = offset + chunk * width."""
    a, b, c = coefs
    index = jnp.reshape(jnp.asarray(chunk, jnp.int32), (1,))
    du = _kernel.logits_grad_pallas(hidden2, weight, labels, lse, a, b, c, index, width=width, offset=offset,
                                    layout=plan.cfg.layout, cap=plan.cfg.logit_soft_cap, interpret=plan.interpret,
                                    config=plan.bwd)
    return chunk_gemms(hidden2, weight, du, offset + chunk * width, plan.cfg.layout)


def chunk_gemms(hidden2, weight, du, start, layout: str):
    """The two gradient GEMMs of one chunk's du (N, width): (dh contribution float32 (N, d), dW of the columns
    [start, start + width) in weight's dtype and layout). The weight's chunk is taken as it lies, (width, d) rows
    or (d, width) columns, never transposed: the dots' dimension numbers say which axis is contracted."""
    w = lax.dynamic_slice_in_dim(weight, start, du.shape[1], axis=_vocab_axis(layout))
    # dh sums over every chunk: float32 out, added to a float32 total. A chunk's dW rows are complete after one
    # GEMM (float32 accumulation inside it), so they come out in the weight's dtype, rounded once.
    f32, wdt = jnp.float32, weight.dtype
    if layout == "vd":  # u = h W^T: dh = du W, dW = du^T h
        dh = jnp.dot(du, w, preferred_element_type=f32)
        dw = lax.dot_general(du, hidden2, (((0,), (0,)), ((), ())), preferred_element_type=wdt)
    else:  # u = h W: dh = du W^T, dW = h^T du
        dh = lax.dot_general(du, w, (((1,), (1,)), ((), ())), preferred_element_type=f32)
        dw = lax.dot_general(hidden2, du, (((0,), (0,)), ((), ())), preferred_element_type=wdt)
    return dh, dw


def _vocab_axis(layout: str) -> int:
    return 0 if layout == "vd" else 1


def _backward(hidden2, weight, labels, lse, coefs, plan: _Plan):
    """dh (hidden2's dtype) and dW (weight's dtype) over the vocabulary in chunks of `plan.width` columns: every
    full chunk in a loop, then the remainder [lo, V) as one narrower chunk. Every chunk starts at a multiple of its
    width, which the kernel relies on for aligned weight loads (see `pallas_fused.loss.kernel`)."""
    width = plan.width
    vocab = plan.cfg.vocab(weight)
    axis = _vocab_axis(plan.cfg.layout)
    full = vocab // width

    def body(i, carry):
        dh, dw = carry
        dh_c, dw_c = _chunk_grads(hidden2, weight, labels, lse, coefs, i, width, 0, plan)
        return dh + dh_c, lax.dynamic_update_slice_in_dim(dw, dw_c, i * width, axis=axis)

    carry = (jnp.zeros(hidden2.shape, jnp.float32), jnp.zeros(weight.shape, weight.dtype))
    dh, dw = lax.fori_loop(0, full, body, carry)
    lo = full * width
    if lo < vocab:  # the remainder: a static chunk of its own width
        dh_c, dw_c = _chunk_grads(hidden2, weight, labels, lse, coefs, 0, vocab - lo, lo, plan)
        dh = dh + dh_c
        dw = lax.dynamic_update_slice_in_dim(dw, dw_c, lo, axis=axis)
    return dh.astype(hidden2.dtype), dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _pallas_loss(hidden2, weight, labels, plan: _Plan):
    lse, z_label, z_sum = _stats(hidden2, weight, labels, plan)
    return token_loss(lse, z_label, z_sum, labels, plan.cfg.vocab(weight), plan.cfg)


def _pallas_loss_fwd(hidden2, weight, labels, plan: _Plan):
    lse, z_label, z_sum = _stats(hidden2, weight, labels, plan)
    loss = token_loss(lse, z_label, z_sum, labels, plan.cfg.vocab(weight), plan.cfg)
    return loss, (hidden2, weight, labels, lse)  # the backward recomputes the logits: only lse is kept (N floats)


def _pallas_loss_bwd(plan: _Plan, res, g):
    hidden2, weight, labels, lse = res
    coefs = grad_coefficients(lse, labels, g, plan.cfg.vocab(weight), plan.cfg)
    dh, dw = _backward(hidden2, weight, labels, lse, coefs, plan)
    return dh, dw, None


_pallas_loss.defvjp(_pallas_loss_fwd, _pallas_loss_bwd)


def _is_array(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _real(name: str, value, lo: float = 0.0, below: float | None = None):
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and float(value) >= lo
    if not ok or (below is not None and value >= below):
        rng = f"in [{lo}, {below})" if below is not None else f">= {lo}"
        raise ValueError(f"{name}: expected a finite Python number {rng}, got {value!r}")
    return float(value)


def _layout(hidden, head_weight, weight_layout):
    d = hidden.shape[-1]
    fits = [name for name, axis in (("vd", 1), ("dv", 0)) if head_weight.shape[axis] == d]
    if weight_layout is not None:
        if weight_layout not in LAYOUTS:
            raise ValueError(f"weight_layout: expected None, 'vd' (vocab, d) or 'dv' (d, vocab), got "
                             f"{weight_layout!r}")
        if weight_layout not in fits:
            want = f"(vocab, {d})" if weight_layout == "vd" else f"({d}, vocab)"
            raise ValueError(f"head_weight: expected shape {want} for weight_layout={weight_layout!r} (hidden's last "
                             f"axis is {d}), got {tuple(head_weight.shape)}")
        return weight_layout
    if not fits:
        raise ValueError(f"head_weight: expected (vocab, {d}) or ({d}, vocab) to match hidden's last axis {d}, got "
                         f"{tuple(head_weight.shape)}")
    if len(fits) == 2:
        raise ValueError(f"weight_layout: head_weight {tuple(head_weight.shape)} is square, so its layout cannot be "
                         f"read from its shape; pass weight_layout='vd' (vocab, d) or 'dv' (d, vocab)")
    return fits[0]


def linear_cross_entropy(hidden, head_weight, labels, *, weight_layout: str | None = None, ignore_index: int = -100,
                         z_loss: float = 0.0, label_smoothing: float = 0.0, reduction: str = "mean",
                         logit_soft_cap: float | None = None, implementation: str | None = None):
    """Cross-entropy of the logits hidden @ W against integer labels, without materializing the logits.

    The value is `optax.softmax_cross_entropy_with_integer_labels(logits, labels)` for logits = hidden @ W computed
    in float32 (the product in hidden's dtype, accumulated in float32), with the options applied in this order:
    the soft cap `cap * tanh(logits / cap)`, label smoothing (optax's `smooth_labels` and torch's
    `label_smoothing`, which agree: 1 - eps + eps / V on the label, eps / V elsewhere), then
    `z_loss * logsumexp(logits)^2` added per token. See `pallas_fused.loss.reference` for the formulas.

    Args:
      hidden: float32 or bfloat16 (..., d): the last hidden states (any leading batch axes).
      head_weight: float32 or bfloat16, (vocab, d) (a tied embedding table) or (d, vocab) (a Dense kernel). Cast to
        hidden's dtype for the product, as `nn.Dense(dtype=hidden.dtype)` does; its gradient comes back in its own
        dtype.
      labels: integer array of hidden's leading shape (...).
      weight_layout: None (read from the shapes: the axis of size d; refused when the weight is square), "vd" or "dv".
      ignore_index: tokens with this label count for nothing (no loss, no gradient, not in the mean's count). Any
        other label outside [0, vocab) gives a NaN loss.
      z_loss: weight of the z-loss term lse^2 (>= 0).
      label_smoothing: eps in [0, 1).
      reduction: "mean" (over the tokens not ignored; 0, not NaN, when every token is ignored), "sum" or "none"
        (per-token float32 losses of labels' shape, 0 at ignored tokens).
      logit_soft_cap: None or a positive cap.
      implementation: None (the Pallas kernels on a GPU, "xla" elsewhere), "pallas", "xla" or "interpret".

    Returns:
      float32 loss: a scalar, or labels' shape for reduction="none".

    Differentiable in hidden and head_weight (labels get no gradient); works under jit, vmap and remat.
    Non-finite inputs stay visible: a NaN in a counted token's hidden row, or anywhere in the weight, makes the loss
    NaN (an ignored token's row is not part of the loss, though a NaN there still reaches d_weight through
    dz^T hidden, as with jax.grad of the materialized loss). An infinite logit gives what jax.nn.logsumexp gives
    (lse = inf, so a loss of inf or NaN); with a soft cap the logits are bounded. Sharded inputs are gathered for
    the Pallas kernels (no sharding rule yet); "xla" shards as XLA shards its dots.

    "xla" is plain jnp, chunked over tokens (`reference.chunked_token_loss`): one chunk's float32 logits at a time,
    recomputed in the backward, the weight's gradient accumulated in float32. "pallas" / "interpret" run the
    forward as one kernel that never writes logits (an online logsumexp over vocabulary blocks) and the backward
    over vocabulary chunks: a kernel recomputes a chunk's logits and writes their gradient (N, width), which two
    GEMMs turn into dh and that chunk's part of dW, in the weight's own layout (see `pallas_fused.loss.kernel`).
    Either layout runs the same work: neither the weight nor its gradient is ever transposed or copied whole.

    Raises:
      ValueError: naming the argument, for a dtype other than float32 / bfloat16, shapes that do not fit, a square
        weight without weight_layout, or an option out of range.
    """
    return linear_cross_entropy_with_config(
        hidden, head_weight, labels, weight_layout=weight_layout, ignore_index=ignore_index, z_loss=z_loss,
        label_smoothing=label_smoothing, reduction=reduction, logit_soft_cap=logit_soft_cap,
        implementation=implementation)


def linear_cross_entropy_with_config(hidden, head_weight, labels, *, weight_layout=None, ignore_index=-100,
                                     z_loss=0.0, label_smoothing=0.0, reduction="mean", logit_soft_cap=None,
                                     implementation=None, fwd_config: _kernel.LaunchConfig | None = None,
                                     bwd_config: _kernel.LaunchConfig | None = None, chunk: int | None = None):
    """`linear_cross_entropy` with explicit launches (benchmarks and tests; None = this device's tuning). `chunk`:
    the Pallas backward's vocabulary chunk, or the "xla" implementation's token chunk."""
    for name, x in (("hidden", hidden), ("head_weight", head_weight)):
        if not _is_array(x) or jnp.dtype(x.dtype) not in DTYPES:
            raise ValueError(f"{name}: expected a float32 or bfloat16 array, got "
                             f"{getattr(x, 'dtype', type(x).__name__)}")
    if hidden.ndim < 1 or hidden.shape[-1] == 0:
        raise ValueError(f"hidden: expected shape (..., d) with d >= 1, got {tuple(hidden.shape)}")
    if head_weight.ndim != 2:
        raise ValueError(f"head_weight: expected a 2-D (vocab, d) or (d, vocab) array, got shape "
                         f"{tuple(head_weight.shape)}")
    if not _is_array(labels) or not jnp.issubdtype(labels.dtype, jnp.integer):
        raise ValueError(f"labels: expected an integer array, got {getattr(labels, 'dtype', type(labels).__name__)}")
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"labels: expected hidden's leading shape {tuple(hidden.shape[:-1])}, got "
                         f"{tuple(labels.shape)}")
    layout = _layout(hidden, head_weight, weight_layout)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise ValueError(f"ignore_index: expected a Python int, got {ignore_index!r}")
    z_loss = _real("z_loss", z_loss)
    label_smoothing = _real("label_smoothing", label_smoothing, below=1.0)
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction: expected one of {REDUCTIONS}, got {reduction!r}")
    if logit_soft_cap is not None:
        logit_soft_cap = _real("logit_soft_cap", logit_soft_cap)
        if logit_soft_cap == 0:
            raise ValueError("logit_soft_cap: expected None or a positive number, got 0")
    impl = _backend.resolve_implementation(implementation, op="linear_cross_entropy")
    cfg = LossConfig(layout, int(ignore_index), z_loss, label_smoothing, logit_soft_cap)

    d = hidden.shape[-1]
    hidden2 = hidden.reshape(-1, d)
    flat = labels.reshape(-1).astype(jnp.int32)
    weight = head_weight.astype(hidden.dtype)  # outside the custom_vjp: autodiff casts dW back
    vocab = cfg.vocab(weight)
    if hidden2.shape[0] == 0:
        per_token = jnp.zeros((0,), jnp.float32)
    elif impl == "xla":
        per_token = chunked_token_loss(hidden2, weight, flat, cfg, **({"chunk": chunk} if chunk else {}))
    else:
        plan = _plan(hidden2.shape[0], vocab, d, jnp.dtype(hidden.dtype).itemsize, cfg, impl == "interpret",
                     fwd_config, bwd_config, chunk)
        per_token = _pallas_loss(hidden2, weight, flat, plan)
    out = reduce_loss(per_token, flat, reduction, cfg.ignore_index)
    return out.reshape(labels.shape) if reduction == "none" else out
