"""Where GaLore's optax path spends its time (development probe): the donated `update -> apply_updates` step of
galore_adamw (both conventions, default and "xla" implementations) beside optax.contrib.galore, timed, then traced
(GPU kernel time per kernel name), with each step's optimized HLO written to OUT/hlo/.

    python benchmarks/results/user_path_dev/galore_profile.py OUT_DIR
"""

import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import optax

from benchmarks.common import bench_carry, rnd
from benchmarks.trace import trace_kernels
from pallas_fused.galore import api

OUT = sys.argv[1]
os.makedirs(f"{OUT}/hlo", exist_ok=True)
rows = []


def record(**row):
    rows.append(row)
    print(" | ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    with open(f"{OUT}/galore_profile.json", "w") as f:
        json.dump(rows, f, indent=1, default=str)


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


for M, N, r, dtype in ((4096, 4096, 128, jnp.float32), (4096, 11008, 128, jnp.float32),
                       (4096, 4096, 128, jnp.bfloat16), (4096, 4096, 32, jnp.float32), (4096, 4096, 512, jnp.float32)):
    case = f"{M}x{N} r{r} {jnp.dtype(dtype).name}"
    for name, make in TXS.items():
        tx = make(r)

        @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
        def step(p, g, s, tx=tx):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), g, s

        try:
            carry = fresh(tx, M, N, dtype)
            if r == 128:
                with open(f"{OUT}/hlo/{M}x{N}_{jnp.dtype(dtype).name}_{name}.txt", "w") as f:
                    f.write(step.lower(*carry).compile().as_text())
            ms = bench_carry(step, carry, n=50, reps=7)
            carry = step(*fresh(tx, M, N, dtype))
            with trace_kernels() as kt:
                for _ in range(20):
                    carry = step(*carry)
                jax.block_until_ready(carry)
            record(case=case, impl=name, ms=round(ms, 4), kernel_us_per_step=round(kt.total_us / 20, 2),
                   top=[(n_, round(us / 20, 2), c // 20) for n_, us, c in kt.top(12)])
        except Exception as e:  # noqa: BLE001
            record(case=case, impl=name, error=f"{type(e).__name__}: {e}"[:400])
