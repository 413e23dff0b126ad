"""Backs tall_grid_minor_dim: the walk along M, 0.81x -> 0.91x torch at 16384x2048x5504 rowwise.

The sm90 FP8 GEMM's tile walk (TileConfig.grid_minor_dim) against torch._scaled_mm, in turn (development probe).

    python -m benchmarks.probes.grid_walk_probe OUT_DIR [MxKxN ...]

At each shape (default: benchmarks/bench_fp8.py's SHAPES) and granularity, three candidates are timed in turn
(common.bench_interleaved: every candidate in every place of the order, so all see the same drift of clocks):
torch._scaled_mm, `kernel_sm90.scaled_matmul_nt` at the tuned tile (`kernel_sm90.config_for`), and the same tile walking
the grid with the other minor dimension. Each timed call runs bench_fp8's distinct operand sets in one jit (host
dispatch is not timed, the sets pass the L2). Every output is checked against XLA's fp8 dot first. Rows go to
OUT_DIR/grid_walk_probe.json as they come; shapes that start after BUDGET_S seconds (default 400) are skipped.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.bench_fp8 import SHAPES, _sets, operand_pairs, quantized_sets, torch_scaled_mm_fn
from benchmarks.common import amortized, bench_interleaved, probe_command_line, torch_sync
from pallas_fused.fp8 import api, kernel_sm90

MAX_REL_ERR = 2e-2  # bf16 output rounding is ~4e-3 of the largest entry; a wrong tile or scale is O(1)


def probe_shape(record, m, k, n, gran):
    case, flops, count = f"{m}x{k}x{n} {gran}", 2 * m * n * k, _sets(m, k, n)
    axis = None if gran == "tensorwise" else -1
    user_sets, vec_sets = quantized_sets(operand_pairs(m, k, n, count), axis)
    want = np.asarray(api._mm_nt(*vec_sets[0], jnp.bfloat16, True, "xla"), np.float32)
    tuned = kernel_sm90.config_for(m, n, k)
    other = dataclasses.replace(tuned, grid_minor_dim="m" if tuned.grid_minor_dim == "n" else "n")
    cands, syncs = {}, {"torch": torch_sync}
    for name, config in ((f"tuned minor={tuned.grid_minor_dim}", tuned), (f"minor={other.grid_minor_dim}", other)):
        fn = amortized(functools.partial(kernel_sm90.scaled_matmul_nt, out_dtype=jnp.bfloat16, config=config))
        err = float(np.abs(np.asarray(fn(vec_sets)[0], np.float32) - want).max() / np.abs(want).max())
        if err > MAX_REL_ERR:
            record(case=case, impl=name, ms=None, rel_err=err, error="MISMATCH with XLA's fp8 dot")
            continue
        cands[name] = (fn, (vec_sets,))
    torch_fn = torch_scaled_mm_fn(user_sets, gran)
    cands["torch"] = (torch_fn, ())
    calls = max(3, min(200, int(10e-3 * 1300e12 / flops)) // count)
    times = bench_interleaved(cands, n=calls, reps=3, syncs=syncs)
    for name, ms in times.items():
        ms /= count
        record(case=case, impl=name, ms=round(ms, 5), tflops=round(flops / ms / 1e9, 1),
               vs_torch=round(times["torch"] / count / ms, 3), config=str(tuned if "tuned" in name else other))


def main():
    record, cases = probe_command_line("grid_walk_probe", [s for s in SHAPES])
    start, budget = time.time(), float(os.environ.get("BUDGET_S", 400))
    print(jax.devices(), flush=True)
    for m, k, n in cases:
        for gran in ("rowwise", "tensorwise"):
            if time.time() - start > budget:
                record(case=f"{m}x{k}x{n} {gran}", impl="all", ms=None, error="skipped (time)")
                continue
            probe_shape(record, m, k, n, gran)
    print(f"grid_walk_probe: {time.time() - start:.0f} s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
