"""A model's tree through GaLore: the refresh runs one loop per group of leaves of one shape, dtype and side
(`_GaLore._refresh_all`); its updates and state are the per-leaf refresh's, bit for bit."""

import contextlib
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pallas_fused.galore import api


def _per_leaf_refresh_all(self, flat_g, flat_p, sides, key):
    """The refresh leaf by leaf, each with its own code (what the grouped loop replaces)."""
    return {i: self._refresh(*self._finite_grad(flat_g[i]), flat_p[i], side, jax.random.fold_in(key, i))
            for i, side in sides.items()}


def _refresh_code(grouped: bool):
    """A context: the package's grouped refresh, or the per-leaf one in its place."""
    if grouped:
        return contextlib.nullcontext()
    return mock.patch.object(api._GaLore, "_refresh_all", _per_leaf_refresh_all)


# repeated shapes (two groups of three fp32 matrices, one per side), a bf16 group of the same shape as an fp32 one,
# a leaf of its own, a vector and a scalar-sized leaf that GaLore leaves to plain Adam(W)
SHAPES = {"q0": ((24, 40), jnp.float32), "q1": ((24, 40), jnp.float32), "q2": ((24, 40), jnp.float32),
          "d0": ((40, 24), jnp.float32), "d1": ((40, 24), jnp.float32), "d2": ((40, 24), jnp.float32),
          "h0": ((24, 40), jnp.bfloat16), "h1": ((24, 40), jnp.bfloat16), "lone": ((16, 48), jnp.float32),
          "norm": ((40,), jnp.float32), "bias": ((1,), jnp.float32)}


def _tree(seed, nan_leaf=None):
    keys = jax.random.split(jax.random.key(seed), len(SHAPES))
    tree = {k: jax.random.normal(kk, s, jnp.float32).astype(d) for kk, (k, (s, d)) in zip(keys, SHAPES.items())}
    if nan_leaf is not None:
        tree[nan_leaf] = tree[nan_leaf].at[1, 2].set(jnp.nan)
    return tree


def _run(tx, steps, grouped: bool, nan_at=None):
    """`steps` jitted update -> apply_updates steps (update_proj_gap 2: refreshes at steps 0 and 2), the gradient of
    leaf "q1" non-finite at step `nan_at`; returns every step's updates and the final params and state."""
    params = _tree(0)
    with _refresh_code(grouped):
        state = tx.init(params)
        step = jax.jit(lambda p, g, s: tx.update(g, s, p))
        history = []
        for t in range(steps):
            u, state = step(params, _tree(10 + t, "q1" if t == nan_at else None), state)
            params = optax.apply_updates(params, u)
            history.append(u)
    return history, params, state


def test_grouped_refresh_inplace_step():
    """galore_adamw_inplace's step runs the same grouped refresh: bit-identical to leaf by leaf."""
    opt = api.galore_adamw_inplace(1e-2, rank=8, update_proj_gap=2, weight_decay=0.01, implementation="xla")

    def run(grouped):
        params = _tree(0)
        with _refresh_code(grouped):
            state = opt.init(params)
            step = jax.jit(opt.step)
            for t in range(3):
                params, state = step(params, _tree(10 + t), state)
        return params, state

    _assert_identical(run(True), run(False))


def _assert_identical(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32)),
                 a, b, is_leaf=lambda x: isinstance(x, optax.MaskedNode))


@pytest.mark.parametrize("projector", ["randomized", "svd"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_grouped_refresh_is_the_per_leaf_refresh(projector, weight_decay):
    tx = api.galore_adamw(1e-2, rank=8, update_proj_gap=2, weight_decay=weight_decay, projector=projector,
                          implementation="xla")
    got, want = _run(tx, 4, True), _run(tx, 4, False)
    _assert_identical(got, want)
    # and a real update: every leaf moved, the projectors are set
    for k, u in got[0][-1].items():
        assert float(jnp.max(jnp.abs(u.astype(jnp.float32)))) > 0, k
    for k, p in got[2].projector.items():
        if not isinstance(p, optax.MaskedNode):
            assert float(jnp.max(jnp.abs(p.astype(jnp.float32)))) > 0, k


def test_grouped_refresh_non_finite_leaf():
    """A non-finite gradient in one leaf of a group at a refresh: that leaf keeps its (zero) projector and skips its
    step, the others of its group refresh, and the next step refreshes every projector (pending_refresh), as leaf by
    leaf."""
    tx = api.galore_adamw(1e-2, rank=8, update_proj_gap=4, implementation="xla")
    got, want = _run(tx, 3, True, nan_at=0), _run(tx, 3, False, nan_at=0)
    _assert_identical(got, want)
    first = got[0][0]
    assert float(jnp.max(jnp.abs(first["q1"]))) == 0 and float(jnp.max(jnp.abs(first["q0"]))) > 0


def test_refresh_code_grows_with_groups_not_leaves():
    """One copy of the refresh per group: the traced step holds one eigh (the range finder's last step) per group
    of leaves of one shape, dtype and side (4 in SHAPES for 9 projected leaves), and one loop (a fori_loop of static
    trip count: a scan) per group of two or more."""
    tx = api.galore_adamw(1e-2, rank=8, implementation="xla")
    params = _tree(0)
    state = tx.init(params)
    counts = {"eigh": 0, "scan": 0}

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in counts:
                counts[eqn.primitive.name] += 1
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(lambda g, s, p: tx.update(g, s, p, refresh=True))(params, state, params).jaxpr)
    assert counts == {"eigh": 4, "scan": 3}
