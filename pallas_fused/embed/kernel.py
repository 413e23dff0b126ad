"""The embedding gradient as a one-hot GEMM: dTable = one_hot(ids)^T @ dy, in one Pallas (Triton-lowered) call.

Why a GEMM: XLA's gradient of a gather is a scatter-add, one atomic add per token and feature; with a small
vocabulary most tokens share a row (16384 tokens on 256 byte values), the atomics serialise on the same
addresses, and the scatter took 13.5 ms of a 98 ms training step. The same sum written as a matrix product
is 2 V N D FLOPs on the tensor cores (17 GFLOP for V 256, N 16384, D 2048: tens of microseconds) and reads
dy once per vocabulary block, with no atomics and a fixed summation order (deterministic).

Grid (vocab blocks, feature blocks, token splits). A program owns a (bv, bd) tile of the table's gradient
and walks its split of the tokens in chunks of bt: it loads the chunk's ids, builds the (bv, bt) one-hot
tile in registers (row == id, exact in any float type) and accumulates one_hot @ dy_chunk in float32.
When the vocabulary and feature blocks alone would leave SMs idle, the tokens are split and each split
writes its own float32 partial; the caller sums the partials (a few MB: a small reduction, still deterministic).

dy in bf16 or fp16 is multiplied as it is (the one-hot is exact in either). dy in fp32 is split into three
bf16 terms whose fp32 sum is dy to all 24 bits (every product with a 0/1 is exact), so an fp32 model's
gradient keeps fp32 accuracy at three bf16 MMAs rather than running fp32 FMAs or TF32's 10-bit rounding.

Ids must be wrapped already (`reference.wrap_ids`); an id outside [0, V) matches no row and adds nothing.
Masked token lanes load id -1 and dy 0 (a 0 times an unmasked garbage NaN would still be NaN).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_fused import _backend
from pallas_fused._backend import cdiv, next_pow2


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes (powers of two, >= 16 for the MMA), token splits and warps of the one-hot kernel."""

    block_vocab: int
    block_features: int
    block_tokens: int
    splits: int
    num_warps: int = 4
    num_stages: int | None = None


def choose_config(tokens: int, vocab: int, features: int) -> LaunchConfig:
    """The launch geometry: a pure function of the shapes and the SM count (the same on every host of a job).

    128 x 128 fp32 accumulators (64 registers a thread at 8 warps); 64-token chunks. Splits: enough programs
    for two per SM, but never fewer than 4 chunks a split (below that the partials cost more than they save)."""
    bv = min(128, max(16, next_pow2(vocab)))
    bd = min(128, max(16, next_pow2(features)))
    bt = 64
    tiles = cdiv(vocab, bv) * cdiv(features, bd)
    splits = max(1, min(cdiv(2 * _backend.num_sms(), tiles), cdiv(tokens, 4 * bt)))
    return LaunchConfig(bv, bd, bt, splits, num_warps=8 if bv * bd >= 128 * 128 else 4)


def _bf16_terms(v):
    """v (float32) as 3 bfloat16 terms whose float32 sum is v to all of float32's 24 bits."""
    terms = []
    for _ in range(3):
        t = v.astype(jnp.bfloat16)
        terms.append(t)
        v = v - t.astype(jnp.float32)
    return terms


def _onehot_grad_kernel(ids_ref, dy_ref, out_ref, *, N, V, D, bv, bd, bt, chunks):
    v, d, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = v * bv + jnp.arange(bv)
    cols = d * bd + jnp.arange(bd)
    col_ok = cols < D
    mma_dtype = jnp.bfloat16 if dy_ref.dtype == jnp.float32 else dy_ref.dtype

    def body(i, acc):
        t0 = (split * chunks + i) * bt
        tok_ok = t0 + jnp.arange(bt) < N
        ids = _backend.load(ids_ref.at[pl.ds(t0, bt)], mask=tok_ok, other=-1)
        dy = _backend.load(dy_ref.at[pl.ds(t0, bt), pl.ds(d * bd, bd)], mask=tok_ok[:, None] & col_ok[None, :],
                           other=0)
        onehot = (rows[:, None] == ids[None, :]).astype(mma_dtype)
        terms = _bf16_terms(dy) if dy_ref.dtype == jnp.float32 else [dy]
        for term in terms:
            acc = acc + _backend.dot(onehot, term)
        return acc

    acc = lax.fori_loop(0, chunks, body, jnp.zeros((bv, bd), jnp.float32))
    _backend.store(out_ref.at[split, pl.ds(v * bv, bv), pl.ds(d * bd, bd)], acc,
                   mask=(rows < V)[:, None] & col_ok[None, :])


def onehot_grad_pallas(ids, dy, vocab: int, *, interpret: bool, config: LaunchConfig | None = None):
    """float32 (V, D) = one_hot(ids)^T @ dy for wrapped int32 ids (N,) and dy (N, D) in bf16, fp16 or fp32."""
    n, features = dy.shape
    config = config or choose_config(n, vocab, features)
    bv, bd, bt = config.block_vocab, config.block_features, config.block_tokens
    chunks = cdiv(cdiv(n, config.splits), bt)
    kernel = functools.partial(_onehot_grad_kernel, N=n, V=vocab, D=features, bv=bv, bd=bd, bt=bt, chunks=chunks)
    partials = _backend.triton_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((config.splits, vocab, features), jnp.float32),
        grid=(cdiv(vocab, bv), cdiv(features, bd), config.splits),
        name="pallas_fused_embed_bwd",
        interpret=interpret,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )(ids, dy)
    return partials[0] if config.splits == 1 else jnp.sum(partials, axis=0)
