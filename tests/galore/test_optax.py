"""The optax transforms against an independent reference, optax.contrib.galore, and optax's combinators."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pallas_fused.galore import (
    GALORE_STATIC_ARGS,
    galore_adam,
    galore_adamw,
    galore_adamw_inplace,
    scale_by_galore_adam,
)
from tests.galore.ref_impl import RefGaLoreAdamW
from tests.helpers import rand

RANK, GAP = 8, 3


def _params(dtype=jnp.float32, scale=1.0):
    return {"w": rand(0, (48, 80), dtype, scale), "u": rand(1, (80, 48), dtype, scale),
            "b": rand(2, (7,), dtype, scale), "small": rand(3, (6, 40), dtype, scale)}  # rank clamped to 6


def _grads(step, params):
    return {k: rand(100 * step + i, p.shape, p.dtype) for i, (k, p) in enumerate(sorted(params.items()))}


def _run(tx, params, steps, grads_fn=_grads):
    state = tx.init(params)
    upd = jax.jit(tx.update)
    traj = []
    for t in range(steps):
        u, state = upd(grads_fn(t, params), state, params)
        params = optax.apply_updates(params, u)
        traj.append(params)
    return traj, state


def _assert_tree_close(a, b, rtol, atol, what=""):
    for k in a:
        np.testing.assert_allclose(np.asarray(a[k], np.float32), np.asarray(b[k], np.float32), rtol=rtol, atol=atol,
                                   err_msg=f"{what} leaf {k}")


@pytest.mark.parametrize("proj_type", ["std", "reverse_std", "right", "left"])
def test_matches_independent_reference_xla(proj_type):
    _check_reference("xla", proj_type)


def test_matches_independent_reference_kernels(kernel_impl):
    _check_reference(f"{kernel_impl}:hybrid", "std")


def _check_reference(impl, proj_type):
    hp = dict(rank=RANK, update_proj_gap=GAP, scale=0.25, b1=0.9, b2=0.99, eps=1e-6, projector="svd")
    tx = galore_adamw(1e-2, weight_decay=0.1, proj_type=proj_type, implementation=impl, **hp)
    params = _params()
    traj, state = _run(tx, params, 7)  # refreshes at steps 0, 3, 6
    ref = RefGaLoreAdamW(1e-2, RANK, GAP, 0.25, 0.9, 0.99, 1e-6, 0.1, proj_type)
    p = params
    for t in range(7):
        p = ref.step(p, _grads(t, params))
        _assert_tree_close(traj[t], p, rtol=2e-5, atol=2e-6, what=f"{impl} {proj_type} step {t}")
    assert int(state.count) == 7
    # the projected leaves really moved along a rank-RANK subspace per refresh period
    assert state.mu["w"].shape == (RANK, 80) if proj_type in ("std", "left") else (48, RANK)


@pytest.mark.parametrize("impl", ["xla", "kernel"])
def test_optax_convention_matches_optax_contrib(impl, kernel_impl):
    impl = kernel_impl if impl == "kernel" else impl
    params = {k: v for k, v in _params().items() if k != "small"}  # optax projects every 2-D leaf
    ours = galore_adamw(1e-2, rank=RANK, update_proj_gap=GAP, scale=0.25, eps=1e-8, weight_decay=0.1,
                        convention="optax", implementation=impl)
    peer = optax.contrib.galore(1e-2, rank=RANK, update_proj_gap=GAP, scale=0.25, weight_decay=0.1)
    a, _ = _run(ours, params, 7)
    b, _ = _run(peer, params, 7)
    for t in range(7):
        _assert_tree_close(a[t], b[t], rtol=2e-5, atol=2e-6, what=f"step {t}")


def test_inplace_step_is_bit_identical(kernel_impl):
    kw = dict(rank=RANK, update_proj_gap=GAP, weight_decay=0.1, implementation=kernel_impl)
    tx, opt = galore_adamw(1e-2, **kw), galore_adamw_inplace(1e-2, **kw)
    params = _params()
    traj, state = _run(tx, params, 4)
    step = jax.jit(opt.step, donate_argnums=(0, 2))
    p, s = jax.tree.map(jnp.copy, params), opt.init(params)
    for t in range(4):
        p, s = step(p, _grads(t, params), s)
    for k in p:
        if kernel_impl == "interpret":
            # interpret mode runs the kernels through XLA:CPU, whose fusion of the in-place kernel's extra
            # `W + update` may contract a different product of `a W + c acc` into an FMA: 1 ulp apart per step,
            # which the 4 steps can compound to 2 (seen at 2 of 3840 elements once rank 8 is zero-padded to the
            # kernel's rank block of 16, which changes how XLA:CPU fuses the interpreted kernel)
            np.testing.assert_allclose(p[k], traj[-1][k], rtol=2.4e-7, atol=0)
        else:
            np.testing.assert_array_equal(p[k], traj[-1][k])
    jax.tree.map(np.testing.assert_array_equal, s, state)


def test_inject_hyperparams_no_recompile():
    params = _params()
    base = dict(rank=RANK, update_proj_gap=GAP, implementation="xla")
    tx = optax.inject_hyperparams(galore_adamw, static_args=GALORE_STATIC_ARGS)(
        learning_rate=1e-2, weight_decay=0.1, b1=0.9, b2=0.999, eps=1e-6, scale=0.25, **base)
    state = tx.init(params)
    upd = jax.jit(tx.update)
    p = params
    for t in range(4):
        u, state = upd(_grads(t, params), state, p)
        p = optax.apply_updates(p, u)
    plain, _ = _run(galore_adamw(1e-2, weight_decay=0.1, **base), params, 4)
    _assert_tree_close(p, plain[-1], rtol=1e-5, atol=1e-6, what="inject vs plain")
    before = jax.tree.map(jnp.copy, p)
    for name, value in [("learning_rate", 3e-2), ("b1", 0.8), ("b2", 0.99), ("eps", 1e-4), ("weight_decay", 0.5),
                        ("scale", 1.0)]:
        state.hyperparams[name] = jnp.asarray(value, jnp.float32)
        u, state = upd(_grads(9, params), state, p)
        p = optax.apply_updates(p, u)
    assert upd._cache_size() == 1
    assert not np.allclose(p["w"], before["w"])


def test_chain_equals_galore_adamw():
    params = _params()
    kw = dict(rank=RANK, update_proj_gap=GAP, scale=0.25, implementation="xla")
    chained = optax.chain(scale_by_galore_adam(**kw), optax.add_decayed_weights(0.1),
                          optax.scale_by_learning_rate(1e-2))
    a, _ = _run(chained, params, 5)
    b, _ = _run(galore_adamw(1e-2, weight_decay=0.1, **kw), params, 5)
    _assert_tree_close(a[-1], b[-1], rtol=1e-5, atol=1e-6, what="chain")
    c, _ = _run(galore_adam(1e-2, **kw), params, 5)
    d, _ = _run(galore_adamw(1e-2, weight_decay=0.0, **kw), params, 5)
    _assert_tree_close(c[-1], d[-1], rtol=1e-6, atol=1e-7, what="galore_adam")


def test_multi_transform_and_multisteps():
    params = _params()
    # the SVD: the randomized projector's sketch is seeded per leaf index, which multi_transform's masking changes
    kw = dict(rank=RANK, update_proj_gap=GAP, projector="svd", implementation="xla")
    labels = {"w": "galore", "u": "galore", "b": "sgd", "small": "sgd"}
    tx = optax.multi_transform({"galore": galore_adamw(1e-2, **kw), "sgd": optax.sgd(1e-2)}, labels)
    a, _ = _run(tx, params, 4)
    b, _ = _run(galore_adamw(1e-2, **kw), params, 4)
    _assert_tree_close({k: a[-1][k] for k in ("w", "u")}, {k: b[-1][k] for k in ("w", "u")}, rtol=1e-6, atol=1e-7,
                       what="multi_transform")
    # MultiSteps(k=2) on grads g0, g1 == one step on their mean
    ms = optax.MultiSteps(galore_adamw(1e-2, **kw), every_k_schedule=2)
    c, _ = _run(ms, params, 4)
    mean = lambda t, p: jax.tree.map(lambda x, y: (x + y) / 2, _grads(2 * t, p), _grads(2 * t + 1, p))
    d, _ = _run(galore_adamw(1e-2, **kw), params, 2, grads_fn=mean)
    _assert_tree_close(c[-1], d[-1], rtol=1e-5, atol=1e-6, what="MultiSteps")


@pytest.mark.parametrize("impl", ["xla", "kernel"])
def test_bf16_params_and_moment_dtypes(impl, kernel_impl):
    impl = kernel_impl if impl == "kernel" else impl
    p16 = _params(jnp.bfloat16, scale=0.01)  # small weights: bf16 can represent lr-sized steps on them
    # the SVD on both: on a flat-spectrum random gradient a randomized sketch of the bf16 and the fp32 gradient can
    # pick different subspaces, which is not what this compares
    tx = galore_adamw(1e-2, rank=RANK, update_proj_gap=GAP, weight_decay=0.1, projector="svd", implementation=impl)
    traj, state = _run(tx, p16, 4)
    assert all(v.dtype == jnp.bfloat16 for v in traj[-1].values())
    assert state.mu["w"].dtype == jnp.float32 and state.projector["w"].dtype == jnp.bfloat16
    p32 = {k: v.astype(jnp.float32) for k, v in p16.items()}
    traj32, _ = _run(galore_adamw(1e-2, rank=RANK, update_proj_gap=GAP, weight_decay=0.1, projector="svd",
                                  implementation="xla"),
                     p32, 4, grads_fn=lambda t, p: jax.tree.map(lambda x: x.astype(jnp.float32), _grads(t, p16)))
    for k in p16:
        delta16 = np.asarray(traj[-1][k], np.float32) - np.asarray(p16[k], np.float32)
        delta32 = np.asarray(traj32[-1][k]) - np.asarray(p32[k])
        assert np.linalg.norm(delta16 - delta32) <= 0.1 * np.linalg.norm(delta32), k
    tx = galore_adamw(1e-2, rank=RANK, mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16, implementation=impl)
    _, state = _run(tx, _params(), 2)
    assert state.mu["w"].dtype == jnp.bfloat16 and state.nu["w"].dtype == jnp.bfloat16
    assert np.all(np.isfinite(np.asarray(state.nu["w"], np.float32)))


def test_optax_convention_defaults_match_optax_contrib():
    # convention="optax" alone (scale and eps left to their defaults) gives optax.contrib.galore's numbers
    params = {k: v for k, v in _params().items() if k != "small"}
    ours = galore_adamw(1e-2, rank=RANK, update_proj_gap=GAP, convention="optax", implementation="xla")
    peer = optax.contrib.galore(1e-2, rank=RANK, update_proj_gap=GAP)
    a, _ = _run(ours, params, 3)
    b, _ = _run(peer, params, 3)
    for t in range(3):
        _assert_tree_close(a[t], b[t], rtol=2e-5, atol=2e-6, what=f"step {t}")
