"""optax's conformance suite for contributed optimizers, run against ours.

optax ships its suite as optax/contrib/_common_test.py (an absl `parameterized.TestCase`, `ContribTest`). Every
test method it defines runs here, unchanged, on our optimizers: the cases optax generates for its own optimizers
are read off the class (their parameters besides the optimizer: target, dtype, wrap), and each is run with every
optimizer of OPTIMIZERS in place of optax's (its `_get_opt_factory` resolves our names), as a main optimizer and as
the base of the wrappers optax runs on any base optimizer (`mechanize`). The wrappers optax tests on SGD alone
(schedule_free, reduce_on_plateau) test the wrapper, not the optimizer, and are not repeated. A new test method in
a later optax runs here too; `test_every_optax_test_runs_here` fails if one could not be read.

Below the suite, ours: a larger matrix target (optax's targets are smaller than adam's MIN_QUANTIZED_SIZE, so the
8-bit states would never be quantized, and GaLore would project at full rank) and inject_hyperparams without
static_args under a jitted init, as optax's suite calls it.
"""

from __future__ import annotations

import importlib
import inspect
import itertools

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
# optax's own test module, held as a module attribute: a TestCase class bound in this module's namespace would
# be collected by pytest and run optax's optimizers too.
optax_suite = importlib.import_module("optax.contrib._common_test")
OPTIMIZER_KEYS = ("opt_name", "opt_kwargs", "wrapper_name", "wrapper_kwargs")
# Wrappers optax runs over every base optimizer (its _OTHER_OPTIMIZERS_UNDER_TEST): ours are bases too, with the
# learning rate optax gives every base there (_BASE_OPTIMIZERS: 1.0). At 1e-2 mechanize's first steps underflow in
# fp32 and the params never move, for optax.adamw as for ours.
ANY_BASE_WRAPPERS = ("mechanize",)
BASE_LEARNING_RATE = 1.0


def _optax_tests() -> dict:
    """{test name: (optax's test function, [its parameters besides the optimizer, one dict per distinct case],
    {wrapper name: its kwargs} of the wrappers it runs)} for every test method of optax's ContribTest."""
    cls, tests = optax_suite.ContribTest, {}
    for attr in sorted(vars(cls)):
        bound = vars(cls)[attr]
        if not attr.startswith("test") or not callable(bound):
            continue
        fn = getattr(bound, "__wrapped__", bound)  # absl's generated case wraps the test (functools.wraps)
        cases = inspect.getclosurevars(bound).nonlocals.get("testcase_params", {}) if fn is not bound else {}
        name, entry = fn.__name__, tests.setdefault(fn.__name__, (fn, [], {}))
        rest = {k: v for k, v in dict(cases).items() if k not in OPTIMIZER_KEYS}
        if rest not in entry[1]:
            entry[1].append(rest)
        if dict(cases).get("wrapper_name") is not None:
            entry[2][dict(cases)["wrapper_name"]] = dict(cases)["wrapper_kwargs"]
        tests[name] = entry
    return tests


OPTAX_TESTS = _optax_tests()


def _case_id(rest: dict) -> str:
    return "-".join(f"{k}={getattr(v, '__name__', None) or getattr(v, 'name', None) or v}"
                    for k, v in sorted(rest.items())) or "default"


def _suite_cases():
    for test, (_, rests, wrappers) in OPTAX_TESTS.items():
        wrapped = [(w, wrappers[w]) for w in ANY_BASE_WRAPPERS if w in wrappers]
        for (name, _, kwargs), (wrapper, wkw), rest in itertools.product(OPTIMIZERS, [(None, None), *wrapped],
                                                                           rests):
            label = name if wrapper is None else f"{wrapper}({name})"
            base_kwargs = kwargs if wrapper is None else dict(kwargs, learning_rate=BASE_LEARNING_RATE)
            yield pytest.param(test, name, base_kwargs, wrapper, wkw, rest, id=f"{test}-{label}-{_case_id(rest)}")


def test_every_optax_test_runs_here():
    """The suite read off optax's class holds its test methods, each with its cases."""
    assert {"test_optimizers", "test_optimizers_can_be_wrapped_in_inject_hyperparams",
            "test_optimizers_accept_extra_args", "test_preserve_dtype", "test_gradient_accumulation",
            "test_state_shape_dtype_shard_stability"} <= set(OPTAX_TESTS)
    assert all(rests for _, rests, _ in OPTAX_TESTS.values())
    assert "mechanize" in OPTAX_TESTS["test_optimizers"][2]


@pytest.mark.parametrize("test,opt_name,opt_kwargs,wrapper_name,wrapper_kwargs,rest", list(_suite_cases()))
def test_optax_suite(monkeypatch, test, opt_name, opt_kwargs, wrapper_name, wrapper_kwargs, rest):
    factories = {name: factory for name, factory, _ in OPTIMIZERS}
    monkeypatch.setattr(optax_suite, "_get_opt_factory", lambda name: factories[name])
    fn = OPTAX_TESTS[test][0]
    params = inspect.signature(fn).parameters
    kwargs = dict(rest, opt_name=opt_name, opt_kwargs=opt_kwargs)
    if "wrapper_name" in params:
        kwargs.update(wrapper_name=wrapper_name, wrapper_kwargs=wrapper_kwargs)
    case = optax_suite.ContribTest(methodName="run")  # a bare instance: its assert*, subTest and skipTest
    fn(case, **kwargs)


def _setup_large_matrix_parabola(dtype):
    """A (64, 80) target of rank 4 (GaLore's rank-8 projection can reach it) with 5120 elements (8-bit moments are
    quantized from 4096 on)."""
    k1, k2 = jax.random.split(jax.random.key(0))
    final_params = (jax.random.normal(k1, (64, 4)) @ jax.random.normal(k2, (4, 80)) / 8).astype(dtype)
    initial_params = jnp.zeros((64, 80), dtype)

    def obj_fn(params):
        return jnp.sum(jnp.square(params - final_params))

    return initial_params, final_params, obj_fn


def _assert_close(actual, desired, rtol=1e-6, atol=0.0):
    assert jax.tree.structure(actual) == jax.tree.structure(desired)
    for a, d in zip(jax.tree.leaves(actual), jax.tree.leaves(desired)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(d, np.float32), rtol=rtol, atol=atol)


@pytest.mark.parametrize("name,factory,kwargs", OPTIMIZERS, ids=IDS)
def test_converges_on_a_large_matrix(name, factory, kwargs):
    """optax's test_optimizers on a target where the 8-bit states are quantized and GaLore projects below full
    rank (3000 steps: every optimizer here is an Adam, well converged by then)."""
    opt = factory(**kwargs)
    initial_params, final_params, obj_fn = _setup_large_matrix_parabola(jnp.float32)

    @jax.jit
    def run(params, state):
        def f(carry, _):
            params, state = carry
            updates, state = opt.update(jax.grad(obj_fn)(params), state, params)
            return (optax.apply_updates(params, updates), state), None

        return jax.lax.scan(f, (params, state), length=3000)[0]

    state = optax.tree.map_params(opt, lambda v: v, opt.init(initial_params))
    params, state = run(initial_params, state)
    _assert_close(params, final_params, rtol=3e-2, atol=3e-2)

# inject_hyperparams without any static_args: init, under jit too, reads the int arguments' values (a jitted init's
# array of an int is a constant of its trace); every update works under jit (GaLore reads each leaf's rank off its
# projector, 8-bit AdamW its layout off the state), and changing an injected value does not recompile. An int that
# sets the state's structure and is a real input of the traced function cannot be known: a ValueError names it and
# static_args.
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
    jitted = jax.jit(opt_inject.init)(params)
    assert jax.tree.structure(jitted) == jax.tree.structure(opt_inject.init(params))
    _assert_close(jitted.inner_state, opt.init(params))
    structural = "state_bits" if "state_bits" in kwargs else "rank" if "galore" in name else None
    if structural:
        with pytest.raises(ValueError, match=rf"{structural}.*static_args"):
            jax.jit(lambda value: factory(**dict(kwargs, **{structural: value})).init(params))(kwargs[structural])
