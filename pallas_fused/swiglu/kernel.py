"""SwiGLU's gating product forward and backward, one Pallas (Triton-lowered) kernel each.

Both work on 2-D (rows, F) views of the inputs (any F: the column block is a power of two, masked past F).

Forward ("pallas_fused_swiglu_fwd"): out = silu(gate) * up, one read of gate and up, one write of out.

Backward ("pallas_fused_swiglu_bwd"): with s = sigmoid(gate), recomputed from gate rather than saved,
    d_gate = dout * up * s * (1 + gate (1 - s))
    d_up   = dout * gate * s
one read of gate, up and dout and one write of each gradient: the op's whole backward pass in one launch, with
nothing but gate and up kept for it (recomputing the sigmoid costs a few instructions per element, storing it a
full array of HBM traffic each way).

A program owns one (block_rows, block_cols) tile. The grid is one-dimensional with the column blocks varying
fastest, so programs launched together cover neighbouring memory and a tall input never meets CUDA's limit of
65535 programs along the grid's second axis. All arithmetic is float32; every array keeps the caller's dtype.

Launch geometry is tuning data (`_backend.tuned("swiglu", HEURISTIC)`): a tile of about `block_elements`
elements at most `max_block_cols` wide, and `num_warps`, per direction.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_fused import _backend
from pallas_fused._backend import cdiv, next_pow2

# The launch of a GPU without a tuning table (no sweep behind it yet: benchmarks/bench_swiglu.py times these
# against other tiles). Per thread, 16 elements of each operand a tile: two 16-byte loads of a bf16 operand.
# Columns stop at 512 so that a wide row wastes little of its last block (5504 = 10.75 x 512: 2% of the lanes
# masked; blocks of 1024 would mask 10%). The backward tile is half the forward's: three inputs and two float32
# gradients live at once.
HEURISTIC = {"fwd": dict(block_elements=4096, max_block_cols=512, num_warps=8),
             "bwd": dict(block_elements=2048, max_block_cols=512, num_warps=4)}
# Fewest elements a warp is given: below it a small tile runs on fewer warps rather than idle lanes.
MIN_ELEMENTS_PER_WARP = 128


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    block_rows: int  # rows per tile, a power of two
    block_cols: int  # columns per tile, a power of two
    num_warps: int


def choose_config(rows: int, cols: int, backward: bool) -> LaunchConfig:
    """The tile of a (rows, cols) launch: a pure function of the shapes and the device kind's tuning table."""
    launch = _backend.tuned("swiglu", HEURISTIC)["bwd" if backward else "fwd"]
    block_cols = min(next_pow2(max(cols, 1)), launch["max_block_cols"])
    block_rows = min(next_pow2(max(rows, 1)), max(1, launch["block_elements"] // block_cols))
    warps = max(1, min(launch["num_warps"], block_rows * block_cols // MIN_ELEMENTS_PER_WARP))
    return LaunchConfig(block_rows, block_cols, next_pow2(warps))


def _tile(rows, cols, br, bc):
    """Index arrays and mask of this program's tile: arrays rather than slices, because a padded block is a static
    slice past the array's end, which jax >= 0.12 refuses even under a mask."""
    col_blocks = cdiv(cols, bc)
    pid = pl.program_id(0)
    r = (pid // col_blocks) * br + jnp.arange(br)
    c = (pid % col_blocks) * bc + jnp.arange(bc)
    return (r[:, None], c[None, :]), (r < rows)[:, None] & (c < cols)[None, :]


def _load(ref, idx, mask):
    return _backend.load(ref.at[idx], mask=mask, other=0).astype(jnp.float32)


def _fwd_kernel(gate_ref, up_ref, out_ref, *, rows, cols, br, bc):
    idx, mask = _tile(rows, cols, br, bc)
    gate, up = _load(gate_ref, idx, mask), _load(up_ref, idx, mask)
    out = gate * jax.nn.sigmoid(gate) * up
    _backend.store(out_ref.at[idx], out.astype(out_ref.dtype), mask=mask)


def _bwd_kernel(gate_ref, up_ref, dout_ref, dgate_ref, dup_ref, *, rows, cols, br, bc):
    idx, mask = _tile(rows, cols, br, bc)
    gate, up, dout = _load(gate_ref, idx, mask), _load(up_ref, idx, mask), _load(dout_ref, idx, mask)
    sig = jax.nn.sigmoid(gate)
    dgate = dout * up * sig * (1.0 + gate * (1.0 - sig))
    dup = dout * gate * sig
    _backend.store(dgate_ref.at[idx], dgate.astype(dgate_ref.dtype), mask=mask)
    _backend.store(dup_ref.at[idx], dup.astype(dup_ref.dtype), mask=mask)


def _launch(kernel, name, n_out, arrays, *, interpret, config):
    rows, cols = arrays[0].shape
    like = jax.ShapeDtypeStruct((rows, cols), arrays[0].dtype)
    if rows == 0 or cols == 0:  # nothing to launch (a grid of zero programs)
        outs = tuple(jnp.zeros(like.shape, like.dtype) for _ in range(n_out))
        return outs[0] if n_out == 1 else outs
    br, bc = config.block_rows, config.block_cols
    body = functools.partial(kernel, rows=rows, cols=cols, br=br, bc=bc)
    out_shape = like if n_out == 1 else (like,) * n_out
    return _backend.triton_call(body, out_shape=out_shape, grid=(cdiv(rows, br) * cdiv(cols, bc),), name=name,
                                interpret=interpret, num_warps=config.num_warps)(*arrays)


def swiglu_fwd_pallas(gate2, up2, *, interpret: bool, config: LaunchConfig | None = None):
    """silu(gate2) * up2 for two (R, F) arrays of one dtype, in that dtype."""
    config = config or choose_config(*gate2.shape, backward=False)
    return _launch(_fwd_kernel, "pallas_fused_swiglu_fwd", 1, (gate2, up2), interpret=interpret, config=config)


def swiglu_bwd_pallas(gate2, up2, dout2, *, interpret: bool, config: LaunchConfig | None = None):
    """(d_gate, d_up), each (R, F) in gate2's dtype, for (R, F) gate2, up2 and the cotangent dout2."""
    config = config or choose_config(*gate2.shape, backward=True)
    return _launch(_bwd_kernel, "pallas_fused_swiglu_bwd", 2, (gate2, up2, dout2), interpret=interpret,
                   config=config)
