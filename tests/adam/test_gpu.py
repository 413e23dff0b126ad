"""The API tests again on the compiled Pallas kernels (GPU only; CI runs them in interpret mode), plus a
check that the donated in-place step really writes in place (no copies of the big buffers)."""

import re

import jax
import optax
import pytest

import pallas_fused.adam as A
from tests.adam import test_api as api
from tests.helpers import rand

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", [
    "test_adamw_matches_optax_100_steps_fp32",
    "test_adamw_matches_optax_100_steps_bf16",
    "test_mu_dtype_bf16",
    "test_adam_and_scale_by_adam_match_optax",
    "test_schedule_mask_and_clipping_in_chain",
    "test_multi_transform_and_multisteps",
    "test_inject_hyperparams_runtime_operands_no_recompile",
    "test_state_bits_8_converges_like_fp32",
    "test_non_finite_gradients",
    "test_leaf_functions",
    "test_xla_implementation_matches_kernel",
])
def test_api_on_gpu(name):
    getattr(api, name)("pallas")


def test_gpu_orbax_round_trip(tmp_path):
    api.test_orbax_round_trip("pallas", tmp_path)


@pytest.mark.parametrize("path", ["inplace", "optax"])
@pytest.mark.parametrize("state_bits", [None, 8])
def test_gpu_step_has_no_copies(state_bits, path):
    """Donated params and state: neither the in-place step nor the optax path copies a tensor-sized buffer."""
    shapes = [(4096, 1024), (4096, 1000), (4096, 1024)]
    params = [rand(i, s) for i, s in enumerate(shapes)]
    grads = [rand(10 + i, s) for i, s in enumerate(shapes)]
    opt = A.adamw(1e-3, weight_decay=0.01, state_bits=state_bits, implementation="pallas")
    state = opt.init(params)

    def step(params, grads, state):
        if path == "inplace":
            return A.adamw_step(params, grads, state, learning_rate=1e-3, weight_decay=0.01, implementation="pallas")
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    hlo = jax.jit(step, donate_argnums=(0, 2)).lower(params, grads, state).compile().as_text()
    copies = [line for line in hlo.splitlines() if re.search(r"= \w+\[4096,10\d\d\]\{[^}]*\} copy\(", line)
              or re.search(r"= (f32|u8)\[\d{6,}\]\{[^}]*\} copy\(", line)]
    assert not copies, "\n".join(copies[:5])
    new_params, new_state = jax.jit(step, donate_argnums=(0, 2))(params, grads, state)
    assert optax.tree.norm(new_params) > 0 and int(new_state.count) == 1
