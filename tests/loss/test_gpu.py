"""GPU checks of the compiled loss kernels against the materialized XLA loss (skipped without a CUDA GPU): both
layouts, bf16 and float32, every option, a vocabulary of Llama 3's size and one that divides no block."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_fused.loss import linear_cross_entropy
from tests.helpers import assert_all_written, assert_close, float32_judge_on_cpu, rand, to64
from tests.loss.test_loss import optax_loss

pytestmark = pytest.mark.gpu

CASES = [(512, 512, 128256, jnp.bfloat16, "dv"), (1000, 256, 32003, jnp.bfloat16, "vd"),
         (777, 256, 5001, jnp.float32, "dv")]
OPTIONS = [{}, dict(z_loss=1e-4, label_smoothing=0.1, logit_soft_cap=30.0)]


@pytest.mark.parametrize("options", OPTIONS, ids=["plain", "all"])
@pytest.mark.parametrize("tokens,d,vocab,dtype,layout", CASES, ids=str)
def test_pallas_matches_xla(tokens, d, vocab, dtype, layout, options):
    hidden = rand(0, (tokens, d), dtype)
    weight = rand(1, (vocab, d) if layout == "vd" else (d, vocab), dtype, scale=d ** -0.5 * 4)
    labels = jax.random.randint(jax.random.key(2), (tokens,), 0, vocab).at[::7].set(-100)

    def run(fn, h, w):
        return jax.jit(jax.value_and_grad(fn, (0, 1)))(h, w)

    ours = run(lambda h, w: linear_cross_entropy(h, w, labels, implementation="pallas", **options), hidden, weight)
    base = run(lambda h, w: optax_loss(h, w, labels, layout=layout, **options), hidden, weight)
    with float32_judge_on_cpu() as cpu:
        h32, w32, y = jax.device_put((hidden.astype(jnp.float32), weight.astype(jnp.float32), labels), cpu)
        exact = jax.jit(jax.value_and_grad(lambda h, w: optax_loss(h, w, y, layout=layout, **options), (0, 1)))(
            h32, w32)
    for name, o, b, e in zip(("loss", "d_hidden", "d_weight"), jax.tree.leaves(ours), jax.tree.leaves(base),
                             jax.tree.leaves(exact)):
        assert_all_written(o, name)
        assert_close(o, to64(e), baseline=b, floor=1e-2 if dtype == jnp.bfloat16 else 1e-4, what=name)


def test_kernels_run_compiled():
    hidden, weight = rand(0, (64, 256), jnp.bfloat16), rand(1, (256, 1000), jnp.bfloat16)
    labels = jnp.arange(64) * 7
    text = jax.jit(jax.grad(lambda h, w: linear_cross_entropy(h, w, labels, implementation="pallas"), (0, 1))).lower(
        hidden, weight).as_text()
    assert "pallas_fused_loss_fwd" in text and "pallas_fused_loss_dlogits" in text
