"""Public DoRA functions: argument checks, implementation choice, the custom_vjp."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_fused import _backend, _sharding
from pallas_fused.dora import kernel_columns, kernel_gemm, kernel_merge, kernel_norm, reference
from pallas_fused.dora.config import DEFAULT, Config
from pallas_fused.dora.kernel_util import pow2
from pallas_fused.dora.quant import Fp8Kernel, Int8Kernel, NF4Kernel, dequantize, is_quantized

# implementation="pallas:<variant>": which big GEMMs the Pallas path uses (the column norm and the backward column
# reductions are Pallas in every variant). Plain "pallas" (and "interpret") takes `choose_variant`'s pick.
VARIANTS = {
    "pallas:sm90": _backend.Variant(
        "the column norm's read-only pass over W, then one Mosaic GPU GEMM (x W + (x A)(s B)) g + bias each way "
        "(dx = (dy g) W^T + ((dy g)(s B)^T) A^T): W is never merged (Hopper, dense 16-bit W, tile-multiple shapes)",
        needs=(9, 0), mosaic=True),
    "pallas:merged": _backend.Variant(
        "one Pallas pass forms (W + s A B) g, then one cuBLAS GEMM; any weight (QDoRA at cuBLAS speed: the merged "
        "weight of an Int8Kernel / NF4Kernel is a transient full-precision array, formed again in the backward)"),
    "pallas:epilogue": _backend.Variant("cuBLAS x W, then one Pallas pass (x W + s (x A) B) g + bias; dense W"),
    "pallas:sm90_dequant": _backend.Variant(
        "Int8Kernel on Hopper: the column norm from the codes in-kernel, then one Mosaic GPU GEMM (x W + s (x A) B) g "
        "+ bias with W's int8 tiles dequantised in registers and the low-rank term in the same accumulator; the "
        "dx GEMM the same way over W^T (tile-multiple shapes; W never formed in full)", needs=(9, 0), mosaic=True),
    "pallas:gemm": _backend.Variant("Pallas GEMMs both ways (the fused-epilogue forward, the dx GEMM) with W "
                                    "dequantised in-kernel: Int8Kernel / NF4Kernel weights never formed in full "
                                    "precision, at the cost of speed"),
}


def choose_variant(kind: str, tokens: int, fin: int, fout: int, dtype, interpret: bool, rank: int = 16) -> str:
    """The variant plain "pallas" runs: a pure function of the shapes, the dtype and the device kind.

    Int8Kernel weights take "sm90_dequant" where it runs (one Hopper GPU, 16-bit, tile-multiple shapes; `rank` the
    adapters' rank): W is never formed in full precision. Other quantised weights take "merged" on a GPU: a transient
    merged weight per layer and cuBLAS, as a dequantise-then-GEMM baseline holds one. For NF4 at 4096 tokens,
    4096 -> 4096 r16 on an H200, "merged" took 1.19x bf16 DoRA's forward and "gemm", which dequantises inside
    Triton GEMMs (a codebook lookup per weight and GEMM tile), 4.9x. Interpreted, they take "gemm", whose kernels
    are the quantised paths' own (Mosaic GPU's interpreter runs "sm90_dequant" by name). Every dense variant reads
    W once for
    the column norm; beyond that and the base GEMM, "sm90" reads x once more (x A: 2 M K bytes), "merged" reads W
    and writes (W + s A B) g (4 K N bytes), "epilogue" reads x for x A and reads + writes x W (2 M K + 4 M N). So
    "sm90" runs wherever it can (one Hopper GPU, 16-bit, tile-multiple shapes; its Mosaic GPU GEMM ties cuBLAS) up to
    the tuned rank (`kernel_sm90.max_rank`: its low-rank slices shrink the GEMM's ring, and at 4096 -> 11008 r64
    "merged" measured 0.614 ms forward against its 0.713 on an H200), and elsewhere the cheaper of the other two.
    benchmarks/bench_dora.py measures every variant.
    """
    if kind != "dense":
        if interpret:
            return "gemm"
        return "sm90_dequant" if _sm90_dequant_ok(kind, tokens, fin, fout, pow2(rank), dtype, interpret) else "merged"
    if not interpret and _sm90_tuned(kind, tokens, fin, fout, dtype, pow2(rank)):
        return "sm90"
    merged_bytes, epilogue_bytes = 4 * fin * fout, 2 * tokens * fin + 4 * tokens * fout
    return "epilogue" if merged_bytes > epilogue_bytes else "merged"


def _check(x, kernel, lora_a, lora_b, magnitude, bias, scale, op="dora_dense", fp8_base=False):
    """Validate shapes/dtypes; returns (in_features, out_features, rank). magnitude=None: LoRA (none to check).
    `fp8_base`: the kernel must be an Fp8Kernel (and is refused otherwise)."""
    x_dtype = getattr(x, "dtype", None)
    if x_dtype is None or not jnp.issubdtype(x_dtype, jnp.floating):
        raise ValueError(f"{op}: x must be a floating-point array, got dtype {x_dtype}")
    if len(x.shape) < 1:
        raise ValueError(f"{op}: x must have at least one dimension (..., in_features)")
    if isinstance(kernel, Fp8Kernel) != fp8_base:
        raise ValueError(f"{op}: kernel must be an Fp8Kernel (pallas_fused.dora.quantize_fp8), got "
                         f"{type(kernel).__name__}" if fp8_base else
                         f"{op}: kernel is an Fp8Kernel (an FP8 base): use pallas_fused.dora."
                         f"{'lora' if magnitude is None else 'dora'}_fp8_dense, whose base GEMMs run in FP8")
    if is_quantized(kernel):
        fin, fout = kernel.shape
    else:
        if jnp.ndim(kernel) != 2 or not jnp.issubdtype(kernel.dtype, jnp.floating):
            raise ValueError(f"{op}: kernel must be a 2-D float (in, out) array or an Int8Kernel/NF4Kernel, "
                             f"got shape {jnp.shape(kernel)} dtype {getattr(kernel, 'dtype', None)}")
        fin, fout = kernel.shape
    if x.shape[-1] != fin:
        raise ValueError(f"{op}: x has {x.shape[-1]} input features but kernel expects {fin} "
                         f"(kernel shape {(fin, fout)})")
    if jnp.ndim(lora_a) != 2 or lora_a.shape[0] != fin:
        raise ValueError(f"{op}: lora_a must have shape ({fin}, rank), got {jnp.shape(lora_a)}")
    rank = lora_a.shape[1]
    if rank < 1 or rank > min(fin, fout):
        raise ValueError(f"{op}: lora_a rank must be in [1, min(in, out) = {min(fin, fout)}], got {rank}")
    if jnp.shape(lora_b) != (rank, fout):
        raise ValueError(f"{op}: lora_b must have shape ({rank}, {fout}), got {jnp.shape(lora_b)}")
    if magnitude is not None and jnp.shape(magnitude) != (fout,):
        raise ValueError(f"{op}: magnitude must have shape ({fout},), got {jnp.shape(magnitude)}")
    if bias is not None and jnp.shape(bias) != (fout,):
        raise ValueError(f"{op}: bias must have shape ({fout},) or be None, got {jnp.shape(bias)}")
    if jnp.ndim(scale) != 0:
        raise ValueError(f"{op}: scale must be a scalar, got shape {jnp.shape(scale)}")
    for name, v in (("lora_a", lora_a), ("lora_b", lora_b), ("magnitude", magnitude), ("bias", bias)):
        if v is not None and not jnp.issubdtype(v.dtype, jnp.floating):
            raise ValueError(f"{op}: {name} must be floating point, got dtype {v.dtype}")
    return fin, fout, rank


def _weight_ops(kernel, dtype):
    """(kind, operand tuple) for the kernels; dense weights are cast to the compute dtype."""
    if isinstance(kernel, Int8Kernel):
        return "int8", (kernel.q, kernel.scale.astype(jnp.float32))
    if isinstance(kernel, NF4Kernel):
        return "nf4", (kernel.packed, kernel.absmax.astype(jnp.float32))
    return "dense", (kernel.astype(dtype),)


def _zero_cotangent(a):
    if jnp.issubdtype(a.dtype, jnp.floating):
        return jnp.zeros_like(a)
    return np.zeros(a.shape, dtype=jax.dtypes.float0)


def _pad_rank(lora_a, lora_b):
    r = lora_a.shape[1]
    rp = pow2(r)
    return jnp.pad(lora_a, ((0, 0), (0, rp - r))), jnp.pad(lora_b, ((0, rp - r), (0, 0)))


def _shard(launch, kind, rule, replicated=(), summed=()):
    """`launch` run per shard under `rule`, where "{w}" stands for the weight operands (see _sharding).
    NF4 weights are not partitioned (packed layout): their kernels see gathered operands."""
    if kind == "nf4":
        return launch
    w = {"dense": "k n", "int8": "k n, n"}[kind]
    return _sharding.partitioned(launch, rule.format(w=w), replicated=replicated, summed=summed)


def _column_sumsq(ops, kind, ap, bp, scale, interpret, config):
    """Column sums of squares; sharded: output features split, the input axis summed per shard + psum."""
    def launch(*a):
        return kernel_norm.column_sumsq(a[:-3], kind, *a[-3:], interpret=interpret, config=config.norm)

    return _shard(launch, kind, "{w}, k r, r n, -> n", replicated=("r",), summed=("k",))(*ops, ap, bp, scale)


def _column_norm_scale(ops, kind, ap, bp, scale, m, interpret, config):
    """(n, g = m / n); on one device the fused kernel (one launch), sharded the partial sums + psum."""
    if jax.device_count() == 1:
        return kernel_norm.column_norm_scale(ops, kind, ap, bp, scale, m, interpret=interpret, config=config.norm)
    n = reference.floored_norm(_column_sumsq(ops, kind, ap, bp, scale, interpret, config))
    return n, m.astype(jnp.float32) / n


def _keeps_merged(config, kind) -> bool:
    """Whether "merged" keeps its merged weight for the backward: `config.save_merged`, where None means for a dense W
    only (a quantised W exists to save the memory that a kept full-precision copy per layer would take)."""
    return kind == "dense" if config.save_merged is None else config.save_merged


def _dense_w(kind, ops, dtype):
    """Full-precision W for the cuBLAS GEMMs (dense kernels only)."""
    if kind != "dense":
        raise ValueError("dora_dense: implementation='pallas:epilogue' takes a dense kernel only; use 'pallas' (or "
                         "'pallas:merged' for an Int8Kernel)")
    return ops[0].astype(dtype)


def _merged_weight(kind, ops, ap, bp, g, scale, interpret, config):
    """(W + s A B) * g in the compute dtype (K, N): one Pallas pass over W (QDoRA: a transient full-precision
    weight)."""

    def launch(*a):  # sharded: both weight axes split, the rank gathered
        ap_, bp_, g_, scale_ = a[-4:]
        return kernel_merge.merge_weight(a[:-4], kind, ap_, bp_, scale_, g=g_, interpret=interpret,
                                         config=config.merge)

    return _shard(launch, kind, "{w}, k r, r n, n, -> k n", replicated=("r",))(*ops, ap, bp, g, scale)


def _norm_and_merged_weight(kind, ops, ap, bp, scale, m, interpret, config):
    """(n, g, (W + s A B) * g, B g s or None). On one device two launches and no XLA op between them: the column
    norm's partial sums over row ranges, then the merge launch, which finishes g (and B g s) from them; sharded,
    the norm + psum, then the merge."""
    if jax.device_count() == 1:
        parts = kernel_norm.column_partials(ops, kind, ap, bp, scale, interpret=interpret, config=config.norm,
                                            rows=config.merge.norm_rows)
        wm, n, g, bg = kernel_merge.merge_weight(ops, kind, ap, bp, scale, partials=parts, magnitude=m,
                                                 interpret=interpret, config=config.merge)
        return n, g, wm, bg
    n, g = _column_norm_scale(ops, kind, ap, bp, scale, m, interpret, config)
    return n, g, _merged_weight(kind, ops, ap, bp, g, scale, interpret, config), None


def _sm90_ok(kind, tokens, fin, fout, dtype, rank, interpret=False) -> bool:
    """Whether "pallas:sm90" can run: a dense 16-bit W on one Hopper device (or interpreted), tile-multiple shapes
    both ways (the forward's (tokens, in) x (in, out) and dx's (tokens, out) x (out, in)) at this padded rank."""
    from pallas_fused.dora import kernel_sm90

    return (kind == "dense" and (interpret or _backend.is_hopper()) and jax.device_count() == 1
            and kernel_sm90.supported(tokens, fout, fin, dtype, rank=rank)
            and kernel_sm90.supported(tokens, fin, fout, dtype, rank=rank))


def _sm90_tuned(kind, tokens, fin, fout, dtype, rank) -> bool:
    """Whether plain "pallas" takes the sm90 GEMM with the low-rank step on a GPU (DoRA's "sm90", `lora_dense`'s
    kernels): where it runs (`_sm90_ok`), up to the tuned padded rank (`kernel_sm90.max_rank`)."""
    from pallas_fused.dora import kernel_sm90

    return rank <= kernel_sm90.max_rank() and _sm90_ok(kind, tokens, fin, fout, dtype, rank)


def _sm90_dequant_ok(kind, tokens, fin, fout, rank, dtype, interpret) -> bool:
    """Whether "pallas:sm90_dequant" can run: an Int8Kernel on one Hopper device (or Mosaic GPU's interpreter),
    shapes that are multiples of its tiles both ways (the forward (tokens, fin) x (fin, fout), dx's (tokens, fout) x
    (fout, fin)), and a padded rank whose low-rank slices fit shared memory."""
    from pallas_fused.dora import kernel_sm90

    return (kind == "int8" and (interpret or _backend.is_hopper()) and jax.device_count() == 1
            and kernel_sm90.qdora_supported(fout, tokens, fin, rank, dtype)
            and kernel_sm90.qdora_supported(fin, tokens, fout, rank, dtype))


def _xa(x, ap):
    return jnp.dot(x, ap)  # cuBLAS accumulates in float32 and rounds once to x's dtype


def _forward(statics, x, ops, a, b, m, bias, scale):
    kind, variant, interpret, config = statics[:4]
    dt = x.dtype
    ap, bp = _pad_rank(a, b)
    if variant == "sm90":
        # y = (x W + (x A)(s B)) g + bias in one Mosaic GPU GEMM (the low-rank product in its accumulator, g and the
        # bias in its epilogue), g from the column norm's read-only pass over W: W + s A B is never written. x A is
        # kept for the backward (its column sums and dA need it).
        from pallas_fused.dora import kernel_sm90

        if not _sm90_ok(kind, x.shape[0], ap.shape[0], bp.shape[1], x.dtype, ap.shape[1], interpret):
            cfg = kernel_sm90.config_for(x.shape[0], bp.shape[1], ap.shape[0], ap.shape[1])
            raise ValueError(f"dora_dense: implementation='pallas:sm90' needs a dense 16-bit kernel on one Hopper GPU "
                             f"(or 'interpret:sm90') and shapes that are multiples of the tile {cfg.cluster_tile} x "
                             f"{cfg.tile_k}; got x {x.shape} {x.dtype}, "
                             f"kernel {ops[0].shape}")
        n, g = _column_norm_scale(ops, kind, ap, bp, scale, m, interpret, config)
        xa = _xa(x, ap)
        sb = (bp.astype(jnp.float32) * scale).astype(dt)
        y = kernel_sm90.scaled_matmul(x, ops[0], g, bias, lowrank=(xa, sb), interpret=interpret)
        return y, (ap, bp, n, g, xa, (None, None))
    if variant == "merged":
        # y = x ((W + s A B) g) + bias: one cuBLAS GEMM on the merged weight (x A is left to the backward). The
        # merged weight is kept for the backward's dx = dy wm^T (one bf16 copy of W per layer in memory).
        n, g, wm, bg = _norm_and_merged_weight(kind, ops, ap, bp, scale, m, interpret, config)
        saved = (wm, bg) if _keeps_merged(config, kind) else (None, bg)
        # The bias is added in the compute dtype: cuBLAS adds it in its epilogue where XLA fuses it (a float32
        # product would be written and read back in full otherwise, 2 x 4 bytes per output).
        y = jnp.dot(x, wm) if bias is None else jnp.dot(x, wm) + bias
        return y, (ap, bp, n, g, None, saved)
    if variant == "sm90_dequant":
        # y = (x q + xa (s B / wscale)) (g wscale) + bias in one Mosaic GPU GEMM: q's int8 tiles converted in
        # registers (exact in 16 bits), the per-column int8 scale with g in the epilogue, so the low-rank operand
        # (rank x out, tiny) carries 1 / wscale. The GEMM's int8 operand is q^T, written by the column norm's pass
        # over the codes with the columns of scale 0 zeroed: those take scale 1, so their low-rank term stays and
        # their x W is 0, with no branch.
        from pallas_fused.dora import kernel_sm90

        if not _sm90_dequant_ok(kind, x.shape[0], ap.shape[0], bp.shape[1], ap.shape[1], dt, interpret):
            raise ValueError(f"dora_dense: implementation='pallas:sm90_dequant' needs an Int8Kernel on one Hopper "
                             f"GPU, a 16-bit x and token / feature counts that are multiples of its tiles "
                             f"({kernel_sm90.QDORA_HEURISTIC}: M the features, N the tokens); got x "
                             f"{x.shape} {x.dtype}, kernel {kind} {(ap.shape[0], bp.shape[1])}, rank {ap.shape[1]}")
        n, g, qt = kernel_norm.column_norm_scale(ops, kind, ap, bp, scale, m, interpret=interpret,
                                                 config=config.norm, transposed_codes=True)
        xa = _xa(x, ap)
        wscale = jnp.where(ops[1] == 0, 1.0, ops[1])
        lb = (bp.astype(jnp.float32) * (scale / wscale)[None, :]).astype(dt)
        y = kernel_sm90.qdora_forward(x, qt, xa, lb, g * wscale, bias, interpret=interpret)
        return y, (ap, bp, n, g, xa, (None, None))
    n, g = _column_norm_scale(ops, kind, ap, bp, scale, m, interpret, config)
    xa = _xa(x, ap)
    if variant == "gemm":
        def fwd(x, *a):  # sharded: tokens and output features split; K and the rank gathered
            ops_, (xa_, bp_, g_, scale_, *bias_) = a[:len(ops)], a[len(ops):]
            return kernel_gemm.forward_gemm(x, ops_, kind, xa_, bp_, g_, scale_, bias_[0] if bias_ else None,
                                            interpret=interpret, config=config.forward)

        rule = "m k, {w}, m r, r n, n, " + ("" if bias is None else ", n") + " -> m n"
        y = _shard(fwd, kind, rule, replicated=("k", "r"))(x, *ops, xa, bp, g, scale,
                                                            *(() if bias is None else (bias,)))
        return y, (ap, bp, n, g, xa, (None, None))
    # "epilogue": cuBLAS z = x W (rounded once to the compute dtype), then one Pallas pass: (z + s xa B) g + bias.
    w = _dense_w(kind, ops, dt)

    def epi(z, *a):  # sharded: tokens and output features split, the rank gathered
        return kernel_gemm.epilogue(z, *a[:4], a[4] if len(a) > 4 else None, interpret=interpret,
                                    config=config.epilogue)

    rule = "m n, m r, r n, n, " + ("" if bias is None else ", n") + " -> m n"
    y = _shard(epi, "dense", rule, replicated=("r",))(jnp.dot(x, w), xa, bp, g, scale,
                                                      *(() if bias is None else (bias,)))
    return y, (ap, bp, n, g, xa, (None, None))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dora_2d(statics, x, ops, a, b, m, bias, scale):
    return _forward(statics, x, ops, a, b, m, bias, scale)[0]


def _dora_2d_fwd(statics, x, ops, a, b, m, bias, scale):
    y, (ap, bp, n, g, xa, (wm, bg)) = _forward(statics, x, ops, a, b, m, bias, scale)
    return y, (x, ops, ap, bp, m, bias, scale, n, g, xa, y, wm, bg)


def _dora_2d_bwd(statics, res, dy):
    kind, variant, interpret, config, exact, rank, fin = statics
    x, ops, ap, bp, m, bias, scale, n, g, xa, y, wm, bg = res
    dt = x.dtype
    gs = g * scale
    # us = s (dy * g) B^T, with g folded into the tiny B instead of the big dy ("merged": the merge launch wrote
    # B g s).
    if bg is None:
        bg = (bp.astype(jnp.float32) * gs[None, :]).astype(dt)
    us = jnp.dot(dy, bg.T)  # cuBLAS rounds once to dt
    if xa is None:  # "merged" never formed x A in the forward
        xa = _xa(x, ap)
    # "sm90": dx = (dy g) W^T + us A^T in one Mosaic GPU GEMM; dy g is written by the column launch (it reads dy
    # anyway) where that launch runs below, by XLA otherwise.
    sm90_dx = variant == "sm90"
    # "sm90_dequant": dx = (dy g wscale) q^T + us A^T, the int8 scale per contraction index there, on dy.
    dyg_scale = g if sm90_dx else (g * ops[1] if variant == "sm90_dequant" else None)
    finished = None
    if not exact and jax.device_count() == 1:
        # Unsharded, constant norm: the column launch returns the finished dB, dm and dbias (in-kernel when one
        # program covers every token), x^T us is rounded once by cuBLAS: no float32 intermediates left to cast.
        db_dt = jnp.float32 if bias is None else bias.dtype
        finished = kernel_columns.backward_columns(dy, y, xa, bias, interpret=interpret, config=config.columns,
                                      finish=(gs, m, bp.dtype, m.dtype, db_dt), dyg_scale=dyg_scale)
    if variant == "sm90_dequant":
        from pallas_fused.dora import kernel_sm90

        dyg = finished[3] if finished is not None else (dy.astype(jnp.float32) * dyg_scale[None, :]).astype(dt)
        dx = kernel_sm90.qdora_dx(dyg, ops[0], us, ap, interpret=interpret)
    elif variant == "gemm":
        gw = g * ops[1] if kind == "int8" else g
        def bwd_dx(dy, gw, *a):  # sharded: tokens and input features split; N and the rank gathered
            return kernel_gemm.backward_dx(dy, gw, a[:-2], kind, *a[-2:], interpret=interpret, config=config.dx)

        dx = _shard(bwd_dx, kind, "m n, n, {w}, m r, k r -> m k", replicated=("n", "r"))(dy, gw, *ops, us, ap)
    else:
        # cuBLAS. dx = (dy g) (W + s A B)^T: with many tokens one GEMM on the merged weight (W + s A B) g
        # (one Pallas pass over W, and no float32 (M, in) partial results); with few tokens g goes on dy
        # and the low-rank term is a second, small GEMM.
        fin_, fout_ = ap.shape[0], bp.shape[1]
        if sm90_dx:
            from pallas_fused.dora import kernel_sm90

            dyg = finished[3] if finished is not None else (dy.astype(jnp.float32) * g[None, :]).astype(dt)
            dx = kernel_sm90.scaled_matmul(dyg, ops[0], lowrank=(us, ap), b_layout="nk", interpret=interpret)
        elif wm is not None:  # "merged" kept it
            dx = jnp.dot(dy, wm.T)
        elif kind != "dense" or dy.shape[0] * (fout_ + 3.5 * fin_) >= fin_ * fout_:
            dx = jnp.dot(dy, _merged_weight(kind, ops, ap, bp, g, scale, interpret, config).T)
        else:
            w = _dense_w(kind, ops, dt)
            dx = jnp.dot((dy.astype(jnp.float32) * g[None, :]).astype(dt), w.T, preferred_element_type=jnp.float32)
            dx = (dx + jnp.dot(us, ap.T, preferred_element_type=jnp.float32)).astype(dt)
    if finished is not None:
        dbm, dm, db = finished[:3]
        dm = _dm_at_zero_magnitude(dm, dy, x, xa, ops, kind, bp, scale, n, m, fin)
        da = jnp.dot(x.T, us)
        return (dx, tuple(_zero_cotangent(o) for o in ops), da[:, :rank], dbm[:rank], dm,
                None if bias is None else db, jnp.zeros_like(scale))

    def bwd_cols(dy, y, xa, *bias_):  # sharded: output features split, tokens summed per shard + psum
        return kernel_columns.backward_columns(dy, y, xa, bias_[0] if bias_ else None, interpret=interpret,
                                               config=config.columns)

    rule = "m n, m n, m r" + ("" if bias is None else ", n") + " -> r n, n, n"
    p, dmz, db = _shard(bwd_cols, "dense", rule, replicated=("r",), summed=("m",))(
        dy, y, xa, *(() if bias is None else (bias,)))
    da = jnp.dot(x.T, us, preferred_element_type=jnp.float32)
    dbm = p * gs[None, :]
    # dm = sum_t dy z / n with z = x W + s (x A) B; since y - bias = z m / n, it is sum_t dy (y - bias) / m
    # from the saved output (no z kept). Undefined for a magnitude of exactly 0.
    dm = _dm_at_zero_magnitude(dmz / m.astype(jnp.float32), dy, x, xa, ops, kind, bp, scale, n, m, fin)
    if exact:
        # Through n: dL/dV = V * c, c = -g dm / n, V = W + s A B (V is never formed: two passes over W).
        c = -g * dm / n
        w = _dequant_ops(kind, ops, fin)
        a32, b32 = ap.astype(jnp.float32), bp.astype(jnp.float32)
        bc = b32 * c[None, :]
        da = da + scale * (w @ bc.T) + scale * scale * (a32 @ (bc @ b32.T))
        dbm = dbm + scale * (a32.T @ w) * c[None, :] + scale * scale * ((a32.T @ a32) @ bc)
    cot_ops = tuple(_zero_cotangent(o) for o in ops)
    dbias = None if bias is None else db.astype(bias.dtype)
    return (dx, cot_ops, da[:, :rank].astype(ap.dtype), dbm[:rank].astype(bp.dtype), dm.astype(m.dtype), dbias,
            jnp.zeros_like(scale))


def _dm_at_zero_magnitude(dm, dy, x, xa, ops, kind, bp, scale, n, m, fin):
    """dm = sum_t dy z / n, z = x W + s (x A) B. The kernels form it as sum_t dy (y - bias) / m, which is 0 / 0 for a
    magnitude of exactly 0 (where a zero column of W with B = 0 starts): such columns are recomputed from z, in a
    branch that runs only when some m is 0 (one more GEMM then)."""
    zero = m == 0

    def recompute(dm):
        z = (jnp.dot(x.astype(jnp.float32), _dequant_ops(kind, ops, fin))
             + scale * jnp.dot(xa.astype(jnp.float32), bp.astype(jnp.float32)))
        return jnp.where(zero, jnp.sum(dy.astype(jnp.float32) * z, axis=0) / n, dm).astype(dm.dtype)

    return jax.lax.cond(jnp.any(zero), recompute, lambda dm: dm, dm)


def _dequant_ops(kind, ops, fin):
    """W in float32 from kernel operands (only the exact-norm-gradient path needs it)."""
    if kind == "int8":
        return Int8Kernel(ops[0], ops[1]).dequantize()
    if kind == "nf4":
        return NF4Kernel(ops[0], ops[1], fin).dequantize()
    return ops[0].astype(jnp.float32)


_dora_2d.defvjp(_dora_2d_fwd, _dora_2d_bwd)


def dora_dense(x, kernel, lora_a, lora_b, magnitude, bias=None, *, scale, exact_norm_grad: bool = False,
               implementation: str | None = None, save_merged: bool | None = None, config: Config | None = None):
    """DoRA dense layer: ``y = (x W + s (x A) B) * (m / ||W + s A B||) + bias``.

    Args:
      x: input (..., in), floating point; the compute dtype (params are cast to it, as flax does).
      kernel: the frozen base weight W (in, out), or a quantised `Int8Kernel` / `NF4Kernel` (QDoRA).
      lora_a: A (in, rank); lora_b: B (rank, out); magnitude: m (out,); bias: (out,) or None.
      scale: s, e.g. alpha / rank (a runtime operand: changing it does not recompile).
      exact_norm_grad: differentiate through the column norm (default: treat it as a constant, as the
        DoRA paper section 4.3 and peft do).
      implementation: None (Pallas on a GPU, XLA elsewhere), "xla", "pallas", "interpret", or one variant of the
        Pallas path, "pallas:<variant>" ("interpret:<variant>" runs it in the Pallas interpreter; see `VARIANTS`).
        Plain "pallas" takes `choose_variant`'s pick: "sm90" where that runs, else "merged" or "epilogue" for dense
        weights, whichever makes the smaller extra pass over memory at this shape; for quantised ones
        "sm90_dequant" where that runs, else "merged" ("gemm" interpreted).
        "pallas:gemm": Pallas GEMMs both ways (the fused-epilogue forward, the dx GEMM; W dequantised in-kernel, never
        formed in full precision: the least memory for an Int8Kernel / NF4Kernel off Hopper, and the slowest).
        "pallas:epilogue": cuBLAS x W, then one Pallas pass (x W + s (x A) B) * g + bias (dense W).
        "pallas:merged": one Pallas pass forms (W + s A B) * g, then one cuBLAS GEMM (x A waits for the backward).
        For a dense W the merged weight is kept for the backward's dx (one copy of W per layer in the compute dtype,
        held from the forward to the backward; `save_merged=False` forms it again in the backward instead). Also
        takes an Int8Kernel / NF4Kernel (QDoRA at cuBLAS speed): the merged weight is then a transient
        full-precision array, formed again in the backward.
        "pallas:sm90" (Hopper, dense 16-bit W, tile-multiple shapes; "interpret:sm90" on jax >= 0.12): the column
        norm's read-only pass over W, then one Mosaic GPU GEMM (x W + (x A)(s B)) g + bias (the low-rank product in
        its accumulator, g and the bias in its epilogue); the backward's dx = (dy g) W^T + ((dy g)(s B)^T) A^T is one
        such GEMM too. W + s A B is never formed; only x A (tokens x rank) is kept for the backward.
        "pallas:sm90_dequant" (Hopper, Int8Kernel, 16-bit x, tile-multiple shapes; plain "pallas" takes it there): the
        column norm read from the int8 codes in-kernel, then one Mosaic GPU GEMM (x q + (x A)(s B / wscale)) g wscale
        + bias with q's int8 tiles converted in registers and the low-rank term in the same fp32 accumulator; the
        backward's dx = (dy g wscale) q^T + ((dy g)(s B)^T) A^T likewise. W is never formed in full precision.
        "merged" and "epilogue" run dx on cuBLAS (with many tokens, or quantised weights, one GEMM on the merged
        weight).
      save_merged: "merged" only: keep the merged weight from the forward for the backward's dx (True: one copy of W
        per layer in the compute dtype held until the backward, e.g. ~12.5 GB over a Llama-7B's 32 blocks in bf16),
        or form it again in the backward (False: one more pass over W, ~0.016 ms per 4096 x 4096 layer on an H200).
        None: `config.save_merged`, whose default None keeps it for a dense W and forms it again for a quantised one.
      config: tile sizes of the Pallas kernels (advanced).

    Gradients flow to x, lora_a, lora_b, magnitude and bias; W (and `scale`) get zero cotangents.

    Precision: with float32 x on a GPU the GEMMs (Pallas and cuBLAS alike) run at TF32 by default (~4e-4 relative,
    as XLA's own fp32 matmuls); under ``jax.default_matmul_precision("highest")`` every one of them runs in full
    fp32 (~1e-6). The norm is floored at 1e-12 (`reference.NORM_FLOOR`), so a column of W + s A B that is all
    zero gives g = 0 and an output column equal to the bias, with finite gradients (peft gets NaN there). Zero
    tokens give an empty output and zero gradients.
    """
    fin, fout, rank = _check(x, kernel, lora_a, lora_b, magnitude, bias, scale)
    impl = _backend.resolve_implementation(implementation, op="dora_dense", variants=VARIANTS)
    base, variant = _backend.split_implementation(impl)
    dt = x.dtype
    a, b = lora_a.astype(dt), lora_b.astype(dt)
    bias_c = None if bias is None else bias.astype(dt)
    if base == "xla":
        return reference.dora_dense_reference(x, kernel, a, b, magnitude, bias_c, scale=scale,
                                              exact_norm_grad=exact_norm_grad)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, fin)
    if x2.shape[0] == 0:
        return jnp.zeros((*lead, fout), dt)
    kind, ops = _weight_ops(kernel, dt)
    interpret = base == "interpret"
    mode = variant or choose_variant(kind, x2.shape[0], fin, fout, dt, interpret, rank)
    config = config or DEFAULT
    if save_merged is not None and save_merged != config.save_merged:
        config = dataclasses.replace(config, save_merged=bool(save_merged))
    statics = (kind, mode, interpret, config, bool(exact_norm_grad), rank, fin)
    y = _dora_2d(statics, x2, ops, a, b, magnitude, bias_c, jnp.asarray(scale, jnp.float32))
    return y.reshape(*lead, fout)


def dora_dense_dropout(x, x_dropped, kernel, lora_a, lora_b, magnitude, bias=None, *, scale,
                       exact_norm_grad: bool = False, implementation: str | None = None, **kw):
    """peft's dropout form: ``y = x W + bias + (g - 1) (x_d W) + g s (x_d A) B`` (x_d = dropout(x)).

    Computed as ``dora_dense(x_d, ...) + (x - x_d) W``: the fused layer on the dropped input plus one
    plain matmul of the dropped-out part (XLA; for quantised kernels W is dequantised for that matmul).
    """
    if jnp.shape(x_dropped) != jnp.shape(x):
        raise ValueError(f"dora_dense_dropout: x_dropped must have x's shape {jnp.shape(x)}, "
                         f"got {jnp.shape(x_dropped)}")
    y = dora_dense(x_dropped, kernel, lora_a, lora_b, magnitude, bias, scale=scale, exact_norm_grad=exact_norm_grad,
                   implementation=implementation, **kw)
    w = jax.lax.stop_gradient(dequantize(kernel, x.dtype))
    rest = jnp.dot(x - x_dropped, w, preferred_element_type=jnp.float32)
    return (y.astype(jnp.float32) + rest).astype(y.dtype)


def column_scale(kernel, lora_a, lora_b, magnitude, *, scale, implementation: str | None = None,
                 config: Config | None = None):
    """g = m / ||W + s A B|| (float32, (out,)) with the fused column-norm kernel (no A B materialised)."""
    fin, fout = kernel.shape
    x_probe = jax.ShapeDtypeStruct((1, fin), jnp.float32)
    _check(x_probe, kernel, lora_a, lora_b, magnitude, None, scale)
    impl = _backend.resolve_implementation(implementation, op="column_scale")
    dt = kernel.dtype if not is_quantized(kernel) else lora_a.dtype
    if impl == "xla":
        return reference.column_scale_reference(kernel, lora_a, lora_b, magnitude, scale, dt)
    kind, ops = _weight_ops(kernel, dt)
    ap, bp = _pad_rank(lora_a.astype(dt), lora_b.astype(dt))
    return _column_norm_scale(ops, kind, ap, bp, jnp.asarray(scale, jnp.float32), magnitude, impl == "interpret",
                              config or DEFAULT)[1]
