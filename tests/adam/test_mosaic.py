"""implementation="pallas:sm90": the Adam step's Mosaic GPU port against the reference (GPU), and its clear
refusal where it cannot run (CPU)."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pallas_fused.adam as A
from pallas_fused import _backend
from pallas_fused.adam import kernel as K
from pallas_fused.adam import reference as ref
from tests.adam import test_api as api
from tests.helpers import assert_all_written, rand, rel_err


@pytest.mark.skipif(_backend.gpu_device() is not None, reason="checks the refusal without a GPU")
def test_mosaic_refused_without_a_gpu():
    with pytest.raises(_backend.ImplementationError, match="pallas:sm90"):
        A.adamw(1e-3, implementation="pallas:sm90")
    p = rand(0, (8, 16))
    with pytest.raises(_backend.ImplementationError, match="pallas:sm90"):
        A.adam_leaf_update(p, p, *A.init_adam_leaf_state(p), jnp.int32(1), learning_rate=1e-3,
                           implementation="pallas:sm90")
    with pytest.raises(ValueError, match="'pallas', 'xla', 'interpret', 'pallas:sm90', got 'interpret:sm90'"):
        A.adamw(1e-3, implementation="interpret:sm90")  # a Mosaic GPU kernel has no interpret form


def _outcome(implementation):
    """What choosing `implementation` for adamw gives as for a Hopper GPU: the resolved name, or the refusal (jax
    before 0.11 has no Mosaic GPU port)."""
    with _backend.gpu_target((9, 0)):
        try:
            A.adamw(1e-3, implementation=implementation)
            return A.api._implementation(implementation)
        except _backend.ImplementationError as e:
            return str(e)


def test_mosaic_spelling_is_a_deprecated_alias():
    """"pallas:mosaic", the variant's name in 0.2, still chooses the Mosaic GPU port, "pallas:sm90" as every op
    names it, with a DeprecationWarning naming the new spelling at the caller's line; the new name warns nothing."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        new = _outcome("pallas:sm90")
    assert not [w for w in seen if issubclass(w.category, DeprecationWarning)]
    with pytest.warns(DeprecationWarning, match="adam: implementation='pallas:mosaic' is deprecated .* use "
                                                "'pallas:sm90'") as seen:
        old = _outcome("pallas:mosaic")
    assert old == new and "pallas:sm90" in new
    assert {w.filename for w in seen if issubclass(w.category, DeprecationWarning)} == {__file__}


def _scalars(count=3, wd=0.05):
    b1, b2 = 0.9, 0.99
    return K.scalar_operand([-1e-2, b1, 1 - b1, b2, 1 - b2, 1e-8, 0.0, wd, 1 - b1**count, 1 - b2**count])


def _operands(n, p_dtype, m_dtype, seed=0):
    p = rand(seed, (n,), p_dtype)
    g = rand(seed + 1, (n,), p_dtype)
    m = rand(seed + 2, (n,), m_dtype, scale=0.1)
    v = (jnp.abs(rand(seed + 3, (n,), jnp.float32, scale=0.1)) + 1e-3).astype(m_dtype)
    # non-finite gradients: those elements keep p, m, v (update 0)
    g = g.at[n // 2].set(jnp.nan).at[n - 1].set(jnp.inf)
    return p, g, m, v


def _close(out, want, dtype):
    out, want = np.asarray(out, np.float32), np.asarray(want, np.float32)
    # fp32: the same operations as the reference, up to a few ulps of the GPU's division and sqrt in the update
    # (|u| <= ~0.03 here: an ulp is 1.9e-9, and p + u can cancel); bf16 outputs: one rounding
    if dtype == jnp.float32:
        np.testing.assert_allclose(out, want, rtol=1e-6, atol=3e-8)
    else:
        np.testing.assert_allclose(out, want, rtol=8e-3, atol=8e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [300, 512 * 12, 512 * 15, 512 * 12 + 517, (1 << 20) + 512 * 37])
@pytest.mark.parametrize("dtypes", [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.bfloat16),
                                    (jnp.float32, jnp.bfloat16)], ids=["fp32", "bf16", "p32_m16"])
@pytest.mark.parametrize("mode", ["inplace", "direction", "direction_no_p"])
def test_mosaic_kernel_matches_reference(n, dtypes, mode):
    """Sizes: 300 and 6661 (not multiples of 512: the reference steps them), 12 blocks of 512 (6 programs of 2
    steps), 15 blocks (15 programs of 1 step), and 2085 blocks of 512 with the default launch (on the H200: 139
    programs of 15 steps, 1024 does not divide the size)."""
    from pallas_fused.adam import kernel_mosaic

    p, g, m, v = _operands(n, *dtypes)
    s = _scalars()
    inplace = mode == "inplace"
    p_arg = None if mode == "direction_no_p" else p
    want = ref.adam_leaf_reference(g, m, v, s, p_arg, inplace=inplace)
    launch = None if n > 1 << 20 else kernel_mosaic.MosaicLaunch(block=512, steps=2, concurrent=2)
    if n % 512 == 0:
        used = launch or kernel_mosaic.default_launch()
        assert kernel_mosaic.launch_shape(n, used.block, used.steps) is not None
    got = kernel_mosaic.adam_fp32(s, g, m, v, p_arg, inplace=inplace, launch=launch)
    for name, a, b in zip(("out", "m", "v"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert_all_written(a, name)
        _close(a, b, a.dtype)
    out = np.asarray(got[0], np.float32)
    assert np.all(np.isfinite(out)), "non-finite gradients must leave finite params / zero updates"
    assert out[n // 2] == (np.float32(p[n // 2]) if inplace else 0.0)


@pytest.mark.gpu
def test_mosaic_optax_and_inplace_match_optax():
    """100 optax steps and 100 donated in-place steps through the public API with the Mosaic GPU kernel (leaves
    of 32k elements run the kernel, the small ones the reference) against optax.adamw."""
    params = api.mlp_params(hidden=4096)
    want, _, _ = api.train(optax.adamw(**api.HP), params, 100)
    got, _, _ = api.train(A.adamw(**api.HP, implementation="pallas:sm90"), params, 100)
    assert api.tree_rel_err(got, want) < 1e-4
    state = A.adamw(**api.HP).init(params)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, state):
        grads = jax.grad(api.loss_fn)(params)
        return A.adamw_step(params, grads, state, **api.HP, implementation="pallas:sm90")

    p2 = jax.tree.map(jnp.copy, params)
    for _ in range(100):
        p2, state = step(p2, state)
    assert api.tree_rel_err(p2, want) < 1e-4
    assert max(rel_err(a, np.asarray(b)) for a, b in zip(jax.tree.leaves(p2), jax.tree.leaves(got))) < 1e-4


@pytest.mark.gpu
def test_mosaic_refuses_8bit_states():
    p = rand(0, (64, 128))
    with pytest.raises(ValueError, match="8-bit"):
        A.adam_leaf_update(p, p, *A.init_adam_leaf_state(p, state_bits=8), jnp.int32(1), learning_rate=1e-3,
                           implementation="pallas:sm90")


def test_launch_shape_tiles_exactly():
    """The Mosaic GPU launch covers every element once, with no tail (CPU: pure arithmetic)."""
    from pallas_fused.adam import kernel_mosaic

    for n in (512, 512 * 15, 4096 * 1000, 2048 * 8 * 7, (1 << 20) + 512 * 37):
        block, steps, programs = kernel_mosaic.launch_shape(n, 2048, 8)
        assert block * steps * programs == n and 512 <= block <= 2048 and 1 <= steps <= 8
    assert kernel_mosaic.launch_shape(2048 * 8 * 7, 2048, 8) == (2048, 8, 7)
    assert kernel_mosaic.launch_shape(2048 * 7, 2048, 8) == (2048, 7, 1)
    for n in (300, 512 * 12 + 517, 128 * 3):
        assert kernel_mosaic.launch_shape(n, 2048, 8) is None


def test_mosaic_launch_is_tuning_data():
    """The launch comes from the device kind's tuning table ("adam_mosaic"), else the dataclass defaults; a launch
    the kernel cannot tile is a ValueError naming the field."""
    from pallas_fused.adam import kernel_mosaic

    if _backend.gpu_device() is None:
        assert kernel_mosaic.default_launch() == kernel_mosaic.MosaicLaunch()
    table = _backend.tuning_table("NVIDIA H200")["adam_mosaic"]["fp32"]
    assert kernel_mosaic.MosaicLaunch(**table) == kernel_mosaic.MosaicLaunch()
    with pytest.raises(ValueError, match="block"):
        kernel_mosaic.MosaicLaunch(block=300)
    with pytest.raises(ValueError, match="steps"):
        kernel_mosaic.MosaicLaunch(steps=0)

