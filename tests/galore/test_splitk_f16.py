"""The split-K down-projection (variant "splitk"), the low-rank Adam kernel on its partial sums and with an fp16 N,
and the up-projection on fp16 operands, against float64 ground truths (CPU: interpret mode, small odd shapes)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_fused.galore import api, kernel, reference
from tests.galore.test_kernels import _exact, _inputs
from tests.helpers import assert_all_written, assert_close

# DownConfig(bm, bk, splits, br, warps, stages) on rank 24 (rank block 32): 3 splits over 3 K chunks of 16 with a
# masked tail; splits past the K chunks (clipped to their number: 2); two rank blocks of 16 (the second masked
# past rank 24), G and P (not P^T) through registers on side left.
DOWN_CONFIGS = [kernel.DownConfig(16, 16, 3, 32, 4, 2), kernel.DownConfig(32, 32, 9, 32, 4, 3),
                kernel.DownConfig(16, 16, 2, 16, 4, 2, True, True)]


def _tf32(x):
    """float64 copy of x rounded to TF32's 10-bit mantissa (what the tensor cores multiply)."""
    u = np.asarray(jnp.asarray(x, jnp.float32)).view(np.uint32).astype(np.uint64)
    u = ((u + 0x1000) & 0xFFFFE000).astype(np.uint32)
    return u.view(np.float32).astype(np.float64)


@pytest.mark.parametrize("cfg", DOWN_CONFIGS, ids=lambda c: "_".join(map(str, c)))
@pytest.mark.parametrize("side", ["right", "left"])
def test_down_splitk_partials(kernel_impl, cfg, side):
    shape = (70, 45) if side == "right" else (45, 70)
    g, w, p, m, v, s = _inputs(shape, 24, side, jnp.float32, seed=4)
    r_ex, m_ex, v_ex, n_ex, _ = _exact(g, w, p, m, v, side, s)
    interpret = kernel_impl == "interpret"
    parts = kernel.down_splitk(g, p, side=side, interpret=interpret, blocks=cfg)
    k_chunks = -(-(shape[1] if side == "right" else shape[0]) // cfg.bk)
    assert parts.shape == (min(cfg.splits, k_chunks), *m.shape) and parts.dtype == jnp.float32
    assert_all_written(parts, "partials")
    base = reference.project(g, p, side)
    assert_close(parts.sum(0), r_ex, baseline=base, floor=2e-6, what=f"sum of partials {side} {cfg}")
    # the Adam kernel adds them (in a fixed order) before its step
    m2, v2, n = kernel.lowrank_adam(parts, m, v, s.pack(), interpret=interpret)
    m_x, v_x, n_x = reference.lowrank_adam(base, m, v, s)
    for what, out, ex, b in [("m", m2, m_ex, m_x), ("v", v2, v_ex, v_x), ("N", n, n_ex, n_x)]:
        assert_close(out, ex, baseline=b, floor=2e-5, what=f"{what} from partials {side}")


def test_lowrank_adam_fp16_n_and_bad_partials(kernel_impl):
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
    with pytest.raises(ValueError, match="r must have"):
        kernel.lowrank_adam(jnp.ones((2, 5, 37)), m, v, s.pack(), interpret=True)


def test_fp16_n_clamped_nan_kept():
    """An fp16 N is clamped to +-F16_MAX (an absurd eps-free ratio) and a NaN stays NaN (never hidden)."""
    m = jnp.array([[1e6, -1e6, jnp.nan, 0.5]], jnp.float32)
    v = jnp.zeros_like(m)
    s = reference.Scalars(0.0, 1.0, 1e-12, 1.0, 1.0, 0.0, 1.0, 1.0)  # b1 0: m' = R; b2 1: v' = v = 0
    _, _, n = kernel.lowrank_adam(m, m, v, s.pack(), interpret=True, n_dtype=jnp.float16)
    n = np.asarray(n, np.float32)[0]
    assert n[0] == kernel.F16_MAX and n[1] == -kernel.F16_MAX and np.isnan(n[2]) and np.isfinite(n[3])


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


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_leaf_step_splitk_fp16_up(kernel_impl, side, dtype):
    """The splitk and hybrid variants with an fp16 up-projection, in place and as an update, fp32 and bf16 params,
    at TF32's tolerance against float64 (the moments are fp32 and TF32-free: tight)."""
    shape = (37, 53) if side == "left" else (53, 37)
    g, w, p, m, v, s = _inputs(shape, 5, side, dtype, seed=8)
    r_ex, m_ex, v_ex, n_ex, upd_ex = _exact(g, w, p, m, v, side, s)
    interpret = kernel_impl == "interpret"
    up = kernel.UpConfig(16, 32, 16, 4, 2, True, 1, 2, True, side == "left")
    w64 = np.asarray(jnp.asarray(w, jnp.float32), np.float64)
    down = kernel.DownConfig(16, 16, 2, 16, 4, 2)
    for variant, inplace in [("splitk", False), ("splitk", True), ("hybrid", False)]:
        what = f"{variant} inplace={inplace} {side} {jnp.dtype(dtype).name}"
        out, m2, v2 = api.leaf_step(variant, w, g, m, v, p, side, s, inplace=inplace, interpret=interpret,
                                    dtype=w.dtype, up_blocks=up, down_blocks=down)
        assert out.dtype == dtype
        if inplace:
            assert_close(out, w64 + upd_ex, floor=4e-3 if dtype == jnp.bfloat16 else 3e-6, what=what)
        else:
            assert_close(out, upd_ex, floor=8e-3 if dtype == jnp.bfloat16 else 2e-3, what=what)
        assert_close(m2, m_ex, floor=2e-5, what=f"m {what}")
        assert_close(v2, v_ex, floor=2e-5, what=f"v {what}")


def test_api_splitk_and_hybrid():
    """implementation="interpret:splitk" / "interpret:hybrid" through the optax transform and the in-place step,
    with this device kind's launches (fp16 operands where tuned so; the explicit fp16 launches are
    test_leaf_step_splitk_fp16_up's): the reference's numbers at TF32 tolerance."""
    params = {"w": jax.random.normal(jax.random.key(0), (24, 40)), "b": jnp.ones((40,))}
    grads = {"w": jax.random.normal(jax.random.key(1), (24, 40)), "b": jnp.ones((40,))}
    from tests.galore.test_variants import api_outputs

    expected = api_outputs("xla", params, grads)
    for kern in ("splitk", "hybrid"):
        for a, b in zip(expected, api_outputs(f"interpret:{kern}", params, grads)):
            np.testing.assert_allclose(a, b, rtol=3e-3, atol=3e-5, err_msg=kern)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 4096), (4096, 11008)])
def test_splitk_and_fp16_up_gpu(shape):
    """The split-K kernel under every DOWN_CANDIDATES[side] entry, and the splitk step with every fp16 UP_CANDIDATES
    entry, at full size against the HIGHEST-precision reference (TF32 tolerance)."""
    from benchmarks.bench_galore import DOWN_CANDIDATES, UP_CANDIDATES
    from tests.galore.test_variants import full_size_case

    side, w, g, m, v, p, s, delta = full_size_case(shape)
    r_hi = reference.project(g, p, side, precision=jax.lax.Precision.HIGHEST)
    for cfg in DOWN_CANDIDATES[side]:
        assert_close(kernel.down_splitk(g, p, side=side, blocks=cfg).sum(0), r_hi, floor=5e-3, what=f"splitk {cfg}")
    for cfg in [c for c in UP_CANDIDATES if c.f16]:
        out, _, _ = api.leaf_step("splitk", w, g, m, v, p, side, s, inplace=True, interpret=False, dtype=w.dtype,
                                  up_blocks=cfg)
        assert_close(out - w, delta, floor=5e-3, what=f"splitk {cfg} update (TF32 / fp16 operands)")
