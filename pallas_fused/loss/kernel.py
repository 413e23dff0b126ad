"""Linear + cross-entropy in Pallas (Triton-lowered): logits are made in registers, block by block, and never
written whole.

Both kernels work on 2-D hidden (N, d) and the head weight in its own layout, (V, d) ("vd", a tied embedding)
or (d, V) ("dv", a Dense kernel), read in place (never transposed or copied). A program's logits block is a
GEMM of its own: a (bt, bv) float32 accumulator over the d axis in steps of bk, operands in the caller's dtype
(bf16 on the tensor cores, float32 accumulation). The weight's tile is the dot's right operand as it lies in
memory: (bv, bk) from a (V, d) weight, taken transposed, (bk, bv) from a (d, V) weight, taken as is.

Forward ("pallas_fused_loss_fwd"), grid (vocabulary splits, token blocks). A program walks its split of the
vocabulary block by block and keeps, per token, the running max m and sum s of exp(z - m) (the online
logsumexp), the label's logit and (with label smoothing) the sum of the logits. It writes those four float32
numbers per token and split; the api combines the splits (a few numbers per token). The splits vary fastest, so
the programs running at once share a few token blocks of hidden (held in L2 for their whole walk) and read the
same few weight blocks at each step; hidden's tiles are re-read once per vocabulary block, which an L2 holding
all of hidden (64 MB at 8192 tokens, d 4096) could not serve.

Backward ("pallas_fused_loss_dlogits"), a 1-D grid over the (token block, vocabulary block) tiles of one chunk,
walked `group` token blocks at a time (a GEMM's grouped order: the tiles running at once share their hidden and
weight tiles in L2): the logits of the chunk's columns [start, start + width) are recomputed and turned into
d(loss)/d(logits) in the epilogue (`reference.logits_grad`), written as a (N, width) block in the caller's dtype.
The api multiplies that block into dh and dW (two GEMMs) and moves on to the next chunk, so no more than one
(N, width) block exists at once.

Alignment, which decides the weight's loads: a (d, V) tile's rows run along the vocabulary, so its loads are
16-byte vectors (cp.async, pipelined over `num_stages`) only where Triton can prove the tile's first column a
multiple of 8. Every chunk starts at a multiple of its width (the api's loop has chunks of one width and ends with
a narrower one for the remainder), and the kernel is told so: the chunk's index is data (a loop's counter), and a
start of unknown alignment gives 2-byte loads, too narrow for cp.async: the weight's tiles are then loaded
synchronously, one bf16 at a time, and the dlogits kernel stalls on them (a (V, d) weight, whose tile rows run
along d, never cared). The column starts of both kernels are stated multiples of their block (`pl.multiple_of`) for
the same reason.

Why the backward leaves the two gradient GEMMs outside the kernel: dh = dz W sums over the vocabulary and
dW = dz^T h over the tokens, while each dz block needs the whole d axis. A kernel that kept dh or dW in
registers would have to hold a (bt, d) or (bv, d) float32 accumulator (1 MB at d 4096), and one that added its
part into them with atomics would move (1 / bt + 1 / bv) N V d float32 values (over 250 GB at 8192 tokens,
d 4096, V 128256). One (N, width) block of dz in HBM costs 2 N width bytes per chunk and lets both GEMMs run at
full size.

Vocabulary and d not dividing the blocks are masked; tokens past N load as zeros and are not stored. A mask
along the axis that runs through memory (d for a (V, d) weight, the vocabulary for a (d, V) one) also narrows
the loads unless that size is a multiple of 8: right, only slower.
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
from pallas_fused.loss.reference import cap_logits, logits_grad

# Launch of a GPU without a tuning table ("loss" section of pallas_fused/tuning/<device>.json overrides it):
# 128 x 128 float32 accumulators at 8 warps (64 registers a thread), K steps of 64 bf16 (a 16 KB operand tile
# each), 3 stages of loads in flight. Forward: at least `programs_per_sm` programs per SM, and at least
# `min_splits` vocabulary splits, so that the ~2 programs per SM running at once span about 2 x SMs / splits token
# blocks: at 8 splits, 33 blocks of 128 tokens x d 4096 in bf16 (33 MB of hidden) plus 8 weight blocks stay
# within an H100's 50 MB L2, and each weight block is read from HBM once per 33 token blocks.
HEURISTIC = {"fwd": dict(block_tokens=128, block_vocab=128, block_k=64, num_warps=8, num_stages=3, min_splits=8),
             "bwd": dict(block_tokens=128, block_vocab=128, block_k=64, num_warps=8, num_stages=3, group=16),
             "programs_per_sm": 4,
             # The backward's dz block (N, width) in the caller's dtype stays under this many bytes.
             "chunk_bytes": 128 << 20}


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    block_tokens: int  # powers of two >= 16 (a Triton dot's smallest side)
    block_vocab: int
    block_k: int
    num_warps: int = 8
    num_stages: int | None = None
    splits: int = 1  # forward only: the vocabulary blocks are shared out among this many programs per token block
    group: int = 1  # backward only: token blocks walked together (grouped order)


def _shrink(block: int, dim: int) -> int:
    return max(16, min(block, next_pow2(dim)))


def choose_config(tokens: int, vocab: int, features: int, backward: bool) -> LaunchConfig:
    """The launch of one direction: a pure function of the shapes and the device (kind and SM count)."""
    launch = _backend.tuned("loss", HEURISTIC)
    side = launch["bwd" if backward else "fwd"]
    bt, bv = _shrink(side["block_tokens"], tokens), _shrink(side["block_vocab"], vocab)
    bk = _shrink(side["block_k"], features)
    splits = 1
    if not backward:
        want = max(side.get("min_splits", 1), cdiv(launch["programs_per_sm"] * _backend.num_sms(), cdiv(tokens, bt)))
        blocks = cdiv(vocab, bv)
        splits = cdiv(blocks, cdiv(blocks, max(1, min(want, blocks))))
    warps = side["num_warps"] if bt * bv >= 128 * 64 else 4
    return LaunchConfig(bt, bv, bk, warps, side["num_stages"], splits, side.get("group", 1) if backward else 1)


def chunk_width(tokens: int, vocab: int, itemsize: int, block_vocab: int) -> int:
    """The backward's vocabulary chunk: the fewest chunks whose (tokens, width) dz block stays under the configured
    bytes, or the whole vocabulary where one chunk fits. Where that many equal chunks tile the vocabulary exactly
    at a multiple of 8 columns (16 bytes of bf16; 128256 = 16 x 8016), that width: no narrower remainder chunk,
    whose dz block and weight chunk XLA would allocate beside the loop's, raising the peak. Otherwise a multiple of
    the vocabulary block, and the api runs the remainder as one narrower chunk."""
    budget = _backend.tuned("loss", HEURISTIC)["chunk_bytes"]
    most = max(1, budget // max(1, tokens * itemsize * block_vocab)) * block_vocab
    if most >= vocab:
        return vocab
    chunks = cdiv(vocab, most)
    if vocab % chunks == 0 and (vocab // chunks) % 8 == 0:
        return vocab // chunks
    return min(vocab, cdiv(cdiv(vocab, chunks), block_vocab) * block_vocab)


def _logits_block(h_ref, w_ref, rows, row_ok, cols, col_ok, *, features, bk, layout):
    """float32 (bt, bv) block of u = h W over the d axis in steps of bk (operands in their own dtype)."""
    k_steps = cdiv(features, bk)
    aligned = features % bk == 0

    def step(i, acc):
        ks = i * bk + jnp.arange(bk)
        k_ok = ks < features
        h_mask = row_ok[:, None] if aligned else row_ok[:, None] & k_ok[None, :]
        h = _backend.load(h_ref.at[rows[:, None], ks[None, :]], mask=h_mask, other=0)
        if layout == "vd":  # W (V, d): a (bv, bk) tile, multiplied transposed
            w_mask = col_ok[:, None] if aligned else col_ok[:, None] & k_ok[None, :]
            w = _backend.load(w_ref.at[cols[:, None], ks[None, :]], mask=w_mask, other=0)
            return acc + _backend.dot(h, w, trans_b=True)
        w_mask = col_ok[None, :] if aligned else k_ok[:, None] & col_ok[None, :]
        w = _backend.load(w_ref.at[ks[:, None], cols[None, :]], mask=w_mask, other=0)
        return acc + _backend.dot(h, w)

    return lax.fori_loop(0, k_steps, step, jnp.zeros((rows.shape[0], cols.shape[0]), jnp.float32))


def _finite_or_zero(m):
    """m where finite, else 0: the shift of an online logsumexp (|m| < inf is false for NaN too), so that a row of
    -inf gives exp(-inf) = 0 and a row with +inf gives lse = inf (as jax.nn.logsumexp) rather than inf - inf."""
    return jnp.where(jnp.abs(m) < jnp.inf, m, 0.0)


def _stats_kernel(h_ref, w_ref, y_ref, m_ref, s_ref, zy_ref, zsum_ref, *, tokens, vocab, features, bt, bv, bk,
                  per_split, layout, cap, smoothing):
    split, tb = pl.program_id(0), pl.program_id(1)
    rows = tb * bt + jnp.arange(bt)
    row_ok = rows < tokens
    labels = _backend.load(y_ref.at[rows], mask=row_ok, other=-1)

    def vocab_block(j, carry):
        m, s, z_label, z_sum = carry
        cols = pl.multiple_of((split * per_split + j) * bv, bv) + jnp.arange(bv)
        col_ok = cols < vocab
        # Stage 1: this block's logits, capped.
        z = cap_logits(_logits_block(h_ref, w_ref, rows, row_ok, cols, col_ok, features=features, bk=bk,
                                     layout=layout), cap)
        # Stage 2: the online logsumexp.
        m_new = jnp.maximum(m, jnp.max(jnp.where(col_ok[None, :], z, -jnp.inf), axis=1))
        shift = _finite_or_zero(m_new)
        p = jnp.where(col_ok[None, :], jnp.exp(z - shift[:, None]), 0.0)
        s = s * jnp.exp(m - shift) + jnp.sum(p, axis=1)
        # Stage 3: the label's logit (and the sum of the logits for label smoothing).
        z_label = z_label + jnp.sum(jnp.where(cols[None, :] == labels[:, None], z, 0.0), axis=1)
        if smoothing:
            z_sum = z_sum + jnp.sum(jnp.where(col_ok[None, :], z, 0.0), axis=1)
        return m_new, s, z_label, z_sum

    zeros = jnp.zeros((bt,), jnp.float32)
    init = (jnp.full((bt,), -jnp.inf, jnp.float32), zeros, zeros, zeros)
    outs = lax.fori_loop(0, per_split, vocab_block, init)
    for ref, value in zip((m_ref, s_ref, zy_ref, zsum_ref), outs):
        _backend.store(ref.at[split, rows], value, mask=row_ok)


def logit_stats_pallas(hidden2, weight, labels, *, layout: str, cap: float | None, smoothing: bool,
                       interpret: bool, config: LaunchConfig | None = None):
    """Per-token float32 (lse, label logit, sum of logits) of hidden2 (N, d) against weight in `layout`.

    The sum of logits is 0 unless `smoothing`. A label outside [0, V) matches no column (label logit 0)."""
    tokens, features = hidden2.shape
    vocab = weight.shape[0] if layout == "vd" else weight.shape[1]
    config = config or choose_config(tokens, vocab, features, backward=False)
    bt, bv, bk = config.block_tokens, config.block_vocab, config.block_k
    blocks = cdiv(vocab, bv)
    per_split = cdiv(blocks, max(1, min(config.splits, blocks)))
    splits = cdiv(blocks, per_split)
    kernel = functools.partial(_stats_kernel, tokens=tokens, vocab=vocab, features=features, bt=bt, bv=bv, bk=bk,
                               per_split=per_split, layout=layout, cap=cap, smoothing=smoothing)
    part = jax.ShapeDtypeStruct((splits, tokens), jnp.float32)
    m, s, z_label, z_sum = _backend.triton_call(
        kernel, out_shape=(part,) * 4, grid=(splits, cdiv(tokens, bt)), name="pallas_fused_loss_fwd",
        interpret=interpret, num_warps=config.num_warps, num_stages=config.num_stages)(hidden2, weight, labels)
    # The splits' online logsumexps combined (the same shift rule as within a program).
    top = _finite_or_zero(jnp.max(m, axis=0))
    lse = top + jnp.log(jnp.sum(s * jnp.exp(m - top[None, :]), axis=0))
    return lse, jnp.sum(z_label, axis=0), jnp.sum(z_sum, axis=0)


def _dlogits_kernel(h_ref, w_ref, y_ref, lse_ref, a_ref, b_ref, c_ref, chunk_ref, out_ref, *, tokens, features,
                    width, offset, align, bt, bv, bk, group, layout, cap):
    tb, vb = _backend.grouped_pid(pl.program_id(0), cdiv(tokens, bt), cdiv(width, bv), group)
    rows = tb * bt + jnp.arange(bt)
    row_ok = rows < tokens
    labels = _backend.load(y_ref.at[rows], mask=row_ok, other=-1)
    lse, a, b, c = (_backend.load(ref.at[rows], mask=row_ok, other=0) for ref in (lse_ref, a_ref, b_ref, c_ref))
    # The chunk's first column, offset + chunk * width, with its alignment stated: the index is read from memory,
    # and a (d, V) weight's tile rows run along the vocabulary, so without it Triton could prove no alignment of
    # the tile's addresses and would load the weight 2 bytes at a time (too narrow for cp.async: no pipelining).
    start = pl.multiple_of(offset + chunk_ref[0] * width, align)
    local = pl.multiple_of(vb * bv, bv) + jnp.arange(bv)
    col_ok = local < width  # the chunk ends at or before V (the caller's contract), so this is the only bound
    cols = start + local
    # Stage 1: the logits of this block, recomputed and capped.
    z = cap_logits(_logits_block(h_ref, w_ref, rows, row_ok, cols, col_ok, features=features, bk=bk,
                                 layout=layout), cap)
    # Stage 2: d(loss)/d(u) = (a softmax - b onehot - c) through the cap.
    du = logits_grad(z, cols, labels, lse, a, b, c, cap)
    _backend.store(out_ref.at[rows[:, None], local[None, :]], du.astype(out_ref.dtype),
                   mask=row_ok[:, None] & col_ok[None, :])


def _pow2_factor(n: int) -> int:
    """The largest power of two dividing n (n > 0); for 0, a large one (every index is a multiple of it)."""
    return n & -n if n else 1 << 30


def logits_grad_pallas(hidden2, weight, labels, lse, a, b, c, chunk, *, width: int, offset: int, layout: str,
                       cap: float | None, interpret: bool, config: LaunchConfig | None = None):
    """(N, width) d(loss)/d(u) in hidden2's dtype for the vocabulary columns [start, start + width) with
    start = offset + chunk * width, chunk an int32 (1,) array (a loop's index). The caller keeps the chunk within
    the vocabulary (start + width <= V); offset and width are static, so that every chunk's start has a known
    alignment. lse, a, b, c: float32 (N,) (see `reference.logits_grad`)."""
    tokens, features = hidden2.shape
    vocab = weight.shape[0] if layout == "vd" else weight.shape[1]
    if not 0 < width <= vocab - offset or offset < 0:
        raise ValueError(f"width, offset: expected a chunk [offset, offset + width) within the vocabulary "
                         f"[0, {vocab}), got width={width}, offset={offset}")
    config = config or choose_config(tokens, vocab, features, backward=True)
    bt, bv, bk = config.block_tokens, config.block_vocab, config.block_k
    align = min(_pow2_factor(width), _pow2_factor(offset))
    kernel = functools.partial(_dlogits_kernel, tokens=tokens, features=features, width=width, offset=offset,
                               align=align, bt=bt, bv=bv, bk=bk, group=config.group, layout=layout, cap=cap)
    return _backend.triton_call(
        kernel, out_shape=jax.ShapeDtypeStruct((tokens, width), hidden2.dtype),
        grid=(cdiv(tokens, bt) * cdiv(width, bv),), name="pallas_fused_loss_dlogits", interpret=interpret,
        num_warps=config.num_warps, num_stages=config.num_stages)(hidden2, weight, labels, lse, a, b, c, chunk)
