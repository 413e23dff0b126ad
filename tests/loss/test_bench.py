"""benchmarks/bench_loss.py: its quick mode runs on the CPU, records every jax row with its memory and check, and
its table reads the rows back."""

from __future__ import annotations

from dataclasses import asdict

from benchmarks import bench_loss
from benchmarks.common import Ceilings, Recorder


def test_quick_mode_records_its_rows_and_table():
    rec = Recorder(Ceilings(hbm_gbps=10.0, bf16_tflops=1.0, tf32_tflops=1.0))
    bench_loss.run(rec, quick=True)
    rows = {r.impl: r for r in rec.rows}
    assert {"user:linear_cross_entropy", "user:linear_cross_entropy vd", "xla:chunked", "xla"} <= set(rows)
    for impl, row in rows.items():
        assert row.ms and row.extra["temp_mib"] >= 0 and row.extra["peak_mib"] > 0, row
        if impl != "xla":
            assert row.extra["rel_err_dw"] < 2e-2 and row.extra["max_abs_loss_diff"] < 1e-2, row
    text = bench_loss.table([asdict(r) for r in rec.rows])
    assert text.count("\n") == len(rec.rows) and "user:linear_cross_entropy vd" in text
