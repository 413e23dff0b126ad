"""The sm90 FP8 GEMM's epilogue staging against torch._scaled_mm (development probe).

    python -m benchmarks.results.fp8_dev.epilogue_probe OUT_DIR [MxKxN[:tensorwise|:rowwise] ...]

At each shape (default: the shape-granularity pairs where the kernel trails cuBLAS by more than 10%, and 8192^3 as
the large-shape control) `cluster_probe.probe_shape` times torch._scaled_mm, the user's `scaled_matmul_nt` and the
tuned tile against its epilogue variants (TileConfig.epi_slots): the epilogue's TMA stores either wait
for the store two pieces back (the tuned 2 slots per warpgroup) or never within a tile (4 slots of 64 x 64, which
cost the ring a stage: 32 x 32 pieces, which would not, split the accumulator's 64-row layout tiles and do not
lower). The tuned tile at 3 stages separates the stage's effect.
Rows go to OUT_DIR/cluster_probe.json; BUDGET_S (default 420) as there.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import jax

from benchmarks.common import probe_recorder
from benchmarks.results.fp8_dev.cluster_probe import parse, probe_shape

SHAPES = [(16384, 2048, 5504, "rowwise"), (16384, 2048, 2048, "rowwise"), (16384, 4096, 11008, "rowwise"),
          (16384, 512, 2048, "tensorwise"), (2048, 16384, 5504, "tensorwise"), (16384, 2048, 512, "tensorwise"),
          (5504, 16384, 2048, "tensorwise"), (16384, 2048, 2048, "tensorwise"), (8192, 8192, 8192, "tensorwise")]


def candidates(tuned):
    three = dataclasses.replace(tuned, max_concurrent_steps=min(3, tuned.max_concurrent_steps))
    return [tuned, three, dataclasses.replace(three, epi_slots=4)]


def main():
    out_dir = sys.argv[1]
    _, shapes = parse(sys.argv[2:])
    shapes = shapes if len(sys.argv) > 2 else SHAPES
    os.makedirs(out_dir, exist_ok=True)
    record = probe_recorder(os.path.join(out_dir, "cluster_probe.json"))
    start, budget = time.time(), float(os.environ.get("BUDGET_S", 420))
    print(jax.devices(), flush=True)
    for m, k, n, gran in shapes:
        # full timing (not quick), no grid neighbours (share 0); the variants run after the tuned tile, at clocks
        # that sustained GEMM work only lowers
        probe_shape(record, m, k, n, gran, False, start, budget, share=0, candidates=candidates)
    print(f"epilogue_probe: {time.time() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
