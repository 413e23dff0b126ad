"""optax's conformance suite for contributed optimizers, run against ours.

Adapted from optax/contrib/_common_test.py (optax 0.2.8, Copyright 2023 DeepMind Technologies Limited,
Apache License 2.0, http://www.apache.org/licenses/LICENSE-2.0): the same cases (extra update arguments, no
recompilation, tree_map_params, convergence on its targets, inject_hyperparams, dtype preservation, MultiSteps,
state dtype stability under lax.cond, learning-rate schedules), in pytest form, with optax's optimizer list
replaced by ours. Changes: the wrappers and the base-optimizer list (which test optax's own wrappers) are left
out; a larger matrix target is added so that the 8-bit states are quantized (optax's targets have a handful of
elements, below adam's MIN_QUANTIZED_SIZE) and GaLore projects below full rank; the optimization runs 3000
steps instead of 30000 (every optimizer here is an Adam: it converges well within that; CPU CI budget).
"""

from __future__ import annotations

import inspect
import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pallas_fused import optim

OPTIMIZERS = [
    ("galore_adamw", optim.galore_adamw, {"learning_rate": 1e-2, "rank": 8}),
    ("galore_adam", optim.galore_adam, {"learning_rate": 1e-2, "rank": 8}),
    ("adamw", optim.adamw, {"learning_rate": 1e-2}),
    ("adamw_8bit", optim.adamw, {"learning_rate": 1e-2, "state_bits": 8}),
]
IDS = [name for name, _, _ in OPTIMIZERS]
# optax's list of hyperparameters that cannot be injected (they set the state's structure), plus ours:
# `state_bits` chooses the 8-bit or the float moment layout at init, as `rank` sets GaLore's shapes.
UNINJECTABLE = ("warmup_steps", "num_betas", "clip_value_fn", "ns_steps", "rank", "update_proj_gap", "state_bits")
STEPS = 3000


def _setup_parabola(dtype):
    initial_params = jnp.array([-1.0, 10.0, 1.0], dtype=dtype)
    final_params = jnp.array([1.0, -1.0, 1.0], dtype=dtype)

    def obj_fn(params):
        return jnp.sum(jnp.square(params - final_params))

    return initial_params, final_params, obj_fn


def _setup_rosenbrock(dtype):
    a, b = 1.0, 100.0
    initial_params = jnp.array([0.0, 0.0], dtype=dtype)
    final_params = jnp.array([a, a**2], dtype=dtype)

    def obj_fn(params):
        return jnp.square(a - params[0]) + b * jnp.square(params[1] - params[0] ** 2)

    return initial_params, final_params, obj_fn


def _setup_matrix_parabola(dtype):
    initial_params = jnp.zeros((2, 2), dtype=dtype)
    final_params = jnp.array([[3.0, -2.0], [1.0, 4.0]], dtype=dtype)

    def obj_fn(params):
        return jnp.sum(jnp.square(params - final_params))

    return initial_params, final_params, obj_fn


def _setup_mixed_tensor_target(dtype):
    initial_params = (jnp.zeros((3,), dtype=dtype), jnp.zeros((2, 2), dtype=dtype))
    final_params = (jnp.array([1.0, -1.0, 2.0], dtype=dtype), jnp.array([[1.0, 0.0], [-1.0, 1.0]], dtype=dtype))

    def obj_fn(params):
        return sum(jnp.sum(jnp.square(p - f)) for p, f in zip(params, final_params))

    return initial_params, final_params, obj_fn


def _setup_large_matrix_parabola(dtype):
    """Ours: a (64, 80) target of rank 4 (GaLore's rank-8 projection can reach it) with 5120 elements (8-bit
    moments are quantized from 4096 on)."""
    k1, k2 = jax.random.split(jax.random.key(0))
    final_params = (jax.random.normal(k1, (64, 4)) @ jax.random.normal(k2, (4, 80)) / 8).astype(dtype)
    initial_params = jnp.zeros((64, 80), dtype)

    def obj_fn(params):
        return jnp.sum(jnp.square(params - final_params))

    return initial_params, final_params, obj_fn


TARGETS = [_setup_parabola, _setup_rosenbrock, _setup_matrix_parabola, _setup_mixed_tensor_target,
           _setup_large_matrix_parabola]


class _CompileLog(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        if "Finished" in record.getMessage() and "compilation" in record.getMessage():
            self.records.append(record)


def _compilations(fn):
    """The compilations `fn()` triggers (as optax's test_utils.log_compilations counts them)."""
    handler, root = _CompileLog(), logging.getLogger("jax")
    root.addHandler(handler)
    try:
        with jax.log_compiles():
            fn()
    finally:
        root.removeHandler(handler)
    return handler.records


def _assert_close(actual, desired, rtol=1e-6, atol=0.0):
    assert jax.tree.structure(actual) == jax.tree.structure(desired)
    for a, d in zip(jax.tree.leaves(actual), jax.tree.leaves(desired)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(d, np.float32), rtol=rtol, atol=atol)


@pytest.mark.parametrize("name,factory,kwargs", OPTIMIZERS, ids=IDS)
def test_optimizers_accept_extra_args(name, factory, kwargs):
    opt = factory(**kwargs)
    initial_params, _, objective = _setup_rosenbrock(jnp.float32)

    @jax.jit
    def step(params, state):
        updates = jax.grad(objective)(params)
        updates, state = opt.update(updates, state, params, unexpected_extra_args_your_optimizer_doesnt_expect=1)
        return optax.apply_updates(params, updates), state

    params, state = initial_params, opt.init(initial_params)
    for _ in range(2):
        params, state = step(params, state)
    # no recompilation on the second call
    params, state = step(initial_params, opt.init(initial_params))
    assert not _compilations(lambda: step(params, state)), "the optimizer recompiles on its second update"


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.__name__[7:])
@pytest.mark.parametrize("name,factory,kwargs", OPTIMIZERS, ids=IDS)
def test_optimizers(name, factory, kwargs, target):
    opt = factory(**kwargs)
    initial_params, final_params, obj_fn = target(jnp.float32)

    @jax.jit
    def run(params, state):
        def f(carry, _):
            params, state = carry
            updates, state = opt.update(jax.grad(obj_fn)(params), state, params)
            return (optax.apply_updates(params, updates), state), None

        return jax.lax.scan(f, (params, state), length=STEPS)[0]

    state = opt.init(initial_params)
    state = optax.tree.map_params(opt, lambda v: v, state)  # a no-op change: tree_map_params works
    params, state = run(initial_params, state)
    _assert_close(params, final_params, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("name,factory,kwargs", OPTIMIZERS, ids=IDS)
def test_optimizers_can_be_wrapped_in_inject_hyperparams(name, factory, kwargs):
    opt = factory(**kwargs)
    static_args = tuple(a for a in UNINJECTABLE if a in inspect.signature(factory).parameters)
    opt_inject = optax.inject_hyperparams(factory, static_args)(**kwargs)
    params = [jnp.negative(jnp.ones((2, 3))), jnp.ones((2, 5, 2))]
    grads = [jnp.ones((2, 3)), jnp.negative(jnp.ones((2, 5, 2)))]
    updates, new_state = jax.jit(opt.update)(grads, jax.jit(opt.init)(params), params)
    updates_inject, new_state_inject = jax.jit(opt_inject.update)(grads, jax.jit(opt_inject.init)(params), params)
    _assert_close(updates_inject, updates, rtol=1e-5)
    _assert_close(new_state_inject.inner_state, new_state, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("name,factory,kwargs", OPTIMIZERS, ids=IDS)
def test_preserve_dtype(name, factory, kwargs, dtype):
    opt = factory(**kwargs)
    params = jnp.array([1.0, 2.0], dtype=dtype)
    grads = jax.grad(lambda x: jnp.sum(x**2))(params)
    updates, _ = jax.jit(opt.update)(grads, jax.jit(opt.init)(params), params)
    assert updates.dtype == params.dtype


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("name,factory,kwargs", OPTIMIZERS, ids=IDS)
def test_gradient_accumulation(name, factory, kwargs, dtype):
    opt = optax.MultiSteps(factory(**kwargs), every_k_schedule=4)
    params = jnp.array([1.0, 2.0], dtype=dtype)
    grads = jax.grad(lambda x: jnp.sum(x**2))(params)
    updates, _ = jax.jit(opt.update)(grads, jax.jit(opt.init)(params), params)
    np.testing.assert_array_equal(updates, jnp.zeros_like(grads))
    assert updates.dtype == grads.dtype


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64])
@pytest.mark.parametrize("name,factory,kwargs", OPTIMIZERS, ids=IDS)
def test_state_shape_dtype_shard_stability(name, factory, kwargs, dtype):
    with jax.enable_x64(dtype == jnp.float64):
        opt = factory(**kwargs)
        initial_params, _, objective = _setup_parabola(dtype)

        @jax.jit
        def step(params, state):
            updates = jax.grad(objective)(params)
            # lax.cond defeats compiler optimization: both branches must have the same types
            cond = jax.random.randint(jax.random.key(0), (), 0, 2) == 0
            updates, state = jax.lax.cond(cond, lambda: opt.update(updates, state, params), lambda: (params, state))
            return optax.apply_updates(params, updates), state

        params, state = initial_params, opt.init(initial_params)
        for _ in range(2):
            params, new_state = step(params, state)
            assert jax.tree.leaves(params)[0].dtype == dtype
            cond = jax.random.randint(jax.random.key(0), (), 0, 2) == 0
            state = jax.lax.cond(cond, lambda s=state: s, lambda s=new_state: s)


@pytest.mark.parametrize("name,factory,kwargs", OPTIMIZERS, ids=IDS)
def test_optimizers_accept_learning_rate_schedule(name, factory, kwargs):
    initial_params, _, obj_fn = _setup_parabola(jnp.float32)
    opt_with_schedule = factory(**dict(kwargs, learning_rate=optax.constant_schedule(1e-3)))
    opt_with_lr = factory(**dict(kwargs, learning_rate=1e-3))

    def step(opt, params, state):
        updates, state = opt.update(jax.grad(obj_fn)(params), state, params)
        return optax.apply_updates(params, updates), state

    ps, pl = initial_params, initial_params
    ss, sl = opt_with_schedule.init(ps), opt_with_lr.init(pl)
    for _ in range(10):
        ps, ss = step(opt_with_schedule, ps, ss)
        pl, sl = step(opt_with_lr, pl, sl)
    _assert_close(ps, pl)


# ---------------------------------------------------------------------------------------------------------- ours
# inject_hyperparams without any static_args: init outside jit reads the int arguments' values; every update
# works under jit (GaLore reads each leaf's rank off its projector, 8-bit AdamW its layout off the state), and
# changing an injected value does not recompile. A jitted init cannot know the value of an int that sets the
# state's shapes: a ValueError names it and static_args.
INJECT_CASES = OPTIMIZERS + [("galore_adamw_randomized", optim.galore_adamw,
                               {"learning_rate": 1e-2, "rank": 8, "projector": "randomized"})]


@pytest.mark.parametrize("name,factory,kwargs", INJECT_CASES, ids=[c[0] for c in INJECT_CASES])
def test_inject_hyperparams_without_static_args(name, factory, kwargs):
    _, _, objective = _setup_large_matrix_parabola(jnp.float32)
    params = {"w": jnp.ones((64, 80)), "b": jnp.ones((3,))}
    obj = lambda p: objective(p["w"]) + jnp.sum(p["b"] ** 2)  # noqa: E731
    opt, opt_inject = factory(**kwargs), optax.inject_hyperparams(factory)(**kwargs)
    state, state_inject = opt.init(params), opt_inject.init(params)
    update = jax.jit(opt.update)
    update_inject = jax.jit(opt_inject.update)
    p = params
    for _ in range(2):
        g = jax.grad(obj)(p)
        u, state = update(g, state, p)
        u_inject, state_inject = update_inject(g, state_inject, p)
        _assert_close(u_inject, u, rtol=1e-5, atol=1e-7)
        p = optax.apply_updates(p, u)
    state_inject.hyperparams["learning_rate"] = jnp.asarray(3e-2, jnp.float32)
    u2, _ = update_inject(g, state_inject, p)
    assert not np.allclose(u2["w"], u_inject["w"])
    assert update_inject._cache_size() == 1
    traced = "state_bits" if "state_bits" in kwargs else "rank" if "galore" in name else None
    if traced:
        with pytest.raises(ValueError, match=rf"{traced}.*static_args"):
            jax.jit(opt_inject.init)(params)
    else:
        jax.jit(opt_inject.init)(params)
