"""The path users run: `jit(tx.update -> optax.apply_updates)`, params and state donated, no weight-decay
term (XLA's graph for every projected leaf): its values, its non-finite skip, and the ops it runs on full-size
arrays."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pallas_fused.galore import galore_adamw
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
