"""Backs docs/galore.md: the TF32 down-projection's 93 against 59 us, and a slower Pallas split-K GEMM.

Development probe: the down-projection of GaLore's optax step (no weight decay: XLA's graph end to end), formulated
three ways, inside the whole user step (`bench_galore.user_path_step`, params, grads and state donated) in a fresh
process, the candidates timed in turn, then traced (GPU kernel time per step and its kernels):

    xla        reference.project as the package runs it (XLA picks the GEMM, a split-K one's partial sums fused
               into the low-rank Adam step)
    xla_t      the same product written transposed (side right: (P G^T)^T, side left: (G^T P)^T): XLA sees the
               GEMM with the rank as its M and may pick another kernel
    splitk_*   a Pallas (Triton) split-K GEMM in G's own dtype (bf16 operands for bf16 G, TF32 for fp32), its
               (splits, *R.shape) fp32 partial sums summed by XLA inside the low-rank Adam fusion

beside optax.contrib.galore's step.

    python benchmarks/probes/galore_down_probe.py OUT_DIR [MxN:r:dtype ...]
"""

import functools
import os
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from benchmarks.bench_galore import probe_case, probe_step
from benchmarks.common import error_text, probe_recorder
from benchmarks.trace import time_then_trace
from pallas_fused import _backend
from pallas_fused.galore import reference

F32 = jnp.float32
INTERPRET = os.environ.get("PROBE_INTERPRET") == "1"  # a CPU smoke run


def _right_kernel(g_ref, p_ref, o_ref, *, BM, BK, KSTEPS, tf32):
    # o[s, rows, :] = G[rows, K slice s] @ P[:, K slice s]^T
    i, sp = pl.program_id(0), pl.program_id(1)
    k0 = sp * (KSTEPS * BK)

    def body(k, acc):
        start = pl.multiple_of(k0 + k * BK, BK)
        g = _backend.load(g_ref.at[pl.ds(i * BM, BM), pl.ds(start, BK)])
        p = _backend.load(p_ref.at[:, pl.ds(start, BK)])
        return acc + _backend.dot(g, p, trans_b=True, allow_tf32=tf32)

    acc = lax.fori_loop(0, KSTEPS, body, jnp.zeros((BM, p_ref.shape[0]), F32))
    _backend.store(o_ref.at[sp, pl.ds(i * BM, BM), :], acc)


def _left_kernel(g_ref, p_ref, o_ref, *, BN, BK, KSTEPS, tf32):
    # o[s, :, cols] = P[K slice s, :]^T @ G[K slice s, cols], computed as (G^T P)^T
    j, sp = pl.program_id(0), pl.program_id(1)
    k0 = sp * (KSTEPS * BK)

    def body(k, acc):
        start = pl.multiple_of(k0 + k * BK, BK)
        g = _backend.load(g_ref.at[pl.ds(start, BK), pl.ds(j * BN, BN)])
        p = _backend.load(p_ref.at[pl.ds(start, BK), :])
        return acc + _backend.dot(p, g, trans_a=True, allow_tf32=tf32)

    acc = lax.fori_loop(0, KSTEPS, body, jnp.zeros((p_ref.shape[1], BN), F32))
    _backend.store(o_ref.at[sp, :, pl.ds(j * BN, BN)], acc)


@functools.partial(jax.jit, static_argnames=("side", "bm", "bk", "splits", "warps", "stages"))
def down_splitk(g, p, *, side, bm, bk, splits, warps, stages):
    M, N = g.shape
    K, keep = (N, M) if side == "right" else (M, N)
    R = p.shape[0] if side == "right" else p.shape[1]
    assert K % (splits * bk) == 0 and keep % bm == 0, (g.shape, bm, bk, splits)
    p = p.astype(g.dtype)
    tf32 = g.dtype == F32
    ksteps = K // (splits * bk)
    if side == "right":
        kern = functools.partial(_right_kernel, BM=bm, BK=bk, KSTEPS=ksteps, tf32=tf32)
        low = (M, R)
    else:
        kern = functools.partial(_left_kernel, BN=bm, BK=bk, KSTEPS=ksteps, tf32=tf32)
        low = (R, N)
    call = _backend.triton_call(kern, out_shape=jax.ShapeDtypeStruct((splits, *low), F32),
                                grid=(keep // bm, splits), name="probe_galore_down_splitk", interpret=INTERPRET,
                                num_warps=warps, num_stages=stages)
    return call(g, p)


ORIG = reference.project  # the package's (the patched candidates' reference)


def project_t(g, p, side, precision=None):
    if side == "right":
        return jnp.matmul(p, g.T, precision=precision, preferred_element_type=F32).T
    return jnp.matmul(g.T, p, precision=precision, preferred_element_type=F32).T


def project_splitk(cfg):
    def project(g, p, side, precision=None):
        return jnp.sum(down_splitk(g, p, side=side, **cfg), axis=0)
    return project


SPLITK = {
    "splitk_64x64s4": dict(bm=64, bk=64, splits=4, warps=4, stages=4),
    "splitk_128x64s4": dict(bm=128, bk=64, splits=4, warps=8, stages=3),
    "splitk_64x128s8": dict(bm=64, bk=128, splits=8, warps=4, stages=3),
    "splitk_128x32s8": dict(bm=128, bk=32, splits=8, warps=8, stages=4),
}
# no split (R itself, no partial sums for XLA to add): one program per `bm` kept rows, the whole contraction each
NOSPLIT = {
    "nosplit_32x128": dict(bm=32, bk=128, splits=1, warps=4, stages=4),
    "nosplit_64x64": dict(bm=64, bk=64, splits=1, warps=4, stages=4),
    "nosplit_64x128": dict(bm=64, bk=128, splits=1, warps=4, stages=3),
}
if os.environ.get("DOWN_PROBE_NOSPLIT"):  # only the unsplit kernels beside XLA's
    SPLITK = NOSPLIT


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    record = probe_recorder(f"{out}/galore_down_probe.json")
    cases = sys.argv[2:] or ["4096x4096:128:bfloat16", "4096x11008:128:bfloat16", "4096x4096:32:float32",
                             "4096x4096:128:float32", "4096x11008:128:float32"]
    formulations = {"xla": ORIG, "xla_t": project_t, **{k: project_splitk(c) for k, c in SPLITK.items()}}
    for spec in cases:
        case, shape, r, dtype = probe_case(spec)

        def build(name, r=r, shape=shape, dtype=dtype):
            patch = None if name == "contrib" else (reference, "project", formulations[name])
            return probe_step(name, r, shape, dtype, impl="pallas:tx", patch=patch)

        g = jax.random.normal(jax.random.key(1), shape, F32).astype(dtype)
        side = reference.projector_side(shape, "std")
        p = jax.random.normal(jax.random.key(2), reference.projector_shape(shape, r, side), F32).astype(dtype)
        want = ORIG(g, p, side, lax.Precision.HIGHEST)
        for name in formulations:
            try:
                got = formulations[name](g, p, side)
                err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
                record(case=case, impl=name, check="R vs HIGHEST", max_rel_err=err)
            except Exception as e:  # noqa: BLE001
                record(case=case, impl=name, error=error_text(e))
        time_then_trace(build, [*formulations, "contrib"], record, ref="contrib", top=6, case=case)


if __name__ == "__main__":
    main()
