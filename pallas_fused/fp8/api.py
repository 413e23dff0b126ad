"""Public FP8 ops: `quantize`, `scaled_matmul` (and its K-major form `scaled_matmul_nt`) and
`fp8_linear`, the custom_vjp linear layer that runs its three GEMMs per a `Float8Config`.

Layouts. Hopper's wgmma reads 8-bit operands only K-major, so the fast kernel computes
a @ bt^T with a (M, K) and bt (N, K) both row-major ("NT"). `scaled_matmul_nt` takes that layout
directly; `scaled_matmul` (b given as (K, N), the natural layout) transposes b first on the Pallas
path (one extra pass over b). The linear layer never pays that pass: its quantize kernels write each
fp8 operand directly in the K-major form its GEMM needs (x for y = x W; W^T for it too; W for
dx = dy W^T; x^T and dy^T for dW = x^T dy), and a tensorwise operand used by two GEMMs is written in
both layouts by one pass.

Implementations ("implementation=" of every op): None picks "pallas" on a GPU and "xla" on the CPU;
"pallas" runs the fastest correct path per case: the Mosaic GPU kernel ("pallas:sm90") on Hopper
for same-dtype fp8 operands with fast accumulation, else XLA's fp8 dot (cuBLAS), which also takes
mixed e4m3 x e5m2 operands and fast_accum=False; "pallas:sm90" and "pallas:triton" force a kernel
(the `VARIANTS` table, validated by `_backend.resolve_implementation`); "xla" is the reference (XLA fp8
dot + fp32 rescale); "interpret" (= "interpret:triton") runs the Triton kernels in the Pallas
interpreter (CPU tests). The GEMM's implementations are the objects of gemm.py, which also holds plain "pallas"'s
per-shape choice and what the tuner times. A config with blockwise scaling quantizes with its own kernel and takes
no variant; its GEMMs run on the Mosaic GPU blockwise kernel (per-K-block scale promotion) with "pallas" on Hopper,
else on XLA (see `fp8_linear`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_fused import _backend, _sharding
from pallas_fused.fp8 import gemm, reference
from pallas_fused.fp8.config import FP8_DTYPES, CastConfig, Float8Config, as_config

# FP8 arithmetic needs compute capability 8.9 (Ada) or newer: on an older GPU the default implementation is XLA's,
# and "pallas" is refused.
FP8_COMPUTE_CAPABILITY = gemm.FP8_COMPUTE_CAPABILITY
VARIANTS = {
    "pallas:sm90": _backend.Variant("the Mosaic GPU scaled matmul (one fp8 dtype for both operands, fast "
                                    "accumulation)", needs=(9, 0), interpretable=False),
    "pallas:triton": _backend.Variant("the portable Triton scaled matmul (any fp8 pair, either accumulation)",
                                      needs=FP8_COMPUTE_CAPABILITY),
}


def _resolve(implementation, op):
    """-> "xla" | "interpret" | "pallas" | "pallas:sm90" | "pallas:triton" ("interpret:triton" is "interpret")."""
    impl = _backend.resolve_implementation(implementation, op=op, needs=FP8_COMPUTE_CAPABILITY, variants=VARIANTS)
    return "interpret" if impl == "interpret:triton" else impl


def _check_fp8(x, name, op):
    if not isinstance(x, jax.Array | jax.ShapeDtypeStruct) and not hasattr(x, "dtype"):
        raise ValueError(f"{op}: {name} must be an fp8 array, got {type(x).__name__}")
    if jnp.dtype(x.dtype) not in FP8_DTYPES:
        raise ValueError(f"{op}: {name} must have dtype float8_e4m3fn or float8_e5m2, got {x.dtype}")
    if x.ndim != 2:
        raise ValueError(f"{op}: {name} must be 2-D, got shape {x.shape}")


def _scale_vector(scale, n, name, allowed, op):
    """A per-row-or-column scale -> an fp32 vector of length n; a scalar / (1,) / (1, 1) one -> an fp32 scalar (0-d),
    which the GEMMs take as one scale for every row or column (the Hopper kernel reads it once, so no vector of it
    is written and read per call)."""
    scale = jnp.asarray(scale)
    if scale.shape not in [(), (1,), (1, 1), *allowed]:
        shapes = " or ".join(map(str, allowed))
        raise ValueError(f"{op}: {name} must be a scalar or of shape {shapes}, got {scale.shape}")
    if not jnp.issubdtype(scale.dtype, jnp.floating):
        raise ValueError(f"{op}: {name} must be floating point, got {scale.dtype}")
    scale = scale.astype(jnp.float32)
    return scale.reshape(()) if scale.shape in [(), (1,), (1, 1)] else scale.reshape(n)


def _per_row(s):
    """A scale vector (or scalar) as a multiplier of a matrix's rows."""
    return s[:, None] if s.ndim else s


def _per_col(s):
    """A scale vector (or scalar) as a multiplier of a matrix's columns."""
    return s[None, :] if s.ndim else s


# ----------------------------------------------------------------------------------------------
# quantize


def _quantize_2d(x, dtype, axis, power_of_2, impl, emit_n=True, emit_t=False):
    """2-D quantize -> (q or None, q^T or None, scale with keepdims shape). axis in (None, 0, 1)."""
    if impl == "xla" or x.size == 0:  # an empty x (no tokens) needs no kernel
        q, scale = reference.quantize_reference(x, dtype, axis, power_of_2)
        return (q if emit_n else None), (q.T if emit_t else None), scale
    from pallas_fused.fp8 import kernel

    def launch(x):
        q, qt, scale = kernel.quantize_2d(x, dtype=jnp.dtype(dtype), axis=axis, power_of_2=power_of_2, emit_n=emit_n,
                                          emit_t=emit_t, interpret=impl == "interpret")
        return tuple(o for o in (q, qt) if o is not None) + (scale,)

    def collective(mesh_axes):
        """Per shard when the reduced axis is split: all-reduce the amax, cast with XLA (same formula)."""
        def run(x):
            amax = reference.finite_amax(x, axis)
            scale = reference.scale_from_amax(jax.lax.pmax(amax, mesh_axes), dtype, power_of_2)
            q = reference.saturating_cast(x, scale, dtype)
            return tuple(o for o, emit in ((q, emit_n), (q.T, emit_t)) if emit) + (scale,)

        return run

    # Sharded: the kept axis stays split (the kernel per shard); a split reduced axis goes through `collective`.
    scale_term = {None: "", 1: "m u", 0: "u k"}[axis]
    outs = (["m k"] if emit_n else []) + (["k m"] if emit_t else []) + [scale_term]
    out = _sharding.partitioned(launch, "m k -> " + ", ".join(outs), reduced=("m", "k") if axis is None else
                                ("k" if axis == 1 else "m",), reduced_fn=collective)(x)
    out = list(out)
    return (out.pop(0) if emit_n else None), (out.pop(0) if emit_t else None), out[0]


def quantize(x, dtype=jnp.float8_e4m3fn, axis: int | None = None, power_of_2: bool = False, *,
             implementation: str | None = None):
    """Dynamic, saturating FP8 quantization: returns (x_fp8, scale) with x ~= x_fp8.astype(f32) * scale.

    axis=None: tensorwise, scale is an fp32 scalar. axis=k: the amax is taken along axis k (keepdims),
    like jnp.max(abs(x), axis=k, keepdims=True); for a (M, K) operand axis=-1 gives (M, 1) rowwise
    scales. scale = max(amax, 1e-12) * (1 / fp8_max), so amax = 0 gives a finite scale; values beyond
    fp8_max * scale clamp to +-fp8_max. `power_of_2` rounds each scale up to a power of two.
    One pass of the Pallas kernel computes the amax and the cast (tensorwise: XLA's amax, then one cast pass).

    Non-finite values: the amax is taken over the finite values only, so an inf or NaN never spoils the scale
    (or the other elements); +-inf saturates to +-fp8_max and NaN stays NaN, element by element. torchao
    instead lets one inf or NaN make the scale 0 or NaN, and the whole tensor NaN. An empty x (e.g. no tokens)
    gives an empty x_fp8 and the scale of amax = 0.
    """
    op = "fp8.quantize"
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating) or jnp.dtype(x.dtype) in FP8_DTYPES:
        raise ValueError(f"{op}: x must be a float32/bfloat16/float16 array, got {x.dtype}")
    if jnp.dtype(dtype) not in FP8_DTYPES:
        raise ValueError(f"{op}: dtype must be float8_e4m3fn or float8_e5m2, got {dtype}")
    if x.ndim == 0:
        raise ValueError(f"{op}: x must be an array of rank >= 1, got shape {x.shape}")
    if axis is not None:
        if not isinstance(axis, int) or not -x.ndim <= axis < x.ndim:
            raise ValueError(f"{op}: axis must be None or an int in [-{x.ndim}, {x.ndim}), got {axis!r}")
        axis = axis % x.ndim
    impl = _resolve(implementation, op)
    if impl == "xla" or x.size == 0 or (axis is not None and 0 < axis < x.ndim - 1) or x.ndim == 1 and axis is not None:
        return reference.quantize_reference(x, dtype, axis, power_of_2)
    # View x as 2-D with the reduced axis as one of the two dimensions.
    if axis is None or axis == x.ndim - 1:
        x2 = x.reshape(-1, x.shape[-1]) if x.ndim != 1 else x.reshape(1, -1)
        ax2 = None if axis is None else 1
    else:  # axis == 0
        x2 = x.reshape(x.shape[0], -1)
        ax2 = 0
    q, _, scale = _quantize_2d(x2, dtype, ax2, power_of_2, impl)
    if axis is None:
        return q.reshape(x.shape), scale
    keep = list(x.shape)
    keep[axis] = 1
    return q.reshape(x.shape), scale.reshape(keep)


# ----------------------------------------------------------------------------------------------
# scaled matmul


def _mm_nt(a, bt, sa, sb, out_dtype, fast_accum, impl):
    """(a * sa[:, None]) @ (bt * sb[:, None])^T; a (M, K), bt (N, K) fp8; sa (M,), sb (N,) fp32, either a 0-d
    scalar instead (one scale for every row). `impl`: "pallas" (the choice of `gemm.choose`) or the name of one
    of `gemm.IMPLEMENTATIONS`, which runs with its default config."""
    if 0 in (*a.shape, bt.shape[0]):  # no tokens (or an empty contraction): nothing for a kernel to do
        return jnp.zeros((a.shape[0], bt.shape[0]), out_dtype)
    args, device = gemm.GemmArgs(a, bt, sa, sb, out_dtype, fast_accum), gemm.current_device()
    if impl == "pallas":
        chosen, config = gemm.choose(args, device)
    else:
        chosen, config = gemm.IMPLEMENTATIONS[impl], None
        why = chosen.refuses(args)
        if why is not None:
            raise ValueError(f"scaled_matmul: implementation={impl!r} {why}")
    if not chosen.partitioned:
        return chosen(args, config if config is not None else chosen.default_config(args, device))

    def launch(a, bt, sa, sb, out_dtype):
        # A tuned config is of the whole GEMM; a shard of it takes the implementation's default for its own shape.
        shard = args.with_operands(a, bt, sa, sb, out_dtype)
        mine = config is not None and shard.key == args.key
        return chosen(shard, config if mine else chosen.default_config(shard, device))

    # Sharded: M data parallel, N tensor parallel; a sharded contraction K (tokens, in the weight-gradient
    # GEMM of data-parallel training) gives float32 partial products, all-reduced and then rounded once.
    rule = f"m k, n k, {'m' if sa.ndim else ''}, {'n' if sb.ndim else ''} -> m n"
    return _sharding.partitioned(lambda *args: launch(*args, out_dtype), rule, summed=("k",),
                                 partial_fn=lambda *args: launch(*args, jnp.float32))(a, bt, sa, sb)


def _mm_nt_blockwise(a, bt, sa_t, sb_t, out_dtype, scale_rows=(1, 1)):
    """out[i, j] = sum_kb (a_kb @ bt_kb^T)[i, j] sa_t[kb, i] sb_t[kb, j] on the Hopper kernel, kb over K blocks of
    128; a (M, K), bt (N, K) fp8 of one dtype; sa_t (ceil(K / 128), M), sb_t (ceil(K / 128), N) fp32, repeating
    each scale over scale_rows[0] rows of a and scale_rows[1] rows of bt (their blocks' heights)."""
    if 0 in (*a.shape, bt.shape[0]):
        return jnp.zeros((a.shape[0], bt.shape[0]), out_dtype)
    from pallas_fused.fp8 import kernel_sm90

    def launch(a, bt, sa_t, sb_t):
        m, n = a.shape[0], bt.shape[0]
        config = kernel_sm90.blockwise_tile(m, n, out_dtype)
        cm, cn = config.cluster_tile
        # A shard starts at a block boundary where the shards' extents are block multiples; else the kernel is
        # not told that a scale covers whole tiles.
        rows = tuple(r if size % r == 0 else 1 for r, size in zip(scale_rows, (m, n)))
        bk = kernel_sm90.BLOCK_K  # zero columns past K: the last block's padding adds nothing
        out = kernel_sm90.blockwise_matmul_nt(gemm.pad_to(a, cm, bk), gemm.pad_to(bt, cn, bk),
                                              gemm.pad_to(sa_t, 1, cm), gemm.pad_to(sb_t, 1, cn),
                                              out_dtype=jnp.dtype(out_dtype), config=config, scale_rows=rows)
        return out[:m, :n]

    # Sharded: M and N split; K (and its blocks with it) gathered: a split K would have to split the scale rows
    # at the same 128-column boundaries, which the sharding rule cannot promise.
    return _sharding.partitioned(launch, "m k, n k, kb m, kb n -> m n", replicated=("k", "kb"))(a, bt, sa_t, sb_t)


def _check_out_dtype(out_dtype, op):
    if jnp.dtype(out_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32), jnp.dtype(jnp.float16)):
        raise ValueError(f"{op}: out_dtype must be bfloat16, float16 or float32, got {out_dtype}")


def scaled_matmul(a_fp8, b_fp8, a_scale, b_scale, *, out_dtype=jnp.bfloat16, fast_accum: bool = True,
                  implementation: str | None = None):
    """(a_fp8 * a_scale) @ (b_fp8 * b_scale) in fp32, cast to `out_dtype`.

    a_fp8 (M, K) and b_fp8 (K, N) are float8_e4m3fn / float8_e5m2; a_scale is a scalar or (M, 1)
    (rowwise), b_scale a scalar or (1, N) (columnwise); the scales are applied to the fp32
    accumulator in the kernel's epilogue. Prefer `scaled_matmul_nt` with b already K-major
    ((N, K), e.g. from `quantize(w.T, ...)`): the Hopper kernel needs that layout, so this
    function transposes b on the Pallas path.
    """
    op = "fp8.scaled_matmul"
    _check_fp8(a_fp8, "a_fp8", op)
    _check_fp8(b_fp8, "b_fp8", op)
    _check_out_dtype(out_dtype, op)
    (m, k), (k2, n) = a_fp8.shape, b_fp8.shape
    if k != k2:
        raise ValueError(f"{op}: a_fp8 (M, K) and b_fp8 (K, N) must share K, got {a_fp8.shape} and {b_fp8.shape}")
    sa = _scale_vector(a_scale, m, "a_scale", [(m, 1)], op)
    sb = _scale_vector(b_scale, n, "b_scale", [(1, n)], op)
    impl = _resolve(implementation, op)
    if impl == "xla":
        return reference.scaled_matmul_reference(a_fp8, b_fp8, _per_row(sa), _per_col(sb), out_dtype=out_dtype,
                                                 fast_accum=fast_accum)
    return _mm_nt(a_fp8, b_fp8.T, sa, sb, out_dtype, fast_accum, impl)


def scaled_matmul_nt(a_fp8, bt_fp8, a_scale, b_scale, *, out_dtype=jnp.bfloat16, fast_accum: bool = True,
                     implementation: str | None = None):
    """(a_fp8 * a_scale) @ (bt_fp8 * b_scale)^T with both operands K-major: a (M, K), bt (N, K).

    The layout the Hopper kernel reads directly. a_scale: scalar or (M, 1); b_scale: scalar or
    (N, 1) (one scale per row of bt, i.e. per output column, as `quantize(bt, axis=-1)` returns).
    """
    op = "fp8.scaled_matmul_nt"
    _check_fp8(a_fp8, "a_fp8", op)
    _check_fp8(bt_fp8, "bt_fp8", op)
    _check_out_dtype(out_dtype, op)
    (m, k), (n, k2) = a_fp8.shape, bt_fp8.shape
    if k != k2:
        raise ValueError(f"{op}: a_fp8 (M, K) and bt_fp8 (N, K) must share K, got {a_fp8.shape} and {bt_fp8.shape}")
    sa = _scale_vector(a_scale, m, "a_scale", [(m, 1)], op)
    sb = _scale_vector(b_scale, n, "b_scale", [(n, 1)], op)
    return _mm_nt(a_fp8, bt_fp8, sa, sb, out_dtype, fast_accum, _resolve(implementation, op))


# ----------------------------------------------------------------------------------------------
# the linear layer: three GEMMs, each argument cast per its config


class _Operand:
    """One GEMM argument in K-major form: fp8 `data` with a scale vector per K-major row (a 0-d scalar for a
    tensorwise cast), or with per-tile scales when `block` is set (blockwise: `scale` in the GEMM's layout, one row
    per block along K, shape (ceil(K / bk), ceil(rows / bm)), the transpose of
    `reference.quantize_blockwise_reference`'s), or (when its cast is disabled) the high-precision `data` whose
    K-major form is data (kmajor) or data.T."""

    def __init__(self, data, scale=None, kmajor=True, block=None):
        self.data, self.scale, self.kmajor, self.block = data, scale, kmajor, block

    @property
    def fp8(self):
        return self.scale is not None

    def hp(self, dtype):
        """The K-major high-precision value."""
        x = self.data if self.kmajor else self.data.T
        if self.block is not None:
            return reference.dequantize_blockwise(x, self.scale.T, self.block, dtype)
        if self.fp8:
            x = x.astype(jnp.float32) * _per_row(self.scale)
        return x.astype(dtype)


jax.tree_util.register_pytree_node(
    _Operand, lambda o: ((o.data, o.scale), (o.kmajor, o.block)),
    lambda aux, ch: _Operand(ch[0], ch[1], *aux))


def _quantize_on_sm90(x, block_n, block_t) -> bool:
    """Whether both blockwise copies of x come from the Hopper kernel: an activation's (1 x 128 blocks along its
    columns for q, along its rows for q^T) or a weight's (128 x 128 tiles for both), of a 16-bit x of 128-multiple
    shape. It reads x once by TMA and q^T's tile transposed from shared memory: 88.6% of an H200's HBM bandwidth
    for an activation against the Triton kernel's 64.0% (16384 x 8192 bf16)."""
    from pallas_fused.fp8 import kernel_sm90_quantize

    block = kernel_sm90_quantize.TILE
    return ((block_n, block_t) in (((1, block), (block, 1)), ((block, block), (block, block)))
            and _backend.is_hopper() and kernel_sm90_quantize.supported(x.shape[0], x.shape[1], x.dtype))


def _quantize_blockwise(x, block_n, block_t, dtype, pow2, impl):
    """x (R, C) -> (q, q_scales, q^T, qt_scales) as `kernel.quantize_blockwise` (blocks in x's coordinates, None: that
    copy not asked for; scales in the GEMM's K-block-major layout): its one pass on the Pallas paths, else the
    reference (a shared tile quantized once, its transpose the other copy)."""
    from pallas_fused.fp8 import kernel

    if impl != "xla" and kernel.blockwise_supported(block_n, block_t):
        # Not partitioned: a sharded x is gathered for the kernel (a K-block-major scale grid per shard would not
        # line up with the global one where a shard splits a block).
        if impl == "pallas" and _quantize_on_sm90(x, block_n, block_t):
            from pallas_fused.fp8 import kernel_sm90_quantize

            return kernel_sm90_quantize.quantize_blockwise_sm90(x, dtype=jnp.dtype(dtype), power_of_2=pow2,
                                                                square=block_n == block_t)
        return kernel.quantize_blockwise(x, dtype=jnp.dtype(dtype), block_n=block_n, block_t=block_t,
                                         power_of_2=pow2, interpret=impl == "interpret")
    q = s = qt = st = None
    if block_n is not None:
        q, s = reference.quantize_blockwise_reference(x, dtype, block_n, pow2)
        s = s.T
    if block_t is not None and block_t == block_n:  # the same tiles of x: one quantization serves both
        qt, st = q.T, s.T
    elif block_t is not None:
        qt, st = reference.quantize_blockwise_reference(x.T, dtype, block_t[::-1], pow2)
        st = st.T
    return q, s, qt, st


def _operands(x, cfg_n: CastConfig, cfg_t: CastConfig | None, pow2, impl):
    """x (R, C) cast for use as a K-major operand directly (cfg_n: contraction over C) and transposed
    (cfg_t: x^T, contraction over R). Tensorwise casts with one dtype share a single pass, and so do blockwise
    ones (one read of x writes both copies; the weight's 128 x 128 blocks cover the same elements of W and W^T,
    so both of its GEMMs share one quantization)."""
    qimpl = impl if impl in ("xla", "interpret") else "pallas"  # the quantize kernels have no variants
    out: list[_Operand | None] = []
    if cfg_t is not None and cfg_n.scaling == cfg_t.scaling == "tensorwise" and cfg_n.dtype == cfg_t.dtype:
        q, qt, s = _quantize_2d(x, cfg_n.dtype, None, pow2, qimpl, emit_n=True, emit_t=True)
        s = s.reshape(())
        return _Operand(q, s), _Operand(qt, s)
    if cfg_t is not None and cfg_n.scaling == cfg_t.scaling == "blockwise" and cfg_n.dtype == cfg_t.dtype:
        # cfg_t's block is given for x^T: (cols, rows) of x (CastConfig gives every blockwise config a block)
        assert cfg_n.block is not None and cfg_t.block is not None
        q, s, qt, st = _quantize_blockwise(x, cfg_n.block, cfg_t.block[::-1], cfg_n.dtype, pow2, qimpl)
        return _Operand(q, s, block=cfg_n.block), _Operand(qt, st, block=cfg_t.block)
    for cfg, transposed in ((cfg_n, False), (cfg_t, True)):
        if cfg is None:
            out.append(None)
        elif cfg.disabled:
            out.append(_Operand(x, None, kmajor=not transposed))
        elif cfg.scaling == "blockwise":  # each GEMM's tiles along its own contraction axis
            assert cfg.block is not None
            q, s, qt, st = _quantize_blockwise(x, None if transposed else cfg.block,
                                               cfg.block[::-1] if transposed else None, cfg.dtype, pow2, qimpl)
            out.append(_Operand(qt, st, block=cfg.block) if transposed else _Operand(q, s, block=cfg.block))
        else:
            axis = None if cfg.scaling == "tensorwise" else (0 if transposed else 1)
            q, qt, s = _quantize_2d(x, cfg.dtype, axis, pow2, qimpl, emit_n=not transposed, emit_t=transposed)
            n = x.shape[1] if transposed else x.shape[0]
            out.append(_Operand(qt if transposed else q, s.reshape(()) if axis is None else s.reshape(n)))
    return tuple(out)


def _step_scales(o: _Operand, k):
    """An fp8 operand's scales as the blockwise kernel's step rows, (ceil(K / 128), rows): a (bm, 128) tile's
    scale repeated over its bm rows (its K-block-major scales already hold one row per K block), a per-row
    scale over every K block."""
    from pallas_fused.fp8.kernel_sm90 import BLOCK_K

    rows, kb = o.data.shape[0], -(-k // BLOCK_K)
    if o.block is None:
        return jnp.broadcast_to(_per_col(o.scale), (kb, rows))
    return jnp.repeat(o.scale, o.block[0], axis=1)[:, :rows]


def _blockwise_on_sm90(lhs: _Operand, rhs: _Operand, impl) -> bool:
    """Whether a GEMM with a blockwise operand runs on the Hopper kernel: "pallas" on Hopper, both operands fp8 of
    one dtype, every block BLOCK_K wide along K."""
    if impl != "pallas" or not _backend.is_hopper() or not (lhs.fp8 and rhs.fp8 and lhs.data.dtype == rhs.data.dtype):
        return False
    from pallas_fused.fp8.kernel_sm90 import BLOCK_K

    return all(o.block is None or o.block[1] == BLOCK_K for o in (lhs, rhs))


def _gemm(lhs: _Operand, rhs: _Operand, fast_accum, impl, out_dtype, hp_dtype):
    """lhs_kmajor @ rhs_kmajor^T: fp8 kernel when both are fp8, else a high-precision dot. With a blockwise
    operand: on Hopper the kernel with per-K-block promotion, else the fp32 product of the dequantized operands
    (its reference). fast_accum does not apply there: the kernel's fast accumulation never runs past one block."""
    if lhs.block is not None or rhs.block is not None:
        if _blockwise_on_sm90(lhs, rhs, impl):
            k = lhs.data.shape[1]
            return _mm_nt_blockwise(lhs.data, rhs.data, _step_scales(lhs, k), _step_scales(rhs, k), out_dtype,
                                    tuple(1 if o.block is None else o.block[0] for o in (lhs, rhs)))
        return reference.matmul_nt_fp32(lhs.hp(jnp.float32), rhs.hp(jnp.float32), out_dtype)
    if lhs.fp8 and rhs.fp8:
        return _mm_nt(lhs.data, rhs.data, lhs.scale, rhs.scale, out_dtype, fast_accum, impl)
    a, b = lhs.hp(hp_dtype), rhs.hp(hp_dtype)
    # Result in the operands' dtype: the dot accumulates in fp32 and writes it itself (asking for an fp32
    # result makes XLA write it and read it back for the cast: ~0.1 ms of the 8192-wide weight gradient).
    acc = None if jnp.dtype(out_dtype) == a.dtype else jnp.float32
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=acc).astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _linear(x, w, config: Float8Config, impl: str):
    y, _ = _linear_fwd(x, w, config, impl)
    return y


def _linear_fwd(x, w, config, impl):
    pow2 = config.round_scales_to_power_of_2
    x_n, x_t = _operands(x, config.cast_config_input, config.cast_config_input_for_grad_weight, pow2, impl)
    # W (in, out): the output GEMM reads W^T (contraction over in), grad_input reads W (over out).
    w_t, w_n = _operands_w(w, config, pow2, impl)
    y = _gemm(x_n, w_t, config.gemm_config_output.fast_accum, impl, x.dtype, x.dtype)
    return y, (x_t, w_n, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))


def _operands_w(w, config, pow2, impl):
    """W (in, out) -> (W^T for the output GEMM, W for the grad_input GEMM), both K-major."""
    w_n_for_gi, w_t_for_out = _operands(w, config.cast_config_weight_for_grad_input, config.cast_config_weight,
                                        pow2, impl)
    return w_t_for_out, w_n_for_gi


def _linear_bwd(config, impl, res, dy):
    x_t, w_n, x_proto, w_proto = res
    pow2 = config.round_scales_to_power_of_2
    dy_n, dy_t = _operands(dy, config.cast_config_grad_output, config.cast_config_grad_output_for_grad_weight,
                           pow2, impl)
    dx = _gemm(dy_n, w_n, config.gemm_config_grad_input.fast_accum, impl, x_proto.dtype, dy.dtype)
    dw = _gemm(x_t, dy_t, config.gemm_config_grad_weight.fast_accum, impl, w_proto.dtype, dy.dtype)
    return dx, dw


_linear.defvjp(_linear_fwd, _linear_bwd)


def fp8_linear(x, w, config: Float8Config | str = "tensorwise", *, implementation: str | None = None):
    """y = x @ w with FP8 GEMMs per `config` (a Float8Config or recipe name), differentiable.

    x: (..., in) float (bf16 typical), w: (in, out) of the same dtype. Forward y = x W, backward
    dx = dy W^T and dW = x^T dy, each argument cast per its cast config (axiswise scales are taken
    over that GEMM's contraction axis) and each GEMM with its fast-accumulation setting. Scales are
    dynamic (from the current amax). Output dtype = x.dtype.

    A config with blockwise scaling (the "blockwise" recipe): "pallas" (the default on an fp8 GPU) and "interpret"
    quantize with the one-pass blockwise kernel (`kernel.quantize_blockwise`: x and dy in both layouts from one read,
    W once for both of its GEMMs). Its GEMMs: with "pallas" on a Hopper GPU, the Mosaic GPU kernel with per-K-block
    scale promotion (each 128-wide K block's fp8 wgmma product scaled by that block's scales and added in fp32,
    DeepSeek-V3's); elsewhere (and for fp8 operands of two dtypes or blocks not 128 wide along K) the exact fp32
    product of the dequantized operands. It takes no variant ("pallas:sm90", "pallas:triton").
    """
    op = "fp8.fp8_linear"
    config = as_config(config)
    x, w = jnp.asarray(x), jnp.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"{op}: w must be 2-D (in, out), got shape {w.shape}")
    if x.ndim < 1 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"{op}: x must be (..., {w.shape[0]}) to match w {w.shape}, got {x.shape}")
    for name, v in (("x", x), ("w", w)):
        if not jnp.issubdtype(v.dtype, jnp.floating) or jnp.dtype(v.dtype) in FP8_DTYPES:
            raise ValueError(f"{op}: {name} must be float32/bfloat16/float16, got {v.dtype}")
    if config.blockwise and isinstance(implementation, str) and implementation.partition(":")[2] in ("sm90", "triton"):
        raise ValueError(f"{op}: a config with blockwise scaling takes implementation None, 'xla', 'pallas' or "
                         f"'interpret' (its GEMM has no variants), got implementation={implementation!r}")
    impl = _resolve(implementation, op)
    lead = x.shape[:-1]
    y = _linear(x.reshape(math.prod(lead), x.shape[-1]), w.astype(x.dtype), config, impl)
    return y.reshape(*lead, w.shape[1])
