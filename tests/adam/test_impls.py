"""The Adam leaf step's implementation objects (pallas_fused/adam/impls.py): what each supports and why not, its
default config, the choice of implementation=None, and the interpreted kernels against the reference."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_fused.adam as A
from pallas_fused import _backend, _tuning
from pallas_fused.adam import api
from pallas_fused.adam import impls as I
from pallas_fused.adam import kernel as K
from pallas_fused.adam import reference as R
from tests.helpers import rand, rel_err

CPU, AMPERE, HOPPER = _tuning.Device("cpu"), _tuning.Device("A100", (8, 0), 108), _tuning.Device("H100", (9, 0), 132)


def _scalars(t=3, wd=0.05):
    b1, b2 = 0.9, 0.999
    return K.scalar_operand([-1e-2, b1, 1 - b1, b2, 1 - b2, 1e-8, 0.0, wd, 1 - b1**t, 1 - b2**t])


def _random_q8(seed, n):
    """8-bit moments of an n-element tensor with random codes and absmaxes (never zeros)."""
    nb = R.num_blocks(n)

    def moment(k):
        codes = jax.random.randint(jax.random.key(seed + k), (nb * R.QBLOCK,), 1, 255).astype(jnp.uint8)
        return A.QuantizedMoment(codes, 0.5 + jax.random.uniform(jax.random.key(seed + k + 1), (nb,)))

    return moment(0), moment(2)


def _args(shape, *, state="fp32", dtype=jnp.float32, inplace=False, with_p=True, seed=0):
    g = rand(seed, shape, dtype)
    p = rand(seed + 1, shape, dtype) if (with_p or inplace) else None
    if state == "q8":
        mu, nu = _random_q8(seed + 2, g.size)
    else:
        sdt = jnp.float32 if state == "fp32" else jnp.bfloat16
        mu, nu = rand(seed + 2, shape, sdt), jnp.abs(rand(seed + 3, shape, sdt)) + 0.1
    return I.LeafArgs(g, mu, nu, p, _scalars(), inplace, None if inplace else jnp.promote_types(dtype, jnp.float32))


def test_supported_reasons():
    fp32, q8 = _args((3, 5)), _args((5000,), state="q8")
    for args in (fp32, q8):
        for device in (CPU, AMPERE, HOPPER):
            assert I.XLA.supported(args, device) is None
            assert I.INTERPRET.supported(args, device) is None
        assert "compute capability 8.0 or newer" in I.TRITON.supported(args, CPU)
        assert I.TRITON.supported(args, AMPERE) is None and I.TRITON.supported(args, HOPPER) is None
        assert "Hopper" in I.SM90.supported(args, CPU) and "Hopper" in I.SM90.supported(args, AMPERE)
    assert "fp32/bf16 states only" in I.SM90.refuses(q8) and I.SM90.refuses(fp32) is None
    if _backend.JAX_VERSION < (0, 11):
        assert "jax >= 0.11" in I.SM90.supported(fp32, HOPPER)
    else:
        assert I.SM90.supported(fp32, HOPPER) is None
        assert "fp32/bf16 states only" in I.SM90.supported(q8, HOPPER)


def test_default_config_and_candidates():
    fp32, q8 = _args((3, 5)), _args((5000,), state="q8")
    assert I.TRITON.default_config(fp32, AMPERE) == K.default_launch("fp32")
    assert I.TRITON.default_config(q8, AMPERE) == K.default_launch("q8")
    assert I.TRITON.default_config(q8, AMPERE).block == R.QBLOCK  # one quantization block per program
    assert I.XLA.default_config(fp32, CPU) is None
    from pallas_fused.adam import kernel_mosaic

    assert I.SM90.default_config(fp32, HOPPER) == kernel_mosaic.default_launch()
    assert I.SM90.candidates(fp32, HOPPER) == {"sm90": kernel_mosaic.default_launch()}
    assert I.TRITON.candidates(q8, HOPPER) == {"pallas": K.default_launch("q8")}
    assert set(I.IMPLEMENTATIONS) == {"xla", "pallas", "interpret", "pallas:sm90"}


def test_choice_of_the_default():
    """implementation=None on a GPU: XLA's fused step for fp32/bf16 states, the Triton kernel for 8-bit ones (its
    default launch); without a GPU every leaf runs XLA's; a named implementation is that object."""
    for state, want in (("fp32", I.XLA), ("bf16", I.XLA), ("q8", I.TRITON)):
        args = _args((5000,), state=state)
        assert I.choose(args, HOPPER) == (want, None) and I.choose(args, AMPERE) == (want, None)
    mu = jnp.zeros((4,))
    assert api._leaf_implementation(None, mu) is I.XLA  # no GPU here: "xla"
    assert api._leaf_implementation("interpret", mu) is I.INTERPRET
    for cc in ((8, 0), (9, 0)):
        with _backend.gpu_target(cc):
            assert api._leaf_implementation(None, mu) is None  # chosen per leaf, with its args
            assert api._leaf_implementation("pallas", mu) is I.TRITON
            assert api._leaf_implementation("xla", mu) is I.XLA
    if _backend.JAX_VERSION >= (0, 11):
        with _backend.gpu_target((9, 0)):
            assert api._leaf_implementation("pallas:sm90", mu) is I.SM90
            with pytest.warns(DeprecationWarning, match="'pallas:sm90'"):
                assert api._leaf_implementation("pallas:mosaic", mu) is I.SM90


def test_forced_sm90_refuses_8bit_states():
    if _backend.JAX_VERSION < (0, 11):
        pytest.skip("the Mosaic GPU port needs jax >= 0.11")
    p = rand(0, (64, 80))
    mu, nu = A.init_adam_leaf_state(p, state_bits=8)
    with _backend.gpu_target((9, 0)), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="'pallas:sm90' steps fp32/bf16 states only"):
            A.adam_leaf_update(p, p, mu, nu, jnp.int32(1), learning_rate=1e-3, implementation="pallas:sm90")


def _close(out, ref, dtype):
    tol = 1e-6 if jnp.dtype(dtype) == jnp.float32 else 1e-2
    for x, y in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        assert x.shape == y.shape and x.dtype == y.dtype
        if jnp.issubdtype(x.dtype, jnp.integer):  # 8-bit codes: at most one code apart (rounding at a boundary)
            assert np.max(np.abs(np.asarray(x, np.int32) - np.asarray(y, np.int32))) <= 1
        else:
            assert rel_err(x, y) <= tol, rel_err(x, y)


@pytest.mark.parametrize("shape", [(7,), (3, 37), (1031,)])
@pytest.mark.parametrize("state", ["fp32", "bf16"])
@pytest.mark.parametrize("inplace", [False, True])
def test_interpret_matches_reference(shape, state, inplace):
    dtype = jnp.bfloat16 if state == "bf16" else jnp.float32
    args = _args(shape, state=state, dtype=dtype, inplace=inplace, seed=len(shape) + shape[-1])
    _close(I.INTERPRET(args, I.INTERPRET.default_config(args, CPU)), I.XLA(args), dtype)


@pytest.mark.parametrize("n", [4096 + 7, 2 * 4096])
@pytest.mark.parametrize("inplace", [False, True])
def test_interpret_8bit_matches_reference(n, inplace):
    args = _args((n,), state="q8", inplace=inplace, seed=n % 97)
    _close(I.INTERPRET(args), I.XLA(args), jnp.float32)
