"""Development probe: why a one-matrix GaLore step slows down as the benchmark process ages. The bf16 4096x4096 r128
user step (ours and optax.contrib.galore's, timed in turn) and a trivial jitted call's host dispatch are measured in
a fresh process, after bench_galore's whole user-path section has run in it (device memory and live arrays recorded
before each of its cases), after deleting every live array, and after jax.clear_caches().

    python benchmarks/results/user_path_dev/galore_aging_probe.py OUT_DIR
"""

import gc
import os
import sys
import time

import jax
import jax.numpy as jnp

from benchmarks import bench_galore
from benchmarks.common import Ceilings, Recorder, bench_carry_interleaved, probe_recorder

OUT = sys.argv[1]
os.makedirs(OUT, exist_ok=True)
record = probe_recorder(f"{OUT}/galore_aging_probe.json")
SHAPE = bench_galore._d(4096, 4096)  # shrunk on a CPU
txs = dict(bench_galore._user_path_txs(bench_galore._r(128)))


def memory():
    stats = jax.devices()[0].memory_stats() or {}
    return dict(live_arrays=len(jax.live_arrays()), live_mib=round(sum(a.nbytes for a in jax.live_arrays()) / 2**20),
                in_use_mib=round(stats.get("bytes_in_use", 0) / 2**20), num_allocs=stats.get("num_allocs"),
                largest_free_mib=round(stats.get("largest_free_block_bytes", 0) / 2**20),
                gc_objects=len(gc.get_objects()))


def dispatch_us():
    """Host time of one jitted call of a tiny op (no read-back), over 2000 calls."""
    f = jax.jit(lambda x: x + 1)
    x = jnp.ones((8,))
    jax.block_until_ready(f(x))
    start = time.perf_counter()
    for _ in range(2000):
        x = f(x)
    host = (time.perf_counter() - start) / 2000 * 1e6
    jax.block_until_ready(x)
    return round(host, 2)


def time_case(stage):
    steps = {name: bench_galore.user_path_step(name, txs[name], {"w": SHAPE}, jnp.bfloat16)
             for name in ("pallas:tx", "peer:optax_contrib_galore")}
    rounds: dict = {}
    times = bench_carry_interleaved(steps, n=50, reps=7, rounds=rounds)
    del steps
    record(stage=stage, **{k: round(v, 4) for k, v in times.items()},
           ratio=round(times["pallas:tx"] / times["peer:optax_contrib_galore"], 3), dispatch_us=dispatch_us(),
           **memory())


time_case("fresh")
orig = bench_galore._user_path_rows


def rows(rec, case, *a, **k):
    record(stage="before case", case=case, dispatch_us=dispatch_us(), **memory())
    return orig(rec, case, *a, **k)


bench_galore._user_path_rows = rows
rec = Recorder(Ceilings.measure(quick=True))
bench_galore.user_path(rec, quick=True)
for row in rec.rows:
    record(stage="section row", case=row.case, impl=row.impl, ms=row.ms)
time_case("aged")
for a in jax.live_arrays():
    a.delete()
gc.collect()
time_case("aged, live arrays deleted")
jax.clear_caches()
gc.collect()
time_case("aged, caches cleared")
