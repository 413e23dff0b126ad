"""How fast GaLore's two full-size GEMMs run for fp32 params, per formulation (development probe). With fp32 params
the optax path's step is two TF32 cuBLAS GEMMs: the down-projection R = G P^T / P^T G (reads G) and the
up-projection with apply_updates' add folded in, p + P N' / N' P (reads and writes p); each is timed amortized over
K operand sets per jit, with its GPU kernels from a trace and its error against an fp32 HIGHEST reference.

  up_tf32        what runs now: fp32 operands (TF32), fp32 output, cuBLAS beta = 1 takes p
  up_bf16        the small operands N' and P rounded to bf16, fp32 accumulation and output, + p (the in-place
                 kernel's 16-bit operands): the update is exact to bf16's 8 bits, p's add in fp32
  down_tf32      what runs now: G and P in fp32 (TF32)
  down_tf32_t    side left only: (G^T P)^T, the same product in the orientation cuBLAS runs fastest
  down_bf16      G converted to bf16 inside the GEMM (a Triton fusion reading fp32 G), P in bf16, fp32 output: the
                 speed a 16-bit operand read would give, for comparison only (it changes the numbers)

    python benchmarks/results/user_path_dev/galore_fp32_probe.py OUT_DIR
"""

import os
import sys

import jax
import jax.numpy as jnp

from benchmarks.common import bench_amortized, bench_carry_amortized, error_text, probe_recorder, rnd
from benchmarks.trace import trace_steps
from pallas_fused.galore import reference

OUT = sys.argv[1] if len(sys.argv) > 1 else "/tmp/galore_fp32_probe"
os.makedirs(f"{OUT}/hlo", exist_ok=True)
CPU = jax.default_backend() == "cpu"
K = 2 if CPU else 3
HI = jax.lax.Precision.HIGHEST
f32, bf16 = jnp.float32, jnp.bfloat16
record = probe_recorder(f"{OUT}/galore_fp32_probe.json")


def orth(seed, shape):
    q = jnp.linalg.qr(rnd(seed, (max(shape), min(shape))))[0]
    return q if shape[0] >= shape[1] else q.T


def rel(x, y):
    return f"{float(jnp.linalg.norm(x.astype(f32) - y) / jnp.linalg.norm(y)):.2e}"


def up(n, p, side, dtype):
    return reference.back_project(n, p, side, None, dtype) if dtype == f32 else (
        jnp.matmul(n.astype(dtype), p.astype(dtype), preferred_element_type=f32) if side == "right"
        else jnp.matmul(p.astype(dtype), n.astype(dtype), preferred_element_type=f32))


def down(g, p, side, form):
    if form == "down_tf32":
        return reference.project(g, p, side)
    if form == "down_tf32_t":
        return jnp.matmul(g.T, p, preferred_element_type=f32).T
    return reference.project(g.astype(bf16), p.astype(bf16), side)


def main():
    cases = [(4096, 4096, 128), (4096, 4096, 32), (4096, 4096, 512), (4096, 11008, 128), (11008, 4096, 128)]
    for m, n, r in cases:
        m, n, r = (m // 32, n // 32, max(2, r // 32)) if CPU else (m, n, r)
        side = reference.projector_side((m, n), "std")
        pshape = reference.projector_shape((m, n), r, side)
        lshape = reference.lowrank_shape((m, n), r, side)
        case = f"{m}x{n} r{r} {side}"
        gb = m * n * 4 / 1e9
        sets = [(rnd(10 * i, (m, n)), orth(10 * i + 1, pshape), rnd(10 * i + 2, lshape, scale=1e-3)) for i in range(K)]
        g0, p0, n0 = sets[0]
        exact_up = reference.back_project(n0, p0, side, HI)
        exact_down = reference.project(g0, p0, side, HI)
        for dtype, name in ((f32, "up_tf32"), (bf16, "up_bf16")):
            def step(w, p, lo, dtype=dtype, side=side):
                return w + up(lo, p, side, dtype), p, lo
            try:
                err = rel(up(n0, p0, side, dtype), exact_up)
                ms = bench_carry_amortized(step, sets, n=30, reps=3)
                fn = jax.jit(step, donate_argnums=0)
                record(case=case, impl=name, ms=round(ms, 4), gbps=round(2 * gb / ms * 1e3), rel_err=err,
                       **trace_steps(fn, (jnp.copy(g0), p0, n0), 10, top=4))
            except Exception as e:  # noqa: BLE001 - a failing formulation is a result
                record(case=case, impl=name, error=error_text(e))
        for name in ("down_tf32", "down_tf32_t", "down_bf16"):
            if name == "down_tf32_t" and side == "right":
                continue
            try:
                fn = jax.jit(lambda g, p, name=name, side=side: down(g, p, side, name))
                with open(f"{OUT}/hlo/{case.replace(' ', '_')}_{name}.txt", "w") as f:
                    f.write(fn.lower(g0, p0).compile().as_text())
                err = rel(fn(g0, p0), exact_down)
                ms = bench_amortized(lambda g, p, lo, name=name, side=side: down(g, p, side, name), sets, n=30, reps=3)
                record(case=case, impl=name, ms=round(ms, 4), gbps=round(gb / ms * 1e3), rel_err=err,
                       **trace_steps(lambda g, p, fn=fn: (g, p, fn(g, p))[:2], (g0, p0), 10, top=4))
            except Exception as e:  # noqa: BLE001
                record(case=case, impl=name, error=error_text(e))


if __name__ == "__main__":
    main()
