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
step_ms (median between refreshes, from a state at count 1 with random moments and projectors), refresh_ms (one
refresh step: every projector recomputed) and amortized_ms (the step with one refresh every GAP = 200 steps). The
peer's refresh (an exact SVD per leaf: tens of seconds on a 1B tree) is timed last, once, while --budget lasts. On a
CPU the shapes are the tree's divided by 32 and the kernels run in the Pallas interpreter (the HLO then shows XLA's
ops, not launches). Rows go to OUT_DIR/galore_tree.json as they come (an inner `timeout` may stop the run: the rows
so far stay); the table is printed after the steps and again after each peer refresh.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import time
import types

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.bench_galore import llama1b_tree
from benchmarks.common import bench_carry, rnd
from pallas_fused.galore import api

R, LR, SCALE, GAP = 128, 1e-3, 0.25, 200
CPU = jax.default_backend() == "cpu"


def _per_leaf_refresh_all(self, flat_g, flat_p, sides, key):
    """The refresh leaf by leaf, each with its own code (--per-leaf: the program before the grouped refresh)."""
    return {i: self._refresh(*self._finite_grad(flat_g[i]), flat_p[i], side, jax.random.fold_in(key, i))
            for i, side in sides.items()}


def make_tx(name, implementation, per_leaf=False):
    if name == "contrib":
        return optax.contrib.galore(LR, rank=R, update_proj_gap=GAP, scale=SCALE)
    tx = api.galore_adamw(LR, rank=R, update_proj_gap=GAP, scale=SCALE, implementation=implementation)
    if per_leaf:  # the refresh leaf by leaf, and the Pallas Adam kernel on every leaf that is not projected
        core = tx.update.__self__
        core._refresh_all = types.MethodType(_per_leaf_refresh_all, core)
        core.adam_implementation = api._backend.split_implementation(core.implementation)[0]
    return tx


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


def with_count(state, count, seed=None):
    """The state with every int32 scalar (the step counts) at `count` and, given `seed`, every float leaf random
    (|N(0, 0.01)|: moments that are valid, projectors that are not zeros): a state between refreshes without the
    refresh before it, which for the peer's exact SVD takes longer than this probe's budget."""
    leaves, treedef = jax.tree.flatten(state)
    out = []
    for i, x in enumerate(leaves):
        if x.shape == () and x.dtype == jnp.int32:
            x = jnp.full_like(x, count)
        elif seed is not None and jnp.issubdtype(x.dtype, jnp.floating) and x.size:
            x = jnp.abs(rnd(seed + i, x.shape, x.dtype, 0.01))
        out.append(x)
    return treedef.unflatten(out)


def candidate(name, shapes, dtype, implementation, timed, per_leaf=False):
    """(row, the refresh step's timing or None): the compiled step's counts and size, its time between refreshes."""
    tx = make_tx(name, implementation, per_leaf)
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
        return row, None
    carry = (params, grads, with_count(state, 1, seed=100))
    row["step_ms"] = round(bench_carry(compiled, carry, n=10 if CPU else 30, reps=3 if CPU else 7), 4)

    def refresh_ms():
        """One refresh step (count 0: every projector recomputed; the host's refresh=True step for tx_host_refresh,
        compiled first): the median of three calls after a first, or for the peer's SVD the first call alone (its
        step is compiled already)."""
        fn = jax.jit(lambda p, g, s: step(p, g, s, refresh=True), donate_argnums=(0, 1, 2)) if host else compiled
        fresh = {k: rnd(3 + i, s, dtype) for i, (k, s) in enumerate(shapes.items())}
        c = (fresh, {k: rnd(40 + i, s, dtype) for i, (k, s) in enumerate(shapes.items())}, tx.init(fresh))
        if name != "contrib":
            c = fn(*c)
        ts = []
        for _ in range(1 if name == "contrib" else 3):
            t = time.perf_counter()
            c = jax.block_until_ready(fn(c[0], c[1], with_count(c[2], 0)))
            ts.append((time.perf_counter() - t) * 1e3)
        return float(np.median(ts))

    return row, refresh_ms


def amortize(row, refresh_ms):
    row["refresh_ms"] = round(refresh_ms, 3)
    row["amortized_ms"] = round(row["step_ms"] + (row["refresh_ms"] - row["step_ms"]) / GAP, 4)


def table(rows, title):
    cols = ["impl", "dtype", "compile_s", "hlo_kb", "fusions", "custom_calls", "conditionals", "whiles",
            "pallas_call", "cond", "step_ms", "refresh_ms", "amortized_ms"]
    print(f"\n{title}\n" + " | ".join(cols))
    for row in rows:
        print(" | ".join(str(row.get(c, row.get("error", "-") if c == "compile_s" else "-")) for c in cols))
    for dtype in sorted({r["dtype"] for r in rows}):
        by = {r["impl"]: r for r in rows if r["dtype"] == dtype and "step_ms" in r}
        for name, r in by.items():
            if name != "contrib" and "contrib" in by:
                c = by["contrib"]
                amort = (f", amortized {r['amortized_ms'] / c['amortized_ms']:.3f}x" if "amortized_ms" in r
                         and "amortized_ms" in c else "")
                print(f"{dtype} {name}/contrib: step {r['step_ms'] / c['step_ms']:.3f}x{amort}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--impls", default="tx,tx_host_refresh,contrib")
    ap.add_argument("--implementation", default=None, help="ours' implementation= (default: the package's default)")
    ap.add_argument("--budget", type=float, default=120.0, help="seconds: no new measurement starts after it")
    ap.add_argument("--no-time", action="store_true", help="compile and count only")
    ap.add_argument("--per-leaf", action="store_true",
                    help="ours as before the grouping too (rows tx:per_leaf...): the refresh leaf by leaf, the Pallas "
                         "Adam kernel on each leaf that is not projected")
    a = ap.parse_args()
    deadline = time.monotonic() + a.budget
    os.makedirs(a.out_dir, exist_ok=True)
    shapes = {k: tuple(d // 32 for d in s) if CPU else s for k, s in llama1b_tree(a.layers).items()}
    implementation = a.implementation or ("interpret" if CPU else None)
    rows, deferred, path = [], [], os.path.join(a.out_dir, "galore_tree.json")
    title = f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {a.layers} layers ({len(shapes)} leaves), r{R}"

    def save():
        with open(path, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "layers": a.layers,
                       "rank": R, "gap": GAP, "rows": rows}, f, indent=1)

    names = a.impls.split(",")
    if a.per_leaf:
        names += [f"{n}:per_leaf" for n in names if n != "contrib"]
    for dtype in a.dtypes.split(","):
        for name in names:
            if time.monotonic() > deadline:
                print(f"budget spent: {name} {dtype} not run", flush=True)
                continue
            row = {"impl": name, "dtype": jnp.dtype(dtype).name,
                   "implementation": "optax" if name == "contrib" else implementation}
            try:
                got, refresh = candidate(name.partition(":")[0], shapes, jnp.dtype(dtype), implementation,
                                         not a.no_time, per_leaf=name.endswith(":per_leaf"))
                got["impl"] = name
                row.update(got)
                if refresh is not None and name == "contrib":  # the peer's SVD refresh last, if time is left
                    deferred.append((row, refresh))
                elif refresh is not None:
                    amortize(row, refresh())
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
            save()
    table(rows, title)
    for row, refresh in deferred:
        if time.monotonic() > deadline:
            print(f"budget spent: contrib {row['dtype']} refresh not timed", flush=True)
            continue
        amortize(row, refresh())
        save()
        table(rows, title + " (the peer's refresh timed)")


if __name__ == "__main__":
    main()
