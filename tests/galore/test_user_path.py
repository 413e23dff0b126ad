"""The path users run: `jit(tx.update -> optax.apply_updates)`, params and state donated, no weight-decay
term (XLA's graph for every projected leaf): its values, its non-finite skip, and the ops it runs on full-size
arrays."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pallas_fused.galore import galore_adamw, galore_adamw_inplace
from tests.galore.ref_impl import RefGaLoreAdamW
from tests.helpers import rand

RANK, GAP = 8, 3


def _params(dtype):
    # "w" (48, 80) and "u" (80, 48) are projected on opposite sides under each convention; "b" is plain Adam
    return {"w": rand(0, (48, 80), dtype, 0.01), "u": rand(1, (80, 48), dtype, 0.01), "b": rand(2, (7,), dtype, 0.01)}


def _grads(t, params):
    return {k: rand(100 * t + i, p.shape, p.dtype) for i, (k, p) in enumerate(sorted(params.items()))}


def _user_step(tx):
    def step(params, grads, state):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return jax.jit(step, donate_argnums=(0, 2))


def _tx(convention, **kw):
    return galore_adamw(1e-2, rank=RANK, update_proj_gap=GAP, scale=0.25, eps=1e-8, projector="svd",
                        convention=convention, **kw)


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("convention", ["galore", "optax"])
def test_user_path_matches_reference(convention, dtype):
    # five steps across the refresh at step 3, against the independent reference (convention "galore") or
    # optax.contrib.galore ("optax") in fp32; bf16 params move as the fp32 ones do, within the rounding of bf16
    # GEMM operands and updates
    params = _params(dtype)
    tx = _tx(convention)
    step = _user_step(tx)
    p, s = _copy(params), tx.init(params)
    p32 = {k: v.astype(jnp.float32) for k, v in params.items()}
    if convention == "galore":
        ref = RefGaLoreAdamW(1e-2, RANK, GAP, 0.25, eps=1e-8)
        ref_step = lambda q, g: ref.step(q, g)
    else:
        peer = optax.contrib.galore(1e-2, rank=RANK, update_proj_gap=GAP, scale=0.25)
        peer_state = [peer.init(p32)]

        def ref_step(q, g):
            u, peer_state[0] = jax.jit(peer.update)(g, peer_state[0], q)
            return optax.apply_updates(q, u)
    q = p32
    for t in range(5):
        g = _grads(t, params)
        p, s = step(p, _copy(g), s)
        q = ref_step(q, {k: v.astype(jnp.float32) for k, v in g.items()})
        for k in params:
            assert p[k].dtype == dtype
            got = np.asarray(p[k], np.float32) - np.asarray(params[k], np.float32)
            want = np.asarray(q[k]) - np.asarray(p32[k])
            if dtype == jnp.float32:
                np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-7, err_msg=f"step {t} leaf {k}")
            else:
                assert np.linalg.norm(got - want) <= 0.05 * np.linalg.norm(want), (t, k)
    assert int(s.count) == 5 and not bool(s.pending_refresh)


def _zero_where_it_meets(proj, i, j):
    """The projector with zeros at the entries that multiply G[i, j] in the down-projection: row i of P (M, r) on
    side left (R = P^T G), column j of P (r, N) on side right (R = G P^T)."""
    left = proj.shape[1] == RANK and proj.shape[0] != RANK
    return proj.at[i, :].set(0) if left else proj.at[:, j].set(0)


@pytest.mark.parametrize("bad", ["nan", "inf", "inf_times_zero"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("convention", ["galore", "optax"])
def test_user_path_skips_nonfinite_gradient(convention, dtype, bad):
    # Between refreshes (step 1, gap 50) one bad element in each projected leaf's gradient: the projected leaves keep
    # their params, moments and projector (the check reads the low-rank moments only, never G again), the plain-Adam
    # leaf moves. "inf_times_zero": the inf meets only zeros of the projector, so every product it enters is
    # 0 * inf = NaN: the low-rank gradient is still not finite.
    params = _params(dtype)
    tx = galore_adamw(1e-2, rank=RANK, update_proj_gap=50, convention=convention, projector="svd")
    step = _user_step(tx)
    p, s = step(_copy(params), _grads(0, params), tx.init(params))
    where = {"w": (5, 7), "u": (3, 2)}
    if bad == "inf_times_zero":
        s = s._replace(projector={**s.projector, **{k: _zero_where_it_meets(s.projector[k], *ij)
                                                  for k, ij in where.items()}})
    g = _grads(1, params)
    for k, (i, j) in where.items():
        g[k] = g[k].at[i, j].set(jnp.nan if bad == "nan" else jnp.inf)
    before_p, before_s = _copy(p), _copy(s)
    p, s = step(p, g, s)
    for k in where:
        np.testing.assert_array_equal(p[k], before_p[k])
        for field in ("mu", "nu", "projector"):
            np.testing.assert_array_equal(getattr(s, field)[k], getattr(before_s, field)[k])
    assert np.all(np.asarray(p["b"], np.float32) != np.asarray(before_p["b"], np.float32))
    assert int(s.count) == 2 and not bool(s.pending_refresh)
    # the next finite step moves every leaf and keeps everything finite
    moved, s = step(_copy(p), _grads(2, params), s)
    for k in params:
        assert np.all(np.isfinite(np.asarray(moved[k], np.float32)))
        assert np.any(np.asarray(moved[k], np.float32) != np.asarray(p[k], np.float32)), k
    assert all(np.all(np.isfinite(np.asarray(x, np.float32))) for x in jax.tree.leaves((s.mu, s.nu)))


def _ops_outside_cond(jaxpr, shape, found):
    """(primitive, whether it reads or writes an array of `shape`) for every op outside the refresh conditional's
    branches, nested jaxprs (jit, custom_vjp) flattened."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "cond":
            continue
        inner = [getattr(v, "jaxpr", v) for v in eqn.params.values()]
        inner = [j for j in inner if hasattr(j, "eqns")]
        for j in inner:
            _ops_outside_cond(j, shape, found)
        if not inner:
            avals = [v.aval for v in (*eqn.invars, *eqn.outvars) if hasattr(v, "aval")]
            found.append((eqn.primitive.name, any(getattr(a, "shape", None) == shape for a in avals)))
    return found


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("convention", ["galore", "optax"])
def test_user_path_full_size_work_is_two_gemms_and_the_add(convention, dtype):
    # Between refreshes the step's only work on (M, N) arrays is the down-projection GEMM (G read once: the skip tests
    # the low-rank moments), the up-projection GEMM whose output is the update itself (lr, scale, bias correction and
    # the skip folded into the small N), and apply_updates' add, which XLA:GPU folds into that GEMM (beta = 1). The
    # projector refresh's random key is hashed inside the refresh branch only, and the other branch runs nothing.
    params = {"w": jax.ShapeDtypeStruct((48, 80), dtype)}
    tx = galore_adamw(1e-2, rank=RANK, convention=convention)

    def step(p, g, s):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    jaxpr = jax.make_jaxpr(step)(params, params, jax.eval_shape(tx.init, params)).jaxpr
    ops = _ops_outside_cond(jaxpr, (48, 80), [])
    assert sorted(name for name, full in ops if full) == ["add", "dot_general", "dot_general"], ops
    names = {name for name, _ in ops}
    assert not names & {"random_fold_in", "threefry2x32", "random_bits", "random_wrap", "random_seed"}, names
    # one conditional, whose branch not taken between refreshes only passes its operands through
    conds = [e for e in jaxpr.eqns if e.primitive.name == "cond"]
    keep = conds[0].params["branches"][0].jaxpr if len(conds) == 1 else None
    assert keep is not None and not keep.eqns and all(any(v is i for i in keep.invars) for v in keep.outvars)


def _prims(jaxpr, found):
    """Every primitive's name in `jaxpr`, nested jaxprs included."""
    for eqn in jaxpr.eqns:
        found.add(eqn.primitive.name)
        for v in eqn.params.values():
            for j in v if isinstance(v, (tuple, list)) else [v]:
                j = getattr(j, "jaxpr", j)
                if hasattr(j, "eqns"):
                    _prims(j, found)
    return found


@pytest.mark.parametrize("api", ["chain", "inplace"])
@pytest.mark.parametrize("convention", ["galore", "optax"])
def test_host_refresh_matches_device_schedule(convention, api):
    # refresh=t % GAP == 0 from the host (static: two compiled steps, no conditional) gives the device schedule's
    # params and state, bit for bit, through optax.chain (which hands the extra argument on) and the in-place step
    params = _params(jnp.float32)
    kw = dict(rank=RANK, update_proj_gap=GAP, scale=0.25, eps=1e-8, convention=convention, weight_decay=0.01)
    if api == "chain":
        tx = optax.chain(optax.clip_by_global_norm(10.0), galore_adamw(1e-2, **kw))

        def step(p, g, s, refresh=None):
            u, s = tx.update(g, s, p, refresh=refresh)
            return optax.apply_updates(p, u), s
        init = tx.init
    else:
        opt = galore_adamw_inplace(1e-2, **kw)
        step, init = opt.step, opt.init
    device = jax.jit(step)
    host = jax.jit(step, static_argnames="refresh")
    a, sa = _copy(params), init(params)
    b, sb = _copy(params), init(params)
    for t in range(7):
        g = _grads(t, params)
        a, sa = device(a, g, sa)
        b, sb = host(b, g, sb, refresh=t % GAP == 0)
        for x, y in zip(jax.tree.leaves((a, sa)), jax.tree.leaves((b, sb))):
            np.testing.assert_array_equal(x, y, err_msg=f"step {t}")
    # the step given refresh=False has no conditional (nothing to read back); the device's schedule has one
    shapes = jax.eval_shape(init, params)
    assert "cond" not in _prims(jax.make_jaxpr(functools.partial(step, refresh=False))(params, params, shapes).jaxpr,
                                set())
    assert "cond" in _prims(jax.make_jaxpr(step)(params, params, shapes).jaxpr, set())


def test_host_refresh_leaves_a_failed_refresh_pending():
    # a refresh that saw a non-finite gradient keeps that leaf's projector and sets pending_refresh; under the host's
    # schedule only the next refresh=True clears it (steps in between use the kept projector and move every leaf)
    params = _params(jnp.float32)
    tx = galore_adamw(1e-2, rank=RANK, update_proj_gap=GAP)

    def step(p, g, s, refresh):
        u, s = tx.update(g, s, p, refresh=refresh)
        return optax.apply_updates(p, u), s
    step = jax.jit(step, static_argnames="refresh")
    p, s = step(_copy(params), _grads(0, params), tx.init(params), refresh=True)
    bad = _grads(1, params)
    bad["w"] = bad["w"].at[0, 0].set(jnp.nan)
    kept = s.projector["w"]
    p, s = step(p, bad, s, refresh=True)
    np.testing.assert_array_equal(s.projector["w"], kept)
    assert bool(s.pending_refresh)
    before = _copy(p)
    p, s = step(p, _grads(2, params), s, refresh=False)
    assert bool(s.pending_refresh)
    assert all(np.any(np.asarray(p[k]) != np.asarray(before[k])) for k in params)
    p, s = step(p, _grads(3, params), s, refresh=True)
    assert not bool(s.pending_refresh)
    assert np.any(np.asarray(s.projector["w"]) != np.asarray(kept))


@pytest.mark.parametrize("refresh", [1, "yes", jnp.ones((2,), jnp.bool_)])
def test_host_refresh_rejects_non_bool(refresh):
    params = _params(jnp.float32)
    tx = galore_adamw(1e-2, rank=RANK)
    with pytest.raises(ValueError, match="refresh must be None or a bool"):
        tx.update(params, tx.init(params), params, refresh=refresh)


def test_host_refresh_traced_is_a_clear_error():
    params = _params(jnp.float32)
    tx = galore_adamw(1e-2, rank=RANK)
    with pytest.raises(ValueError, match="refresh must be known when the step is traced.*static_argnames"):
        jax.jit(lambda g, s, r: tx.update(g, s, params, refresh=r))(params, tx.init(params), True)


def test_host_refresh_through_inject_hyperparams():
    # optax.inject_hyperparams hands update's extra arguments to the inner transform: the host's schedule works there
    params = _params(jnp.float32)
    tx = optax.inject_hyperparams(galore_adamw)(learning_rate=1e-2, rank=RANK, update_proj_gap=GAP)
    state = tx.init(params)
    step = jax.jit(lambda g, s, refresh: tx.update(g, s, params, refresh=refresh), static_argnames="refresh")
    _, s1 = step(_grads(0, params), state, refresh=True)
    _, s2 = step(_grads(1, params), s1, refresh=False)
    assert np.any(np.asarray(s1.inner_state.projector["w"]) != 0)
    np.testing.assert_array_equal(s2.inner_state.projector["w"], s1.inner_state.projector["w"])
    jaxpr = jax.make_jaxpr(lambda g, s: tx.update(g, s, params, refresh=False))(params, state).jaxpr
    assert "cond" not in _prims(jaxpr, set())
