"""benchmarks/profile_step.py: the classifier on kernel names seen on GPUs, the trace parser on a synthetic
GPU trace, and the whole script on CPU (a tiny model: the table and JSON are written)."""

from __future__ import annotations

import gzip
import json

import pytest

profile_step = pytest.importorskip("benchmarks.profile_step")


@pytest.mark.parametrize("name,family", [
    ("pallas_fused_embed_bwd", "pallas_fused"),
    ("input_scatter_fusion_3", "scatter"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "gemm"),
    ("gemm_fusion_dot_123", "gemm"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "attention"),
    ("input_transpose_fusion", "transpose/copy"),
    ("loop_multiply_fusion_7", "xla fusion"),
    ("some_kernel", "other"),
])
def test_classify(name, family):
    assert profile_step.classify(name) == family


def test_parse_reads_device_streams_only(tmp_path):
    from benchmarks import trace

    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 3, "args": {"name": "tf_XLAExecute/1"}},
        {"ph": "M", "name": "thread_name", "pid": 2, "tid": 7, "args": {"name": "Stream #14(Compute)"}},
        {"ph": "M", "name": "thread_name", "pid": 2, "tid": 8, "args": {"name": "XLA Ops"}},
        {"ph": "X", "pid": 2, "tid": 7, "name": "pallas_fused_embed_bwd", "dur": 30.0, "ts": 0},
        {"ph": "X", "pid": 2, "tid": 7, "name": "pallas_fused_embed_bwd", "dur": 10.0, "ts": 50},
        {"ph": "X", "pid": 2, "tid": 8, "name": "fusion.1", "dur": 40.0, "ts": 0},  # derived line: not counted
        {"ph": "X", "pid": 1, "tid": 3, "name": "fusion.2", "dur": 99.0, "ts": 0},  # host: not with a GPU
    ]
    (tmp_path / "run").mkdir()
    with gzip.open(tmp_path / "run" / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    times = trace.parse(tmp_path, host=True)
    assert times.per_kernel == {"pallas_fused_embed_bwd": 40.0} and times.counts == {"pallas_fused_embed_bwd": 2}
    summary = profile_step.summarize(times, steps=2)
    assert summary["families_ms"]["pallas_fused"] == pytest.approx(0.02)
    assert summary["kernels"][0]["calls_per_step"] == 1
    # 0-30 and 50-60 busy: 20 us idle over a 60 us span, charged to the launch that ended the gap
    assert (times.span_us, times.idle_us) == (60.0, 20.0)
    assert times.idle_before == {"pallas_fused_embed_bwd": 20.0} and times.gaps_before == {"pallas_fused_embed_bwd": 1}
    assert summary["idle_ms_per_step"] == pytest.approx(0.01) and summary["idle_before"][0]["gaps_per_step"] == 0.5
    # No device process: the CPU thunks stand in only when asked for.
    with gzip.open(tmp_path / "run" / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": [e for e in events if e.get("pid") != 2]}, f)
    assert trace.parse(tmp_path).per_kernel == {}
    assert trace.parse(tmp_path, host=True).per_kernel == {"fusion.2": 99.0}


def test_idle_counts_time_no_stream_covers():
    from benchmarks import trace

    # Two streams overlapping (0-10 and 5-20), a gap to 25, a kernel inside the next one's span (25-40, 30-35),
    # a gap to 50: 5 + 10 us idle, each charged to the kernel that started after it.
    events = [(0.0, 10.0, "a"), (5.0, 15.0, "b"), (25.0, 15.0, "c"), (30.0, 5.0, "d"), (50.0, 5.0, "c")]
    span, idle, by, gaps = trace.idle(events[::-1])
    assert (span, idle) == (55.0, 15.0) and by == {"c": 15.0} and gaps == {"c": 2}
    assert trace.idle([]) == (0.0, 0.0, {}, {})


def test_cpu_run_writes_table_and_json(tmp_path):
    result = profile_step.main(["--preset", "cpu", "--d-model", "32", "--n-layers", "1", "--seq-len", "16",
                                "--batch-size", "2", "--steps", "2", "--warmup", "1", "--fp8", "none",
                                "--out", str(tmp_path)])
    assert [r["name"] for r in result["runs"]] == ["baseline", "ours"]
    text = (tmp_path / "profile.md").read_text()
    assert "| family | baseline | ours |" in text and "kernel sum" in text and "GPU idle ms / step" in text
    saved = json.loads((tmp_path / "profile.json").read_text())
    assert all(r["total_ms"] > 0 and r["steps_traced"] == 2 for r in saved["runs"])
    assert not list(tmp_path.rglob("*.xplane.pb"))
