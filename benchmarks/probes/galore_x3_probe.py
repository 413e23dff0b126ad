"""Backs docs/performance.md's BF16_BF16_F32_X3 step times (0.308 against 0.267 ms at 4096x11008 r128).

Development probe: GaLore's fp32 GEMMs as three bf16 products (XLA's BF16_BF16_F32_X3 dot algorithm) instead of
TF32, inside the whole user step (`bench_galore.user_path_step`, params, grads and state donated), the candidates
timed in turn, then traced (GPU kernel time per step and its kernels), beside optax.contrib.galore's step.

Why: with fp32 params GaLore's "std" side projects a wide matrix from the left, R = P^T G, whose contraction runs
along G's rows: neither operand is K-major, which Hopper's TF32 wgmma needs, while its 16-bit wgmma reads either
layout. bf16x3 (hi/lo splits, three bf16 products, fp32 accumulation) is also closer to fp32 than TF32.

    host        the package as it is, the host's refresh schedule (no conditional)
    host_x3     the down-projection R with BF16_BF16_F32_X3
    host_x3_up  the down- and the up-projection with BF16_BF16_F32_X3
    dev, dev_x3 the same two with the refresh decided on the device (the default: a predicate read-back per step)
    contrib     optax.contrib.galore

    python benchmarks/probes/galore_x3_probe.py OUT_DIR [MxN:r:dtype ...]
"""

import os
import sys
from unittest import mock

import jax
import jax.numpy as jnp
from jax import lax

from benchmarks.bench_galore import probe_case, probe_step
from benchmarks.common import error_text, probe_recorder
from benchmarks.trace import time_then_trace
from pallas_fused.galore import reference

F32 = jnp.float32
X3 = lax.DotAlgorithmPreset.BF16_BF16_F32_X3
ORIG_PROJECT, ORIG_BACK = reference.project, reference.back_project


def project_x3(g, p, side, precision=None):
    return ORIG_PROJECT(g, p, side, X3 if precision is None and g.dtype == F32 else precision)


def back_x3(n, p, side, precision=None, dtype=F32):
    return ORIG_BACK(n, p, side, X3 if precision is None and jnp.dtype(dtype) == F32 else precision, dtype)


PATCHES = {"host": [], "host_x3": [("project", project_x3)],
           "host_x3_up": [("project", project_x3), ("back_project", back_x3)],
           "dev": [], "dev_x3": [("project", project_x3)]}


def build(name, r, shape, dtype):
    if name == "contrib":
        return probe_step(name, r, shape, dtype, impl="pallas:tx")
    impl = "pallas:tx_host_refresh" if name.startswith("host") else "pallas:tx"
    patches = [mock.patch.object(reference, attr, fn) for attr, fn in PATCHES[name]]
    for p in patches:
        p.start()
    try:
        step, carry = probe_step(name, r, shape, dtype, impl=impl)
        # the host schedule's step between refreshes is a jit of its own, traced on its first call: make that call
        # here, under the patches
        return step, step(*carry)
    finally:
        for p in patches:
            p.stop()


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    record = probe_recorder(f"{out}/galore_x3_probe.json")
    cases = sys.argv[2:] or ["4096x11008:128:float32", "4096x11008:512:float32", "4096x4096:128:float32",
                             "4096x4096:512:float32", "4096x4096:32:float32", "4096x11008:32:float32"]
    for spec in cases:
        case, shape, r, dtype = probe_case(spec)
        g = jax.random.normal(jax.random.key(1), shape, F32).astype(dtype)
        side = reference.projector_side(shape, "std")
        p = jax.random.normal(jax.random.key(2), reference.projector_shape(shape, r, side), F32).astype(dtype)
        want = ORIG_PROJECT(g, p, side, lax.Precision.HIGHEST)
        for name, fn in (("tf32 (default)", ORIG_PROJECT), ("x3", project_x3)):
            try:
                got = jax.jit(fn, static_argnums=2)(g, p, side)
                err = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
                record(case=case, impl=name, check="R vs HIGHEST, relative Frobenius error", rel_err=err)
            except Exception as e:  # noqa: BLE001
                record(case=case, impl=name, error=error_text(e))
        time_then_trace(lambda name, r=r, shape=shape, dtype=dtype: build(name, r, shape, dtype), [*PATCHES, "contrib"],
                        record, ref="contrib", top=6, case=case)


if __name__ == "__main__":
    main()
