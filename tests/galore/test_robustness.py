"""Bad arguments, non-finite gradients on a refresh step, and orbax checkpoint resume."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pallas_fused.galore import galore_adamw, galore_adamw_inplace, scale_by_galore_adam
from tests.galore.ref_impl import RefGaLoreAdamW
from tests.helpers import rand


def _params():
    return {"w": rand(0, (48, 80)), "u": rand(1, (80, 48)), "b": rand(2, (7,))}


def _grads(step):
    return {k: rand(1000 + 10 * step + i, p.shape) for i, (k, p) in enumerate(sorted(_params().items()))}


@pytest.mark.parametrize("kwargs,match", [
    (dict(rank=0), "rank"), (dict(rank=-3), "rank"), (dict(rank=2.5), "rank"), (dict(rank=True), "rank"),
    (dict(proj_type="middle"), "proj_type"), (dict(update_proj_gap=0), "update_proj_gap"),
    (dict(projector="qr"), "projector"), (dict(convention="torch"), "convention"),
    (dict(implementation="pallas:x"), "implementation"),
    (dict(implementation="cuda"), "implementation"),
])
def test_bad_arguments_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        galore_adamw(1e-3, **kwargs)
    with pytest.raises(ValueError, match=match):
        scale_by_galore_adam(**kwargs)


def _small_params():
    """2-D leaves whose smaller side is below, at and above rank 8, a one-row leaf, an empty one, a vector."""
    return {"w": rand(0, (24, 40)), "small": rand(1, (6, 40)), "square": rand(2, (8, 8)), "tall": rand(3, (40, 5)),
            "row": rand(4, (1, 7)), "empty": rand(5, (0, 5)), "b": rand(6, (7,))}


@pytest.mark.parametrize("impl", ["xla", "kernel"])
def test_rank_clamped_per_leaf(impl, kernel_impl):
    # Never a silent no-op: every 2-D leaf is projected, at rank min(rank, M, N) (optax.contrib.galore's and
    # galore-torch's rule); the numbers are the independent reference's, whose U[:, :r] / Vh[:r] clamp the same way
    impl = kernel_impl if impl == "kernel" else impl
    params = _small_params()
    tx = galore_adamw(1e-2, rank=8, update_proj_gap=2, weight_decay=0.1, projector="svd", implementation=impl)
    state = tx.init(params)
    shapes = {k: (state.projector[k].shape, state.mu[k].shape) for k in ("w", "small", "square", "tall", "row")}
    assert shapes == {"w": ((24, 8), (8, 40)), "small": ((6, 6), (6, 40)), "square": ((8, 8), (8, 8)),
                      "tall": ((5, 5), (40, 5)), "row": ((1, 1), (1, 7))}
    assert isinstance(state.projector["empty"], optax.MaskedNode) and isinstance(state.projector["b"], optax.MaskedNode)
    ref = RefGaLoreAdamW(1e-2, 8, 2, 0.25, wd=0.1)
    step = jax.jit(tx.update)
    p, q = params, {k: v for k, v in params.items() if k != "empty"}
    for t in range(3):
        g = {k: rand(50 + 10 * t + i, x.shape) for i, (k, x) in enumerate(sorted(params.items()))}
        u, state = step(g, state, p)
        p = optax.apply_updates(p, u)
        q = ref.step(q, g)
        assert p["empty"].shape == (0, 5)
        for k in q:
            np.testing.assert_allclose(p[k], q[k], rtol=2e-5, atol=2e-6, err_msg=f"step {t} leaf {k}")


def test_optax_convention_with_default_rank_matches_optax_contrib_on_small_leaves():
    params = {k: v for k, v in _small_params().items() if k != "empty"}
    ours, peer = galore_adamw(1e-2, convention="optax", implementation="xla"), optax.contrib.galore(1e-2)
    s_ours, s_peer, p, q = ours.init(params), peer.init(params), params, params
    for t in range(3):
        g = {k: rand(70 + 10 * t + i, x.shape) for i, (k, x) in enumerate(sorted(params.items()))}
        u, s_ours = jax.jit(ours.update)(g, s_ours, p)
        v, s_peer = jax.jit(peer.update)(g, s_peer, q)
        p, q = optax.apply_updates(p, u), optax.apply_updates(q, v)
        for k in params:
            np.testing.assert_allclose(p[k], q[k], rtol=2e-5, atol=2e-6, err_msg=f"step {t} leaf {k}")


def test_leaves_that_cannot_be_projected():
    params = dict(_params(), qkv=rand(3, (16, 4, 8)))
    # the default mask projects the 2-D leaves only: the 3-D one steps as plain Adam(W)
    tx = galore_adamw(1e-2, rank=4, implementation="xla")
    state = tx.init(params)
    assert isinstance(state.projector["qkv"], optax.MaskedNode) and state.mu["qkv"].shape == (16, 4, 8)
    u, _ = jax.jit(tx.update)(jax.tree.map(lambda x: x * 0.5 + 1, params), state, params)
    assert np.all(np.isfinite(np.asarray(u["qkv"]))) and np.all(np.asarray(u["qkv"]) != 0)
    # selected by `mask`, an N-D leaf (optax's weight_dimension_numbers) or a vector is refused, naming the leaf,
    # its shape and the alternatives
    for leaf, shape in (("qkv", (16, 4, 8)), ("b", (7,))):
        mask = {k: k in ("w", leaf) for k in params}
        with pytest.raises(ValueError, match=re.escape(f"leaf ['{leaf}'] has shape {shape}") + r".*2-D.*`mask`"):
            galore_adamw(1e-2, rank=4, mask=mask).init(params)


def test_params_required_for_weight_decay():
    tx = galore_adamw(1e-3, rank=8, weight_decay=0.1, implementation="xla")
    with pytest.raises(ValueError, match="params"):
        tx.update(_grads(0), tx.init(_params()))


@pytest.mark.parametrize("projector", ["svd", "randomized"])
def test_nonfinite_gradient_on_refresh_keeps_projector_and_moments(projector, kernel_impl):
    impl = "xla" if projector == "randomized" else kernel_impl
    tx = galore_adamw(1e-2, rank=8, update_proj_gap=2, weight_decay=0.1, projector=projector, implementation=impl)
    params = _params()
    state = tx.init(params)
    upd = jax.jit(tx.update)
    u, state = upd(_grads(0), state, params)
    params = optax.apply_updates(params, u)
    u, state = upd(_grads(1), state, params)
    params = optax.apply_updates(params, u)
    bad = _grads(2)
    bad["w"] = bad["w"].at[5, 7].set(jnp.inf)
    u, new = upd(bad, state, params)  # step 2: a refresh step
    np.testing.assert_array_equal(new.projector["w"], state.projector["w"])
    np.testing.assert_array_equal(new.mu["w"], state.mu["w"])
    np.testing.assert_array_equal(new.nu["w"], state.nu["w"])
    np.testing.assert_array_equal(u["w"], jnp.zeros_like(u["w"]))  # skipped, weight decay included
    assert np.all(np.isfinite(u["u"])) and np.all(np.isfinite(u["b"]))
    assert not np.array_equal(new.projector["u"], state.projector["u"])  # the finite leaf refreshed
    assert bool(new.pending_refresh)
    params = optax.apply_updates(params, u)
    u, newer = upd(_grads(3), new, params)  # step 3 is not a multiple of the gap but refreshes (pending)
    assert not bool(newer.pending_refresh)
    assert not np.array_equal(newer.projector["w"], new.projector["w"])
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves((u, newer)))


def test_nonfinite_first_refresh_retries_next_step():
    tx = galore_adamw(1e-2, rank=8, update_proj_gap=100, implementation="xla")
    params = _params()
    bad = _grads(0)
    bad["u"] = bad["u"].at[0, 0].set(jnp.nan)
    upd = jax.jit(tx.update)
    u, state = upd(bad, tx.init(params), params)
    assert np.all(np.asarray(state.projector["u"]) == 0) and bool(state.pending_refresh)
    u, state = upd(_grads(1), state, params)
    assert np.any(np.asarray(state.projector["u"]) != 0) and not bool(state.pending_refresh)


@pytest.mark.parametrize("projector", ["svd", "randomized"])
def test_orbax_checkpoint_resume_is_bit_identical(tmp_path, projector):
    import orbax.checkpoint as ocp

    opt = galore_adamw_inplace(1e-2, rank=8, update_proj_gap=3, weight_decay=0.1, projector=projector,
                               implementation="xla")
    step = jax.jit(opt.step)
    params = _params()
    state = opt.init(params)
    for t in range(4):
        params, state = step(params, _grads(t), state)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "ckpt", {"params": params, "state": state})
    ckpt.wait_until_finished()
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "state": state})
    restored = ckpt.restore(tmp_path / "ckpt", abstract)
    a, b = (params, state), (restored["params"], restored["state"])
    for t in range(4, 8):  # crosses the refresh at step 6
        a = step(a[0], _grads(t), a[1])
        b = step(b[0], _grads(t), b[1])
    jax.tree.map(np.testing.assert_array_equal, a, b)


@pytest.mark.parametrize("convention", ["galore", "optax"])
@pytest.mark.parametrize("projector", ["svd", "randomized"])
@pytest.mark.parametrize("implementation", [None, "interpret"])
def test_nonfinite_gradient_between_refreshes_skips_projected_leaf(convention, projector, implementation):
    # One bad element per leaf on step 1 (not a refresh: gap 50): "w" (48, 80) is projected on the left, "u"
    # (80, 48) on the right, "b" is plain Adam. Both paths (optax update, in-place step) under jit.
    kw = dict(rank=8, update_proj_gap=50, weight_decay=0.1, projector=projector, convention=convention,
              implementation=implementation)
    tx, opt = galore_adamw(1e-2, **kw), galore_adamw_inplace(1e-2, **kw)
    upd, step = jax.jit(tx.update), jax.jit(opt.step)
    params = _params()
    state = tx.init(params)
    u, state = upd(_grads(0), state, params)
    params = optax.apply_updates(params, u)
    bad = _grads(1)
    bad["w"] = bad["w"].at[5, 7].set(jnp.nan)
    bad["u"] = bad["u"].at[3, 2].set(jnp.inf)
    bad["b"] = bad["b"].at[4].set(jnp.nan)
    u, new = upd(bad, state, params)
    p_in, new_in = step(params, bad, state)
    for k in ("w", "u"):
        np.testing.assert_array_equal(u[k], jnp.zeros_like(u[k]))
        np.testing.assert_array_equal(p_in[k], params[k])
        for s in (new, new_in):
            for field in ("mu", "nu", "projector"):
                np.testing.assert_array_equal(getattr(s, field)[k], getattr(state, field)[k])
    # the plain-Adam leaf skips the bad element only
    assert u["b"][4] == 0 and p_in["b"][4] == params["b"][4]
    assert np.all(np.asarray(u["b"]).nonzero()[0] == np.array([0, 1, 2, 3, 5, 6]))
    assert int(new.count) == 2 and not bool(new.pending_refresh)
    # the next finite step moves every leaf and stays finite
    params = optax.apply_updates(params, u)
    u, newer = upd(_grads(2), new, params)
    p_in2, newer_in = step(p_in, _grads(2), new_in)
    for tree in (u, newer, p_in2, newer_in):
        assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(tree))
    assert all(np.all(np.asarray(x) != 0) for x in jax.tree.leaves(u))


def test_wrong_gradient_names_the_leaf_and_shapes():
    params = _params()
    tx = galore_adamw(1e-3, rank=8, implementation="xla")
    state = tx.init(params)
    for k, shape in (("w", (48, 40)), ("u", (80, 40)), ("b", (5,))):
        g = dict(_grads(0), **{k: rand(9, shape)})
        with pytest.raises(ValueError, match=re.escape(f"['{k}'] has shape {shape}, expected {params[k].shape}")):
            tx.update(g, state, params)
    g = _grads(0)
    del g["b"]
    with pytest.raises(ValueError, match=r"does not match.*expected .*'b'.*got"):
        tx.update(g, state, params)
    # leaves projected at a clamped (full) rank: the expected shape is read off the state all the same
    params = _small_params()
    state = tx.init(params)
    for k in ("small", "square", "tall", "row"):
        shape = params[k].shape
        g = {n: rand(9, (shape[1], shape[0]) if n == k else x.shape) for n, x in params.items()}
        if k == "square":
            g[k] = rand(9, (8, 9))
        with pytest.raises(ValueError, match=re.escape(f"['{k}'] has shape {g[k].shape}, expected {shape}")):
            tx.update(g, state, params)


def test_weight_decay_mask_bool_prefix():
    params = _params()
    for flag in (True, False):
        tx = galore_adamw(1e-2, rank=8, weight_decay=0.5, weight_decay_mask=flag, implementation="xla")
        ref = galore_adamw(1e-2, rank=8, weight_decay=0.5, weight_decay_mask={k: flag for k in params},
                           implementation="xla")
        u, _ = tx.update(_grads(0), tx.init(params), params)
        r, _ = ref.update(_grads(0), ref.init(params), params)
        for k in params:
            np.testing.assert_array_equal(u[k], r[k])


def test_state_shardings_of_empty_params():
    """No params, no mesh to read from them: a ValueError that says to pass mesh=, and with it the flags' sharding."""
    from jax.sharding import NamedSharding, PartitionSpec

    from pallas_fused.galore import galore_adamw, state_shardings

    state = galore_adamw(1e-3).init({})
    with pytest.raises(ValueError, match="mesh="):
        state_shardings(state, {})
    mesh = jax.make_mesh((1,), ("data",))
    assert state_shardings(state, {}, mesh=mesh).count == NamedSharding(mesh, PartitionSpec())


def _bits(x):
    a = np.asarray(x)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _impl(implementation, kernel_impl):
    """"xla", or the Pallas kernels as they run here ("kernel", "kernel:<variant>")."""
    return implementation.replace("kernel", kernel_impl)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("implementation", ["xla", "kernel", "kernel:hybrid", "kernel:xla_up"])
def test_nonfinite_step_leaves_moments_and_params_bit_identical(implementation, dtype, kernel_impl):
    # A NaN / inf in each projected gradient between refreshes: the in-place step writes W (-0.0 entries included)
    # and the moments back bit for bit, and the optax path keeps the moments bit for bit with a zero update.
    kw = dict(rank=8, update_proj_gap=50, weight_decay=0.1, projector="svd",
              implementation=_impl(implementation, kernel_impl))
    tx, opt = galore_adamw(1e-2, **kw), galore_adamw_inplace(1e-2, **kw)
    params = {k: v.astype(dtype) for k, v in _params().items()}
    state = opt.init(params)
    params, state = jax.jit(opt.step)(params, {k: v.astype(dtype) for k, v in _grads(0).items()}, state)
    params = {**params, "w": params["w"].at[0, :3].set(-0.0), "u": params["u"].at[1, 2].set(-0.0)}
    bad = {k: v.astype(dtype) for k, v in _grads(1).items()}
    bad["w"] = bad["w"].at[5, 7].set(jnp.nan)
    bad["u"] = bad["u"].at[3, 2].set(jnp.inf)
    keep_p, keep_s = jax.tree.map(jnp.copy, (params, state))
    u, new = jax.jit(tx.update)(bad, state, params)
    p_in, new_in = jax.jit(opt.step, donate_argnums=(0, 2))(params, bad, state)
    for k in ("w", "u"):
        np.testing.assert_array_equal(_bits(p_in[k]), _bits(keep_p[k]))
        np.testing.assert_array_equal(np.asarray(u[k], np.float32), 0)
        for s in (new, new_in):
            for field in ("mu", "nu", "projector"):
                np.testing.assert_array_equal(_bits(getattr(s, field)[k]), _bits(getattr(keep_s, field)[k]))
    assert int(new_in.count) == 2 and not bool(new_in.pending_refresh)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("implementation", ["xla", "kernel", "kernel:hybrid", "kernel:xla_up"])
def test_finite_step_matches_reference_step(implementation, dtype, kernel_impl):
    # A finite step between refreshes gives reference.galore_adam_step's W and moments (its selects on ok = 1 are
    # the step as it was before the skip became a flag), in place and through optax
    from pallas_fused.galore import reference

    lr, wd, scale, eps, b1, b2 = 1e-2, 0.1, 0.25, 1e-6, 0.9, 0.999
    kw = dict(rank=8, update_proj_gap=50, weight_decay=wd, scale=scale, eps=eps, projector="svd",
              implementation=_impl(implementation, kernel_impl))
    tx, opt = galore_adamw(lr, **kw), galore_adamw_inplace(lr, **kw)
    params = {k: v.astype(dtype) for k, v in _params().items()}
    params, state = jax.jit(opt.step)(params, {k: v.astype(dtype) for k, v in _grads(0).items()}, opt.init(params))
    g = {k: v.astype(dtype) for k, v in _grads(1).items()}
    u, new = jax.jit(tx.update)(g, state, params)
    p_tx = optax.apply_updates(params, u)
    p_in, new_in = jax.jit(opt.step)(params, g, state)
    t = 2.0
    sc = reference.Scalars(*(jnp.asarray(x, jnp.float32) for x in (
        b1, b2, eps, 1.0, 1.0, -lr * wd, -lr * scale * np.sqrt(1 - b2**t) / (1 - b1**t), 1.0)))
    for k in ("w", "u"):
        side = reference.projector_side(params[k].shape, "std")
        want, m, v = reference.galore_adam_step(params[k], g[k], state.mu[k], state.nu[k], state.projector[k], side,
                                                sc, inplace=True, precision=jax.lax.Precision.HIGHEST)
        delta = np.asarray(want, np.float32) - np.asarray(params[k], np.float32)
        for got_p, s in ((p_in, new_in), (p_tx, new)):
            if dtype == jnp.float32:  # the step's change, within a few ulps of W
                got = np.asarray(got_p[k], np.float32) - np.asarray(params[k], np.float32)
                np.testing.assert_allclose(got, delta, rtol=1e-4, atol=1e-6, err_msg=k)
            else:  # W rounded to bf16: one bf16 ulp from the reference's (of the update, near zero)
                np.testing.assert_allclose(np.asarray(got_p[k], np.float32), np.asarray(want, np.float32),
                                           rtol=2.0**-7, atol=2.0**-7 * np.abs(delta).max(), err_msg=k)
            np.testing.assert_allclose(s.mu[k], m, rtol=1e-5, atol=1e-9, err_msg=k)
            np.testing.assert_allclose(s.nu[k], v, rtol=1e-5, atol=1e-12, err_msg=k)


def _selects_outside_kernels(jaxpr, shapes, found):
    """The select_n ops of `jaxpr` (nested jaxprs but Pallas kernels' and the refresh conditional's included) whose
    output has one of `shapes`."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("pallas_call", "cond"):
            continue
        for v in eqn.params.values():
            for j in v if isinstance(v, (tuple, list)) else [v]:
                j = getattr(j, "jaxpr", j)
                if hasattr(j, "eqns"):
                    _selects_outside_kernels(j, shapes, found)
        if eqn.primitive.name == "select_n" and eqn.outvars[0].aval.shape in shapes:
            found.append(eqn.outvars[0].aval.shape)
    return found


@pytest.mark.parametrize("inplace", [False, True])
def test_kernel_skip_selects_nothing_of_size_outside_kernels(inplace, kernel_impl):
    # The skip is a flag in the kernels' scalars: no select between old and new moments (which would keep a copy of
    # the moments the kernel writes in place) or over W happens outside the kernels.
    params = {"w": jax.ShapeDtypeStruct((48, 80), jnp.float32), "u": jax.ShapeDtypeStruct((80, 48), jnp.float32)}
    kw = dict(rank=8, weight_decay=0.1, implementation=f"{kernel_impl}:hybrid")
    if inplace:
        opt = galore_adamw_inplace(1e-2, **kw)
        fn, init = (lambda p, g, s: opt.step(p, g, s)), opt.init
    else:
        tx = galore_adamw(1e-2, **kw)
        fn, init = (lambda p, g, s: optax.apply_updates(p, tx.update(g, s, p)[0])), tx.init
    jaxpr = jax.make_jaxpr(fn)(params, params, jax.eval_shape(init, params)).jaxpr
    shapes = {(48, 80), (80, 48), (8, 80), (80, 8), (8 * 80,)}
    assert _selects_outside_kernels(jaxpr, shapes, []) == []
