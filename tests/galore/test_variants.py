"""The per-leaf variants (api.VARIANTS), the up kernel's launch configurations and the default-choice
table, against the plain-jnp reference and a float64 ground truth (CPU: interpret mode, small shapes)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_fused import _backend
from pallas_fused.galore import api, kernel, reference
from tests.galore.test_kernels import _exact, _inputs
from tests.helpers import assert_all_written, assert_close


def _exact_out(g, w, p, m, v, side, s, inplace, with_w):
    *_, out = _exact(g, w if with_w else jnp.zeros_like(w), p, m, v, side, s)
    return np.asarray(jnp.asarray(w, jnp.float32), np.float64) + out if inplace else out


VARIANT_NAMES = [name.partition(":")[2] for name in api.VARIANTS]


@pytest.mark.parametrize("variant", VARIANT_NAMES)
@pytest.mark.parametrize("side", ["right", "left"])
def test_leaf_step_variants(kernel_impl, variant, side):
    """In place, update with W (decay) and update without W (no decay: no W read) for every variant."""
    g, w, p, m, v, s = _inputs((37, 53), 5, side, jnp.float32, seed=7)
    _, m_ex, v_ex, _, _ = _exact(g, w, p, m, v, side, s)
    interpret = kernel_impl == "interpret"
    for inplace, with_w in [(True, True), (False, True), (False, False)]:
        what = f"{variant} {side} inplace={inplace} w={with_w}"
        out, m2, v2 = api.leaf_step(variant, w if with_w else None, g, m, v, p, side, s, inplace=inplace,
                                    interpret=interpret, dtype=w.dtype)
        s_ref = s if with_w else s._replace(a=0.0)
        base, m_x, v_x = reference.galore_adam_step(w, g, m, v, p, side, s_ref, inplace=inplace)
        assert out.shape == w.shape and out.dtype == w.dtype, what
        assert_all_written(out, what)
        assert_close(out, _exact_out(g, w, p, m, v, side, s, inplace, with_w), baseline=base,
                     floor=1e-6 if inplace else 2e-5, what=what)
        assert_close(m2, m_ex, baseline=m_x, floor=2e-5, what=f"m {what}")
        assert_close(v2, v_ex, baseline=v_x, floor=2e-5, what=f"v {what}")


# Small configurations covering the code paths (rank 24 below; UpConfig(bm, bn, br, warps, stages, w_first, tn,
# tm)): a column loop with the next tile's W prefetched over 2 K chunks (the last tile past N: masked); a row
# loop with the B columns loaded once; a 2 x 2 block of tiles (both operands per tile) with W after the GEMM;
# one tile per program.
UP_CONFIGS = [kernel.UpConfig(16, 16, 16, 4, 2, True, 3, 1), kernel.UpConfig(16, 32, 32, 4, 2, True, 1, 3),
              kernel.UpConfig(16, 16, 32, 4, 1, False, 2, 2), kernel.UpConfig(32, 16, 16, 4, 3, False, 1, 1)]


@pytest.mark.parametrize("cfg", UP_CONFIGS, ids=lambda c: "_".join(map(str, c)))
def test_up_update_configs(kernel_impl, cfg):
    side = "left"
    g, w, p, m, v, s = _inputs((70, 45), 24, side, jnp.float32, seed=2)  # rank 24: 2 K chunks of 16
    n = jnp.asarray(_exact(g, w, p, m, v, side, s)[3], jnp.float32)
    w64, p64, n64 = (np.asarray(x, np.float64) for x in (w, p, n))
    exact = w64 + s.a * w64 + s.c * (p64 @ n64)
    base = w + reference.full_update(w, n, p, side, s)
    out = kernel.up_update(w, n, p, s.pack(), side=side, inplace=True, interpret=kernel_impl == "interpret",
                           blocks=cfg)
    assert_all_written(out)
    assert_close(out, exact, baseline=base, floor=1e-6, what=f"up {cfg}")


def test_up_config_sets_the_launch():
    """The launch passed as `blocks` is the one traced (the grid follows its tiles); without one, this device
    kind's tuned launch (a CPU: the heuristic on fp32 operands, see `kernel.up_config`)."""
    w, n, p = jnp.ones((64, 64)), jnp.ones((64, 8)), jnp.ones((8, 64))
    s = reference.Scalars(0.9, 0.999, 1e-6, 1.0, 1.0, 0.0, -1.0, 1.0).pack()

    def grid(blocks):
        jaxpr = jax.make_jaxpr(lambda w, n, p, s: kernel.up_update(w, n, p, s, side="right", interpret=True,
                                                                   blocks=blocks))(w, n, p, s)
        calls = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "pallas_call"]
        if not calls:  # nested in the jitted helper
            inner = [e for e in jaxpr.jaxpr.eqns if "jaxpr" in e.params][0].params["jaxpr"]
            calls = [e for e in inner.eqns if e.primitive.name == "pallas_call"]
        return tuple(calls[0].params["grid_mapping"].grid)

    assert grid(kernel.UpConfig(32, 32, 16, 4, 2, True, 1)) == (2, 2)
    assert grid(kernel.UpConfig(16, 16, 16, 4, 2, True, 2)) == (4, 2)
    if _backend.gpu_device() is None:
        for side in ("right", "left"):
            want = kernel.UpConfig(**kernel.UP_HEURISTIC[side])._replace(br=16, f16=False, p16=False)
            assert kernel.up_config(8, side) == want
        assert kernel.up_operands(8, "left") == (jnp.float32, False)
    assert kernel.up_config(24, "right", kernel.UpConfig(32, 16, 64, 4, 2, True, 1, 2)) == kernel.UpConfig(
        32, 16, 32, 4, 2, True, 1, 2)  # br <= the rank's block
    assert kernel.up_operands(24, "left", kernel.UpConfig(16, 32, 16, 8, 3, False, 2, 1, True, True)) == (
        jnp.float16, True)


def test_choose_variant_table():
    measured = [[4096, 4096, 128, "right", "hybrid"], [4096, 4096, 512, "right", "xla_up"],
                [4096, 11008, 128, "left", "xla_up"]]
    assert kernel.choose_variant((4096, 4096), 128, "right", measured) == "hybrid"
    assert kernel.choose_variant((4096, 4096), 400, "right", measured) == "xla_up"  # nearest rank
    assert kernel.choose_variant((8192, 8192), 100, "right", measured) == "hybrid"
    assert kernel.choose_variant((2048, 4096), 128, "left", measured) == "xla_up"  # same side first
    assert kernel.choose_variant((64, 64), 8, "right", []) == "hybrid"  # nothing measured
    if _backend.gpu_device() is None:  # the heuristic table
        assert api.choose_kernel((4096, 4096), 512, "right") == "xla_up"
        assert api.choose_kernel((4096, 4096), 128, "right") == "hybrid"
    s = reference.Scalars(*([1.0] * 8))
    with pytest.raises(ValueError, match="variant"):
        api.leaf_step("nope", None, *([jnp.ones((4, 4))] * 4), "right", s, inplace=False, interpret=True,
                      dtype=jnp.float32)


def test_implementation_names_variants():
    """implementation="pallas:<variant>" / "interpret:<variant>" name the variants; anything else is a ValueError
    listing them."""
    with pytest.raises(ValueError, match="implementation.*'interpret:hybrid'"):
        api.galore_adamw(1e-2, implementation="interpret:nope")
    with pytest.raises(TypeError, match="kernel"):
        api.galore_adamw(1e-2, kernel="hybrid")  # the variant is named by implementation= only
    assert api.GaLoreConfig(implementation="interpret:xla_up").resolved().implementation == "interpret:xla_up"


def api_outputs(impl, params, grads):
    """Two optax-transform updates and one in-place step of galore_adamw: (update, new param, mu) of leaf "w"."""
    tx = api.galore_adamw(1e-2, rank=4, weight_decay=0.1, implementation=impl)
    state = tx.init(params)
    u, state = tx.update(grads, state, params)
    u, state = tx.update(grads, state, params)
    step = api.galore_adamw_inplace(1e-2, rank=4, weight_decay=0.1, implementation=impl)
    p2, _ = step.step(params, grads, step.init(params))
    return u["w"], p2["w"], state.mu["w"]


@pytest.mark.parametrize("variant", VARIANT_NAMES)
def test_api_variants(variant):
    """implementation="interpret:<variant>" through the optax transform and the in-place step, with this device
    kind's launches (a GPU's tuned up-projection has fp16 operands: TF32 tolerance; the explicit fp16 launches are
    test_leaf_step_fp16_up's): the reference's numbers."""
    params = {"w": jax.random.normal(jax.random.key(0), (24, 40)), "b": jnp.ones((40,))}
    grads = {"w": jax.random.normal(jax.random.key(1), (24, 40)), "b": jnp.ones((40,))}
    fp16 = variant == "hybrid" and _backend.gpu_device() is not None
    for a, b in zip(api_outputs("xla", params, grads), api_outputs(f"interpret:{variant}", params, grads)):
        np.testing.assert_allclose(a, b, rtol=3e-3 if fp16 else 2e-5, atol=3e-5 if fp16 else 1e-6, err_msg=variant)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_leaf_step_fp16_up(kernel_impl, side, dtype):
    """The hybrid variant with an fp16 up-projection (N from the Adam kernel in fp16; on side left P cast to fp16 by
    the same launch), in place and as an update, fp32 and bf16 params, at TF32's tolerance against float64 (the
    moments are fp32 and TF32-free: tight)."""
    shape = (37, 53) if side == "left" else (53, 37)
    g, w, p, m, v, s = _inputs(shape, 5, side, dtype, seed=8)
    _, m_ex, v_ex, _, upd_ex = _exact(g, w, p, m, v, side, s)
    up = kernel.UpConfig(16, 32, 16, 4, 2, True, 1, 2, True, side == "left")
    w64 = np.asarray(jnp.asarray(w, jnp.float32), np.float64)
    for inplace in (False, True):
        what = f"inplace={inplace} {side} {jnp.dtype(dtype).name}"
        out, m2, v2 = api.leaf_step("hybrid", w, g, m, v, p, side, s, inplace=inplace,
                                    interpret=kernel_impl == "interpret", dtype=w.dtype, up_blocks=up)
        assert out.dtype == dtype
        if inplace:
            assert_close(out, w64 + upd_ex, floor=4e-3 if dtype == jnp.bfloat16 else 3e-6, what=what)
        else:
            assert_close(out, upd_ex, floor=8e-3 if dtype == jnp.bfloat16 else 2e-3, what=what)
        assert_close(m2, m_ex, floor=2e-5, what=f"m {what}")
        assert_close(v2, v_ex, floor=2e-5, what=f"v {what}")


def full_size_case(shape, rank=128):
    """A GPU-size step: (side, w, g, m, v, p, scalars, the exact update at HIGHEST precision)."""
    from tests.helpers import rand

    side = reference.projector_side(shape, "std")
    g, w = rand(0, shape), rand(1, shape)
    q = jnp.linalg.qr(rand(2, (shape[1] if side == "right" else shape[0], rank)))[0]
    p = q.T if side == "right" else q
    low = reference.lowrank_shape(shape, rank, side)
    m, v = rand(3, low, scale=0.1), jnp.abs(rand(4, low, scale=0.1)) + 0.01
    s = reference.Scalars(0.9, 0.999, 1e-6, 1.0, 1.0, -1e-5, -2.5e-4, 1.0)
    exact, _, _ = reference.galore_adam_step(w, g, m, v, p, side, s, inplace=True, precision=jax.lax.Precision.HIGHEST)
    return side, w, g, m, v, p, s, exact - w


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 4096), (4096, 11008)])
def test_variants_and_up_configs_gpu(shape):
    """Every variant, the up kernel under every configuration the tuning sweep times, and the hybrid step with every
    fp16 one (N and P in fp16 from the Adam kernel), at full size (TF32)."""
    from benchmarks.bench_galore import UP_CANDIDATES

    side, w, g, m, v, p, s, delta = full_size_case(shape)
    hi = jax.lax.Precision.HIGHEST
    for variant in VARIANT_NAMES:
        out, _, _ = api.leaf_step(variant, w, g, m, v, p, side, s, inplace=True, interpret=False, dtype=w.dtype)
        assert_close(out - w, delta, floor=5e-3, what=f"{variant} update (TF32)")
    _, _, n = reference.lowrank_adam(reference.project(g, p, side, precision=hi), m, v, s)
    up_exact = reference.full_update(w, n, p, side, s, precision=hi)
    for cfg in UP_CANDIDATES:
        out = kernel.up_update(w, n, p, s.pack(), side=side, blocks=cfg)
        assert_close(out, up_exact, floor=5e-3, what=f"up {cfg} (TF32)")
    for cfg in [c for c in UP_CANDIDATES if c.f16]:
        out, _, _ = api.leaf_step("hybrid", w, g, m, v, p, side, s, inplace=True, interpret=False, dtype=w.dtype,
                                  up_blocks=cfg)
        assert_close(out - w, delta, floor=5e-3, what=f"hybrid {cfg} update (TF32 / fp16 operands)")
