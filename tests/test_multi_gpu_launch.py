"""benchmarks/multi_gpu.py --launch: one process per GPU, the scaling table in scaling.json.

The launch itself runs here on CPU processes (--platform cpu: one CPU device each, a localhost coordinator, gloo
collectives), a tiny model for 3 steps: 1 process (data=1), 2 (data=2), 2 (fsdp=2). The table's rows come from
the reports the runs wrote; weak_scaling is checked against the rows' own tokens/s. The runs train with the fused
AdamW rather than the example's default GaLore: what is checked here is the launcher, and each of the five
processes would compile GaLore's programs too (the optimizers across processes: tests/examples/test_multi_process.py).

The launch runs on the floor leg only (`slow`): the launcher is plain Python, and what runs under it on jax, the
example on jax.distributed over 2 processes with data=2 and fsdp=2, is test_two_processes_match_one, on both legs.
"""

from __future__ import annotations

import json

import pytest

from benchmarks import multi_gpu
from tests.helpers import MULTIPROCESS_ENV

TINY = "--d-model 32 --n-layers 1 --seq-len 32 --max-bytes 300000 --optimizer adamw"


@pytest.mark.slow
def test_launch_on_cpu_processes(tmp_path, monkeypatch):
    for name, value in MULTIPROCESS_ENV.items():
        monkeypatch.setenv(name, value)
    rows = multi_gpu.main(["--launch", "--platform", "cpu", "--gpus", "1,2", "--preset", "cpu", "--steps", "3",
                           "--batch-per-gpu", "4", "--timeout", "500", "--out", str(tmp_path),
                           "--example-args", TINY])
    saved = json.loads((tmp_path / "scaling.json").read_text())
    assert saved == json.loads(json.dumps(rows))
    assert [(r["gpus"], r["processes"], r["mesh"], r["global_batch"], r["per_gpu_batch"]) for r in saved] == [
        (1, 1, "data=1", 4, 4), (2, 2, "data=2", 8, 4), (2, 2, "fsdp=2", 4, 2)]
    for r in saved:
        assert set(r) == set(multi_gpu.ROW_KEYS)
        assert r["error"] is None, r["error"]
        assert r["median_ms"] > 0 and r["tokens_per_s"] > 0
        assert 0 < r["final_train_loss"] < 10 and 0 < r["val_loss"] < 10
        assert r["peak_gb"] is None and r["mfu_per_device"] is None  # CPU: no memory stats, no known peak
        assert r["attention"] == "xla"
        report = json.loads((tmp_path / "runs" / r["mesh"].replace("=", "") / "report.json").read_text())
        assert report["environment"]["processes"] == r["processes"] and report["settings"]["mesh"] == {
            r["mesh"].split("=")[0]: r["gpus"]}
        run = report["runs"][0]
        assert run["num_devices"] == r["gpus"]
        # tokens/s is the global batch's tokens at the median step
        assert r["tokens_per_s"] == pytest.approx(r["global_batch"] * 32 / (r["median_ms"] * 1e-3))
    one, data2, fsdp2 = saved
    assert one["weak_scaling"] == pytest.approx(1.0)
    assert data2["weak_scaling"] == pytest.approx(data2["tokens_per_s"] / one["tokens_per_s"])
    assert fsdp2["weak_scaling"] is None
    assert (tmp_path / "logs" / "data2_p1.log").is_file()


def test_weak_scaling_arithmetic():
    rows = multi_gpu.plan_rows([1, 2, 4], ["data", "fsdp"], batch_per_gpu=16, fsdp_global_batch=16)
    assert [(r["mesh"], r["global_batch"], r["per_gpu_batch"]) for r in rows] == [
        ("data=1", 16, 16), ("data=2", 32, 16), ("fsdp=2", 16, 8), ("data=4", 64, 16), ("fsdp=4", 16, 4)]
    tokens = {"data=1": 1000.0, "data=2": 1900.0, "fsdp=2": 1500.0, "data=4": 3600.0, "fsdp=4": 2000.0}
    for r in rows:
        r["tokens_per_s"] = tokens[r["mesh"]]
    rows.append({"gpus": 2, "mesh": "data=2", "per_gpu_batch": 8, "tokens_per_s": 900.0})  # no 1-GPU row at 8
    rows.append({"gpus": 4, "mesh": "data=4", "per_gpu_batch": 16, "tokens_per_s": None})  # a failed row
    got = [r["weak_scaling"] for r in multi_gpu.add_weak_scaling(rows)]
    assert got == [pytest.approx(1.0), pytest.approx(1.9), None, pytest.approx(3.6), None, None, None]


@pytest.mark.parametrize("argv,message", [
    (["--gpus", "0,2"], "--gpus must be comma-separated GPU counts >= 1"),
    (["--gpus", "two"], "--gpus must be comma-separated GPU counts"),
    (["--gpus", "1", "--meshes", "tp"], "--meshes must name data and/or fsdp"),
    (["--gpus", "1", "--steps", "0"], "--steps must be >= 1"),
])
def test_launch_bad_arguments(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit):
        multi_gpu.parse_args(["--launch", "--out", str(tmp_path), *argv])
    assert message in capsys.readouterr().err


def test_fsdp_batch_must_split_over_the_gpus():
    with pytest.raises(ValueError, match="--fsdp-global-batch 6 must be a multiple"):
        multi_gpu.plan_rows([1, 4], ["fsdp"], batch_per_gpu=16, fsdp_global_batch=6)
