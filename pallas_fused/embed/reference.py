"""Embedding lookup: the plain-jnp reference (also the "xla" implementation) and the large-vocabulary gradient.

`reference_embed` computes exactly what `flax.linen.Embed.__call__` computes: the table cast to `dtype`, then
`jnp.take(table, ids, axis=0)`, or a broadcast when the vocabulary has one row. Its gradient is whatever
autodiff makes of that: XLA's scatter-add of every token's cotangent into its row, in `dtype`.

Index semantics are jnp.take's default (mode "fill"), which nn.Embed and nnx.Embed inherit:
  - ids in [0, V) pick their row; ids in [-V, 0) count from the end (numpy style: -1 is the last row);
  - any other id gives a row of NaN in the forward pass and contributes nothing to the table's gradient.
(A vocabulary of one row ignores the ids altogether, as nn.Embed does.)

This file knows nothing of Pallas.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def reference_embed(table, ids, dtype=None):
    """What nn.Embed(num_embeddings=V, features=D, dtype=dtype) computes from `table` (V, D) and integer `ids`."""
    if dtype is not None:
        table = jnp.asarray(table, dtype)
    if table.shape[0] == 1:
        return jnp.broadcast_to(table[0], ids.shape + table.shape[1:])
    return jnp.take(table, ids, axis=0)


def wrap_ids(ids, vocab: int):
    """int32 ids with [-V, 0) mapped to [0, V) (jnp.take's convention); every other id is left as it is."""
    if jnp.issubdtype(ids.dtype, jnp.unsignedinteger):  # never negative; clamp so a huge id stays out of range
        return jnp.minimum(ids, vocab).astype(jnp.int32)
    ids = ids.astype(jnp.int32)
    return jnp.where(ids < 0, ids + vocab, ids)


def segment_sum_grad(ids, dy, vocab: int):
    """float32 (V, D) sum of the rows of `dy` (N, D) per id (N,), ids already wrapped; ids outside [0, V) drop.

    The ids are sorted first, so the scatter that remains adds runs of equal ids in order (XLA turns a
    sorted segment sum into a reduction per run, not an atomic add per token that collides with every
    other token of the same id)."""
    order = jnp.argsort(ids)
    return jax.ops.segment_sum(jnp.take(dy, order, axis=0).astype(jnp.float32), ids[order],
                               num_segments=vocab, indices_are_sorted=True)

