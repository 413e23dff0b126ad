"""examples/train_llama.py on a device mesh (2 simulated CPU devices, in a subprocess): `--mesh data=2`
(data parallel) and `--mesh fsdp=2` (params and optimizer states split) give the losses of one device.

Pretraining only (galore_adamw in place, randomized projector, XLA model ops on CPU), to keep compile time
down: the DoRA fine-tune's kernels on a mesh are covered by tests/sharding."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from tests.helpers import SUBPROCESS_XLA_FLAGS

ROOT = pathlib.Path(__file__).resolve().parents[2]


# Floor leg only: the newest leg runs the example on the same two meshes across two processes
# (test_multi_process.py), which covers the jax APIs this test exercises.
@pytest.mark.slow
def test_mesh_matches_one_device(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{SUBPROCESS_XLA_FLAGS} --xla_force_host_platform_device_count=2")
    proc = subprocess.run([sys.executable, "-m", "tests.examples._mesh_worker", str(tmp_path), "none", "data=2",
                           "fsdp=2"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-4000:]
    record = json.loads(lines[0][len("RESULT "):])
    one = record["none"]
    for mesh in ("data=2", "fsdp=2"):
        run = record[mesh]
        # The first step sees the same params and batch: only the reduction order of the loss differs.
        assert run["pretrain"]["train"][0] == pytest.approx(one["pretrain"]["train"][0], rel=1e-5), mesh
        # Later steps: fp32 sums in another order, through GaLore's projector refreshes (steps 0 and 3).
        a, b = run["pretrain"], one["pretrain"]
        assert a["train"] == pytest.approx(b["train"], rel=5e-3), (mesh, a["train"], b["train"])
        assert a["val"] == pytest.approx(b["val"], rel=5e-3), (mesh, a["val"], b["val"])
        assert run["checks"]["checkpoint_restored_identical"]  # orbax saves and restores the sharded params
    assert one["pretrain"]["val"][-1] < one["pretrain"]["val"][0] - 0.3  # and the runs do train


def test_mesh_argument_errors():
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from llama import mesh
    finally:
        sys.path.remove(str(ROOT / "examples"))
    assert mesh.parse("data=2") == {"data": 2}
    assert mesh.parse("data=2,fsdp=4") == {"data": 2, "fsdp": 4}
    assert mesh.parse(None) == {}
    for bad in ("model=2", "data", "data=0", "data=2,data=2", "fsdp=x"):
        with pytest.raises(ValueError, match="--mesh"):
            mesh.parse(bad)
