"""The fused Adam(W) transforms and the in-place step against optax, in the ways optax is used."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pallas_fused.adam as A
from tests.helpers import assert_all_written, assert_close, rand, rel_err

# A tiny regression model: x (64, 8) -> tanh(x @ w1 + b1) @ w2 + b2.
X = jax.random.normal(jax.random.key(10), (64, 8))
Y = jnp.sin(X @ jnp.linspace(-1.0, 1.0, 8))[:, None]


def fp32_tol(kernel_impl):
    """fp32 agreement with optax after many steps: exact-op interpretation on the CPU; on the GPU Triton's
    fp32 division and sqrt are a few ulps off XLA's, and that drift accumulates over the steps."""
    return 1e-4 if kernel_impl == "pallas" else 1e-5


def mlp_params(dtype=jnp.float32, hidden=32, inputs=8):
    return {
        "w1": rand(1, (inputs, hidden), dtype, scale=0.5),
        "b1": rand(2, (hidden,), dtype, scale=0.1),
        "w2": rand(3, (hidden, 1), dtype, scale=0.5),
        "b2": jnp.zeros((1,), dtype),
    }


def loss_fn(params, x=X, y=Y):
    # Full fp32 matmuls: on a GPU the default (TF32) rounds products to 10 bits, which turns the ulp-level
    # differences between two optimizers into 1e-3-level gradient differences within a few steps.
    p = jax.tree.map(lambda t: t.astype(jnp.float32), params)
    h = jnp.tanh(jnp.matmul(x, p["w1"], precision="highest") + p["b1"])
    return jnp.mean((jnp.matmul(h, p["w2"], precision="highest") + p["b2"] - y) ** 2)


def train(opt, params, steps, grad_fn=None):
    """`steps` jitted optax steps (one compilation); returns final params, state and loss."""
    grad_fn = grad_fn or jax.value_and_grad(loss_fn)

    @jax.jit
    def step(params, state):
        loss, grads = grad_fn(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    state = opt.init(params)
    for _ in range(steps):
        params, state, loss = step(params, state)
    return params, state, loss


def train_inplace(params, steps, **hparams):
    state = A.adamw(**hparams).init(params)
    hp = {k: v for k, v in hparams.items() if k not in ("state_bits", "mu_dtype")}

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, state):
        grads = jax.grad(loss_fn)(params)
        return A.adamw_step(params, grads, state, **hp)

    for _ in range(steps):
        params, state = step(params, state)
    return params, state


def tree_rel_err(a, b):
    return max(rel_err(x, np.asarray(y, np.float64)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


HP = dict(learning_rate=1e-2, b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.05)


def test_adamw_matches_optax_100_steps_fp32(kernel_impl):
    params = mlp_params()
    want, want_state, _ = train(optax.adamw(**HP), params, 100)
    got, state, _ = train(A.adamw(**HP, implementation=kernel_impl), params, 100)
    assert tree_rel_err(got, want) < fp32_tol(kernel_impl)
    assert tree_rel_err(state.mu, want_state[0].mu) < 1e-4
    assert tree_rel_err(state.nu, want_state[0].nu) < 1e-4
    assert int(state.count) == 100
    got_inplace, state2 = train_inplace(params, 100, **HP, implementation=kernel_impl)
    assert tree_rel_err(got_inplace, want) < fp32_tol(kernel_impl)
    assert int(state2.count) == 100


def test_adamw_matches_optax_100_steps_bf16(kernel_impl):
    """bf16 params and moments: at least as close to an fp32 run as optax's own bf16 run is (2x rule)."""
    params = mlp_params(jnp.bfloat16)
    exact, _, _ = train(optax.adamw(**HP), jax.tree.map(lambda p: p.astype(jnp.float32), params), 100)
    baseline, _, _ = train(optax.adamw(**HP), params, 100)
    got, state, _ = train(A.adamw(**HP, implementation=kernel_impl), params, 100)
    got_inplace, _ = train_inplace(params, 100, **HP, implementation=kernel_impl)
    for name in params:
        exact64 = np.asarray(exact[name], np.float64)
        assert got[name].dtype == jnp.bfloat16 and state.mu[name].dtype == jnp.bfloat16
        assert_close(got[name], exact64, baseline=baseline[name], what=f"optax path {name}")
        assert_close(got_inplace[name], exact64, baseline=baseline[name], what=f"in-place {name}")


def test_mu_dtype_bf16(kernel_impl):
    params = mlp_params()
    want, want_state, _ = train(optax.adamw(**HP, mu_dtype=jnp.bfloat16), params, 30)
    got, state, _ = train(A.adamw(**HP, mu_dtype=jnp.bfloat16, implementation=kernel_impl), params, 30)
    assert state.mu["w1"].dtype == jnp.bfloat16 and state.nu["w1"].dtype == jnp.float32
    # optax rounds mhat to bf16 before dividing; we round mu only when storing it.
    assert tree_rel_err(got, want) < 2e-2


def test_update_dtype_promotes_like_optax(kernel_impl):
    """fp32 params with bf16 grads: optax's update is fp32 (promotion with the fp32 moments); ours too."""
    params = {"w": rand(0, (40, 50))}
    grads = {"w": rand(1, (40, 50), jnp.bfloat16)}
    for opt, ref in ((A.adamw(**HP, implementation=kernel_impl), optax.adamw(**HP)),
                     (A.scale_by_adam(implementation=kernel_impl), optax.scale_by_adam())):
        got, _ = opt.update(grads, opt.init(params), params)
        baseline, _ = ref.update(grads, ref.init(params), params)  # optax rounds (1 - b1) * g to bf16
        exact, _ = ref.update(jax.tree.map(lambda g: g.astype(jnp.float32), grads), ref.init(params), params)
        assert got["w"].dtype == baseline["w"].dtype == jnp.float32
        assert_close(got["w"], np.asarray(exact["w"], np.float64), baseline=baseline["w"], what="bf16 grads")


def test_adam_and_scale_by_adam_match_optax(kernel_impl):
    params = mlp_params()
    want, _, _ = train(optax.adam(1e-2, b1=0.8, b2=0.95, eps=1e-6, eps_root=1e-10), params, 20)
    got, _, _ = train(A.adam(1e-2, b1=0.8, b2=0.95, eps=1e-6, eps_root=1e-10, implementation=kernel_impl), params, 20)
    assert tree_rel_err(got, want) < fp32_tol(kernel_impl)
    chain = optax.chain(A.scale_by_adam(b1=0.8, implementation=kernel_impl), optax.scale(-1e-2))
    got, state, _ = train(chain, params, 20)
    want, _, _ = train(optax.chain(optax.scale_by_adam(b1=0.8), optax.scale(-1e-2)), params, 20)
    assert tree_rel_err(got, want) < fp32_tol(kernel_impl)
    assert isinstance(state[0], A.FusedAdamState)


def test_schedule_mask_and_clipping_in_chain(kernel_impl):
    params = mlp_params()
    sched = optax.warmup_cosine_decay_schedule(0.0, 2e-2, 5, 30)
    mask = {"w1": True, "b1": False, "w2": True, "b2": False}
    want, _, _ = train(optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(sched, weight_decay=0.1, mask=mask)),
                       params, 30)
    got, _, _ = train(optax.chain(optax.clip_by_global_norm(0.5),
                                  A.adamw(sched, weight_decay=0.1, mask=mask, implementation=kernel_impl)), params, 30)
    assert tree_rel_err(got, want) < fp32_tol(kernel_impl)
    callable_mask = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)  # noqa: E731
    got2, _, _ = train(optax.chain(optax.clip_by_global_norm(0.5), A.adamw(
        sched, weight_decay=0.1, mask=callable_mask, implementation=kernel_impl)), params, 30)
    assert tree_rel_err(got2, want) < fp32_tol(kernel_impl)
    wd_sched = optax.linear_schedule(0.2, 0.0, 30)
    want, _, _ = train(optax.adamw(1e-2, weight_decay=wd_sched), params, 30)
    got, _, _ = train(A.adamw(1e-2, weight_decay=wd_sched, implementation=kernel_impl), params, 30)
    assert tree_rel_err(got, want) < fp32_tol(kernel_impl)


def test_multi_transform_and_multisteps(kernel_impl):
    params = mlp_params()
    labels = {"w1": "adam", "b1": "sgd", "w2": "adam", "b2": "sgd"}
    want, _, _ = train(optax.multi_transform({"adam": optax.adamw(**HP), "sgd": optax.sgd(0.1)}, labels), params, 20)
    got, _, _ = train(optax.multi_transform(
        {"adam": A.adamw(**HP, implementation=kernel_impl), "sgd": optax.sgd(0.1)}, labels), params, 20)
    assert tree_rel_err(got, want) < fp32_tol(kernel_impl)
    want, want_state, _ = train(optax.MultiSteps(optax.adamw(**HP), every_k_schedule=3), params, 12)
    got, state, _ = train(optax.MultiSteps(A.adamw(**HP, implementation=kernel_impl), every_k_schedule=3), params, 12)
    assert tree_rel_err(got, want) < fp32_tol(kernel_impl)
    assert int(state.inner_opt_state.count) == 4


def test_inject_hyperparams_runtime_operands_no_recompile(kernel_impl):
    params = mlp_params()
    grads = jax.grad(loss_fn)(params)
    traces = []

    def make(factory):
        opt = optax.inject_hyperparams(factory)(learning_rate=1e-2, b1=0.9, b2=0.99, weight_decay=0.05)

        @jax.jit
        def step(params, state):
            traces.append(1)
            updates, state = opt.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        return opt, step

    ours, step = make(functools.partial(A.adamw, implementation=kernel_impl))
    theirs, ref_step = make(optax.adamw)
    p1, s1 = params, ours.init(params)
    p2, s2 = params, theirs.init(params)
    for lr, b1, wd in [(1e-2, 0.9, 0.05), (3e-3, 0.8, 0.0), (5e-2, 0.95, 0.2)]:
        for s in (s1, s2):
            s.hyperparams.update(learning_rate=jnp.asarray(lr), b1=jnp.asarray(b1), weight_decay=jnp.asarray(wd))
        p1, s1 = step(p1, s1)
        p2, s2 = ref_step(p2, s2)
        assert tree_rel_err(p1, p2) < fp32_tol(kernel_impl)
    assert len(traces) == 2  # one trace each for ours and optax's, whatever the values
    assert step._cache_size() == 1
    # The learning rate is an operand of the kernel, not a constant folded into it.
    jaxpr = jax.make_jaxpr(lambda lr: A.adamw(lr, implementation=kernel_impl).update(grads, A.adamw(
        lr).init(params), params))(1e-2)
    assert "1e-02" not in str(jaxpr) and "0.01" not in str(jaxpr)


def test_inject_hyperparams_with_8bit_states():
    params = mlp_params(hidden=512)
    # Without static_args, under jit as outside it: inject_hyperparams' array of the int is a constant of a jitted
    # init's trace, so init reads its value (optax's conformance suite calls jax.jit(opt.init)).
    jitted = jax.jit(optax.inject_hyperparams(A.adamw)(learning_rate=1e-2, state_bits=8).init)(params)
    assert isinstance(jitted.inner_state.mu["w1"], A.QuantizedMoment)
    # A state_bits that is a real input of the traced function has no value at trace time: the error says what to do.
    with pytest.raises(ValueError, match=r"state_bits.*static_args=\('state_bits',\)"):
        jax.jit(lambda bits: A.adamw(1e-2, state_bits=bits).init(params))(8)
    opt = optax.inject_hyperparams(A.adamw)(learning_rate=1e-2, state_bits=8, implementation="xla")
    _, state, loss = train(opt, params, 2)
    assert isinstance(state.inner_state.mu["w1"], A.QuantizedMoment)
    opt = optax.inject_hyperparams(A.adamw, static_args=("state_bits",))(
        learning_rate=1e-2, state_bits=8, implementation="xla")
    _, state, loss = train(opt, params, 5)
    assert isinstance(state.inner_state.mu["w1"], A.QuantizedMoment)
    assert float(loss) < float(loss_fn(params))


def test_state_bits_8_converges_like_fp32(kernel_impl):
    """A model with 4096-element weights (quantized) trained 200 steps converges like fp32 states (within 1%)."""
    params = mlp_params(hidden=512, inputs=8)
    steps = 200
    _, s32, loss32 = train(A.adamw(3e-3, weight_decay=0.01, implementation=kernel_impl), params, steps)
    p8, s8, loss8 = train(A.adamw(3e-3, weight_decay=0.01, state_bits=8, implementation=kernel_impl), params, steps)
    assert isinstance(s8.mu["w1"], A.QuantizedMoment) and isinstance(s8.nu["w1"], A.QuantizedMoment)
    assert s8.mu["b1"].dtype == jnp.float32  # under 4096 elements: fp32
    assert_all_written(p8["w1"])
    loss0, loss32, loss8 = float(loss_fn(params)), float(loss32), float(loss8)
    assert loss32 < 0.01 * loss0  # it trained
    # 8-bit states: final loss no more than 1% above fp32's, and within 1% of its loss reduction.
    assert loss8 <= 1.01 * loss32, (loss8, loss32)
    assert abs(loss8 - loss32) <= 0.01 * (loss0 - loss32), (loss8, loss32, loss0)
    big8 = A.adam_state_bytes(s8._replace(mu=s8.mu["w1"], nu=s8.nu["w1"]))
    big32 = A.adam_state_bytes(s32._replace(mu=s32.mu["w1"], nu=s32.nu["w1"]))
    assert big8 < 0.27 * big32, (big8, big32)  # 2 + 8/256 bytes per element instead of 8
    m8 = A.dequantize_moment(s8.mu["w1"], params["w1"].shape, signed=True)
    assert rel_err(m8, np.asarray(s32.mu["w1"], np.float64)) < 0.2


def test_orbax_round_trip(kernel_impl, tmp_path):
    import orbax.checkpoint as ocp

    params = mlp_params(hidden=512, inputs=8)
    opt = A.adamw(**HP, state_bits=8, implementation=kernel_impl)
    params, state, _ = train(opt, params, 3)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "ckpt", {"params": params, "opt": state})
    with ocp.StandardCheckpointer() as ckptr:
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "opt": state})
        restored = ckptr.restore(tmp_path / "ckpt", abstract)
    assert isinstance(restored["opt"], A.FusedAdamState)
    assert isinstance(restored["opt"].mu["w1"], A.QuantizedMoment)
    grads = jax.grad(loss_fn)(params)
    step = jax.jit(lambda p, s: opt.update(grads, s, p))
    u1, s1 = step(params, state)
    u2, s2 = step(restored["params"], restored["opt"])
    for a, b in zip(jax.tree.leaves((u1, s1)), jax.tree.leaves((u2, s2))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_non_finite_gradients(kernel_impl):
    params = mlp_params(hidden=512)
    opt = A.adamw(**HP, implementation=kernel_impl)
    opt8 = A.adamw(**HP, state_bits=8, implementation=kernel_impl)
    grads = jax.grad(loss_fn)(params)
    bad = jax.tree.map(lambda g: g.reshape(-1).at[0].set(jnp.nan).at[1].set(jnp.inf).reshape(g.shape), grads)
    for o in (opt, opt8):
        state = o.init(params)
        _, state = jax.jit(o.update)(grads, state, params)  # non-zero moments first
        updates, new_state = jax.jit(o.update)(bad, state, params)
        for leaf in jax.tree.leaves((updates, new_state)):
            assert_all_written(leaf)
        for u in jax.tree.leaves(updates):
            assert not np.any(np.asarray(u).reshape(-1)[:2])
            if u.size > 2:
                assert float(jnp.abs(u.reshape(-1)[2:]).max()) > 0
        assert int(new_state.count) == 2
    # Elements with finite gradients step as usual.
    state = opt.init(params)
    u_bad, s_bad = jax.jit(opt.update)(bad, state, params)
    u_ok, s_ok = jax.jit(opt.update)(grads, state, params)
    np.testing.assert_array_equal(np.asarray(u_bad["w2"]).reshape(-1)[2:], np.asarray(u_ok["w2"]).reshape(-1)[2:])
    np.testing.assert_array_equal(np.asarray(s_bad.mu["w2"]).reshape(-1)[0], 0.0)
    # Whole-step skipping, the optax way.
    guarded = optax.apply_if_finite(opt, max_consecutive_errors=3)
    gstate = guarded.init(params)
    updates, gstate2 = jax.jit(guarded.update)(bad, gstate, params)
    assert all(float(jnp.abs(u).max()) == 0.0 for u in jax.tree.leaves(updates))
    assert int(gstate2.notfinite_count) == 1 and int(gstate2.inner_state.count) == 0


def test_leaf_functions(kernel_impl):
    """The per-tensor functions (for GaLore's unprojected leaves) agree with the tree transform."""
    p = rand(0, (40, 130))
    g = rand(1, (40, 130))
    for bits in (None, 8):
        opt = A.adamw(**HP, state_bits=bits, implementation=kernel_impl)
        state = opt.init({"p": p})
        updates, state1 = opt.update({"p": g}, state, {"p": p})
        m, v = A.init_adam_leaf_state(p, state_bits=bits)
        hp = dict(b1=HP["b1"], b2=HP["b2"], eps=HP["eps"], weight_decay=HP["weight_decay"])
        u, m1, v1 = A.adam_leaf_direction(g, m, v, jnp.int32(1), param=p, learning_rate=HP["learning_rate"], **hp,
                                          implementation=kernel_impl)
        agree(u, updates["p"], kernel_impl, rtol=1e-6, atol=1e-9)
        p1, m2, v2 = A.adam_leaf_update(p, g, m, v, jnp.int32(1), learning_rate=HP["learning_rate"], **hp,
                                        implementation=kernel_impl)
        agree(p1, p + updates["p"], kernel_impl, rtol=1e-6, atol=1e-7)
        for a, b, c in zip(jax.tree.leaves((m1, v1)), jax.tree.leaves((m2, v2)), jax.tree.leaves(state1[1:])):
            agree(a, b, kernel_impl, atol=1e-7)
            agree(a, c, kernel_impl, atol=1e-7)


def agree(a, b, kernel_impl, rtol=0.0, atol=0.0):
    """Elementwise agreement where both sides run the same arithmetic (interpreted kernels, XLA). Compiled
    for a GPU, the direction and in-place kernels are separate Triton programs whose FMA contraction and
    fast division differ by ulps, which can also flip a rare 8-bit code across a rounding boundary: there
    the check is norm-wise."""
    if kernel_impl != "pallas":
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=rtol, atol=atol)
    else:
        assert rel_err(a, np.asarray(b, np.float64)) < (1e-2 if jnp.asarray(a).dtype == jnp.uint8 else 1e-5)


def test_xla_implementation_matches_kernel(kernel_impl):
    params = mlp_params(hidden=512)
    for bits in (None, 8):
        a, _, _ = train(A.adamw(**HP, state_bits=bits, implementation="xla"), params, 5)
        b, _, _ = train(A.adamw(**HP, state_bits=bits, implementation=kernel_impl), params, 5)
        assert tree_rel_err(a, b) < fp32_tol(kernel_impl)


def test_bad_inputs():
    for bits in (4, 16, "8", True, 8.0):
        with pytest.raises(ValueError, match="state_bits"):
            A.adamw(1e-3, state_bits=bits)
    with pytest.raises(ValueError, match="learning_rate"):
        A.adamw(-1e-3)
    with pytest.raises(ValueError, match="b1"):
        A.adam(1e-3, b1=1.0)
    with pytest.raises(ValueError, match="b2"):
        A.scale_by_adam(b2=-0.1)
    with pytest.raises(ValueError, match="weight_decay"):
        A.adamw(1e-3, weight_decay=-1.0)
    with pytest.raises(ValueError, match="learning_rate"):
        A.adamw(jnp.ones(3))
    with pytest.raises(ValueError, match="implementation"):
        A.adamw(1e-3, implementation="cuda")
    params = {"w": jnp.ones((4, 5))}
    opt = A.adamw(1e-3, implementation="xla")
    state = opt.init(params)
    with pytest.raises(ValueError, match="params"):
        opt.update(params, state)
    with pytest.raises(ValueError, match="mu"):
        opt.update({"w": jnp.ones((5, 4))}, state, {"w": jnp.ones((5, 4))})
    with pytest.raises(ValueError, match="grads"):
        A.adamw_step(params, {"v": jnp.ones((4, 5))}, state, learning_rate=1e-3)
    with pytest.raises(ValueError, match="state"):
        A.adamw_step(params, params, optax.adamw(1e-3).init(params), learning_rate=1e-3)
    with pytest.raises(ValueError, match="grad"):
        A.adam_leaf_direction(jnp.ones(3, jnp.int32), jnp.zeros(3), jnp.zeros(3), 1)


@pytest.mark.parametrize("make", [lambda: A.adamw(1e-3), lambda: A.adam(1e-3), lambda: A.scale_by_adam()])
def test_update_accepts_extra_args_in_a_chain(make):
    # optax.chain of GradientTransformationExtraArgs passes extra keyword args to every member
    params = {"w": jnp.arange(6.0).reshape(2, 3)}
    tx = make()
    assert isinstance(tx, optax.GradientTransformationExtraArgs)
    chained = optax.chain(tx, optax.scale(1.0))
    u, _ = chained.update(params, chained.init(params), params, value=jnp.asarray(1.0))
    ref, _ = tx.update(params, tx.init(params), params)
    np.testing.assert_array_equal(u["w"], ref["w"])


def test_errors_name_the_leaf_and_key_lists():
    params = {"a": jnp.ones((8, 48)), "b": jnp.ones((3,))}
    tx = A.adamw(1e-3)
    state = tx.init(params)
    with pytest.raises(ValueError, match=r"leaf \['a'\]: .*expected shape \(8, 40\).*got \(8, 48\)"):
        tx.update({"a": jnp.ones((8, 40)), "b": jnp.ones((3,))}, state, {"a": jnp.ones((8, 40)), "b": params["b"]})
    with pytest.raises(ValueError, match=r"expected \[\"\['a'\]\", \"\['b'\]\"\], got \[\"\['a'\]\"\]"):
        tx.update({"a": params["a"]}, state, {"a": params["a"]})


def test_updates_in_the_params_dtype():
    # as optax's: bf16 params get bf16 updates whatever the moments' dtype (fp32 mu, 8-bit layout's fp32 small
    # leaves), with or without weight decay; without params, the grad's dtype promoted with the moments'
    params = {"w": jnp.ones((8, 4), jnp.bfloat16), "b": jnp.ones((3,), jnp.bfloat16)}
    grads = jax.tree.map(lambda p: p * 0.5, params)
    for tx in (A.adam(1e-2, mu_dtype=jnp.float32), A.adam(1e-2, state_bits=8), A.scale_by_adam(mu_dtype=jnp.float32),
               A.adamw(1e-2, state_bits=8, implementation="xla")):
        u, _ = jax.jit(tx.update)(grads, tx.init(params), params)
        assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(u))
    tx = A.adam(1e-2, mu_dtype=jnp.float32)
    u, _ = jax.jit(tx.update)(grads, tx.init(params))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(u))


def test_state_shardings_of_empty_params():
    """No params, no mesh to read from them: a ValueError that says to pass mesh=, and with it the count's sharding."""
    from jax.sharding import NamedSharding, PartitionSpec

    from pallas_fused.adam import state_shardings

    state = A.adamw(1e-3).init({})
    with pytest.raises(ValueError, match="mesh="):
        state_shardings(state, {})
    mesh = jax.make_mesh((1,), ("data",))
    out = state_shardings(state, {}, mesh=mesh)
    assert out.count == NamedSharding(mesh, PartitionSpec())
