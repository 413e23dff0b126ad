"""Triton-lowered Pallas kernels for FP8: the quantize passes and a portable scaled matmul.

Quantize (x ~= q * scale, saturating; see `quantize_2d`): XLA reduces the amax, then one Pallas pass
over a 2-D grid of tiles casts, writing the transposed copy q^T in the same pass when asked (the K-major
operand the backward GEMMs need), so an fp8 tensor is produced in both layouts from one cast pass.

Scaled matmul (`scaled_matmul_nt`): out = (a * a_scale) @ (bt * b_scale)^T, a (M, K) and bt (N, K)
both K-major, with per-row/per-column fp32 scale vectors applied to the fp32 accumulator in the
epilogue. This is the portable fallback (and what the CPU tests interpret); the Hopper-speed version
is the Mosaic GPU kernel in kernel_sm90.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_fused import _backend
from pallas_fused.fp8.reference import (
    finite_amax,
    fp8_max,
    saturate,
    scale_from_amax,
)


def _cast(x, scale, dtype):
    """As reference.saturating_cast: +-inf saturates, NaN stays NaN (Triton's min/max would turn it into -limit)."""
    limit = fp8_max(dtype)
    v = x / scale
    return jnp.where(v == v, jnp.clip(v, -limit, limit), v)


def _cast_kernel(x_ref, s_ref, *refs, shape, block, dtype, scale_axis, emit_n, emit_t):
    """One program: one `block` tile of x, cast with the scalar scale (scale_axis=None), the per-row
    scales (scale_axis=1: the amax was taken along axis 1) or the per-column scales (scale_axis=0)."""
    refs = list(refs)
    o_ref = refs.pop(0) if emit_n else None
    ot_ref = refs.pop(0) if emit_t else None
    r0, c0 = pl.program_id(0) * block[0], pl.program_id(1) * block[1]
    rows, cols = r0 + jnp.arange(block[0]), c0 + jnp.arange(block[1])
    row_mask, col_mask = rows < shape[0], cols < shape[1]
    mask = row_mask[:, None] & col_mask[None, :]
    idx = (pl.ds(r0, block[0]), pl.ds(c0, block[1]))
    x = _backend.load(x_ref.at[idx], mask=mask, other=0.0).astype(jnp.float32)
    if scale_axis is None:
        scale = _backend.load(s_ref.at[pl.ds(0, 1)])[:, None]
    elif scale_axis == 1:
        scale = _backend.load(s_ref.at[pl.ds(r0, block[0])], mask=row_mask, other=1.0)[:, None]
    else:
        scale = _backend.load(s_ref.at[pl.ds(c0, block[1])], mask=col_mask, other=1.0)[None, :]
    q = _cast(x, scale, dtype)
    if emit_n:
        _backend.store(o_ref.at[idx], q.astype(dtype), mask=mask)
    if emit_t:
        _backend.store(ot_ref.at[idx[1], idx[0]], q.T.astype(dtype), mask=mask.T)


def _outs(shape, dtype, emit_n, emit_t):
    outs = []
    if emit_n:
        outs.append(jax.ShapeDtypeStruct(shape, dtype))
    if emit_t:
        outs.append(jax.ShapeDtypeStruct(shape[::-1], dtype))
    return outs


# (rows, columns) of x per program of the cast pass, and warps, per scale axis, for a GPU without a tuning table:
# the H200's (the fastest of its sweep, see docs/performance.md, "Tuning tables").
HEURISTIC = {"tensorwise": dict(block=(128, 128), num_warps=8), "axis1": dict(block=(64, 64), num_warps=8),
             "axis0": dict(block=(128, 64), num_warps=4)}


def cast_config(axis) -> tuple[tuple[int, int], int]:
    """((rows, columns) per program, warps) of the cast pass for this scale axis and device kind."""
    entry = _backend.tuned("fp8_cast", HEURISTIC)["tensorwise" if axis is None else f"axis{axis}"]
    return tuple(entry["block"]), entry["num_warps"]


@functools.partial(jax.jit, static_argnames=("dtype", "axis", "power_of_2", "emit_n", "emit_t", "interpret",
                                             "block", "num_warps"))
def quantize_2d(x, *, dtype, axis, power_of_2, emit_n=True, emit_t=False, interpret=False, block=None,
                num_warps=None):
    """Quantize a 2-D x: returns (q or None, q^T or None, scale).

    axis=None: tensorwise (scale shape ()); axis=1: one scale per row ((R, 1)); axis=0: one per
    column ((1, C)). The transposed copy q^T has the same scale, transposed.

    XLA reduces the amax (one read of x), then one Pallas pass over a 2-D grid of tiles casts and writes
    q and/or q^T (a second read of x): bytes = 2 reads + the writes, but every tile runs in parallel.
    Measured on an H200 (16384x8192 bf16, q and q^T): 0.24-0.27 ms for every axis; one program per block
    of rows (columns) taking the amax and casting in one kernel took 0.53-0.73 ms (too few programs in
    flight).
    """
    dtype = jnp.dtype(dtype)
    shape = x.shape
    # Phase 1: the amax of the finite values (XLA's reduction fuses abs, max and the scale arithmetic into one
    # read of x).
    amax = finite_amax(x, axis)
    scale = scale_from_amax(amax, dtype, power_of_2)
    # Phase 2: the cast, tile by tile.
    tuned_block, tuned_warps = cast_config(axis)
    block = block or ((32, 32) if interpret else tuned_block)
    outs = _backend.triton_call(
        functools.partial(_cast_kernel, shape=shape, block=block, dtype=dtype, scale_axis=axis, emit_n=emit_n,
                          emit_t=emit_t),
        out_shape=_outs(shape, dtype, emit_n, emit_t),
        grid=(pl.cdiv(shape[0], block[0]), pl.cdiv(shape[1], block[1])),
        name="pallas_fused_fp8_quantize_" + ("tensorwise" if axis is None else f"axis{axis}"),
        interpret=interpret,
        num_warps=num_warps or tuned_warps,
    )(x, scale.reshape(-1))
    outs = list(outs)
    q = outs.pop(0) if emit_n else None
    qt = outs.pop(0) if emit_t else None
    return q, qt, scale


def _matmul_kernel(a_ref, bt_ref, sa_ref, sb_ref, o_ref, *, shape, block, upcast):
    m, n, k = shape
    bm, bn, bk = block
    m0, n0 = pl.program_id(0) * bm, pl.program_id(1) * bn
    rows, cols = m0 + jnp.arange(bm), n0 + jnp.arange(bn)
    row_mask, col_mask = rows < m, cols < n

    def step(i, acc):
        ks = i * bk + jnp.arange(bk)
        k_mask = ks < k
        a = _backend.load(a_ref.at[pl.ds(m0, bm), pl.ds(i * bk, bk)], mask=row_mask[:, None] & k_mask[None, :],
                          other=0.0)
        b = _backend.load(bt_ref.at[pl.ds(n0, bn), pl.ds(i * bk, bk)], mask=col_mask[:, None] & k_mask[None, :],
                          other=0.0)
        if upcast is not None:  # mixed fp8 dtypes (or the CPU interpreter): multiply in a wider type
            a, b = a.astype(upcast), b.astype(upcast)
        return acc + _backend.dot(a, b, trans_b=True)

    acc = jax.lax.fori_loop(0, pl.cdiv(k, bk), step, jnp.zeros((bm, bn), jnp.float32))
    sa = _backend.load(sa_ref.at[pl.ds(m0, bm)], mask=row_mask, other=0.0)
    sb = _backend.load(sb_ref.at[pl.ds(n0, bn)], mask=col_mask, other=0.0)
    out = acc * sa[:, None] * sb[None, :]
    _backend.store(o_ref.at[pl.ds(m0, bm), pl.ds(n0, bn)], out.astype(o_ref.dtype),
                   mask=row_mask[:, None] & col_mask[None, :])


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "block"))
def scaled_matmul_nt(a, bt, a_scale, b_scale, *, out_dtype, interpret=False, block=None):
    """(a * a_scale[:, None]) @ (bt * b_scale[:, None])^T for a (M, K), bt (N, K) fp8 and fp32 scale
    vectors a_scale (M,), b_scale (N,)."""
    m, k = a.shape
    n = bt.shape[0]
    if block is None:
        block = (32, 32, 32) if interpret else (128, 128, 64)
    if interpret:
        upcast = jnp.float32
    elif a.dtype != bt.dtype:
        upcast = jnp.bfloat16
    else:
        upcast = None
    return _backend.triton_call(
        functools.partial(_matmul_kernel, shape=(m, n, k), block=block, upcast=upcast),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(pl.cdiv(m, block[0]), pl.cdiv(n, block[1])),
        name="pallas_fused_fp8_scaled_matmul_triton",
        interpret=interpret,
        num_warps=8 if not interpret else 4,
        num_stages=3 if not interpret else None,
    )(a, bt, a_scale, b_scale)


# ----------------------------------------------------------------------------------------------
# blockwise quantize: one scale per tile, the amax and the cast in one pass


def fp8_cast(dtype, interpret: bool):
    """The saturating fp32 -> fp8 cast of a kernel (`reference.saturate`'s numbers). Compiled, Triton and Mosaic GPU
    convert with cvt.rn.satfinite (out of range and +-inf to +-max, NaN kept): the clamp of `saturate` (a min, a max
    and a NaN select per element) is the conversion's own there. Interpret mode (XLA's conversion) turns
    out-of-range values into NaN, so it keeps the clamp."""
    return (lambda v: saturate(v, dtype)) if interpret else (lambda v: v.astype(dtype))


def _block_scale(amax, dtype, power_of_2, interpret):
    """(scale, 1 / scale): reference.scale_from_amax and its cast's reciprocal, correctly rounded (PTX rcp.rn;
    Triton's own fp32 division is div.full, approximate)."""
    scale = scale_from_amax(amax, dtype, power_of_2)
    if interpret:
        return scale, 1.0 / scale
    from jax.experimental.pallas import triton as pl_triton

    (inv,) = pl_triton.elementwise_inline_asm("rcp.rn.f32 $0, $1;", args=[scale], constraints="=r,r", pack=1,
                                              result_shape_dtypes=[jax.ShapeDtypeStruct(scale.shape, jnp.float32)])
    return scale, inv


_KEY_ZERO = 0x01000000  # the key of |x| = 0


def _abs_key(x):
    """uint32 keys of an fp32 x whose unsigned order is that of reference.finite_abs(x), every inf and NaN below the
    key of 0: the bits shifted past the sign, plus 2^24, which wraps the exponent 0xFF (inf, NaN) to the bottom. The
    amax over them costs one integer multiply-add per element, where abs, the finite test and its select cost three
    instructions."""
    return (jax.lax.bitcast_convert_type(x, jnp.uint32) << jnp.uint32(1)) + jnp.uint32(_KEY_ZERO)


def _key_amax(key):
    """The fp32 amax of a max of `_abs_key`s (0 where only inf and NaN were seen)."""
    bits = (jnp.maximum(key, jnp.uint32(_KEY_ZERO)) - jnp.uint32(_KEY_ZERO)) >> jnp.uint32(1)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _max_into(acc, a):
    return a if acc is None else jnp.maximum(acc, a)


def _each_chunk(n, chunk, body, carry):
    """carry = body(k, carry) for the first row k of each of the n // chunk chunks: a loop (chunk < n), so that a
    thread holds one chunk's registers, not the tile's, and more programs share an SM; one call where chunk == n."""
    if chunk < n:
        return jax.lax.fori_loop(0, n // chunk, lambda i, c: body(i * chunk, c), carry)
    return body(0, carry)


def _blockwise_kernel(x_ref, *refs, shape, tile, dtype, power_of_2, square, emit_n, emit_t, interpret, chunk, cast):
    """One program: one `tile` = (rows, cols) of x.

    square=False: q's scales are per row of the tile (a 1 x cols block along x's columns), q^T's per column (a
    rows x 1 block of x, i.e. 1 x rows along the rows of x^T). square=True: one scale for the whole tile, shared
    by q and q^T. Scales are stored into flat outputs at their GEMM-layout positions (see `quantize_blockwise`).

    The tile is taken `chunk` rows at a time (`_each_chunk`; chunk == rows: at once, read once): a row block's scale
    needs only its row, so q is cast chunk by chunk while the column amax accumulates as an elementwise max over the
    chunks (one cross-thread reduction per tile, after the last); what needs the whole tile's amax (q^T's column
    scales, a square tile's scale) reads the chunks a second time, from L2. The amax is a max of `_abs_key`s."""
    refs = list(refs)
    if square:  # refs: q, q^T (each if asked), then the tile scales
        o_ref = refs.pop(0) if emit_n else None
        ot_ref = refs.pop(0) if emit_t else None
        s_ref = refs.pop(0)
    else:  # refs: q and its scales, q^T and its scales (each pair if asked)
        o_ref, so_ref = (refs.pop(0), refs.pop(0)) if emit_n else (None, None)
        ot_ref, sot_ref = (refs.pop(0), refs.pop(0)) if emit_t else (None, None)
    i, j = pl.program_id(0), pl.program_id(1)
    r0, c0 = i * tile[0], j * tile[1]
    cols = c0 + jnp.arange(tile[1])
    col_mask = cols < shape[1]
    f32 = jnp.float32
    looped = chunk < tile[0]
    kept = {}  # the one chunk of an unchunked tile, reused by the second pass instead of a second read

    def load(k, again=False):
        """Rows [k, k + chunk) of the tile: (x, row mask, mask). Outside x the tile reads 0, which leaves every amax
        as it is: a ragged tile is a block of its own."""
        if again and not looped:
            return kept[0]
        row_mask = r0 + k + jnp.arange(chunk) < shape[0]
        mask = row_mask[:, None] & col_mask[None, :]
        x = _backend.load(x_ref.at[pl.ds(r0 + k, chunk), pl.ds(c0, tile[1])], mask=mask, other=0.0).astype(f32)
        kept[0] = (x, row_mask, mask)
        return kept[0]

    def store(k, q, mask):
        if o_ref is not None:
            _backend.store(o_ref.at[pl.ds(r0 + k, chunk), pl.ds(c0, tile[1])], q, mask=mask)

    def store_t(k, qt, mask):
        _backend.store(ot_ref.at[pl.ds(c0, tile[1]), pl.ds(r0 + k, chunk)], qt, mask=mask.T)

    # The elementwise max of the chunks' keys, carried by the loop (key 0 is below every finite |x|'s).
    acc_init = jnp.zeros((chunk, tile[1]), jnp.uint32) if looped else None

    if square:
        acc = _each_chunk(tile[0], chunk, lambda k, acc: _max_into(acc, _abs_key(load(k)[0])), acc_init)
        amax = _key_amax(jnp.max(jnp.max(acc, axis=1), axis=0, keepdims=True))
        scale, inv = _block_scale(amax, dtype, power_of_2, interpret)  # (1,)

        def cast_square(k, carry):
            x, _, mask = load(k, again=True)
            q = cast(x * inv[:, None])
            store(k, q, mask)
            if emit_t:
                store_t(k, q.T, mask)
            return carry

        _each_chunk(tile[0], chunk, cast_square, 0)
        # The (row-tile, column-tile) grid of scales, row-major: the reference's layout.
        _backend.store(s_ref.at[pl.ds(i * pl.num_programs(1) + j, 1)], scale)
        return

    def rows_pass(k, col_acc):
        """q of rows [k, k + chunk); col_acc: the elementwise max of the chunks' keys so far."""
        x, row_mask, mask = load(k)
        a = _abs_key(x)
        if emit_n:  # per row of the tile, along x's columns: row r of K block j is element (j, r) of (K blocks, M)
            scale, inv = _block_scale(_key_amax(jnp.max(a, axis=1)), dtype, power_of_2, interpret)
            store(k, cast(x * inv[:, None]), mask)
            _backend.store(so_ref.at[pl.ds(j * shape[0] + r0 + k, chunk)], scale, mask=row_mask)
        return _max_into(col_acc, a) if emit_t else col_acc

    col_acc = _each_chunk(tile[0], chunk, rows_pass, acc_init if emit_t else None)
    if emit_t:  # per column of the tile, along x's rows (the contraction of x^T's GEMM)
        scale, inv = _block_scale(_key_amax(jnp.max(col_acc, axis=0)), dtype, power_of_2, interpret)

        def cols_pass(k, carry):
            x, _, mask = load(k, again=True)
            store_t(k, cast(x * inv[None, :]).T, mask)
            return carry

        _each_chunk(tile[0], chunk, cols_pass, 0)
        _backend.store(sot_ref.at[pl.ds(i * shape[1] + c0, tile[1])], scale, mask=col_mask)


def _blockwise_packed_kernel(x_ref, o_ref, so_ref, ot_ref, sot_ref, *, shape, tile, dtype, power_of_2, interpret,
                             chunk, cast):
    """The activation pass (q in 1 x cols blocks and q^T in rows x 1 blocks) with q^T's codes packed four to a word.

    x_ref and o_ref are x and q viewed as (R / 4, 4 C), row t holding rows 4t .. 4t + 3; ot_ref is q^T viewed as
    uint32 (C, R / 4), word (c, t) holding codes (c, 4t .. 4t + 3), lowest byte first; so_ref is q's scales
    (K blocks, R) viewed as (K blocks * R / 4, 4). The tile's rows 4t + k (k = 0..3) come in as four (rows / 4, cols)
    parts, so a thread holds the four codes of one word of q^T: the transposition through shared memory moves 4-byte
    words where `_blockwise_kernel` moves single bytes. Chunks as in `_blockwise_kernel` (a chunk: chunk / 4 rows
    of each part)."""
    r, c = shape
    i, j = pl.program_id(0), pl.program_id(1)
    nt, ct = tile[0] // 4, chunk // 4
    t0, c0 = i * nt, j * tile[1]
    col_mask = c0 + jnp.arange(tile[1]) < c
    looped = ct < nt
    kept = {}

    def parts(kk, again=False):
        """Rows [4 (t0 + kk), 4 (t0 + kk + ct)) of x as its four parts, with the rows' mask and the mask."""
        if again and not looped:
            return kept[0]
        row_mask = t0 + kk + jnp.arange(ct) < r // 4
        mask = row_mask[:, None] & col_mask[None, :]
        xs = [_backend.load(x_ref.at[pl.ds(t0 + kk, ct), pl.ds(k * c + c0, tile[1])], mask=mask,
                            other=0.0).astype(jnp.float32) for k in range(4)]
        kept[0] = (xs, row_mask, mask)
        return kept[0]

    def rows_pass(kk, col_acc):
        xs, row_mask, mask = parts(kk)
        for k, x in enumerate(xs):
            a = _abs_key(x)
            col_acc = _max_into(col_acc, a)
            scale, inv = _block_scale(_key_amax(jnp.max(a, axis=1)), dtype, power_of_2, interpret)
            _backend.store(o_ref.at[pl.ds(t0 + kk, ct), pl.ds(k * c + c0, tile[1])], cast(x * inv[:, None]),
                           mask=mask)
            # Row 4t + k of x: element (j, 4t + k) of q's (K blocks, R) scales, seen as (K blocks * R / 4, 4).
            _backend.store(so_ref.at[pl.ds(j * (r // 4) + t0 + kk, ct), pl.ds(k, 1)], scale[:, None],
                           mask=row_mask[:, None])
        return col_acc

    acc_init = jnp.zeros((ct, tile[1]), jnp.uint32) if looped else None
    col_acc = _each_chunk(nt, ct, rows_pass, acc_init)  # the elementwise max of the parts' keys
    scale, inv = _block_scale(_key_amax(jnp.max(col_acc, axis=0)), dtype, power_of_2, interpret)

    def cols_pass(kk, carry):
        xs, _, mask = parts(kk, again=True)
        word = None
        for k, x in enumerate(xs):
            code = jax.lax.bitcast_convert_type(cast(x * inv[None, :]), jnp.uint8).astype(jnp.uint32)
            code = code << jnp.uint32(8 * k) if k else code
            word = code if word is None else word | code
        _backend.store(ot_ref.at[pl.ds(c0, tile[1]), pl.ds(t0 + kk, ct)], word.T, mask=mask.T)
        return carry

    _each_chunk(nt, ct, cols_pass, 0)
    _backend.store(sot_ref.at[pl.ds(i * c + c0, tile[1])], scale, mask=col_mask)


# The blockwise pass' launch per mode, for a GPU without a tuning table: the H200's (docs/performance.md,
# "Tuning tables", says what was measured). Modes: both activation copies (q in 1 x bk blocks and q^T in bm x 1),
# one copy, or a square tile's two. num_warps per program; rows: the tile's rows per loop step (None: the whole
# tile at once); packed: q^T's codes four to a word (`_blockwise_packed_kernel`).
BLOCKWISE_HEURISTIC = {"both": {"num_warps": 4, "rows": 64, "packed": True},
                       "one": {"num_warps": 8, "rows": 32},
                       "square": {"num_warps": 8, "rows": None}}


def blockwise_supported(block_n, block_t) -> bool:
    """Whether `quantize_blockwise` takes these blocks (in x's coordinates; None: that copy is not asked for):
    1 x b along the columns for q and/or b x 1 along the rows for q^T, or one b0 x b1 tile (both > 1) shared by
    both; every b a power of two (a Triton block shape)."""
    pow2 = lambda b: b >= 1 and b & (b - 1) == 0  # noqa: E731
    if block_n is None and block_t is None:
        return False
    tiles = [b for b in (block_n, block_t) if b is not None]
    if all(b[0] > 1 and b[1] > 1 for b in tiles):  # one shared tile
        return all(b == tiles[0] for b in tiles) and all(map(pow2, tiles[0]))
    return ((block_n is None or (block_n[0] == 1 and pow2(block_n[1])))
            and (block_t is None or (block_t[1] == 1 and pow2(block_t[0]))))


def _is_square(block_n, block_t) -> bool:
    """Whether supported blocks are one tile shared by q and q^T (a weight's), not 1 x b / b x 1 blocks."""
    return all(b[0] > 1 and b[1] > 1 for b in (block_n, block_t) if b is not None)


def _blockwise_launch(rows, block_n, block_t):
    """(tile, num_warps, chunk, packed) of `quantize_blockwise` for an x of `rows` rows and supported blocks."""
    square = _is_square(block_n, block_t)
    both = block_n is not None and block_t is not None
    if square:
        tile = block_n or block_t
    else:  # the other side of a lone block: 128 (a 128 x 128 bf16 tile is 32 KiB, as the cast pass' best)
        tile = (block_t[0] if block_t else 128, block_n[1] if block_n else 128)
    launch = _backend.tuned("fp8_blockwise", BLOCKWISE_HEURISTIC)["square" if square else "both" if both else "one"]
    chunk = min(launch["rows"] or tile[0], tile[0])  # both powers of two: chunk divides the tile
    # The packed pass takes x's rows four at a time: R and the chunk a multiple of 4.
    packed = launch.get("packed", False) and both and not square and rows % 4 == 0 and chunk % 4 == 0
    return tile, launch["num_warps"], chunk, packed


@functools.partial(jax.jit, static_argnames=("dtype", "block_n", "block_t", "power_of_2", "interpret"))
def quantize_blockwise(x, *, dtype, block_n=None, block_t=None, power_of_2=False, interpret=False):
    """Blockwise quantize of a 2-D x (R, C) in one pass: returns (q, q_scales, q^T, qt_scales), None where not asked.

    Blocks are given in x's coordinates (`blockwise_supported` says which): `block_n` for q (R, C), `block_t` for the
    transposed copy q^T (C, R). Every tile of x is read once and both copies (and their scales) are written from it:
      - activations and gradients: block_n = (1, bk), block_t = (bm, 1). q is x in 1 x bk blocks along C (the
        contraction of y = x W), q^T is x^T in 1 x bm blocks along R (the tokens: the contraction of dW = x^T dy).
        The program's tile is bm x bk (either alone: 128 rows or columns).
      - weights: block_n = block_t = (bm, bk) (or one of them): one scale per tile, the same for q and q^T.

    Scales (fp32) come out in the GEMM's layout, one row per block along the operand's contraction axis ("K-block
    major"), the transpose of `reference.quantize_blockwise_reference`'s (see `reference_layout`):
      q_scales  (ceil(C / bk), R) for 1 x bk blocks, (ceil(C / bk), ceil(R / bm)) for bm x bk tiles;
      qt_scales (ceil(R / bm), C) for bm x 1 blocks, (ceil(R / bm), ceil(C / bk)) for tiles.
    (for a square tile these two are transposes of each other: one scale per tile, returned in both layouts.)
    A K step of the blockwise GEMM thereby reads one contiguous row of scales.

    Numbers: exactly the reference's, per block: amax of the finite |x| (a ragged edge block is a block of its
    own; 0 gives the floor scale), scale = max(amax, 1e-12) * (1 / fp8_max) (rounded up to a power of 2 if asked), the
    cast saturating with NaN kept.

    The launch (warps, rows per loop step, q^T packed four codes to a word) is tuning data per mode,
    `BLOCKWISE_HEURISTIC`; x of a row count that is not a multiple of 4 takes the unpacked pass.
    """
    dtype = jnp.dtype(dtype)
    if not blockwise_supported(block_n, block_t):
        raise ValueError(f"quantize_blockwise: blocks (block_n={block_n}, block_t={block_t}) must be 1 x 2^a and/or "
                         f"2^b x 1, or one 2^a x 2^b tile")
    (r, c), emit_n, emit_t = x.shape, block_n is not None, block_t is not None
    square = _is_square(block_n, block_t)
    tile, warps, chunk, packed = _blockwise_launch(r, block_n, block_t)
    grid = (pl.cdiv(r, tile[0]), pl.cdiv(c, tile[1]))
    f32 = jnp.float32
    cast = fp8_cast(dtype, interpret)
    kw = dict(shape=(r, c), tile=tile, dtype=dtype, power_of_2=power_of_2, interpret=interpret, chunk=chunk,
              cast=cast)
    if x.size and packed:
        q, sq, qt, sqt = _backend.triton_call(
            functools.partial(_blockwise_packed_kernel, **kw),
            out_shape=[jax.ShapeDtypeStruct((r // 4, 4 * c), dtype),
                       jax.ShapeDtypeStruct((grid[1] * r // 4, 4), f32),
                       jax.ShapeDtypeStruct((c, r // 4), jnp.uint32),
                       jax.ShapeDtypeStruct((grid[0] * c,), f32)],
            grid=grid, name="pallas_fused_fp8_quantize_blockwise", interpret=interpret, num_warps=warps,
        )(x.reshape(r // 4, 4 * c))
        qt = jax.lax.bitcast_convert_type(qt, dtype).reshape(c, r)
        return q.reshape(r, c), sq.reshape(grid[1], r), qt, sqt.reshape(grid[0], c)
    outs = []
    if emit_n:
        outs.append(jax.ShapeDtypeStruct((r, c), dtype))
        if not square:
            outs.append(jax.ShapeDtypeStruct((grid[1] * r,), f32))
    if emit_t:
        outs.append(jax.ShapeDtypeStruct((c, r), dtype))
        if not square:
            outs.append(jax.ShapeDtypeStruct((grid[0] * c,), f32))
    if square:
        outs.append(jax.ShapeDtypeStruct((grid[0] * grid[1],), f32))
    if x.size == 0:  # no program to run (and every scale array is empty too)
        res = [jnp.zeros(o.shape, o.dtype) for o in outs]
    else:
        res = list(_backend.triton_call(
            functools.partial(_blockwise_kernel, square=square, emit_n=emit_n, emit_t=emit_t, **kw),
            out_shape=outs, grid=grid, name="pallas_fused_fp8_quantize_blockwise", interpret=interpret,
            num_warps=warps,
        )(x))
    if square:
        q = res.pop(0) if emit_n else None
        qt = res.pop(0) if emit_t else None
        s = res[0].reshape(grid)  # the reference's layout
        return q, (s.T if emit_n else None), qt, (s if emit_t else None)
    q, sq = (res.pop(0), res.pop(0).reshape(grid[1], r)) if emit_n else (None, None)
    qt, sqt = (res.pop(0), res.pop(0).reshape(grid[0], c)) if emit_t else (None, None)
    return q, sq, qt, sqt


def reference_layout(scales):
    """`quantize_blockwise`'s scales (K-block major) -> `reference.quantize_blockwise_reference`'s layout."""
    return scales.T
