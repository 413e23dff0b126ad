"""Why a one-matrix GaLore step's wall time differs from its GPU time (development probe): bench_galore's user-path
candidates built exactly as its rows build them, timed in turn (`bench_carry_interleaved`), then each traced
(GPU kernel time per step and its kernels) and its host-side gap (wall minus kernel time) reported, with the
optimized HLO's thunk order around the conditional written to OUT/.

    python benchmarks/results/user_path_dev/galore_harness_probe.py OUT_DIR [MxN:r:dtype ...]
"""

import os
import sys

from benchmarks.bench_galore import _user_path_txs, probe_case, user_path_step
from benchmarks.common import bench_carry_interleaved, error_text, probe_recorder
from benchmarks.trace import trace_steps

OUT = sys.argv[1]
os.makedirs(OUT, exist_ok=True)
record = probe_recorder(f"{OUT}/galore_harness_probe.json")
CASES = sys.argv[2:] or ["4096x4096:128:bfloat16", "4096x4096:128:float32"]


for spec in CASES:
    case, shape, r, dtype = probe_case(spec)
    steps = {impl: user_path_step(impl, make, {"w": shape}, dtype) for impl, make in _user_path_txs(r)}
    rounds: dict = {}
    times = bench_carry_interleaved(steps, n=50, reps=5, rounds=rounds)
    for impl, make in _user_path_txs(r):
        try:
            step, carry = user_path_step(impl, make, {"w": shape}, dtype)  # the timed carries were donated
            with open(f"{OUT}/{case.replace(' ', '_')}_{impl.replace(':', '_')}.hlo.txt", "w") as f:
                f.write(step.lower(*carry).compile().as_text())
            tr = trace_steps(step, carry, 20, top=8)
            record(case=case, impl=impl, ms=round(times[impl], 4), rounds=[round(t, 4) for t in rounds[impl]],
                   host_gap_us=round(times[impl] * 1e3 - tr["kernel_us_per_step"], 1), **tr)
        except Exception as e:  # noqa: BLE001
            record(case=case, impl=impl, error=error_text(e))
