"""SwiGLUMLP / NNXSwiGLUMLP: the params of a Llama MLP written with nn.Dense / nnx.Linear, the same outputs and
gradients as that MLP (float32 and bfloat16), and the Dense options passed through to the projections."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from pallas_fused import adapt
from pallas_fused.swiglu import NNXSwiGLUMLP, SwiGLUMLP
from tests.helpers import assert_close, rand, to64

IMPLS = ["kernel", "xla"]


class DenseMLP(nn.Module):
    """The Llama MLP as it is usually written."""

    hidden: int
    dtype: jnp.dtype | None = None

    @nn.compact
    def __call__(self, x):
        dense = lambda n, name: nn.Dense(n, use_bias=False, dtype=self.dtype, name=name)  # noqa: E731
        return dense(x.shape[-1], "down")(nn.silu(dense(self.hidden, "gate")(x)) * dense(self.hidden, "up")(x))


class NNXDenseMLP(nnx.Module):
    def __init__(self, din, hidden, *, dtype=None, rngs):
        self.gate = nnx.Linear(din, hidden, use_bias=False, dtype=dtype, rngs=rngs)
        self.up = nnx.Linear(din, hidden, use_bias=False, dtype=dtype, rngs=rngs)
        self.down = nnx.Linear(hidden, din, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.silu(self.gate(x)) * self.up(x))


def _check(ours, theirs, exact, dtype, what):
    """Outputs, then every gradient: ours as close to the float32 computation as the usual MLP in `dtype` is."""
    for name, o, t, e in zip(("y", "dx", "dparams"), ours, theirs, exact):
        for leaf_o, leaf_t, leaf_e in zip(jax.tree.leaves(o), jax.tree.leaves(t), jax.tree.leaves(e)):
            assert leaf_o.dtype == leaf_t.dtype, (name, leaf_o.dtype, leaf_t.dtype)
            assert_close(leaf_o, to64(leaf_e), baseline=leaf_t, dtype=dtype, floor=1e-5 if dtype == jnp.float32
                         else None, what=f"{what} {name}")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_linen_is_the_dense_mlp(kernel_impl, impl, dtype):
    impl = kernel_impl if impl == "kernel" else impl
    x = rand(0, (2, 7, 48), dtype)
    ours = SwiGLUMLP(hidden_features=88, dtype=dtype, implementation=impl)
    params = ours.init(jax.random.key(1), x)
    theirs = DenseMLP(88, dtype=dtype)
    assert jax.tree.map(jnp.shape, params) == jax.tree.map(jnp.shape, theirs.init(jax.random.key(1), x))
    assert set(params["params"]) == {"gate", "up", "down"}
    dy = rand(2, x.shape, dtype)

    def run(module, x, dtype_override=None):
        m = module if dtype_override is None else module.clone(dtype=dtype_override)
        y, vjp = jax.vjp(lambda p, x: m.apply(p, x), params, x)
        dp, dx = vjp(dy.astype(y.dtype))
        return y, dx, dp

    exact = run(theirs, x.astype(jnp.float32), jnp.float32)
    _check(run(ours, x), run(theirs, x), exact, dtype, f"linen {impl}")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_nnx_is_the_linear_mlp(kernel_impl, dtype):
    x = rand(0, (3, 5, 40), dtype)
    ours = NNXSwiGLUMLP(40, 72, dtype=dtype, implementation=kernel_impl, rngs=nnx.Rngs(0))
    theirs = NNXDenseMLP(40, 72, dtype=dtype, rngs=nnx.Rngs(0))
    exact = NNXDenseMLP(40, 72, dtype=jnp.float32, rngs=nnx.Rngs(0))
    state = nnx.state(theirs, nnx.Param)
    assert jax.tree.map(jnp.shape, nnx.state(ours, nnx.Param)) == jax.tree.map(jnp.shape, state)
    nnx.update(ours, jax.tree.map(lambda p: p * 1.5, state))  # ours holds their (changed) params
    nnx.update(theirs, jax.tree.map(lambda p: p * 1.5, state))
    nnx.update(exact, jax.tree.map(lambda p: p * 1.5, state))
    dy = rand(2, x.shape, dtype)

    def run(model, x):
        def loss(m, x):
            return jnp.sum(m(x).astype(jnp.float32) * dy.astype(jnp.float32))

        gm, gx = nnx.grad(loss, argnums=(0, 1))(model, x)
        return model(x), gx, nnx.state(gm, nnx.Param)

    _check(run(ours, x), run(theirs, x), run(exact, x.astype(jnp.float32)), dtype, "nnx")


def test_linen_options_reach_the_projections(kernel_impl):
    calls = []

    class CountingDot:
        def __call__(self, *args, **kwargs):
            calls.append(args[0].shape)
            return jax.lax.dot_general(*args, **kwargs)

    x = rand(0, (4, 16))
    mlp = SwiGLUMLP(hidden_features=24, out_features=8, use_bias=True, param_dtype=jnp.bfloat16,
                    dot_general_cls=CountingDot, implementation=kernel_impl)
    params = mlp.init(jax.random.key(0), x)["params"]
    assert {k: (v["kernel"].shape, v["bias"].shape, v["kernel"].dtype) for k, v in params.items()} == {
        "gate": ((16, 24), (24,), jnp.bfloat16), "up": ((16, 24), (24,), jnp.bfloat16),
        "down": ((24, 8), (8,), jnp.bfloat16)}
    calls.clear()
    assert mlp.apply({"params": params}, x).shape == (4, 8) and len(calls) == 3


def test_nnx_options_reach_the_projections(kernel_impl):
    calls = []

    def counting_dot(*args, **kwargs):
        calls.append(args[0].shape)
        return jax.lax.dot_general(*args, **kwargs)

    mlp = NNXSwiGLUMLP(16, 24, 8, use_bias=True, dot_general=counting_dot, implementation=kernel_impl,
                       rngs=nnx.Rngs(0))
    assert (mlp.gate.kernel.shape, mlp.down.kernel.shape, mlp.down.bias.shape) == ((16, 24), (24, 8), (8,))
    assert mlp(rand(0, (4, 16))).shape == (4, 8) and len(calls) == 3


def test_adapt_rules_match_the_projections(kernel_impl):
    """A LoRA rule on the projections: the adapted MLP starts equal to the pretrained one."""
    x = rand(0, (4, 32))
    model = SwiGLUMLP(hidden_features=48, implementation=kernel_impl)
    pretrained = model.init(jax.random.key(0), x)["params"]
    lmodel = adapt.apply(model, [adapt.LoraRule(module_path=r"(gate|up|down)", rank=4, alpha=8.0)])
    variables = adapt.from_pretrained(lmodel, lmodel.init(jax.random.key(1), x), pretrained)
    assert not adapt.unused_rules(lmodel)
    assert_close(lmodel.apply(variables, x), to64(model.apply({"params": pretrained}, x)), what="adapted")


def test_zero_tokens(kernel_impl):
    x = jnp.zeros((0, 3, 16), jnp.bfloat16)
    mlp = SwiGLUMLP(hidden_features=24, implementation=kernel_impl)
    params = mlp.init(jax.random.key(0), x)
    grads = jax.grad(lambda p: jnp.sum(mlp.apply(p, x)))(params)
    assert mlp.apply(params, x).shape == (0, 3, 16)
    assert all(float(jnp.sum(jnp.abs(g))) == 0 for g in jax.tree.leaves(grads))
    nmlp = NNXSwiGLUMLP(16, 24, implementation=kernel_impl, rngs=nnx.Rngs(0))
    assert nmlp(x).shape == (0, 3, 16)
