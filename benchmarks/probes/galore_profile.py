"""Backs docs/performance.md: GaLore's GPU kernel time is optax.contrib.galore's within 5%.

Where GaLore's optax path spends its time (development probe): the donated `update -> apply_updates` step of
galore_adamw (both conventions, default and "xla" implementations) beside optax.contrib.galore, timed, then traced
(GPU kernel time per kernel name), with each step's optimized HLO written to OUT/hlo/.

    python benchmarks/probes/galore_profile.py OUT_DIR
"""

import functools
import os
import sys

import jax
import jax.numpy as jnp
import optax

from benchmarks.common import bench_carry, probe_recorder, rnd
from benchmarks.trace import trace_steps
from pallas_fused.galore import api

OUT = sys.argv[1]
os.makedirs(f"{OUT}/hlo", exist_ok=True)
record = probe_recorder(f"{OUT}/galore_profile.json")


LR, GAP = 1e-3, 10**9
TXS = {
    "ours": lambda r: api.galore_adamw(LR, rank=r, update_proj_gap=GAP),
    "ours_optax": lambda r: api.galore_adamw(LR, rank=r, update_proj_gap=GAP, convention="optax"),
    "ours_xla": lambda r: api.galore_adamw(LR, rank=r, update_proj_gap=GAP, implementation="xla"),
    "contrib": lambda r: optax.contrib.galore(LR, rank=r, update_proj_gap=GAP),
}


def fresh(tx, M, N, dtype):
    params, grads = {"w": rnd(3, (M, N), dtype)}, {"w": rnd(4, (M, N), dtype)}
    state = tx.init(params)
    _, state = jax.jit(tx.update)(grads, state, params)  # the refresh step, outside the timed loop
    return params, grads, jax.tree.map(jnp.copy, state)


CASES = ((4096, 4096, 128, jnp.float32), (4096, 11008, 128, jnp.float32),
         (4096, 4096, 128, jnp.bfloat16), (4096, 4096, 32, jnp.float32), (4096, 4096, 512, jnp.float32),
         (4096, 11008, 512, jnp.float32), (4096, 4096, 512, jnp.bfloat16))
ONLY = [c for c in os.environ.get("GALORE_PROFILE_CASES", "").split(",") if c]  # e.g. "4096x4096 r128 bfloat16"
for M, N, r, dtype in CASES:
    case = f"{M}x{N} r{r} {jnp.dtype(dtype).name}"
    if ONLY and case not in ONLY:
        continue
    for name, make in TXS.items():
        tx = make(r)

        @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
        def step(p, g, s, tx=tx):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), g, s

        try:
            carry = fresh(tx, M, N, dtype)
            if r in (128, 512):
                with open(f"{OUT}/hlo/{M}x{N}_{jnp.dtype(dtype).name}_{name}.txt", "w") as f:
                    f.write(step.lower(*carry).compile().as_text())
            ms = bench_carry(step, carry, n=50, reps=7)
            record(case=case, impl=name, ms=round(ms, 4), **trace_steps(step, step(*fresh(tx, M, N, dtype)), 20))
        except Exception as e:  # noqa: BLE001
            record(case=case, impl=name, error=f"{type(e).__name__}: {e}"[:400])
