"""benchmarks/bench_swiglu.py: its quick mode runs on the CPU and records every row; its sweep's launch
geometries are valid tiles."""

from __future__ import annotations

from benchmarks import bench_swiglu
from benchmarks.common import Ceilings, Recorder


def test_quick_mode_records_its_rows():
    rec = Recorder(Ceilings(hbm_gbps=10.0, bf16_tflops=1.0, tf32_tflops=1.0))
    bench_swiglu.run(rec, quick=True)
    rows = {(r.case.rsplit(" ", 1)[-1], r.impl): r for r in rec.rows}
    assert {"user:swiglu", "xla"} <= {impl for _, impl in rows}
    for (direction, impl), row in rows.items():
        if impl.startswith("peer:"):
            continue
        assert direction in ("fwd", "fwd+bwd") and row.ms and row.floor_ms, row


def test_sweep_configs_are_tiles():
    for backward in (False, True):
        configs = bench_swiglu._sweep_configs(16384, 5504, backward)
        assert configs and len(set(configs.values())) == len(configs)
        for cfg in configs.values():
            for n in (cfg.block_rows, cfg.block_cols, cfg.num_warps):
                assert n >= 1 and n & (n - 1) == 0, cfg
