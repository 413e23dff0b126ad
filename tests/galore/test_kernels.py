"""The GaLore kernels against the plain-jnp reference and a float64 ground truth (CPU: interpret mode)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_fused.galore import kernel, reference
from tests.helpers import assert_all_written, assert_close, rand

SHAPES = [((48, 80), 8), ((37, 53), 5), ((70, 33), 16)]
DTYPES = [jnp.float32, jnp.bfloat16]
CASES = [(sh, r, side, dt) for (sh, r) in SHAPES for side in ("right", "left") for dt in DTYPES
         if dt == jnp.float32 or sh == SHAPES[1][0]]  # bf16 on one (odd) shape: interpret mode is slow


def _inputs(shape, rank, side, dtype, seed=0):
    g = rand(seed, shape, dtype)
    w = rand(seed + 1, shape, dtype)
    p = reference.svd_projector(g, rank, side)  # in g's dtype, like the optimizer state
    low = reference.lowrank_shape(shape, rank, side)
    m = rand(seed + 2, low, jnp.float32, scale=0.1)
    v = jnp.abs(rand(seed + 3, low, jnp.float32, scale=0.1)) + 0.01
    s = reference.Scalars(0.9, 0.999, 1e-6, 1.1, 0.9, -1e-3 * 0.1, -2.5e-3, 1.0)
    return g, w, p, m, v, s


def _exact(g, w, p, m, v, side, s):
    """float64 numpy: R, m', v', N, out."""
    g, w, p, m, v = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (g, w, p, m, v))
    r = g @ p.T if side == "right" else p.T @ g
    m2 = s.b1 * m + (1 - s.b1) * r
    v2 = s.b2 * v + (1 - s.b2) * r * r
    n = s.alpha * m2 / (s.beta * np.sqrt(v2) + s.eps)
    back = n @ p if side == "right" else p @ n
    return r, m2, v2, n, s.a * w + s.c * back


@pytest.mark.parametrize("shape,rank,side,dtype", CASES)
def test_lowrank_adam(kernel_impl, shape, rank, side, dtype):
    g, w, p, m, v, s = _inputs(shape, rank, side, dtype)
    _, m_ex, v_ex, n_ex, _ = _exact(g, w, p, m, v, side, s)
    r = reference.project(g, p, side)
    m_x, v_x, n_x = reference.lowrank_adam(r, m, v, s)
    m_k, v_k, n_k = kernel.lowrank_adam(r, m, v, s.pack(), interpret=kernel_impl == "interpret")
    assert m_k.shape == m.shape and n_k.dtype == jnp.float32
    for what, out, ex, base in [("m", m_k, m_ex, m_x), ("v", v_k, v_ex, v_x), ("N", n_k, n_ex, n_x)]:
        assert_all_written(out, what)
        assert_close(out, ex, baseline=base, floor=2e-5, what=f"{what} {side} {dtype.__name__}")


def test_lowrank_adam_fp16_n_and_bad_r(kernel_impl):
    g, w, p, m, v, s = _inputs((37, 53), 5, "right", jnp.float32, seed=5)
    r = reference.project(g, p, "right")
    _, _, n_ex = reference.lowrank_adam(r, m, v, s)
    _, _, n16 = kernel.lowrank_adam(r, m, v, s.pack(), interpret=kernel_impl == "interpret", n_dtype=jnp.float16)
    assert n16.dtype == jnp.float16
    assert_close(n16, np.asarray(n_ex, np.float64), floor=1e-3, what="fp16 N")  # fp16 rounding: 2^-11 relative
    # with p: the same launch casts P to fp16 (P here has more elements than m: the grid covers both)
    m2, v2, n2, p16 = kernel.lowrank_adam(r, m, v, s.pack(), interpret=kernel_impl == "interpret",
                                          n_dtype=jnp.float16, p=p)
    assert p.size > m.size and p16.dtype == jnp.float16 and p16.shape == p.shape
    np.testing.assert_array_equal(p16, p.astype(jnp.float16))
    np.testing.assert_array_equal(n2, n16)
    with pytest.raises(ValueError, match="r must have m's shape"):
        kernel.lowrank_adam(jnp.ones((2, 5, 37)), m, v, s.pack(), interpret=True)


def test_fp16_n_clamped_nan_kept():
    """An fp16 N is clamped to +-F16_MAX (an absurd eps-free ratio) and a NaN stays NaN (never hidden)."""
    m = jnp.array([[1e6, -1e6, jnp.nan, 0.5]], jnp.float32)
    v = jnp.zeros_like(m)
    s = reference.Scalars(0.0, 1.0, 1e-12, 1.0, 1.0, 0.0, 1.0, 1.0)  # b1 0: m' = R; b2 1: v' = v = 0
    _, _, n = kernel.lowrank_adam(m, m, v, s.pack(), interpret=True, n_dtype=jnp.float16)
    n = np.asarray(n, np.float32)[0]
    assert n[0] == kernel.F16_MAX and n[1] == -kernel.F16_MAX and np.isnan(n[2]) and np.isfinite(n[3])


@pytest.mark.parametrize("shape,rank,side,dtype", CASES)
@pytest.mark.parametrize("inplace", [False, True])
def test_up_update(kernel_impl, shape, rank, side, dtype, inplace):
    g, w, p, m, v, s = _inputs(shape, rank, side, dtype, seed=3)
    _, _, _, n, _ = _exact(g, w, p, m, v, side, s)
    n = jnp.asarray(n, jnp.float32)
    # exact out from the fp32 N (the kernel's input)
    w64, p64, n64 = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (w, p, n))
    out_ex = s.a * w64 + s.c * (n64 @ p64 if side == "right" else p64 @ n64)
    base = reference.full_update(w, n, p, side, s)
    if inplace:
        out_ex, base = w64 + out_ex, w.astype(jnp.float32) + base
    out = kernel.up_update(w, n, p, s.pack(), side=side, inplace=inplace, interpret=kernel_impl == "interpret")
    assert out.dtype == w.dtype and out.shape == w.shape
    assert_all_written(out)
    floor = 8e-3 if dtype == jnp.bfloat16 else (1e-6 if inplace else 2e-5)
    assert_close(out, out_ex, baseline=base.astype(dtype), floor=floor, what=f"up {side} {dtype.__name__}")


def _tf32(x):
    """float64 copy of x rounded to TF32's 10-bit mantissa (what the tensor cores multiply)."""
    u = np.asarray(jnp.asarray(x, jnp.float32)).view(np.uint32).astype(np.uint64)
    u = ((u + 0x1000) & 0xFFFFE000).astype(np.uint32)
    return u.view(np.float32).astype(np.float64)


# UpConfig(bm, bn, br, warps, stages, w_first, tn, tm, f16, p16): fp16 operands over a row loop; 2 x 2 tiles with
# 2 K chunks, with P in fp16 too; one tile (the loops' W prefetch is dtype-blind: tested in fp32 in test_variants).
F16_CONFIGS = [kernel.UpConfig(16, 32, 32, 4, 2, True, 1, 3, True),
               kernel.UpConfig(16, 16, 16, 4, 1, False, 2, 2, True, True),
               kernel.UpConfig(32, 16, 32, 4, 3, False, 1, 1, True, True)]


@pytest.mark.parametrize("cfg", F16_CONFIGS, ids=lambda c: "_".join(map(str, c)))
@pytest.mark.parametrize("side", ["right", "left"])
def test_up_update_fp16_operands_as_exact_as_tf32(kernel_impl, cfg, side):
    """fp16 operands (N written in fp16, P cast) are as exact as TF32: the error of the update against the
    float64 product is within 2x that of the float64 product of TF32-rounded operands (module note in kernel.py)."""
    shape = (70, 45) if side == "right" else (45, 70)
    g, w, p, m, v, s = _inputs(shape, 24, side, jnp.float32, seed=6)
    n = jnp.asarray(_exact(g, w, p, m, v, side, s)[3], jnp.float32)
    n64, p64 = np.asarray(n, np.float64), np.asarray(p, np.float64)
    back = lambda n, p: n @ p if side == "right" else p @ n  # noqa: E731
    exact = s.c * back(n64, p64)
    tf32 = s.c * back(_tf32(n), _tf32(p))
    interpret = kernel_impl == "interpret"
    out = kernel.up_update(None, n.astype(jnp.float16), p.astype(jnp.float16) if cfg.p16 else p, s.pack(), side=side,
                           interpret=interpret, blocks=cfg, out_dtype=jnp.float32)
    assert out.dtype == jnp.float32
    assert_all_written(out)
    assert_close(out, exact, baseline=tf32, floor=1e-6, what=f"fp16 up {side} {cfg}")
    # and the same configuration given fp32 N and P (cast in registers)
    out32 = kernel.up_update(None, n, p, s.pack(), side=side, interpret=interpret, blocks=cfg, out_dtype=jnp.float32)
    assert_close(out32, exact, baseline=tf32, floor=1e-6, what=f"fp16 up, fp32 inputs {side} {cfg}")


def test_skip_step_keeps_moments(kernel_impl):
    """ok = 0 (a non-finite gradient on a refresh step): moments unchanged, update zero, nothing NaN."""
    g, w, p, m, v, s = _inputs((48, 80), 8, "right", jnp.float32)
    g = g.at[3, 4].set(jnp.nan)
    s = s._replace(ok=0.0)
    interpret = kernel_impl == "interpret"
    m2, v2, n = kernel.lowrank_adam(reference.project(g, p, "right"), m, v, s.pack(), interpret=interpret)
    np.testing.assert_array_equal(m2, m)
    np.testing.assert_array_equal(v2, v)
    out = kernel.up_update(w, n, p, s.pack(), side="right", interpret=interpret)
    np.testing.assert_array_equal(out, jnp.zeros_like(w))


def test_runtime_scalars_do_not_recompile(kernel_impl):
    g, w, p, m, v, s = _inputs((48, 80), 8, "left", jnp.float32)
    f = jax.jit(lambda w, n, p, sc: kernel.up_update(w, n, p, sc, side="left",
                                                     interpret=kernel_impl == "interpret"))
    n = jnp.ones((8, 80), jnp.float32)
    a = f(w, n, p, s.pack())
    b = f(w, n, p, s._replace(c=2 * s.c).pack())
    assert f._cache_size() == 1
    assert not np.allclose(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 4096), (4096, 11008)])
@pytest.mark.parametrize("rank", [32, 128, 512])
def test_large_shapes_gpu(shape, rank):
    side = reference.projector_side(shape, "std")
    g, w = rand(0, shape), rand(1, shape)
    q = jnp.linalg.qr(rand(2, (shape[1] if side == "right" else shape[0], rank)))[0]  # orthonormal, no SVD
    p = q.T if side == "right" else q
    low = reference.lowrank_shape(shape, rank, side)
    m, v = rand(3, low, scale=0.1), jnp.abs(rand(4, low, scale=0.1)) + 0.01
    s = reference.Scalars(0.9, 0.999, 1e-6, 1.0, 1.0, -1e-5, -2.5e-4, 1.0)
    hi = jax.lax.Precision.HIGHEST
    m_x, v_x, n_x = reference.lowrank_adam(reference.project(g, p, side, precision=hi), m, v, s)
    m_k, v_k, n_k = kernel.lowrank_adam(reference.project(g, p, side), m, v, s.pack())
    assert_close(m_k, m_x, floor=5e-3, what="m (TF32)")
    assert_close(v_k, v_x, floor=5e-3, what="v (TF32)")
    assert_close(n_k, n_x, floor=5e-3, what="N (TF32)")
    out = kernel.up_update(w, n_x, p, s.pack(), side=side)
    assert_close(out, reference.full_update(w, n_x, p, side, s, precision=hi), floor=5e-3, what="update (TF32)")
