"""Pallas (Triton lowering) kernels of the GaLore Adam step. Knows nothing of optax.

Two kernels, both launched through `_backend.triton_call` and reading the step's runtime scalars from
an (8,) fp32 operand (see `reference.Scalars`); the down-projection R = G P^T (side "right") or P^T G (side
"left") before them is XLA's GEMM:

  lowrank_adam      the low-rank Adam step as an elementwise kernel: writes m', v' (aliased onto m, v) and the
                    normalized update N from R; optionally writes N in fp16 and casts P to fp16.
  up_update         the up-projection GEMM (N P or P N, K = r) with the full-rank update in its epilogue:
                    out = a W + c backproject(N), stored as the update (optax path) or added to W and
                    written over W through input_output_aliases (in-place path). One pass over W; none
                    when w is None (no weight decay on the optax path). A program may own several tiles.
                    Operands fp32 (TF32) or fp16 (UpConfig.f16: as exact as TF32, see the note there).

The up-projection's launch and the per-leaf variant choice are tuning data: `up_config` and `choose_variant`
read them from this GPU kind's table (pallas_fused/tuning/<device>.json, sections "galore_up" and
"galore_variant", which the tuning sweep in benchmarks/bench_galore.py prints), else from the heuristics below;
`up_update` also takes its launch as an argument (`blocks=`). api.py strings the kernels
into the variants of its `VARIANTS` table.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_fused import _backend
from pallas_fused._backend import cdiv

F32 = jnp.float32

# fp16's largest finite value: N is clamped to it before an fp16 store (it never gets near: |N| is O(1)).
F16_MAX = 65504.0


class UpConfig(NamedTuple):
    """Launch configuration of the up-projection kernel: (bm, bn) tiles of W, tn x tm of them per program
    (a loop), K (= rank) in chunks of br, and whether W's load is issued before the GEMM (overlapping its
    HBM latency; with several tiles, the next tile's W is prefetched) or after it."""

    bm: int = 64
    bn: int = 128
    br: int = 32
    warps: int = 4
    stages: int = 3
    w_first: bool = True
    tn: int = 1  # column tiles per program (a pipelined loop; with br >= rank the A rows load once)
    tm: int = 1  # row tiles per program (with tn == 1 and br >= rank the B columns load once)
    f16: bool = False  # fp16 GEMM operands (tiles cast in registers; the Adam kernel then writes N in fp16)
    p16: bool = False  # with f16: the Adam kernel also casts P to fp16 once per step (halves its L2 traffic)


# Why fp16 operands lose nothing against TF32 here: the tensor cores round TF32 operands to a 10-bit mantissa,
# fp16's own. N = m / (sqrt(v) + eps) is O(1) (Cauchy-Schwarz: |m| / sqrt(v) <= (1 - b1) / sqrt((1 - b2)
# (1 - b1^2 / b2)), 7.3 at b1 0.9, b2 0.999; clamped to F16_MAX anyway) and P has orthonormal rows/columns
# (|entries| <= 1): neither overflows. Only values below fp16's
# normal range (6.1e-5) keep fewer mantissa bits, an absolute error <= 2^-25 (3e-8) on terms that small,
# against the relative 2^-11 TF32 rounding of every term. Accumulation stays fp32. G never goes to fp16
# (gradients can be far below 6e-5): the down-projection (XLA's GEMM) reads G as it is.


# The launches of a GPU without a tuning table: the H200's (pallas_fused/tuning/nvidia_h200.json holds them, their
# measurements are in docs/performance.md, "Tuning tables"), per side of the projector.
UP_HEURISTIC = {
    "right": dict(bm=64, bn=128, br=128, warps=8, stages=2, w_first=True, tn=1, tm=8, f16=True, p16=False),
    "left": dict(bm=64, bn=64, br=128, warps=4, stages=2, w_first=True, tn=1, tm=8, f16=True, p16=True),
}
# The variant of a GPU without a table: the H200's winners, [M, N, rank, side, variant] (`choose_variant`).
VARIANT_HEURISTIC = {"measured": [
    [4096, 4096, 128, "right", "hybrid"], [4096, 11008, 128, "left", "hybrid"], [4096, 4096, 32, "right", "hybrid"],
    [4096, 11008, 32, "left", "hybrid"], [4096, 4096, 512, "right", "xla_up"], [4096, 4096, 256, "right", "hybrid"],
    [4096, 11008, 256, "left", "hybrid"],
]}


def up_config(rank: int, side: str, blocks=None) -> UpConfig:
    """The up-projection's launch for `side`: `blocks` (an `UpConfig` or a tuple of its fields), else this GPU
    kind's tuned one; its K chunk no wider than the rank's block."""
    if blocks:
        cfg = UpConfig(*blocks)
    else:
        cfg = UpConfig(**_backend.tuned("galore_up", UP_HEURISTIC)[side])
        if _backend.gpu_device() is None:
            # Without a GPU the kernels only run in the interpreter, where fp16 operands save no memory traffic and
            # only round: it multiplies fp32, exact as the XLA:CPU reference it is checked against.
            cfg = cfg._replace(f16=False, p16=False)
    return cfg._replace(br=min(cfg.br, _rank_block(rank)))


def _rank_block(rank: int) -> int:
    """Ranks are padded (by masks) to a power of two >= 16 (Triton dot minimum)."""
    return max(16, 1 << (rank - 1).bit_length())


def _pad_rank(x, axis: int, block: int):
    """`x` zero-padded along its rank `axis` to `block` when the rank is smaller.

    A kernel that covers the whole rank in one power-of-two block (Triton's shapes) would otherwise index a
    static block past the array's end: masked on the GPU, but jax >= 0.12 rejects such a slice when it traces the
    kernel (on the GPU and in interpret mode alike). Ranks that are powers of two >= 16 pad nothing; other ranks
    copy the low-rank arrays, O(rank (M + N)) against the O(M N) of the gradient and weight streams."""
    if x.shape[axis] >= block:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, block - x.shape[axis])
    return jnp.pad(x, widths)


def _scalars(s_ref):
    return tuple(s_ref[i] for i in range(8))


def _adam_epilogue(r, m, v, s):
    """fp32 low-rank Adam on a tile: returns (m', v', N). With ok = 0 (a skipped step: the caller's finiteness flag)
    m' and v' are m and v as loaded, so the in-place store writes them back unchanged and no copy of the old moments
    is needed outside."""
    b1, b2, eps, alpha, beta, _, _, ok = s
    okb = ok > 0
    m_new = jnp.where(okb, b1 * m + (1.0 - b1) * r, m)
    v_new = jnp.where(okb, b2 * v + (1.0 - b2) * r * r, v)
    n = (alpha * m_new) / (beta * jnp.sqrt(v_new) + eps)
    return m_new, v_new, n


# ------------------------------------------------------------------------------ elementwise low-rank Adam
def _store_adam(acc, m_ref, v_ref, m_out, v_out, n_out, idx, mask, s):
    m = _backend.load(m_ref.at[idx], mask=mask, other=0.0).astype(F32)
    v = _backend.load(v_ref.at[idx], mask=mask, other=0.0).astype(F32)
    m_new, v_new, n = _adam_epilogue(acc, m, v, s)
    _backend.store(m_out.at[idx], m_new.astype(m_out.dtype), mask=mask)
    _backend.store(v_out.at[idx], v_new.astype(v_out.dtype), mask=mask)
    if n_out.dtype == jnp.float16:  # |N| is O(1); the clamp only guards the cast (NaN stays NaN)
        n = jnp.where(jnp.abs(n) > F16_MAX, jnp.where(n > 0, F16_MAX, -F16_MAX), n)
    _backend.store(n_out.at[idx], n.astype(n_out.dtype), mask=mask)


def _lowrank_adam_kernel(*refs, size, size_p, BLOCK):
    # r_ref: R flattened (size elements). With size_p, the same programs also cast P (flattened, size_p elements)
    # to fp16 (p16_out).
    if size_p:
        r_ref, m_ref, v_ref, s_ref, p_ref, m_out, v_out, n_out, p16_out = refs
    else:
        r_ref, m_ref, v_ref, s_ref, m_out, v_out, n_out = refs
    i = pl.program_id(0)
    idx = pl.ds(i * BLOCK, BLOCK)
    offs = i * BLOCK + jnp.arange(BLOCK)
    mask = offs < size
    r = _backend.load(r_ref.at[idx], mask=mask, other=0.0).astype(F32)
    _store_adam(r, m_ref, v_ref, m_out, v_out, n_out, idx, mask, _scalars(s_ref))
    if size_p:
        pmask = offs < size_p
        pv = _backend.load(p_ref.at[idx], mask=pmask, other=0.0).astype(F32)
        _backend.store(p16_out.at[idx], pv.astype(jnp.float16), mask=pmask)


@functools.partial(jax.jit, static_argnames=("interpret", "n_dtype"))
def lowrank_adam(r, m, v, scalars, *, interpret: bool = False, n_dtype=F32, p=None):
    """Elementwise low-rank Adam on an already projected R (m's shape). Returns (m', v', N), m' and v' written over m's
    and v's buffers (input_output_aliases). The scalars' ok = 0 skips the step in place: m and v are stored back
    unchanged (the caller computes that flag from R, m and v before this launch: `reference.lowrank_finite`).

    `n_dtype`: N's dtype (fp32, or fp16 for an fp16 up-projection: clamped to +-F16_MAX). With `p` (the
    projector) the same launch also returns P cast to fp16: (m', v', N, P16), for an up-projection on fp16
    operands (UpConfig.p16) without a separate cast."""
    shape = m.shape
    size = m.size
    if r.shape != shape:
        raise ValueError(f"lowrank_adam: r must have m's shape {shape}, got {r.shape}")
    block = 1024
    size_p = 0 if p is None else p.size
    outs = (jax.ShapeDtypeStruct((size,), m.dtype), jax.ShapeDtypeStruct((size,), v.dtype),
            jax.ShapeDtypeStruct((size,), n_dtype))
    args = (r.reshape(-1), m.reshape(-1), v.reshape(-1), scalars)
    if size_p:
        outs += (jax.ShapeDtypeStruct((size_p,), jnp.float16),)
        args += (p.reshape(-1),)
    kern = functools.partial(_lowrank_adam_kernel, size=size, size_p=size_p, BLOCK=block)
    call = _backend.triton_call(kern, out_shape=outs, grid=(cdiv(max(size, size_p), block),),
                                name="pallas_fused_galore_adam", interpret=interpret, num_warps=4,
                                input_output_aliases={1: 0, 2: 1})
    m2, v2, n, *p16 = call(*args)
    out = (m2.reshape(shape), v2.reshape(shape), n.reshape(shape))
    return (*out, p16[0].reshape(p.shape)) if size_p else out


# ------------------------------------------------------------------------------------ up + full update
def _up_kernel(*refs, M, N, R, BM, BN, BR, TM, TN, inplace, has_w, w_first, f16):
    # acc[BM, BN] = A[rows, :] @ B[:, cols] with K = R; A, B = (N, P) on side right, (P, N) on side left.
    # A program owns TM x TN tiles (row-major order): a loop whose loads Triton pipelines.
    w_ref, a_ref, b_ref, s_ref, o_ref = refs if has_w else (None, *refs)
    op_dtype = jnp.float16 if f16 else F32  # the GEMM's operand dtype (see the fp16 note at UpConfig)
    ii, jj = pl.program_id(0), pl.program_id(1)
    _, _, _, _, _, ca, cc, ok = _scalars(s_ref)
    T = TM * TN

    def tile_index(t):
        if TN == 1:
            i, j = ii * TM + t, jj
        elif TM == 1:
            i, j = ii, jj * TN + t
        else:  # lax's truncating div/rem: t >= 0 (jnp's floor versions do not lower here)
            i, j = ii * TM + lax.div(t, TN), jj * TN + lax.rem(t, TN)
        rmask = i * BM + jnp.arange(BM) < M
        cmask = j * BN + jnp.arange(BN) < N
        return i, j, rmask, cmask, (pl.ds(i * BM, BM), pl.ds(j * BN, BN)), rmask[:, None] & cmask[None, :]

    def load_a(t, k):
        i, _, rmask, _, _, _ = tile_index(t)
        kmask = k * BR + jnp.arange(BR) < R
        return _backend.load(a_ref.at[pl.ds(i * BM, BM), pl.ds(k * BR, BR)], mask=rmask[:, None] & kmask[None, :],
                             other=0.0).astype(op_dtype)

    def load_b(t, k):
        _, j, _, cmask, _, _ = tile_index(t)
        kmask = k * BR + jnp.arange(BR) < R
        return _backend.load(b_ref.at[pl.ds(k * BR, BR), pl.ds(j * BN, BN)], mask=kmask[:, None] & cmask[None, :],
                             other=0.0).astype(op_dtype)

    # One K chunk (BR >= R): the operand shared by all the program's tiles (A rows along a column loop, B
    # columns along a row loop) is loaded once.
    a_once = load_a(0, 0) if BR >= R and TM == 1 else None
    b_once = load_b(0, 0) if BR >= R and TN == 1 else None

    def load_w(t, extra_mask=None):
        *_, idx, mask = tile_index(t)
        mask = mask if extra_mask is None else mask & extra_mask
        return _backend.load(w_ref.at[idx], mask=mask, other=0.0).astype(F32)

    # W is the big stream. w_first: its load is issued before the GEMM so the HBM latency overlaps it (holding
    # the tile in registers through the K loop); with several tiles per program the next tile's W is loaded
    # during this tile's work (carried through the loop: two tiles of W in flight per program). Otherwise W
    # loads after the GEMM.
    prefetch = has_w and w_first and T > 1

    def tile(t, w_next):
        *_, idx, mask = tile_index(t)
        if prefetch:
            w, w_next = w_next, load_w(t + 1, t + 1 < T)
        else:
            w = load_w(t) if has_w and w_first else None

        def body(k, acc):
            a = a_once if a_once is not None else load_a(t, k)
            b = b_once if b_once is not None else load_b(t, k)
            return acc + _backend.dot(a, b, allow_tf32=None if f16 else True)

        acc = lax.fori_loop(0, cdiv(R, BR), body, jnp.zeros((BM, BN), F32))
        if has_w and not w_first:
            w = load_w(t)
        out = ca * w + cc * acc if has_w else cc * acc
        # a skipped step (ok = 0): a zero update, or W written back as loaded (W + 0 would turn -0.0 into 0.0)
        out = jnp.where(ok > 0, w + out, w) if inplace else jnp.where(ok > 0, out, 0.0)
        _backend.store(o_ref.at[idx], out.astype(o_ref.dtype), mask=mask)
        return w_next

    if T == 1:
        tile(0, None)
    else:
        lax.fori_loop(0, T, tile, load_w(0) if prefetch else jnp.zeros((), F32))


def up_operands(rank: int, side: str, blocks=None):
    """(N's dtype, whether P is cast to fp16 once per step) for the up-projection launch `blocks` (see
    `up_config`)."""
    cfg = up_config(rank, side, blocks)
    return (jnp.float16 if cfg.f16 else F32), bool(cfg.f16 and cfg.p16)


def up_update(w, n, p, scalars, *, side: str, inplace: bool = False, interpret: bool = False, blocks=None,
              out_dtype=None):
    """The up-projection GEMM with the full-rank update in its epilogue.

    Returns out = a W + c backproject(N) in W's dtype; with `inplace`, W + out written over W's buffer
    (input_output_aliases: donate W at the jit boundary to update it without a copy). `w=None` (no weight
    decay on the optax path) drops the a W term and never reads a W: out = c backproject(N) in `out_dtype`
    (default P's dtype). `blocks`: its launch (see `up_config`)."""
    if w is None and inplace:
        raise ValueError("up_update: inplace=True needs w (the weight to update)")
    R = n.shape[1] if side == "right" else n.shape[0]
    dtype = jnp.dtype(w.dtype if w is not None else (out_dtype or p.dtype))
    return _up_update(w, n, p, scalars, side=side, inplace=inplace, interpret=interpret,
                      cfg=up_config(R, side, blocks), dtype=dtype)


@functools.partial(jax.jit, static_argnames=("side", "inplace", "interpret", "cfg", "dtype"))
def _up_update(w, n, p, scalars, *, side, inplace, interpret, cfg: UpConfig, dtype):
    if side == "right":
        (M, R), N = n.shape, p.shape[1]
    else:
        M, (R, N) = p.shape[0], n.shape
    a, b = (n, p) if side == "right" else (p, n)
    if cfg.br > R:  # one K chunk covers the rank: pad it to the chunk (see `_pad_rank`)
        a, b = _pad_rank(a, 1, cfg.br), _pad_rank(b, 0, cfg.br)
    has_w = w is not None
    kern = functools.partial(_up_kernel, M=M, N=N, R=R, BM=cfg.bm, BN=cfg.bn, BR=cfg.br, TM=cfg.tm, TN=cfg.tn,
                             inplace=inplace, has_w=has_w, w_first=cfg.w_first, f16=cfg.f16)
    call = _backend.triton_call(kern, out_shape=jax.ShapeDtypeStruct((M, N), dtype),
                                grid=(cdiv(cdiv(M, cfg.bm), cfg.tm), cdiv(cdiv(N, cfg.bn), cfg.tn)),
                                name="pallas_fused_galore_up_inplace" if inplace else "pallas_fused_galore_up",
                                interpret=interpret, num_warps=cfg.warps, num_stages=cfg.stages,
                                input_output_aliases={0: 0} if inplace else None)
    return call(w, a, b, scalars) if has_w else call(a, b, scalars)


def choose_variant(shape: tuple[int, int], rank: int, side: str, measured=None) -> str:
    """The default variant for one leaf: the entry of `measured` ([M, N, rank, side, variant] rows; default this GPU
    kind's tuned "galore_variant" table) of the same side nearest in size and rank (log scale); "hybrid" with
    none."""
    measured = _backend.tuned("galore_variant", VARIANT_HEURISTIC)["measured"] if measured is None else measured
    table = [row for row in measured if row[3] == side] or list(measured)
    if not table:
        return "hybrid"
    m, n = shape

    def distance(row):
        return abs(math.log(row[0] * row[1] / (m * n))) + abs(math.log(row[2] / rank))

    return min(table, key=distance)[4]
