"""DoRA: kernels vs the plain-jnp reference (forward and every gradient), QDoRA, Flax drop-ins."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from pallas_fused import _backend
from pallas_fused.dora import (
    ColumnsConfig,
    Config,
    Int8Kernel,
    MergeConfig,
    NF4Kernel,
    NormConfig,
    NormTiles,
    column_scale,
    column_scale_reference,
    dequantize,
    dora_dense,
    dora_dense_dropout,
    dora_dense_reference,
    impls,
    quantize_int8,
    quantize_nf4,
)
from pallas_fused.dora.flax import DoRADense, DoRALinear, dense_to_dora_params, lora_scale, merge
from pallas_fused.dora.reference import dora_dense_dropout_reference
from tests.helpers import assert_all_written, assert_close, rand


def chosen(kind, tokens, fin, fout, dtype, interpret=False, rank=16) -> str:
    """The variant plain "pallas" (`interpret`: "interpret") runs for this layer on this device."""
    args = impls.DoraArgs.shaped(kind, tokens, fin, fout, rank, dtype)
    return impls.choose(args, impls.current_device(), interpret).variant

NAMES = ("x", "lora_a", "lora_b", "magnitude", "bias")


def make(seed, lead, fin, fout, r, dtype, w_dtype=None):
    """x in `dtype`, W in `w_dtype` (default dtype), adapters / magnitude / bias in float32 (flax's param_dtype)."""
    x = rand(seed, (*lead, fin), dtype)
    w = rand(seed + 1, (fin, fout), w_dtype or dtype, scale=fin ** -0.5)
    a = rand(seed + 2, (fin, r), scale=fin ** -0.5)
    b = rand(seed + 3, (r, fout), scale=0.3)
    m = jnp.abs(rand(seed + 4, (fout,))) + 0.5
    bias = rand(seed + 5, (fout,), scale=0.1)
    dy = rand(seed + 6, (*lead, fout), dtype)
    return x, w, a, b, m, bias, dy


def vjp_all(fn, args, dy):
    """(fn(*args), vjp(dy)) as one jitted program (interpret-mode kernels compile ~2.5x faster so)."""
    def run(args, dy):
        y, pull = jax.vjp(fn, *args)
        return y, pull(dy)
    return jax.jit(run)(tuple(args), dy)


def check_against_reference(kernel, x, a, b, m, bias, dy, *, scale, impl, exact=False, what="", config=None):
    """Forward and all 5 gradients: error vs the float32 reference <= 2x the same-dtype XLA reference's."""
    dt = x.dtype
    ours_fn = lambda x, a, b, m, bias: dora_dense(x, kernel, a, b, m, bias, scale=scale, exact_norm_grad=exact,  # noqa: E731
                                                  implementation=impl, config=config)
    base_fn = lambda x, a, b, m, bias: dora_dense(x, kernel, a, b, m, bias, scale=scale, exact_norm_grad=exact,  # noqa: E731
                                                  implementation="xla")
    w32 = dequantize(kernel, dt).astype(jnp.float32)
    exact_fn = lambda x, a, b, m, bias: dora_dense_reference(x, w32, a, b, m, bias, scale=scale,  # noqa: E731
                                                             exact_norm_grad=exact)
    args = (x, a, b, m, bias)
    with jax.default_matmul_precision("highest"):
        y_ex, g_ex = vjp_all(exact_fn, (x.astype(jnp.float32), a, b, m, bias), dy.astype(jnp.float32))
    y_base, g_base = vjp_all(base_fn, args, dy)
    y, g = vjp_all(ours_fn, args, dy)
    assert y.dtype == dt and y.shape == y_ex.shape
    assert_all_written(y, what)
    assert_close(y, y_ex, baseline=y_base, dtype=dt, what=f"{what} y")
    for name, ours, base, ex in zip(NAMES, g, g_base, g_ex):
        if bias is None and name == "bias":
            assert ours is None and base is None
            continue
        assert ours.dtype == base.dtype, (name, ours.dtype, base.dtype)
        assert_close(ours, ex, baseline=base, dtype=dt, what=f"{what} d{name}")


# (lead, in, out, rank), dtype. Interpret-mode compiles dominate CI time, so the shapes are shared
# across tests (the compiled kernels are cached per shape).
BASE = ((37,), 45, 29, 5)
CASES = [
    (BASE, jnp.float32),
    (BASE, jnp.bfloat16),
    (BASE, jnp.float16),
    (((2, 3), 17, 33, 1), jnp.bfloat16),
    (((19,), 70, 40, 16), jnp.float16),
]


@pytest.mark.parametrize("shape, dtype", CASES, ids=lambda v: getattr(v, "__name__", str(v)))
def test_forward_and_grads(kernel_impl, dtype, shape):
    lead, fin, fout, r = shape
    x, w, a, b, m, bias, dy = make(10, lead, fin, fout, r, dtype)
    check_against_reference(w, x, a, b, m, bias, dy, scale=0.75, impl=kernel_impl, what=f"{dtype.__name__}{shape}")


def test_choose_variant_rank_rule():
    """On Hopper, plain "pallas" runs "sm90" (the low-rank step in the GEMM) up to the tuned rank, and the cheaper of
    "merged" / "epilogue" above it."""
    from pallas_fused.dora import kernel_sm90

    with _backend.gpu_target((9, 0)):
        assert kernel_sm90.max_rank() == 16
        assert chosen("dense", 4096, 4096, 4096, jnp.bfloat16, False, 16) == "sm90"
        assert chosen("dense", 4096, 4096, 4096, jnp.bfloat16, False, 5) == "sm90"  # padded to 16
        assert chosen("dense", 4096, 4096, 11008, jnp.bfloat16, False, 64) == "merged"
        assert chosen("dense", 512, 4096, 11008, jnp.bfloat16, False, 64) == "epilogue"


def test_large_rank_no_bias(kernel_impl):
    """Rank 64, no bias; plain "pallas" takes the "epilogue" variant at this shape (asserted)."""

    x, w, a, b, m, _, dy = make(20, (23,), 130, 96, 64, jnp.bfloat16)
    assert chosen("dense", 23, 130, 96, jnp.bfloat16, False) == "epilogue"  # 23 tokens: no sm90 tile
    fn = lambda x, a, b, m: dora_dense(x, w, a, b, m, None, scale=0.25, implementation=kernel_impl)  # noqa: E731
    ref = lambda x, a, b, m: dora_dense(x, w, a, b, m, None, scale=0.25, implementation="xla")  # noqa: E731
    w32 = w.astype(jnp.float32)
    ex = lambda x, a, b, m: dora_dense_reference(x, w32, a, b, m, None, scale=0.25)  # noqa: E731
    y, g = vjp_all(fn, (x, a, b, m), dy)
    yb, gb = vjp_all(ref, (x, a, b, m), dy)
    ye, ge = vjp_all(ex, (x.astype(jnp.float32), a, b, m), dy.astype(jnp.float32))
    assert_close(y, ye, baseline=yb, what="y")
    for name, o, bb, e in zip(NAMES, g, gb, ge):
        assert_close(o, e, baseline=bb, dtype=jnp.bfloat16, what=name)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_exact_norm_grad(kernel_impl, dtype):
    x, w, a, b, m, bias, dy = make(30, *BASE, dtype)
    check_against_reference(w, x, a, b, m, bias, dy, scale=1.3, impl=kernel_impl, exact=True, what="exact")
    # and the exact gradient really differs from the constant-norm one (so the check above means something)
    def grad_a(exact):
        return jax.grad(lambda a: jnp.sum(dora_dense_reference(x, w, a, b, m, bias, scale=1.3, exact_norm_grad=exact)
                                          .astype(jnp.float32) * dy))(a)
    assert float(jnp.max(jnp.abs(grad_a(False) - grad_a(True)))) > 1e-3


# "merged" configurations: the norm launch's partial sums over 3 row ranges (not a power of two) finished by the
# merge launch, "expand" and "direct" norms, merge tiles ragged at both edges, forward or natural tile order.
MERGE_CONFIGS = {
    "merged_split3": Config(norm=NormConfig(expand=NormTiles(bn=16, bk=16, rows=1024, warps=4, stages=3)),
                            merge=MergeConfig(bk=16, bn=16, norm_rows=16)),
    # merge programs of 2 row tiles (the second ragged at the bottom), next W tile loaded one step ahead
    "merged_rows2": Config(merge=MergeConfig(bk=16, bn=16, rows=32)),
    "merged_direct_split3": Config(norm=NormConfig(mode="direct", direct=NormTiles(bn=64, bk=16, rows=16, warps=4,
                                                                                   stages=2)),
                                   merge=MergeConfig(bk=32, bn=16, reverse=False)),
    # backward column reductions over 3 token ranges, finished by XLA (the default config covers the 37 tokens
    # with one program per column strip: finished in the kernel); below 64 output features the sums run in
    # registers with y prefetched (the MMA sums: test_backward_columns)
    "merged_cols_split3": Config(columns=ColumnsConfig(rows=16, bt=16)),
}


@pytest.mark.parametrize("variant", ["gemm", "epilogue", "merged", *MERGE_CONFIGS])
def test_variants(kernel_impl, variant):
    """Each "pallas:<variant>" (on the CPU "interpret:<variant>") against the reference."""
    x, w, a, b, m, bias, dy = make(40, *BASE, jnp.bfloat16)
    config = MERGE_CONFIGS.get(variant)
    check_against_reference(w, x, a, b, m, bias, dy, scale=0.5, impl=f"{kernel_impl}:{variant.split('_')[0]}",
                            what=variant, config=config)


@pytest.mark.parametrize("cfg", ["mma_finish", "mma_split", "elementwise_finish", "elementwise_split"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_backward_columns(kernel_impl, cfg, with_bias):
    """The backward column reductions (dB = xa^T dy g s, dm = sum dy (y - bias) / m, dbias = sum dy) against jnp:
    sums on the MMA or elementwise, finished in the kernel (one program over all tokens) or by XLA (3 ranges)."""
    from pallas_fused.dora import kernel_columns

    M, N, R = 37, 70, 16  # N > 64: 64-column tiles (the MMA sums need them), the second one ragged
    dy, y, xa = rand(90, (M, N), jnp.bfloat16), rand(91, (M, N), jnp.bfloat16), rand(92, (M, R), jnp.bfloat16)
    bias = rand(93, (N,), jnp.bfloat16, scale=0.5) if with_bias else None
    gs, m = rand(94, (N,)), jnp.abs(rand(95, (N,))) + 0.5
    config = ColumnsConfig(mma_sums=cfg.startswith("mma"), **({"rows": 16, "bt": 16} if "split" in cfg else {}))
    g = rand(96, (N,))
    p, dm, db, dyg = kernel_columns.backward_columns(dy, y, xa, bias, interpret=kernel_impl == "interpret",
                                                     config=config, dyg_scale=g,
                                                     finish=(gs, m, jnp.float32, jnp.float32, jnp.float32))
    # dy * g from the same launch ("sm90"), rounded once to dy's dtype
    np.testing.assert_array_equal(dyg, (dy.astype(jnp.float32) * g[None, :]).astype(jnp.bfloat16))
    f = lambda v: np.asarray(v, np.float64)  # noqa: E731
    z = f(y) - (0 if bias is None else f(bias))
    np.testing.assert_allclose(p, f(xa).T @ f(dy) * f(gs), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dm, (f(dy) * z).sum(0) / f(m), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(db, f(dy).sum(0), rtol=1e-5, atol=1e-5)


def test_save_merged_flag(kernel_impl):
    """save_merged=False (the backward forms the merged weight again) gives the gradients of the default (kept),
    through dora_dense and the linen module; and the kept weight really is a residual of the VJP."""
    x, w, a, b, m, bias, dy = make(47, (21,), 40, 24, 4, jnp.bfloat16)
    outs = {}
    for keep in (True, False):
        fn = lambda x, a, b, m, keep=keep: dora_dense(x, w, a, b, m, bias, scale=0.5,  # noqa: E731
                                                      implementation=f"{kernel_impl}:merged", save_merged=keep)
        outs[keep] = vjp_all(fn, (x, a, b, m), dy)
        _, pull = jax.vjp(fn, x, a, b, m)
        kept = [leaf for leaf in jax.tree.leaves(pull) if getattr(leaf, "shape", None) == w.shape]
        assert (len(kept) >= 2) == keep, (keep, len(kept))  # W itself, plus the merged weight when kept
    for o, n in zip(jax.tree.leaves(outs[True]), jax.tree.leaves(outs[False])):
        np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(n, np.float32))
    module = DoRADense(24, rank=4, save_merged=False, implementation=f"{kernel_impl}:merged")
    params = module.init(jax.random.key(0), x)
    assert module.apply(params, x).shape == (21, 24)


def test_merge_weight_outputs(kernel_impl):
    """merge_weight from partial sums returns ((W + s A B) g, n, g, B g s); from g, the same merged weight."""
    from pallas_fused.dora import kernel_merge, kernel_norm

    w, a = rand(84, (70, 40), jnp.bfloat16, scale=0.1), rand(85, (70, 16), jnp.bfloat16)
    b = rand(86, (16, 40), jnp.bfloat16)
    m = jnp.abs(rand(87, (40,))) + 0.5
    cfg = MergeConfig(bk=32, bn=16)
    interp = kernel_impl == "interpret"
    norm = NormConfig(expand=NormTiles(bn=16, bk=16, rows=1024, warps=4, stages=3))
    parts = kernel_norm.column_partials((w,), "dense", a, b, 0.7, interpret=interp, config=norm, rows=32)
    assert parts.shape == (3, 40)
    wm, n, g, bg = kernel_merge.merge_weight((w,), "dense", a, b, 0.7, partials=parts, magnitude=m, interpret=interp,
                                             config=cfg)
    v = w.astype(jnp.float32) + 0.7 * jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32), precision="highest")
    n_ex = jnp.linalg.norm(v, axis=0)
    np.testing.assert_allclose(n, n_ex, rtol=2e-6)
    np.testing.assert_allclose(g, m / n_ex, rtol=2e-6)
    assert bg.dtype == jnp.bfloat16
    np.testing.assert_array_equal(bg, (b.astype(jnp.float32) * (g * 0.7)[None, :]).astype(jnp.bfloat16))
    assert wm.dtype == jnp.bfloat16
    np.testing.assert_allclose(wm.astype(jnp.float32), (v * (m / n_ex)).astype(jnp.bfloat16).astype(jnp.float32),
                               rtol=1e-2, atol=1e-3)
    for cfg2 in (MergeConfig(reverse=False), MergeConfig(bk=16, rows=64, bn=32)):
        wm2 = kernel_merge.merge_weight((w,), "dense", a, b, 0.7, g=g, interpret=interp, config=cfg2)
        np.testing.assert_array_equal(wm2.astype(jnp.float32), wm.astype(jnp.float32))


def test_sm90_skeleton_rejects_bad_operands():
    """The shared sm90 GEMM names what is wrong before building a kernel (no GPU needed to get there)."""
    from pallas_fused import _sm90

    kw = dict(epilogue=lambda acc, rows, cols: acc, out_dtype=jnp.bfloat16, config=_sm90.TileConfig(), name="t")
    a8 = jnp.zeros((256, 256), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="b_layout must be"):
        _sm90.matmul(a8, a8, b_layout="kk", **kw)
    with pytest.raises(ValueError, match="only K-major"):
        _sm90.matmul(a8, a8, b_layout="kn", **kw)
    with pytest.raises(ValueError, match="multiples of the tile"):
        _sm90.matmul(a8[:100], a8, b_layout="nk", **kw)


def test_sm90_needs_hopper_and_tile_shapes():
    """"pallas:sm90" runs only where it can (a Hopper GPU, dense 16-bit W, tile-multiple shapes), else a clear
    error; "interpret:sm90" needs jax >= 0.12 (Mosaic GPU's interpret mode) and the same tile-multiple shapes."""
    x, w, a, b, m, bias, _ = make(46, (5,), 64, 48, 4, jnp.bfloat16)
    with pytest.raises(ValueError, match="implementation='pallas:sm90' needs"):
        dora_dense(x, w, a, b, m, bias, scale=0.5, implementation="pallas:sm90")
    if not _backend.has_mosaic_interpret():
        with pytest.raises(_backend.ImplementationError, match="jax >= 0.12"):
            dora_dense(x, w, a, b, m, bias, scale=0.5, implementation="interpret:sm90")
    else:
        with pytest.raises(ValueError, match="multiples of the tile"):
            dora_dense(x, w, a, b, m, bias, scale=0.5, implementation="interpret:sm90")


needs_mosaic_interpret = pytest.mark.skipif(
    not _backend.has_mosaic_interpret(),
    reason="Mosaic GPU interpret mode needs jax >= 0.12")


@needs_mosaic_interpret
@pytest.mark.parametrize("lead, fin, fout, r, with_bias", [((128,), 256, 256, 5, True), ((2, 64), 256, 512, 40, False)],
                         ids=["r5_bias", "r40_nobias"])
def test_sm90_interpret(lead, fin, fout, r, with_bias):
    """"interpret:sm90": the forward (x W + (x A)(s B)) g + bias and dx = (dy g) W^T + ((dy g)(s B)^T) A^T as the
    Mosaic GPU kernels with the low-rank step, every gradient against the reference; odd ranks (padded to 16 / 64),
    bias and none."""
    x, w, a, b, m, bias, dy = make(300, lead, fin, fout, r, jnp.bfloat16)
    check_against_reference(w, x, a, b, m, bias if with_bias else None, dy, scale=0.5, impl="interpret:sm90",
                            what=f"interpret sm90 r{r}")


@pytest.mark.parametrize("variant", ["merged", "epilogue"])
def test_few_tokens_no_bias(kernel_impl, variant):
    """Few tokens per weight, no bias. "merged": dx on the merged weight kept from the forward; "epilogue": the
    cuBLAS backward scales dy by g and adds the low-rank term separately (many tokens: one GEMM on the merged
    weight, covered by test_variants)."""
    x, w, a, b, m, _, dy = make(45, (3,), 64, 48, 4, jnp.bfloat16)
    fn = lambda x, a, b, m: dora_dense(x, w, a, b, m, None, scale=0.5, implementation=f"{kernel_impl}:{variant}")  # noqa: E731
    ref = lambda x, a, b, m: dora_dense(x, w, a, b, m, None, scale=0.5, implementation="xla")  # noqa: E731
    ex = lambda x, a, b, m: dora_dense_reference(x, w.astype(jnp.float32), a, b, m, None, scale=0.5)  # noqa: E731
    y, g = vjp_all(fn, (x, a, b, m), dy)
    yb, gb = vjp_all(ref, (x, a, b, m), dy)
    with jax.default_matmul_precision("highest"):
        ye, ge = vjp_all(ex, (x.astype(jnp.float32), a, b, m), dy.astype(jnp.float32))
    assert_close(y, ye, baseline=yb, what="y")
    for name, o, bb, e in zip(NAMES, g, gb, ge):
        assert_close(o, e, baseline=bb, dtype=jnp.bfloat16, what=name)


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_qdora_merged(kernel_impl, kind):
    """Quantised W with "pallas:merged": the merged weight is formed from the codes and scales (fwd and dx), and by
    default not kept for the backward (only the quantised operands are its residuals). int8: 2 tiles a program;
    NF4 (150 inputs: 256 padded rows, 128 packed): 2 programs of one absmax block along the packed rows, each
    writing rows of both halves, those past 150 masked."""
    x, w, a, b, m, bias, dy = make(55, (27,), 150, 36, 6, jnp.bfloat16, w_dtype=jnp.float32)
    qw, merge = (quantize_int8(w), MergeConfig(bk=64, rows=128)) if kind == "int8" else (quantize_nf4(w),
                                                                                           MergeConfig(rows=64))
    check_against_reference(qw, x, a, b, m, bias, dy, scale=0.5, impl=f"{kernel_impl}:merged",
                            what=f"{kind} merged", config=Config(merge=merge))
    _, pull = jax.vjp(lambda x: dora_dense(x, qw, a, b, m, bias, scale=0.5, implementation=f"{kernel_impl}:merged"),
                      x)
    kept = [leaf for leaf in jax.tree.leaves(pull) if getattr(leaf, "shape", None) == (150, 36)
            and jnp.issubdtype(leaf.dtype, jnp.floating)]
    assert not kept, [k.dtype for k in kept]


def test_choose_variant_quantized():
    """Plain "pallas" with a quantised W on Hopper: int8 runs "sm90_dequant" at tile-multiple shapes, "merged" (a
    transient merged weight and cuBLAS) elsewhere and for NF4; interpreted, "gemm"."""

    with _backend.gpu_target((9, 0)):
        assert chosen("int8", 4096, 4096, 4096, jnp.bfloat16, False, 16) == "sm90_dequant"
        assert chosen("int8", 4000, 4096, 4096, jnp.bfloat16, False, 16) == "merged"
        assert chosen("nf4", 4096, 4096, 4096, jnp.bfloat16, False, 16) == "merged"
        assert chosen("nf4", 4096, 4096, 4096, jnp.bfloat16, True, 16) == "gemm"


@pytest.mark.parametrize("kind, dtype, exact", [("int8", jnp.bfloat16, False), ("nf4", jnp.bfloat16, False),
                                                ("int8", jnp.float32, True), ("nf4", jnp.float32, True)])
def test_qdora_matches_dequantized_reference(kernel_impl, kind, dtype, exact):
    x, w, a, b, m, bias, dy = make(50, (27,), 150, 36, 6, dtype, w_dtype=jnp.float32)
    qw = quantize_int8(w) if kind == "int8" else quantize_nf4(w)
    check_against_reference(qw, x, a, b, m, bias, dy, scale=0.6, impl=kernel_impl, exact=exact, what=kind)


def test_quantizers():
    w = rand(60, (200, 40), scale=0.05)
    q8 = quantize_int8(w)
    assert q8.q.dtype == jnp.int8 and q8.shape == (200, 40)
    assert float(jnp.max(jnp.abs(q8.dequantize() - w) / q8.scale[None, :])) <= 0.5 + 1e-5
    q4 = quantize_nf4(w)
    assert q4.packed.dtype == jnp.uint8 and q4.shape == (200, 40) and q4.absmax.shape == (256 // 64, 40)
    err = float(jnp.linalg.norm(q4.dequantize() - w) / jnp.linalg.norm(w))
    assert 0.0 < err < 0.12, err  # NF4 on Gaussian weights: ~8-10 % relative error
    # every code is representable exactly: quantising a dequantised weight is lossless
    again = quantize_nf4(q4.dequantize())
    np.testing.assert_allclose(again.dequantize(), q4.dequantize(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", ["dense", "int8", "nf4"])
def test_column_scale(kernel_impl, kind):
    w = rand(70, (150, 36), scale=0.1)
    kernel = {"dense": w, "int8": quantize_int8(w), "nf4": quantize_nf4(w)}[kind]
    a, b = rand(71, (150, 6), scale=0.1), rand(72, (6, 36), scale=0.1)
    m = jnp.abs(rand(73, (36,))) + 0.5
    g = column_scale(kernel, a, b, m, scale=2.0, implementation=kernel_impl)
    with jax.default_matmul_precision("highest"):
        ref = column_scale_reference(kernel, a, b, m, 2.0, jnp.float32)
    np.testing.assert_allclose(g, ref, rtol=2e-5)


# "expand" column norm (16-bit W or int8 codes with 16-bit adapters): one program over all rows (g fused in
# the kernel), split rows (partial sums finished by XLA), a ragged last tile; "direct" as the fallback.
NORM_CONFIGS = {
    "fused_finish": Config(),
    "split_rows": Config(norm=NormConfig(expand=NormTiles(bn=16, bk=32, rows=64, warps=4, stages=3))),
    "split_ragged": Config(norm=NormConfig(expand=NormTiles(bn=32, bk=64, rows=128, warps=4, stages=3))),
    "direct": Config(norm=NormConfig(mode="direct")),
    # next W tile loaded one step ahead, 3 row ranges of 2 steps (the last ragged: prefetches past K masked)
    "direct_prefetch": Config(norm=NormConfig(mode="direct", direct=NormTiles(bn=16, bk=32, rows=64, warps=4,
                                                                              stages=2))),
}


@pytest.mark.parametrize("kind, dtype, cfg", [
    ("dense", jnp.bfloat16, "fused_finish"), ("dense", jnp.bfloat16, "split_rows"), ("dense", jnp.bfloat16, "direct"),
    ("dense", jnp.float16, "split_ragged"), ("int8", jnp.bfloat16, "fused_finish"),
    ("int8", jnp.bfloat16, "split_ragged"), ("dense", jnp.bfloat16, "direct_prefetch"),
    ("int8", jnp.bfloat16, "direct_prefetch"),
], ids=str)
def test_column_scale_expand(kernel_impl, kind, dtype, cfg):
    from pallas_fused.dora.kernel_norm import expand_supported

    fin, fout, r = 150, 36, 6
    w = rand(74, (fin, fout), scale=0.1)
    kernel = w.astype(dtype) if kind == "dense" else quantize_int8(w)
    a, b = rand(75, (fin, r), dtype, scale=0.1), rand(76, (r, fout), dtype, scale=0.1)
    m = jnp.abs(rand(77, (fout,))) + 0.5
    ops = (kernel,) if kind == "dense" else (kernel.q, kernel.scale)
    assert expand_supported(ops, kind, a)  # the variant under test really runs
    g = column_scale(kernel, a, b, m, scale=-1.5, implementation=kernel_impl, config=NORM_CONFIGS[cfg])
    # exact: W, A, B as given (16-bit values), everything else in float32
    with jax.default_matmul_precision("highest"):
        ref = column_scale_reference(dequantize(kernel, jnp.float32), a.astype(jnp.float32), b.astype(jnp.float32),
                                     m, -1.5, jnp.float32)
    np.testing.assert_allclose(g, ref, rtol=2e-6)


# The "direct" launch that writes q^T: its default tiles (one row range at 150 rows), and small ones: 3 row ranges of
# 2 steps, the last ragged (its prefetch past K masked).
@pytest.mark.parametrize("tiles", [NormTiles(128, 64, 512, 4, 2), NormTiles(16, 32, 64, 4, 2)],
                         ids=["default", "split"])
def test_column_norm_transposed_codes(kernel_impl, tiles):
    """With `transposed_codes` the norm pass also writes the int8 codes transposed (QDoRA's forward operand), zero in
    a column whose scale is 0 (its codes are not), and n, g are the plain call's. Ragged tiles both ways."""
    from pallas_fused.dora import kernel_norm
    from pallas_fused.dora.quant import Int8Kernel

    fin, fout, r = 150, 36, 16
    q = quantize_int8(rand(84, (fin, fout), scale=0.1))
    kernel = Int8Kernel(q.q, q.scale.at[5].set(0.0))
    assert bool(jnp.any(kernel.q[:, 5] != 0))
    a, b = rand(85, (fin, r), jnp.bfloat16, scale=0.1), rand(86, (r, fout), jnp.bfloat16, scale=0.1)
    m = jnp.abs(rand(87, (fout,))) + 0.5
    norm = NormConfig(codes_t=tiles)
    args = ((kernel.q, kernel.scale), "int8", a, b, 0.7, m)
    n, g, qt = kernel_norm.column_norm_scale(*args, interpret=kernel_impl == "interpret", config=norm,
                                             transposed_codes=True)
    want = np.where(np.asarray(kernel.scale)[None, :] != 0, np.asarray(kernel.q), 0).T
    assert qt.dtype == jnp.int8 and qt.shape == (fout, fin)
    np.testing.assert_array_equal(qt, want)
    n0, g0 = kernel_norm.column_norm_scale(*args, interpret=kernel_impl == "interpret", config=norm)
    np.testing.assert_allclose(n, n0, rtol=1e-6)  # the same arithmetic, fused differently around the extra store
    np.testing.assert_allclose(g, g0, rtol=1e-6)
    with pytest.raises(ValueError, match="transposed_codes needs int8 codes"):
        kernel_norm.column_norm_scale((kernel.dequantize().astype(jnp.bfloat16),), "dense", a, b, 0.7, m,
                                      interpret=kernel_impl == "interpret", config=norm, transposed_codes=True)


def test_column_norm_scale_outputs(kernel_impl):
    """The fused-finish launch returns n and g = m / n (the layer keeps n for the exact norm gradient)."""
    from pallas_fused.dora import kernel_norm

    w, a = rand(80, (70, 40), jnp.bfloat16, scale=0.1), rand(81, (70, 16), jnp.bfloat16)
    b = rand(82, (16, 40), jnp.bfloat16)
    m = jnp.abs(rand(83, (40,))) + 0.5
    n, g = kernel_norm.column_norm_scale((w,), "dense", a, b, 0.7, m, interpret=kernel_impl == "interpret")
    v = w.astype(jnp.float32) + 0.7 * jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32), precision="highest")
    np.testing.assert_allclose(n, jnp.linalg.norm(v, axis=0), rtol=2e-6)
    np.testing.assert_allclose(g, m / n, rtol=1e-6)


def test_scale_is_runtime_operand(kernel_impl):
    x, w, a, b, m, bias, _ = make(80, *BASE, jnp.float32)
    f = jax.jit(lambda s: dora_dense(x, w, a, b, m, bias, scale=s, implementation=kernel_impl))
    for s in (0.5, 2.0):
        assert_close(f(s), dora_dense_reference(x, w, a, b, m, bias, scale=s), what=f"s={s}")
    assert f._cache_size() == 1


def test_jit_vmap_remat(kernel_impl):
    x, w, a, b, m, bias, dy = make(90, (4, 11), 24, 20, 3, jnp.float32)
    f = lambda x, a: dora_dense(x, w, a, b, m, bias, scale=0.5, implementation=kernel_impl)  # noqa: E731
    ref = dora_dense_reference(x, w, a, b, m, bias, scale=0.5)
    assert_close(jax.jit(f)(x, a), ref, what="jit")
    assert_close(jax.jit(jax.vmap(f, in_axes=(0, None)))(x, a), ref, what="vmap x")
    a_batch = jnp.stack([a, 2 * a])
    yb = jax.jit(jax.vmap(f, in_axes=(None, 0)))(x, a_batch)
    assert_close(yb[1], dora_dense_reference(x, w, 2 * a, b, m, bias, scale=0.5), what="vmap lora_a")
    loss = lambda x, a: jnp.sum(f(x, a) * dy)  # noqa: E731
    g_plain = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, a)
    g_remat = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1)))(x, a)
    for p, r in zip(g_plain, g_remat):
        assert_close(r, p, what="remat")


def test_dropout_function_semantics(kernel_impl):
    x, w, a, b, m, bias, dy = make(100, *BASE, jnp.float32)
    keep = jax.random.bernoulli(jax.random.key(1), 0.7, x.shape)
    x_d = jnp.where(keep, x / 0.7, 0.0)
    fn = lambda x, a, b, m, bias: dora_dense_dropout(x, x_d, w, a, b, m, bias, scale=0.8,  # noqa: E731
                                                     implementation=kernel_impl)
    ref = lambda x, a, b, m, bias: dora_dense_dropout_reference(x, x_d, w, a, b, m, bias, scale=0.8)  # noqa: E731
    y, g = vjp_all(fn, (x, a, b, m, bias), dy)
    yr, gr = vjp_all(ref, (x, a, b, m, bias), dy)
    assert_close(y, yr, what="dropout y")
    for name, o, r in zip(NAMES, g, gr):
        assert_close(o, r, what=f"dropout d{name}")
    # with nothing dropped it is the plain layer
    y0 = dora_dense_dropout(x, x, w, a, b, m, bias, scale=0.8, implementation=kernel_impl)
    assert_close(y0, dora_dense_reference(x, w, a, b, m, bias, scale=0.8), what="no drop")


def test_linen_dropout_train_vs_eval(kernel_impl):
    x = rand(110, (6, 16), jnp.float32)
    layer = DoRADense(12, rank=4, dropout=0.5, implementation=kernel_impl, lora_b_init=nn.initializers.normal(0.5))
    params = layer.init(jax.random.key(0), x, deterministic=True)
    y_eval = layer.apply(params, x, deterministic=True)
    y_train = layer.apply(params, x, deterministic=False, rngs={"dropout": jax.random.key(3)})
    assert_all_written(y_train)
    assert float(jnp.max(jnp.abs(y_train - y_eval))) > 1e-3
    nodrop = DoRADense(12, rank=4, implementation=kernel_impl)
    assert_close(y_eval, nodrop.apply(params, x), what="eval == no dropout")


@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_zero_lora_b_equals_dense(impl):
    x = rand(120, (3, 7, 24), jnp.float32)
    dense = nn.Dense(20)
    dparams = dense.init(jax.random.key(0), x)["params"]
    dparams = dict(dparams, bias=rand(121, (20,), scale=0.1))
    y_dense = dense.apply({"params": dparams}, x)
    params = dense_to_dora_params(dparams, 4, key=jax.random.key(1), alpha=8.0)
    layer = DoRADense(20, rank=4, alpha=8.0, implementation=impl)
    y = layer.apply({"params": params}, x)
    if impl == "xla":
        np.testing.assert_array_equal(y, y_dense)
    else:
        np.testing.assert_allclose(y, y_dense, rtol=2e-6, atol=2e-6)
    # a freshly initialised DoRADense has the same param names / shapes as nn.Dense plus the adapters
    fresh = layer.init(jax.random.key(2), x)["params"]
    assert set(fresh) == {"kernel", "bias", "lora_a", "lora_b", "magnitude"}
    assert fresh["kernel"].shape == dparams["kernel"].shape
    np.testing.assert_array_equal(fresh["lora_b"], 0.0)
    np.testing.assert_allclose(fresh["magnitude"], jnp.linalg.norm(fresh["kernel"], axis=0), rtol=1e-6)


def test_merge_round_trip(kernel_impl):
    x = rand(130, (9, 24), jnp.float32)
    layer = DoRADense(20, rank=3, alpha=6.0, use_rslora=True, implementation=kernel_impl,
                      lora_b_init=nn.initializers.normal(0.3))
    params = layer.init(jax.random.key(0), x)["params"]
    params = dict(params, magnitude=params["magnitude"] * 1.5)
    y = layer.apply({"params": params}, x)
    merged = merge(params, alpha=6.0, use_rslora=True)
    assert set(merged) == {"kernel", "bias"}
    y_dense = nn.Dense(20).apply({"params": merged}, x)
    np.testing.assert_allclose(y, y_dense, rtol=1e-5, atol=1e-5)
    assert lora_scale(3, 6.0, True) == pytest.approx(6.0 / 3 ** 0.5)


def test_linen_bf16_and_qdora(kernel_impl):
    x = rand(140, (2, 5, 64), jnp.bfloat16)
    for quantize in (None, "int8", "nf4"):
        layer = DoRADense(48, rank=8, dtype=jnp.bfloat16, quantize=quantize, implementation=kernel_impl,
                          lora_b_init=nn.initializers.normal(0.1))
        params = layer.init(jax.random.key(0), x)["params"]
        if quantize == "int8":
            assert isinstance(params["kernel"], Int8Kernel)
        if quantize == "nf4":
            assert isinstance(params["kernel"], NF4Kernel)
        y = layer.apply({"params": params}, x)
        assert y.dtype == jnp.bfloat16 and y.shape == (2, 5, 48)
        w32 = dequantize(params["kernel"], jnp.bfloat16).astype(jnp.float32)
        ref = dora_dense_reference(x.astype(jnp.float32), w32, params["lora_a"], params["lora_b"],
                                   params["magnitude"], params["bias"], scale=1.0)
        base = DoRADense(48, rank=8, dtype=jnp.bfloat16, quantize=quantize, implementation="xla").apply(
            {"params": params}, x)
        assert_close(y, ref, baseline=base, what=f"linen {quantize}")
        if quantize is not None:  # the quantised backward kernels are covered by the QDoRA test above
            continue
        adapters = {k: params[k] for k in ("lora_a", "lora_b", "magnitude", "bias")}
        loss = lambda p, layer=layer, params=params: jnp.sum(  # noqa: E731
            layer.apply({"params": {**params, **p}}, x).astype(jnp.float32))
        grads = jax.grad(loss)(adapters)
        assert grads["lora_a"].dtype == jnp.float32
        assert_all_written(grads["magnitude"])


def test_nnx_optimizer_trains_only_adapters(kernel_impl):
    model = DoRALinear(16, 12, rank=4, implementation=kernel_impl, rngs=nnx.Rngs(0),
                       b_initializer=nnx.initializers.normal(0.2))
    assert isinstance(model.lora_a, nnx.LoRAParam) and isinstance(model.magnitude, nnx.LoRAParam)
    assert type(model.kernel) is nnx.Param
    x = rand(150, (8, 16), jnp.float32)
    target = rand(151, (8, 12), jnp.float32)
    y_ref = dora_dense_reference(x, model.kernel[...], model.lora_a[...], model.lora_b[...], model.magnitude[...],
                                 model.bias[...], scale=1.0)
    assert_close(model(x), y_ref, what="nnx forward")
    before = jax.tree.map(lambda v: jnp.array(v), nnx.state(model, nnx.Param))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.LoRAParam)

    @nnx.jit
    def step(model, opt, x, target):
        loss_fn = lambda m: jnp.mean((m(x) - target) ** 2)  # noqa: E731
        loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))(model)
        opt.update(model, grads)
        return loss

    loss0 = step(model, opt, x, target)
    loss1 = step(model, opt, x, target)
    assert float(loss1) < float(loss0)
    after = nnx.state(model, nnx.Param)
    changed = jax.tree.map(lambda u, v: bool(jnp.any(u != v)), before, after)
    flat = dict(jax.tree_util.tree_flatten_with_path(changed)[0])
    by_name = {jax.tree_util.keystr(k): v for k, v in flat.items()}
    for key, did_change in by_name.items():
        adapter = any(n in key for n in ("lora_a", "lora_b", "magnitude"))
        assert did_change == adapter, (key, did_change)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(x=jnp.ones((4, 10), jnp.int32)), "x must be a floating"),
        (dict(x=jnp.ones((4, 11))), "x has 11 input features"),
        (dict(kernel=jnp.ones((10,))), "kernel must be a 2-D"),
        (dict(lora_a=jnp.ones((10, 0)), lora_b=jnp.ones((0, 8))), "rank must be in"),
        (dict(lora_a=jnp.ones((10, 9)), lora_b=jnp.ones((9, 8))), "rank must be in"),
        (dict(lora_a=jnp.ones((9, 2))), "lora_a must have shape"),
        (dict(lora_b=jnp.ones((3, 8))), "lora_b must have shape"),
        (dict(magnitude=jnp.ones((7,))), "magnitude must have shape"),
        (dict(bias=jnp.ones((9,))), "bias must have shape"),
        (dict(scale=jnp.ones((2,))), "scale must be a scalar"),
    ],
)
def test_bad_input(change, match):
    args = dict(x=jnp.ones((4, 10)), kernel=jnp.ones((10, 8)), lora_a=jnp.ones((10, 2)), lora_b=jnp.ones((2, 8)),
                magnitude=jnp.ones((8,)), bias=jnp.ones((8,)), scale=1.0)
    args.update(change)
    scale = args.pop("scale")
    with pytest.raises(ValueError, match=match):
        dora_dense(**args, scale=scale, implementation="xla")


def test_bad_module_args():
    x = jnp.ones((2, 6))
    with pytest.raises(ValueError, match="rank"):
        DoRADense(4, rank=0).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="rank"):
        DoRADense(4, rank=5).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="quantize"):
        DoRADense(4, rank=2, quantize="int4").init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="implementation must be None or one of .*'pallas:merged'"):
        dora_dense(x, jnp.ones((6, 4)), jnp.ones((6, 2)), jnp.ones((2, 4)), jnp.ones((4,)), scale=1.0,
                   implementation="pallas:cublas")
    with pytest.raises(ValueError, match="'interpret:epilogue' takes a dense kernel only"):
        dora_dense(x, quantize_int8(jnp.ones((6, 4))), jnp.ones((6, 2)), jnp.ones((2, 4)), jnp.ones((4,)), scale=1.0,
                   implementation="interpret:epilogue")


# ---------------------------------------------------------------------------------------------------- GPU
BIG = [((512,), 4096, 4096, 16), ((256,), 4096, 11008, 64)]


GPU_CONFIGS = {
    # dy g written from the register path of the column launch
    "sm90_cols_registers": Config(columns=ColumnsConfig(mma_sums=False)),
    # norm partials over 8 row ranges from the "direct" kernel, merge tiles 64 x 128 in forward order
    "merged_direct": Config(norm=NormConfig(mode="direct"), merge=MergeConfig(bk=64, bn=128, reverse=False)),
    # backward column sums over token ranges, finished by XLA
    "merged_cols_split": Config(columns=ColumnsConfig(rows=128)),
    # 4 row tiles per merge program; sums in registers
    "merged_rows512": Config(merge=MergeConfig(rows=512), columns=ColumnsConfig(mma_sums=False)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("shape", BIG, ids=str)
@pytest.mark.parametrize("variant", ["", "gemm", "merged", "epilogue", "sm90", *GPU_CONFIGS])
def test_gpu_big_shapes(shape, variant):
    lead, fin, fout, r = shape
    x, w, a, b, m, bias, dy = make(200, lead, fin, fout, r, jnp.bfloat16)
    impl = "pallas" + (f":{variant.split('_')[0]}" if variant else "")
    check_against_reference(w, x, a, b, m, bias, dy, scale=0.5, impl=impl, what=f"gpu {shape} {variant}",
                            config=GPU_CONFIGS.get(variant))


@pytest.mark.gpu
def test_gpu_sm90_4096_tokens():
    """"pallas:sm90" at the benchmark's shape (4096 tokens, 4096 -> 4096, r16): the low-rank step in both GEMMs."""
    x, w, a, b, m, bias, dy = make(206, (4096,), 4096, 4096, 16, jnp.bfloat16)
    check_against_reference(w, x, a, b, m, bias, dy, scale=0.5, impl="pallas:sm90", what="gpu sm90 4096")


@pytest.mark.gpu
def test_gpu_sm90_exact_norm_grad():
    """"pallas:sm90" differentiating through the norm (dy g formed by XLA, the column sums on the sharded path)."""
    lead, fin, fout, r = BIG[0]
    x, w, a, b, m, bias, dy = make(205, lead, fin, fout, r, jnp.bfloat16)
    check_against_reference(w, x, a, b, m, bias, dy, scale=0.5, impl="pallas:sm90", exact=True,
                            what="gpu sm90 exact")


@pytest.mark.gpu
def test_gpu_auto_takes_sm90_on_hopper():
    from pallas_fused import _backend

    want = "sm90" if _backend.is_hopper() else "merged"
    assert chosen("dense", 4096, 4096, 4096, jnp.bfloat16, False) == want
    assert chosen("dense", 4096, 4096, 4096, jnp.bfloat16, True) == "merged"  # interpret: no sm90


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("config", [0, 1])  # kernel_sm90.tiles(): large, small
def test_gpu_sm90_scaled_matmul(dtype, with_bias, config):
    """The Mosaic GPU GEMM (x V) g + bias against a float32 product of the same 16-bit inputs: one rounding."""
    from pallas_fused import _backend
    from pallas_fused.dora import kernel_sm90

    if not _backend.is_hopper():
        pytest.skip("the sm90 kernel needs a Hopper GPU")
    x, v = rand(240, (384, 1024), dtype), rand(241, (1024, 768), dtype, scale=1024 ** -0.5)
    g, bias = jnp.abs(rand(242, (768,))) + 0.5, rand(243, (768,), dtype) if with_bias else None
    y = kernel_sm90.scaled_matmul(x, v, g, bias, config=kernel_sm90.tiles()[config])
    ref = jnp.dot(x.astype(jnp.float32), v.astype(jnp.float32), precision="highest") * g
    ref = ref + (0.0 if bias is None else bias.astype(jnp.float32))
    assert y.dtype == dtype
    np.testing.assert_allclose(y.astype(jnp.float32), ref, rtol=1e-2, atol=1e-2 * float(jnp.std(ref)))
    with pytest.raises(ValueError, match="multiples of the tile"):
        kernel_sm90.scaled_matmul(x[:100], v, g, bias)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["pallas", "pallas:gemm"])  # 300 tokens: plain "pallas" takes "merged"
@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_gpu_qdora(kind, impl):
    x, w, a, b, m, bias, dy = make(210, (300,), 4096, 1024, 16, jnp.bfloat16, w_dtype=jnp.float32)
    qw = quantize_int8(w) if kind == "int8" else quantize_nf4(w)
    check_against_reference(qw, x, a, b, m, bias, dy, scale=0.5, impl=impl, what=f"gpu {kind} {impl}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_gpu_odd_shapes(dtype):
    x, w, a, b, m, bias, dy = make(220, (333,), 517, 389, 7, dtype)
    check_against_reference(w, x, a, b, m, bias, dy, scale=0.5, impl="pallas", what="gpu odd")


GPU_NORM_CONFIGS = {
    **NORM_CONFIGS,
    "one_launch_4096": Config(norm=NormConfig(expand=NormTiles(bn=32, bk=128, rows=4096, warps=4, stages=3))),
    # "expand" past the default max rank
    "expand_rank64": Config(norm=NormConfig(expand_max_rank=128, expand=NormTiles(bn=128, bk=64, rows=1024, warps=4,
                                                                                   stages=3))),
}


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", list(GPU_NORM_CONFIGS), ids=str)
@pytest.mark.parametrize("fout, r", [(4096, 16), (11008, 64)])
def test_gpu_column_scale(cfg, fout, r):
    """The column norm configurations at the benchmark shapes vs a float32 reference of the same 16-bit inputs
    (squares summed by FMAs: 1e-5 relative; XLA's bf16 reference errs by up to 2.2e-4 here, it rounds W + s A B to
    bf16)."""
    config = GPU_NORM_CONFIGS[cfg]
    rtol = 1e-5
    w = rand(230, (4096, fout), jnp.bfloat16, scale=4096 ** -0.5)
    a, b = rand(231, (4096, r), jnp.bfloat16, scale=r ** -0.5), rand(232, (r, fout), jnp.bfloat16, scale=0.05)
    m = jnp.abs(rand(233, (fout,))) + 0.5
    g = column_scale(w, a, b, m, scale=2.0, implementation="pallas", config=config)
    with jax.default_matmul_precision("highest"):
        ref = column_scale_reference(w.astype(jnp.float32), a.astype(jnp.float32), b.astype(jnp.float32), m, 2.0,
                                     jnp.float32)
    np.testing.assert_allclose(g, ref, rtol=rtol)
