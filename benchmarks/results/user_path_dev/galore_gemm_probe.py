"""Which XLA formulations of GaLore's two GEMMs run fastest on this GPU (development probe), each timed amortized over
K distinct operand sets per jit (a single 0.03-0.1 ms call would time the host dispatch), GPU kernel time per kernel
name from a trace, the optimized HLO of each written to OUT/hlo/:

  up16_convert / up16_select   the 16-bit up-projection with apply_updates' add, p + P @ N', its small operand N' cast
                               to 16 bits as the last op (convert) or selected after the cast (what the library
                               runs): does XLA:GPU pick a Triton GEMM fusion for the first and cuBLAS (beta = 1) for
                               the second, as the peer's 16-bit step gets?
  down_left_s1 / _s2 / _s4     the side-left down-projection R = P^T G of a wide matrix (GaLore's "std" side at
                               4096x11008, 90 us against the peer's orientation's 60 us in fp32), and the same as s
                               batched partial GEMMs over row blocks of G summed in fp32 (more CTAs for cuBLAS)
  down_right                   the peer's orientation G P (contraction over N) at the same shape, for comparison
  cond_none / cond_gemm / cond_refresh   a non-refresh step (down, low-rank Adam, up + add) with no conditional, with
                               a lax.cond whose true branch is GEMMs and elementwise ops only (capturable in a CUDA
                               graph), and with the randomized refresh (cuSOLVER calls) as the true branch: whether this
                               XLA runs a conditional on the device (no predicate read-back) when its branches allow it

    python benchmarks/results/user_path_dev/galore_gemm_probe.py OUT_DIR
"""

import os
import sys

import jax
import jax.numpy as jnp
from jax import lax

from benchmarks.common import bench_carry, bench_carry_amortized, probe_recorder, rnd
from benchmarks.trace import trace_steps
from pallas_fused.galore import projector

OUT = sys.argv[1] if len(sys.argv) > 1 else "/tmp/galore_gemm_probe"
os.makedirs(f"{OUT}/hlo", exist_ok=True)
CPU = jax.default_backend() == "cpu"
K = 2 if CPU else 4


record = probe_recorder(f"{OUT}/galore_gemm_probe.json")


def measure(case, name, step, states, amortized=True):
    """Time `step` (carry -> carry, all of it donated), trace its kernels, write its HLO."""
    try:
        fn = jax.jit(step, donate_argnums=tuple(range(len(states[0]))))
        with open(f"{OUT}/hlo/{case.replace(' ', '_')}_{name}.txt", "w") as f:
            f.write(fn.lower(*states[0]).compile().as_text())
        if amortized:
            ms = bench_carry_amortized(step, states, n=20)
        else:
            ms = bench_carry(fn, jax.tree.map(jnp.copy, states[0]), n=50)
        record(case=case, impl=name, ms=round(ms, 4), **trace_steps(fn, fn(*jax.tree.map(jnp.copy, states[0])), 10))
    except Exception as e:  # noqa: BLE001 - a failing formulation is a result
        record(case=case, impl=name, error=f"{type(e).__name__}: {e}"[:400])


def d(*dims):
    return tuple(x // 32 if CPU else x for x in dims)


def orth(seed, shape, dtype):
    q = jnp.linalg.qr(rnd(seed, (max(shape), min(shape))))[0]
    return (q if shape[0] >= shape[1] else q.T).astype(dtype)


# -- the 16-bit up-projection with the add: operand cast last vs selected after the cast
R = 2 if CPU else 128
for M, N in (d(4096, 4096), d(4096, 11008)):
    case = f"{M}x{N} r{R} bfloat16"
    sets = [(rnd(10 * i, (M, N), jnp.bfloat16), orth(10 * i + 1, (M, R), jnp.bfloat16), rnd(10 * i + 2, (R, N)),
             jnp.ones([], jnp.bool_)) for i in range(K)]

    def up_convert(p, proj, n, ok):
        n16 = jnp.where(ok, n * -1e-3, 0.0).astype(jnp.bfloat16)
        return p + proj @ n16, proj, n, ok

    def up_select(p, proj, n, ok):
        n16 = jnp.where(ok, (n * -1e-3).astype(jnp.bfloat16), jnp.zeros((), jnp.bfloat16))
        return p + proj @ n16, proj, n, ok

    measure(case, "up16_convert", up_convert, sets)
    measure(case, "up16_select", up_select, sets)

# -- the side-left down-projection of a wide matrix, whole and split over row blocks of G
for dtype in (jnp.float32, jnp.bfloat16):
    M, N = d(4096, 11008)
    case = f"{M}x{N} r{R} {jnp.dtype(dtype).name}"
    sets = [(rnd(10 * i, (M, N), dtype), orth(10 * i + 1, (M, R), dtype), rnd(10 * i + 2, (R, N))) for i in range(K)]
    for s in (1, 2, 4):
        def down(g, p, out, s=s):
            if s == 1:
                return g, p, jnp.matmul(p.T, g, preferred_element_type=jnp.float32)
            rows_, cols = g.shape
            parts = jnp.einsum("smr,smn->srn", p.reshape(s, rows_ // s, R), g.reshape(s, rows_ // s, cols),
                               preferred_element_type=jnp.float32)
            return g, p, parts.sum(0)
        measure(case, f"down_left_s{s}", down, sets)
    sets_r = [(rnd(10 * i, (M, N), dtype), orth(10 * i + 1, (N, R), dtype), rnd(10 * i + 2, (M, R)))
              for i in range(K)]
    measure(case, "down_right", lambda g, p, out: (g, p, jnp.matmul(g, p, preferred_element_type=jnp.float32)),
            sets_r)

# -- the conditional: none, a GEMM-only true branch, the randomized refresh
M, N = d(4096, 4096)
case = f"{M}x{N} r{R} float32 step"


def lowrank_step(w, g, m, v, p):
    r = g @ p.T
    m1, v1 = 0.9 * m + 0.1 * r, 0.999 * v + 0.001 * r * r
    keep = jnp.all(jnp.isfinite(m1) & jnp.isfinite(v1))
    n = jnp.where(keep, -1e-3 * m1 / (jnp.sqrt(v1) + 1e-8), 0.0)
    return w + n @ p, jnp.where(keep, m1, m), jnp.where(keep, v1, v)


def make(kind):
    def step(w, g, m, v, p, count):
        pred = count % 1_000_000 == 0
        if kind == "cond_gemm":
            p = lax.cond(pred, lambda: (p + 1e-3 * (p @ g.T) @ g).astype(p.dtype), lambda: p)
        elif kind == "cond_refresh":
            p = lax.cond(pred, lambda: projector.randomized_projector(g, R, "right", jax.random.key(0), prev=p),
                         lambda: p)
        w, m, v = lowrank_step(w, g, m, v, p)
        return w, g, m, v, p, count + 1
    return step


state = (rnd(1, (M, N)), rnd(2, (M, N)), rnd(3, (M, R), scale=0.01), jnp.abs(rnd(4, (M, R), scale=1e-4)),
         orth(5, (R, N), jnp.float32), jnp.ones([], jnp.int32))
for kind in ("cond_none", "cond_gemm", "cond_refresh"):
    measure(case, kind, make(kind), [state], amortized=False)
