"""`embed`: the public embedding lookup (argument checks, implementation choice, custom_vjp)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_fused import _backend, _sharding
from pallas_fused.embed import kernel as _kernel
from pallas_fused.embed.reference import reference_embed, segment_sum_grad, wrap_ids

# The one-hot GEMM costs 2 V flops per byte of dy it reads, a sorted segment sum a few bytes of traffic per byte
# of dy whatever V is; on a Hopper GPU (~1000 dense bf16 TFLOP/s, ~4.8 TB/s) the two meet at a vocabulary of a
# few hundred to a thousand rows. Above this size the gradient is the sorted segment sum (XLA). fp32 dy takes
# three bf16 MMAs per tile, hence a third of the vocabulary for the same time.
ONEHOT_MAX_VOCAB = 1024


def use_onehot(vocab: int, dtype) -> bool:
    """Whether the table's gradient is the one-hot GEMM kernel (else the sorted segment sum): a pure function of
    the vocabulary size and dy's dtype, so every host of a job makes the same program."""
    limit = ONEHOT_MAX_VOCAB // 3 if jnp.dtype(dtype) == jnp.float32 else ONEHOT_MAX_VOCAB
    return vocab <= limit


@dataclasses.dataclass(frozen=True)
class _Static:
    dtype: jnp.dtype  # the output dtype (the table is cast to it before the lookup, as nn.Embed does)
    vocab: int
    table_dtype: jnp.dtype
    interpret: bool
    config: _kernel.LaunchConfig | None = None


def _table_grad(ids, dy, vocab: int, st: _Static):
    """float32 (V, D) gradient of the table from wrapped ids (N,) and dy (N, D)."""
    if not use_onehot(vocab, dy.dtype):
        return segment_sum_grad(ids, dy, vocab)

    def local(ids, dy):
        return _kernel.onehot_grad_pallas(ids, dy, vocab, interpret=st.interpret, config=st.config)

    # Sharded: each device sums its own tokens (and its slice of the features) and the (V, D) float32 partial
    # gradients are all-reduced, as XLA does for its scatter; dy is never gathered.
    return _sharding.partitioned(local, "t, t d -> v d", summed=("t",))(ids, dy)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _embed(table, ids, st: _Static):
    # Gather, then cast: the same values as nn.Embed's cast-then-gather, reading N rows instead of casting V.
    return jnp.take(table, ids, axis=0).astype(st.dtype)


def _embed_fwd(table, ids, st: _Static):
    return _embed(table, ids, st), ids  # the ids are all the backward pass needs


def _embed_bwd(st: _Static, ids, g):
    flat_ids = wrap_ids(ids.reshape(-1), st.vocab)
    grad = _table_grad(flat_ids, g.reshape(flat_ids.shape[0], g.shape[-1]), st.vocab, st)
    return grad.astype(st.table_dtype), None


_embed.defvjp(_embed_fwd, _embed_bwd)


def embed(table, ids, *, dtype=None, implementation: str | None = None):
    """Look up rows of `table` (V, D) at integer `ids` (any shape): returns ids.shape + (D,).

    Numerically the forward pass is `flax.linen.Embed`'s (table cast to `dtype`, then `jnp.take`), and so are
    the index semantics (see `pallas_fused.embed.reference`): ids in [-V, 0) count from the end, any other
    out-of-range id gives a NaN row and no gradient; a one-row table ignores the ids. Empty ids give an empty
    result and a zero gradient.

    The backward pass is where the implementations differ. "xla" is autodiff of the reference: XLA's
    scatter-add, which serialises on colliding rows and accumulates in `dtype`. "pallas" / "interpret" compute
    the table's gradient in float32 and round it once to the table's dtype: for V <= `ONEHOT_MAX_VOCAB` (a
    third of it when dy is float32) as one_hot(ids)^T @ dy in a Pallas kernel (`kernel.py`), above it as a
    sorted segment sum in XLA (`use_onehot` decides from the shapes alone).

    Args:
      table: (V, D) floating-point embedding table (a param; float32, bfloat16 or float16).
      ids: integer array of any shape.
      dtype: the dtype of the result and of the lookup (None: the table's dtype), as nn.Embed's `dtype`.
      implementation: None (the kernel on a GPU, the XLA reference elsewhere), "pallas", "xla" or "interpret".
    """
    return embed_with_config(table, ids, dtype=dtype, implementation=implementation)


def embed_with_config(table, ids, *, dtype=None, implementation: str | None = None,
                      config: _kernel.LaunchConfig | None = None):
    """`embed` with an explicit one-hot kernel launch geometry (benchmarks and tests; None = heuristic)."""
    if not hasattr(table, "shape") or not hasattr(table, "dtype") or table.ndim != 2:
        raise ValueError(f"table: expected a 2-D array (num_embeddings, features), got "
                         f"{getattr(table, 'shape', type(table).__name__)}")
    if not jnp.issubdtype(table.dtype, jnp.floating):
        raise ValueError(f"table: expected a floating-point dtype (float32, bfloat16 or float16), got {table.dtype}")
    if table.shape[0] == 0:
        raise ValueError(f"table: expected at least one row (num_embeddings >= 1), got shape {table.shape}")
    if not hasattr(ids, "dtype") or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"ids: expected an integer array, got {getattr(ids, 'dtype', type(ids).__name__)}")
    if dtype is not None and not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
        raise ValueError(f"dtype: expected None or a floating-point dtype, got {dtype}")
    impl = _backend.resolve_implementation(implementation, op="embed")
    if impl == "xla" or table.shape[0] == 1 or ids.size == 0 or table.shape[1] == 0:
        return reference_embed(table, ids, dtype)
    st = _Static(jnp.dtype(dtype or table.dtype), int(table.shape[0]), jnp.dtype(table.dtype), impl == "interpret",
                 config)
    return _embed(table, jnp.asarray(ids), st)

