"""Test helpers: random non-zero inputs, relative errors, and the reference-comparison rule.

The rule (see DESIGN.md): a kernel's error against an exact (float64) reference may be at most
`factor` (2) times the error of the same-precision XLA reference against that exact reference, with a
small per-dtype floor so that an exact-to-the-bit reference does not demand the impossible. NaN or inf
never passes.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

# Relative-error floors: a few ulps of the storage dtype, the error of one rounding of the result.
FLOOR = {
    jnp.dtype(jnp.float64): 1e-12,
    jnp.dtype(jnp.float32): 2e-6,
    jnp.dtype(jnp.bfloat16): 8e-3,
    jnp.dtype(jnp.float16): 1e-3,
}

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)

# XLA:CPU flags of the tests that run jax in a subprocess (multi-process, simulated devices): they compare one
# program with another compiled under the same flags, and compile far more than they run, so LLVM's optimization
# passes are skipped. Not for the in-process suite: at level 0 XLA:CPU rounds some float expressions differently
# from the default level, which its bit-exact checks (the 8-bit Adam encoders) see.
SUBPROCESS_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
# The environment of the tests' jax.distributed processes on CPU: no persistent compilation cache. jax writes cache
# entries from process 0 only, and the other processes' cache keys differ from its own, so with a warm cache (one an
# earlier run of the same test filled, as a second `make test` finds it) process 0 runs the executables it
# deserializes while process 1 compiles the same programs anew. On XLA:CPU that pair computes wrong numbers: the
# 2-process FSDP run of the example then differs from one process' run (a GaLore refresh sees a non-finite gradient,
# moments off by 1-10%), where process 0 compiling too gives the reference's. Each CI leg starts with an empty cache.
MULTIPROCESS_ENV = {"XLA_FLAGS": SUBPROCESS_XLA_FLAGS, "JAX_ENABLE_COMPILATION_CACHE": "false"}


def rand(seed: int, shape, dtype=jnp.float32, scale: float = 1.0, offset: float = 0.0) -> jax.Array:
    """Normal random values (never all zeros), cast to `dtype`."""
    x = jax.random.normal(jax.random.key(seed), shape, jnp.float32) * scale + offset
    return x.astype(dtype)


def to64(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x).astype(jnp.float32), dtype=np.float64)


@contextlib.contextmanager
def float32_judge_on_cpu():
    """Yields the CPU device, with it the default and dots at full precision: where a float32 judge of a GPU run is
    computed (its inputs put there), so that it is compiled by another backend than the run it judges and a GPU
    compiler bug cannot hit both alike."""
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu), jax.default_matmul_precision("highest"):
        yield cpu


def rel_err(x, ref) -> float:
    """||x - ref|| / ||ref|| in float64; inf where x has a non-finite value."""
    x, ref = to64(x), np.asarray(ref, dtype=np.float64)
    if x.shape != ref.shape:
        raise AssertionError(f"shape {x.shape} != reference shape {ref.shape}")
    if not np.all(np.isfinite(x)):
        return float("inf")
    denom = np.linalg.norm(ref)
    return float(np.linalg.norm(x - ref) / (denom if denom > 0 else 1.0))


def assert_close(out, exact, *, baseline=None, dtype=None, factor: float = 2.0, floor: float | None = None, what=""):
    """Assert `out` is as close to `exact` (float64) as the same-precision `baseline` is, within `factor`."""
    dtype = jnp.dtype(dtype or jnp.asarray(out).dtype)
    err = rel_err(out, exact)
    allowed = FLOOR.get(dtype, 1e-6) if floor is None else floor
    if baseline is not None:
        allowed = max(allowed, factor * rel_err(baseline, exact))
    assert err <= allowed, f"{what}: relative error {err:.3g} > allowed {allowed:.3g} ({dtype})"
    return err


def assert_all_written(x, what=""):
    """Every element finite: catches outputs the kernel never wrote (poisoned with NaN) or overflowed."""
    arr = to64(x)
    assert np.all(np.isfinite(arr)), f"{what}: {int(np.sum(~np.isfinite(arr)))} non-finite elements"


def odd_dims(min_value: int = 1, max_value: int = 67) -> st.SearchStrategy[int]:
    """Sizes that are rarely multiples of a block: hypothesis' strategy for shape dimensions."""
    return st.integers(min_value=min_value, max_value=max_value)
