"""Linear + cross-entropy: the plain-jnp ground truth, the per-token arithmetic every implementation shares, and the
"xla" implementation (chunked over tokens, so that it never holds the full float32 logits).

Definitions, for one token with hidden row h, labels y and vocabulary V (logits z = h W in float32):

    z      = cap tanh(u / cap) with u = h W      (the soft cap; z = u without one)
    lse    = log sum_v exp(z_v)
    loss   = lse - (1 - eps) z_y - (eps / V) sum_v z_v  +  z_loss lse^2

which is `optax.softmax_cross_entropy_with_integer_labels(z, y)` for eps = 0, and
`optax.softmax_cross_entropy(z, optax.smooth_labels(one_hot(y), eps))` otherwise: the target puts 1 - eps + eps / V
on the label and eps / V on every other class, the convention of optax's `smooth_labels` and of torch's
`cross_entropy(label_smoothing=eps)` (they agree). A token whose label is `ignore_index` contributes 0 and no
gradient; any other label outside [0, V) gives a NaN loss (as optax's gather does), never a silent 0.

The gradient of the loss with respect to the logits, scaled by the token's cotangent g:

    dz_v = a p_v - b [v == y] - c      with  p = exp(z - lse),  a = g (1 + 2 z_loss lse),  b = g (1 - eps),
                                             c = g eps / V
and through the soft cap du = dz (1 - (z / cap)^2). A row whose three coefficients are 0 (an ignored token)
contributes exactly nothing, even where its hidden row holds a NaN.

This file knows nothing of Pallas.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

REDUCTIONS = ("mean", "sum", "none")


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """The static configuration of one call (hashable: a custom_vjp's non-differentiable argument)."""

    layout: str  # "vd": the head weight is (vocab, d) (a tied embedding); "dv": (d, vocab) (a Dense kernel)
    ignore_index: int = -100
    z_loss: float = 0.0
    label_smoothing: float = 0.0
    logit_soft_cap: float | None = None

    def vocab(self, weight) -> int:
        return int(weight.shape[0] if self.layout == "vd" else weight.shape[1])


# ---- the per-token arithmetic shared by every implementation --------------------------------------------------


def cap_logits(u, cap: float | None):
    """The soft cap cap * tanh(u / cap) (identity for cap None), in u's dtype."""
    return u if cap is None else cap * jnp.tanh(u / cap)


def token_loss(lse, z_label, z_sum, labels, vocab: int, cfg: LossConfig):
    """float32 per-token loss from the logits' statistics (lse, the label's logit, the sum of all logits)."""
    eps = cfg.label_smoothing
    loss = lse - z_label if eps == 0 else lse - (1.0 - eps) * z_label - (eps / vocab) * z_sum
    if cfg.z_loss:
        loss = loss + cfg.z_loss * lse * lse
    counted = labels != cfg.ignore_index
    in_range = (labels >= 0) & (labels < vocab)
    return jnp.where(counted, jnp.where(in_range, loss, jnp.nan), 0.0)


def grad_coefficients(lse, labels, g, vocab: int, cfg: LossConfig):
    """(a, b, c), each float32 (N,): dz = a p - b onehot(y) - c (see the module docstring), zero for ignored tokens."""
    counted = labels != cfg.ignore_index
    g = jnp.where(counted, g.astype(jnp.float32), 0.0)
    a = g * (1.0 + 2.0 * cfg.z_loss * lse) if cfg.z_loss else g
    a = jnp.where(counted, a, 0.0)  # an ignored row's lse may be NaN; 0 * NaN would not be 0
    return a, g * (1.0 - cfg.label_smoothing), g * (cfg.label_smoothing / vocab)


def logits_grad(z, cols, labels, lse, a, b, c, cap: float | None):
    """d(loss)/du for a (rows, cols) block of capped logits z at vocabulary indices `cols`, float32 (rows, cols).

    Rows with a = b = c = 0 give exact zeros whatever z holds."""
    p = jnp.exp(z - lse[:, None])
    dz = a[:, None] * p - jnp.where(cols[None, :] == labels[:, None], b[:, None], 0.0) - c[:, None]
    live = (a != 0) | (b != 0) | (c != 0)
    dz = jnp.where(live[:, None], dz, 0.0)
    if cap is not None:
        t = z / cap
        dz = dz * (1.0 - t * t)
    return dz


def reduce_loss(per_token, labels, reduction: str, ignore_index: int):
    """'none': per-token (ignored tokens 0); 'sum'; 'mean': the sum over the number of counted (not ignored) tokens,
    0 when every token is ignored (never 0 / 0)."""
    if reduction == "none":
        return per_token
    total = jnp.sum(per_token)
    if reduction == "sum":
        return total
    count = jnp.sum(labels != ignore_index)
    return total / jnp.maximum(count, 1).astype(jnp.float32)


def logits(hidden2, weight, cfg: LossConfig):
    """float32 (N, V) capped logits of 2-D hidden (N, d): the dot in the operands' dtype, accumulated in float32."""
    dims = (((1,), (1,)), ((), ())) if cfg.layout == "vd" else (((1,), (0,)), ((), ()))
    u = lax.dot_general(hidden2, weight, dims, preferred_element_type=jnp.float32)
    return cap_logits(u, cfg.logit_soft_cap)


# ---- the ground truth: materialized logits, autodiff ----------------------------------------------------------


def reference_linear_cross_entropy(hidden, weight, labels, cfg: LossConfig, reduction: str = "mean"):
    """The loss from the full (N, V) float32 logits, differentiated by jax: the definition, not for large inputs.

    `weight` must already be in hidden's dtype (the api casts it)."""
    d = hidden.shape[-1]
    z = logits(hidden.reshape(-1, d), weight, cfg)
    flat = labels.reshape(-1)
    vocab = cfg.vocab(weight)
    lse = jax.nn.logsumexp(z, axis=-1)
    z_label = jnp.take_along_axis(z, jnp.clip(flat, 0, vocab - 1)[:, None], axis=-1)[:, 0]
    z_sum = jnp.sum(z, axis=-1) if cfg.label_smoothing else None
    per_token = token_loss(lse, z_label, z_sum, flat, vocab, cfg)
    out = reduce_loss(per_token, flat, reduction, cfg.ignore_index)
    return out.reshape(labels.shape) if reduction == "none" else out


# ---- the "xla" implementation: chunked over tokens ------------------------------------------------------------

# Tokens per chunk: the (chunk, V) float32 logits of one chunk are the largest temporary (1024 x 128256 x 4 bytes
# = 525 MB); the float32 (V, d) weight gradient is carried across chunks.
XLA_CHUNK_TOKENS = 1024


def _chunks(hidden2, labels, chunk: int, ignore_index: int):
    """hidden2 (N, d) and labels (N,) as (n, chunk, ...) stacks, padded with ignored tokens."""
    n = hidden2.shape[0]
    pad = -n % chunk
    hidden2 = jnp.pad(hidden2, ((0, pad), (0, 0)))
    labels = jnp.pad(labels, (0, pad), constant_values=ignore_index)
    return hidden2.reshape(-1, chunk, hidden2.shape[1]), labels.reshape(-1, chunk)


def _chunk_stats(h, y, weight, cfg: LossConfig):
    z = logits(h, weight, cfg)
    vocab = z.shape[1]
    lse = jax.nn.logsumexp(z, axis=-1)
    cols = jnp.arange(vocab)
    z_label = jnp.sum(jnp.where(cols[None, :] == y[:, None], z, 0.0), axis=-1)
    z_sum = jnp.sum(z, axis=-1) if cfg.label_smoothing else jnp.zeros_like(lse)
    return lse, z_label, z_sum


def _xla_stats(hidden2, weight, labels, cfg: LossConfig, chunk: int):
    n = hidden2.shape[0]
    hs, ys = _chunks(hidden2, labels, chunk, cfg.ignore_index)
    stats = lax.map(lambda hy: _chunk_stats(hy[0], hy[1], weight, cfg), (hs, ys))
    return tuple(s.reshape(-1)[:n] for s in stats)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _xla_loss(hidden2, weight, labels, cfg: LossConfig, chunk: int):
    lse, z_label, z_sum = _xla_stats(hidden2, weight, labels, cfg, chunk)
    return token_loss(lse, z_label, z_sum, labels, cfg.vocab(weight), cfg)


def _xla_loss_fwd(hidden2, weight, labels, cfg: LossConfig, chunk: int):
    lse, z_label, z_sum = _xla_stats(hidden2, weight, labels, cfg, chunk)
    return token_loss(lse, z_label, z_sum, labels, cfg.vocab(weight), cfg), (hidden2, weight, labels, lse)


def _xla_loss_bwd(cfg: LossConfig, chunk: int, res, g):
    hidden2, weight, labels, lse = res
    n, vocab = hidden2.shape[0], cfg.vocab(weight)
    coefs = grad_coefficients(lse, labels, g, vocab, cfg)
    hs, ys = _chunks(hidden2, labels, chunk, cfg.ignore_index)
    # Padded tokens get zero coefficients: they contribute nothing.
    abc = [jnp.pad(x, (0, -n % chunk)).reshape(-1, chunk) for x in (lse, *coefs)]
    cols = jnp.arange(vocab)

    def step(dw, xs):
        h, y, lse_c, a, b, c = xs
        du = logits_grad(logits(h, weight, cfg), cols, y, lse_c, a, b, c, cfg.logit_soft_cap).astype(h.dtype)
        if cfg.layout == "vd":  # u = h W^T: dh = du W, dW = du^T h
            dh = jnp.dot(du, weight, preferred_element_type=jnp.float32)
            dw = dw + lax.dot_general(du, h, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        else:  # u = h W: dh = du W^T, dW = h^T du
            dh = lax.dot_general(du, weight, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            dw = dw + lax.dot_general(h, du, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return dw, dh.astype(h.dtype)

    dw, dhs = lax.scan(step, jnp.zeros(weight.shape, jnp.float32), (hs, ys, *abc))
    return dhs.reshape(-1, hidden2.shape[1])[:n], dw.astype(weight.dtype), None


_xla_loss.defvjp(_xla_loss_fwd, _xla_loss_bwd)


def chunked_token_loss(hidden2, weight, labels, cfg: LossConfig, chunk: int = XLA_CHUNK_TOKENS):
    """float32 per-token loss (N,) of hidden2 (N, d), differentiable in hidden2 and weight: the "xla" implementation.

    Forward and backward run over chunks of `chunk` tokens (the backward recomputes each chunk's logits), so no
    more than one chunk's (chunk, V) float32 logits exist at a time; the weight's gradient is accumulated in
    float32 and rounded once."""
    chunk = max(1, min(chunk, hidden2.shape[0]))
    return _xla_loss(hidden2, weight, labels, cfg, chunk)
