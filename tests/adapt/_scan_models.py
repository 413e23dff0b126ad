"""A small decoder of our own (attention q/k/v/o, an MLP up/down) with its layers stacked the ways large models
stack them: linen `nn.scan` (the layer axis of the params at 0 or elsewhere) with `nn.remat` inside, NNX layers
built by `nnx.vmap` and run by `nnx.scan`, an NNX layer under `nnx.remat`, and NNX layers inside a linen model
through `nnx.bridge.ToLinen`, unscanned and scanned."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx

VOCAB, D, HEADS, FF, LAYERS, SEQ = 48, 32, 4, 48, 3, 8


def attention(q, k, v):
    """Causal multi-head attention of (b, t, h, d) projections."""
    t = q.shape[1]
    s = jnp.einsum("bthd,bshd->bhts", q, k) / q.shape[-1] ** 0.5
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v)


# -- linen ---------------------------------------------------------------------------------------------------------


class LinenLayer(nn.Module):
    """One pre-norm decoder layer; `(carry, None) -> (carry, None)` so that `nn.scan` can run it."""

    @nn.compact
    def __call__(self, x, _=None):
        h = nn.LayerNorm(name="ln1")(x)
        q, k, v = (nn.DenseGeneral((HEADS, D // HEADS), name=n)(h) for n in ("q", "k", "v"))
        x = x + nn.DenseGeneral(D, axis=(-2, -1), name="o")(attention(q, k, v))
        h = nn.LayerNorm(name="ln2")(x)
        x = x + nn.Dense(D, name="down")(jax.nn.gelu(nn.Dense(FF, name="up")(h)))
        return x, None


class LinenDecoder(nn.Module):
    """Embedding, `LAYERS` layers (scanned with the params' layer axis at `axis`, or a Python loop where axis is
    None), each rematerialized where `remat`, then a head."""

    axis: int | None = 0
    remat: bool = True

    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(VOCAB, D, name="embed")(ids)
        layer = nn.remat(LinenLayer) if self.remat else LinenLayer
        if self.axis is None:
            for i in range(LAYERS):
                x, _ = layer(name=f"layers_{i}")(x)
        else:
            stack = nn.scan(layer, variable_axes={"params": self.axis}, split_rngs={"params": True}, length=LAYERS)
            x, _ = stack(name="layers")(x, None)
        return nn.Dense(VOCAB, name="head")(nn.LayerNorm(name="ln")(x))


# -- NNX -----------------------------------------------------------------------------------------------------------


class NnxLayer(nnx.Module):
    """The same layer in NNX: nnx.LinearGeneral over heads, an einsum weight for o, nnx.Linear for the MLP."""

    def __init__(self, rngs: nnx.Rngs):
        self.ln1, self.ln2 = nnx.LayerNorm(D, rngs=rngs), nnx.LayerNorm(D, rngs=rngs)
        self.q, self.k, self.v = (nnx.LinearGeneral(D, (HEADS, D // HEADS), rngs=rngs) for _ in range(3))
        self.o = nnx.Param(jax.random.normal(rngs.params(), (HEADS, D // HEADS, D)) / D ** 0.5)
        self.up, self.down = nnx.Linear(D, FF, rngs=rngs), nnx.Linear(FF, D, rngs=rngs)

    def __call__(self, x):
        h = self.ln1(x)
        x = x + jnp.einsum("bthd,hde->bte", attention(self.q(h), self.k(h), self.v(h)), self.o[...])
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class NnxDecoder(nnx.Module):
    """NNX decoder: `layers` one NnxLayer with every param stacked on `axis` (built by `nnx.vmap`), run by
    `nnx.scan` where `scan`; else a list of layers, each under `nnx.remat` where `remat`."""

    def __init__(self, *, scan: bool = True, remat: bool = False, axis: int = 0, rngs: nnx.Rngs):
        self.scan, self.remat, self.axis = scan, remat, axis
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        if scan:
            @nnx.split_rngs(splits=LAYERS)
            @nnx.vmap(in_axes=(0,), out_axes=axis)
            def make(rngs):
                return NnxLayer(rngs)

            self.layers = make(rngs)
        else:
            self.layers = nnx.List([NnxLayer(rngs) for _ in range(LAYERS)])
        self.ln = nnx.LayerNorm(D, rngs=rngs)
        self.head = nnx.Linear(D, VOCAB, rngs=rngs)

    def __call__(self, ids):
        x = self.embed(ids)
        if self.scan:
            def body(x, layer):
                return (nnx.remat(lambda l, x: l(x))(layer, x) if self.remat else layer(x)), None

            x, _ = nnx.scan(body, in_axes=(nnx.Carry, self.axis), out_axes=(nnx.Carry, 0))(x, self.layers)
        else:
            for layer in self.layers:
                x = nnx.remat(lambda l, x: l(x))(layer, x) if self.remat else layer(x)
        return self.head(self.ln(x))


# -- NNX inside linen ----------------------------------------------------------------------------------------------


class BridgedLayer(nn.Module):
    """An NnxLayer run by linen through `nnx.bridge.ToLinen`, as a scannable `(carry, None)` layer."""

    @nn.compact
    def __call__(self, x, _=None):
        return nnx.bridge.ToLinen(NnxLayer, name="nnx")(x), None


class BridgedDecoder(nn.Module):
    """A linen decoder whose layers are NNX modules: scanned (params' layer axis at `axis`) or a loop (None)."""

    axis: int | None = 0

    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(VOCAB, D, name="embed")(ids)
        if self.axis is None:
            for i in range(LAYERS):
                x, _ = BridgedLayer(name=f"layers_{i}")(x)
        else:
            stack = nn.scan(BridgedLayer, variable_axes={"params": self.axis}, split_rngs={"params": True},
                            length=LAYERS)
            x, _ = stack(name="layers")(x, None)
        return nn.Dense(VOCAB, name="head")(x)


def token_batch(seed: int = 1):
    """(inputs, targets) of a next-token task."""
    ids = jax.random.randint(jax.random.key(seed), (2, SEQ + 1), 0, VOCAB)
    return ids[:, :-1], ids[:, 1:]


def lm_loss(logits, targets):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))
