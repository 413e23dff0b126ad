"""GaLore on a whole model's tree: one jitted optax step over a Llama-1B-shaped params tree, ours against
optax.contrib.galore, with its compile time, the size of its optimized HLO and what it launches.

    python -m benchmarks.probes.galore_tree_probe OUT_DIR [--layers 16] [--dtypes float32,bfloat16]
        [--impls tx,tx_host_refresh,contrib] [--implementation xla] [--budget 130] [--no-time]

Candidates (each `jit(update -> optax.apply_updates)`, params, grads and state donated, rank 128, scale 0.25):
  tx               galore_adamw, the refresh schedule on the device (one lax.cond per step)
  tx_host_refresh  galore_adamw with refresh=False static between refreshes (no conditional) and refresh=True on a
                   refresh step (a second compiled step)
  contrib          optax.contrib.galore (its exact SVD on a refresh step)
Per candidate and dtype: compile_s (lower + compile), hlo_kb (the optimized HLO's text), the optimized HLO's
fusions, custom calls (by target), dots, conditionals and whiles (each fusion or custom call is a launch where it
runs), the traced step's pallas_calls / conds / whiles / dot_generals (the GPU path's structure, also on a CPU),
step_ms (median between refreshes), refresh_ms (one refresh step: every projector recomputed) and amortized_ms
(the step with one refresh every GAP = 200 steps). On a CPU the shapes are the tree's divided by 32 and the kernels
run in the Pallas interpreter (the HLO then shows XLA's ops, not launches). Rows go to OUT_DIR/galore_tree.json as
they come (an inner `timeout` may stop the run: the rows so far stay); a table is printed last.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import time

import jax
import jax.extend.core
import jax.numpy as jnp
import optax

from benchmarks.bench_galore import llama1b_tree
from benchmarks.common import bench_carry, rnd
from pallas_fused.galore import api

R, LR, SCALE, GAP = 128, 1e-3, 0.25, 200
CPU = jax.default_backend() == "cpu"


def make_tx(name, implementation):
    if name == "contrib":
        return optax.contrib.galore(LR, rank=R, update_proj_gap=GAP, scale=SCALE)
    return api.galore_adamw(LR, rank=R, update_proj_gap=GAP, scale=SCALE, implementation=implementation)


def jaxpr_counts(fn, *args) -> dict[str, int]:
    """Primitives of the traced step, sub-jaxprs (cond branches, loop bodies) included, each counted once."""
    counts: collections.Counter = collections.Counter()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            counts[eqn.primitive.name] += 1
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return {k: counts[k] for k in ("pallas_call", "cond", "while", "dot_general")}


def hlo_counts(text: str) -> dict:
    """Launch-like instructions of an optimized HLO module (fusion bodies hold no fusion or custom call)."""
    ops = collections.Counter(m.group(1) for m in re.finditer(r"\s(fusion|custom-call|dot|conditional|while)\(", text))
    targets = collections.Counter(re.findall(r'custom_call_target="([^"]+)"', text))
    return {"fusions": ops["fusion"], "custom_calls": ops["custom-call"], "dots": ops["dot"],
            "conditionals": ops["conditional"], "whiles": ops["while"], "custom_call_targets": dict(targets)}


def reset_count(state):
    """The state with every int32 scalar (the step counts) at 0: its next step refreshes every projector."""
    return jax.tree.map(lambda x: jnp.zeros_like(x) if x.shape == () and x.dtype == jnp.int32 else x, state)


def candidate(name, shapes, dtype, implementation, timed, deadline):
    tx = make_tx(name, implementation)
    params = {k: rnd(3 + i, s, dtype) for i, (k, s) in enumerate(shapes.items())}
    grads = {k: rnd(40 + i, s, dtype) for i, (k, s) in enumerate(shapes.items())}
    state = tx.init(params)
    host = name == "tx_host_refresh"

    def step(p, g, s, refresh=None):
        u, s = tx.update(g, s, p, refresh=refresh) if host else tx.update(g, s, p)
        return optax.apply_updates(p, u), g, s

    row = {"impl": name, "dtype": jnp.dtype(dtype).name, "leaves": len(shapes)}
    static = dict(refresh=False) if host else {}
    row.update(jaxpr_counts(lambda p, g, s: step(p, g, s, **static), params, grads, state))
    jitted = jax.jit(step, donate_argnums=(0, 1, 2), static_argnames="refresh")
    t = time.perf_counter()
    compiled = jitted.lower(params, grads, state, **static).compile()
    row["compile_s"] = round(time.perf_counter() - t, 2)
    text = compiled.as_text()
    row["hlo_kb"] = round(len(text) / 1024, 1)
    row.update(hlo_counts(text))
    if not timed:
        return row
    refresh_step = jax.jit(lambda p, g, s: step(p, g, s, refresh=True), donate_argnums=(0, 1, 2)) if host else compiled
    carry = refresh_step(params, grads, state)  # count 0: the refresh step
    t = time.perf_counter()
    carry = jax.block_until_ready(refresh_step(*carry[:2], reset_count(carry[2])))
    row["refresh_ms"] = round((time.perf_counter() - t) * 1e3, 3)  # one call, warm (its compile is above)
    if time.monotonic() > deadline:
        return row
    row["step_ms"] = round(bench_carry(compiled, carry, n=10 if CPU else 30, reps=3 if CPU else 7), 4)
    row["amortized_ms"] = round(row["step_ms"] + (row["refresh_ms"] - row["step_ms"]) / GAP, 4)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--impls", default="tx,tx_host_refresh,contrib")
    ap.add_argument("--implementation", default=None, help="ours' implementation= (default: the package's default)")
    ap.add_argument("--budget", type=float, default=130.0, help="seconds: no new candidate starts after it")
    ap.add_argument("--no-time", action="store_true", help="compile and count only")
    a = ap.parse_args()
    deadline = time.monotonic() + a.budget
    os.makedirs(a.out_dir, exist_ok=True)
    shapes = {k: tuple(d // 32 for d in s) if CPU else s for k, s in llama1b_tree(a.layers).items()}
    implementation = a.implementation or ("interpret" if CPU else None)
    rows, path = [], os.path.join(a.out_dir, "galore_tree.json")
    for dtype in a.dtypes.split(","):
        for name in a.impls.split(","):
            if time.monotonic() > deadline:
                print(f"budget spent: {name} {dtype} not run", flush=True)
                continue
            try:
                row = candidate(name, shapes, jnp.dtype(dtype), implementation, not a.no_time, deadline)
            except Exception as e:  # noqa: BLE001
                row = {"impl": name, "dtype": dtype, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            row["implementation"] = "optax" if name == "contrib" else implementation
            rows.append(row)
            print(json.dumps(row), flush=True)
            with open(path, "w") as f:
                json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "layers": a.layers,
                           "rank": R, "gap": GAP, "rows": rows}, f, indent=1)
    cols = ["impl", "dtype", "compile_s", "hlo_kb", "fusions", "custom_calls", "conditionals", "whiles",
            "pallas_call", "cond", "step_ms", "refresh_ms", "amortized_ms"]
    print(f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}, {a.layers} layers ({len(shapes)} leaves), r{R}")
    print(" | ".join(cols))
    for row in rows:
        print(" | ".join(str(row.get(c, row.get("error", "-") if c == "compile_s" else "-")) for c in cols))
    for dtype in a.dtypes.split(","):
        by = {r["impl"]: r for r in rows if r.get("dtype") == jnp.dtype(dtype).name and "step_ms" in r}
        if "contrib" in by:
            for name, r in by.items():
                if name != "contrib":
                    print(f"{dtype} {name}/contrib: step {r['step_ms'] / by['contrib']['step_ms']:.3f}x, amortized "
                          f"{r['amortized_ms'] / by['contrib']['amortized_ms']:.3f}x")


if __name__ == "__main__":
    main()
