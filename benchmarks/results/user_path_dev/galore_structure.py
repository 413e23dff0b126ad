"""Which graph structure makes GaLore's optax step fastest (development probe): the same non-refresh step
(convention "galore", side right/left as galore_adamw picks) written as plain jnp in three shapes, beside
galore_adamw(implementation="xla") and optax.contrib.galore, all as the donated `update -> apply_updates` step:

  early   the refresh lax.cond first (galore_adamw's order), then one finiteness reduction over m' + v' and
          one fused select of m', v' and the scaled N
  late    the low-rank step computed with the previous projector first, then the lax.cond (whose true branch
          refreshes and recomputes it), so the predicate's read-back waits on queued GPU work
  nocond  no conditional at all (a lower bound; it never refreshes)

    python benchmarks/results/user_path_dev/galore_structure.py OUT_DIR
"""

import functools
import sys

import jax
import jax.numpy as jnp
import optax
from jax import lax

from benchmarks.common import bench_carry, probe_recorder, rnd
from pallas_fused.galore import api, projector, reference

OUT = sys.argv[1]
LR, B1, B2, EPS, SCALE, GAP = 1e-3, 0.9, 0.999, 1e-6, 0.25, 10**9


record = probe_recorder(f"{OUT}/galore_structure.json")


def lowrank(g, p, m, v, count, side):
    r = reference.project(g, p, side)
    t = (count + 1).astype(jnp.float32)
    m1 = B1 * m + (1 - B1) * r
    v1 = B2 * v + (1 - B2) * r * r
    c = -LR * SCALE * jnp.sqrt(1 - B2**t) / (1 - B1**t)
    n = m1 / (jnp.sqrt(v1) + EPS)
    fin = jnp.all(jnp.isfinite(m1 + v1))
    return jnp.where(fin, m1, m), jnp.where(fin, v1, v), jnp.where(fin, c * n, 0.0)


def refresh(g, p, side, count):
    key = jax.random.fold_in(jax.random.key(0), count)
    return projector.randomized_projector(g, p.shape[0] if side == "right" else p.shape[1], side, key, prev=p,
                                          dtype=p.dtype)


def make_step(kind, side):
    def step(w, g, s):
        count, m, v, p = s
        pred = count % GAP == 0
        if kind == "early":
            p = lax.cond(pred, lambda: refresh(g, p, side, count), lambda: p)
            m, v, n = lowrank(g, p, m, v, count, side)
        elif kind == "late":
            spec = lowrank(g, p, m, v, count, side)

            def fresh():
                p2 = refresh(g, p, side, count)
                return (p2, *lowrank(g, p2, m, v, count, side))

            p, m, v, n = lax.cond(pred, fresh, lambda: (p, *spec))
        else:
            m, v, n = lowrank(g, p, m, v, count, side)
        u = reference.back_project(n, p, side).astype(w.dtype)
        return w + u, g, (count + 1, m, v, p)

    return jax.jit(step, donate_argnums=(0, 1, 2))


for M, N, dtype in ((4096, 4096, jnp.float32), (4096, 11008, jnp.float32), (4096, 4096, jnp.bfloat16)):
    r = 128
    case = f"{M}x{N} r{r} {jnp.dtype(dtype).name}"
    side = reference.projector_side((M, N), "std")
    p0 = jnp.linalg.qr(rnd(5, (N if side == "right" else M, r)))[0]
    p0 = (p0.T if side == "right" else p0).astype(dtype)
    low = reference.lowrank_shape((M, N), r, side)
    for kind in ("early", "late", "nocond"):
        step = make_step(kind, side)
        carry = (rnd(3, (M, N), dtype), rnd(4, (M, N), dtype),
                 (jnp.ones([], jnp.int32), rnd(6, low, scale=0.01), jnp.abs(rnd(7, low, scale=1e-4)), jnp.copy(p0)))
        try:
            record(case=case, impl=kind, ms=round(bench_carry(step, carry, n=50, reps=7), 4))
        except Exception as e:  # noqa: BLE001
            record(case=case, impl=kind, error=f"{type(e).__name__}: {e}"[:400])
    for name, tx in (("galore_adamw_xla", api.galore_adamw(LR, rank=r, update_proj_gap=GAP, implementation="xla")),
                     ("galore_adamw", api.galore_adamw(LR, rank=r, update_proj_gap=GAP)),
                     ("contrib", optax.contrib.galore(LR, rank=r, update_proj_gap=GAP))):
        params, grads = {"w": rnd(3, (M, N), dtype)}, {"w": rnd(4, (M, N), dtype)}
        state = tx.init(params)
        _, state = jax.jit(tx.update)(grads, state, params)

        @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
        def tstep(p, g, s, tx=tx):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), g, s

        try:
            record(case=case, impl=name, ms=round(bench_carry(tstep, (params, grads, jax.tree.map(jnp.copy, state)),
                                                              n=50, reps=7), 4))
        except Exception as e:  # noqa: BLE001
            record(case=case, impl=name, error=f"{type(e).__name__}: {e}"[:400])
