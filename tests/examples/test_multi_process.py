"""examples/train_llama.py as 2 and 4 CPU processes on jax.distributed (localhost coordinator, gloo
collectives) gives the losses and the restored checkpoint of one process with the same global batch.

Each process is `tests/examples/_multiprocess_worker.py`; the single-process reference runs beside the first
launch. Configurations (one launch runs several): FSDP with galore_adamw + FP8 tensorwise + a DoRA fine-tune,
data parallel with the 8-bit fused AdamW. The SPMD programs must be the same on every process, so the
test also compares every choice pallas_fused makes on its own (tests/examples/_program_choices.py).
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

from tests.helpers import MULTIPROCESS_ENV

ROOT = pathlib.Path(__file__).resolve().parents[2]
TIMEOUT_S = 600
CONFIGS = ("fsdp_galore_fp8_dora", "data_adamw8")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(out: pathlib.Path, num_processes: int, process_id: int, configs, port: int = 0) -> subprocess.Popen:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), **MULTIPROCESS_ENV)
    return subprocess.Popen([sys.executable, "-m", "tests.examples._multiprocess_worker", str(out),
                             f"127.0.0.1:{port}", str(num_processes), str(process_id), *configs],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result(proc: subprocess.Popen) -> dict:
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, stdout[-3000:] + stderr[-5000:]
    return json.loads(lines[0][len("RESULT "):])


def launch(tmp: pathlib.Path, num_processes: int, configs) -> list[dict]:
    port = free_port()
    procs = [start(tmp / f"p{num_processes}", num_processes, i, configs, port) for i in range(num_processes)]
    return [result(p) for p in procs]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The single-process run (one device, no jax.distributed) of every configuration, started early."""
    proc = start(tmp_path_factory.mktemp("reference"), 0, 0, CONFIGS)
    cache: dict = {}

    def get() -> dict:
        if not cache:
            cache.update(result(proc))
        return cache

    yield get
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


def assert_same_as_reference(runs: list[dict], ref: dict, configs) -> None:
    for rank, run in enumerate(runs):
        assert run["choices"] == ref["choices"], rank  # the same program on every process
        for config in configs:
            got, want = run[config], ref[config]
            for phase in (p for p in want if p not in ("checks", "fingerprint", "wrote_report")):
                if phase == "pretrain":  # the first step sees the same params and batch: only the sum order differs
                    assert got[phase]["train"][0] == pytest.approx(want[phase]["train"][0], rel=1e-5), config
                # Later steps: fp32 sums in another order (FP8 scales, 8-bit codes and GaLore refreshes follow).
                assert got[phase]["train"] == pytest.approx(want[phase]["train"], rel=5e-3), (config, phase, rank)
                assert got[phase]["val"] == pytest.approx(want[phase]["val"], rel=5e-3), (config, phase, rank)
            assert all(got["checks"].values()) and got["checks"] == want["checks"], (config, got["checks"])
            # The restored checkpoint (params and optimizer state: GaLore projectors and moments, 8-bit codes
            # and scales) holds the same numbers: sum of |x| and sum of squares of every leaf. (Not the plain
            # sum: a projector's columns are fixed up to their sign by the QR of its refresh, and a sharded QR
            # may flip one, with its low-rank moments; the update P @ moments is the same.)
            # Moments trained through FP8 GEMMs move by more than the params: one e4m3 step is 1/8 relative,
            # so a gradient element rounded the other way after a reduction in another order shifts them.
            assert set(got["fingerprint"]) == set(want["fingerprint"]), config
            for leaf, (_, a, q) in want["fingerprint"].items():
                rel = 5e-2 if "fp8" in config and leaf.startswith("['opt_state']") else 1e-2
                assert got["fingerprint"][leaf][1:] == pytest.approx([a, q], rel=rel, abs=1e-6), (config, leaf)
            assert got["wrote_report"] == (rank == 0), (config, rank)  # only process 0 writes the report


def test_two_processes_match_one(tmp_path, reference):
    runs = launch(tmp_path, 2, CONFIGS)
    ref = reference()
    assert_same_as_reference(runs, ref, CONFIGS)
    # And the runs do train.
    assert ref["data_adamw8"]["pretrain"]["val"][-1] < ref["data_adamw8"]["pretrain"]["val"][0] - 0.3
    assert (tmp_path / "p2" / "data_adamw8" / "report.json").is_file()


@pytest.mark.slow
def test_four_processes_match_one(tmp_path, reference):
    """data=2,fsdp=2 over 4 processes (one device each): both mesh axes cross process boundaries."""
    runs = launch(tmp_path, 4, CONFIGS[:1])
    assert_same_as_reference(runs, reference(), CONFIGS[:1])


def test_program_choices_ignore_host_state(monkeypatch):
    """Every choice pallas_fused makes on its own is the same under another clock, environment, working
    directory and random state (what differs between the processes of one job)."""
    import random
    import time

    import numpy as np

    sys.path.insert(0, str(ROOT))
    from tests.examples._program_choices import program_choices

    first = program_choices()
    clock = iter(range(10**9, 10**10, 7919))
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock) * 1e-3)
    monkeypatch.setattr(time, "time", lambda: next(clock) * 1e-3)
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.chdir(ROOT / "tests")
    random.seed(12345)
    np.random.seed(54321)
    assert program_choices() == first
    assert set(first["galore_variant"].values()) <= {"hybrid", "xla_up"}


# Modules whose use in the library would let a process' program depend on its host: clocks (measured
# autotuning), randomness outside jax's keyed PRNG, the environment, the host's identity.
HOST_STATE = {"time", "timeit", "random", "socket", "platform", "datetime", "getpass", "uuid"}


# The readers of the environment allowed: XLA_FLAGS, for whether to warn of an XLA miscompile the user has not
# disabled (`_xla_workarounds.XLA_GPU_MISCOMPILES`), which decides a warning, never what a program computes or how;
# and where the tuning cache lives (`_tuning.cache_dir`), whose file every host of a job must hold alike (the tuner
# writes process 0's results on every host), so the choice stays a function of shapes, dtypes, the device and that
# file.
ENVIRONMENT_READERS = {("pallas_fused/_xla_workarounds.py", "xla_disabled_passes"),
                       ("pallas_fused/_tuning.py", "cache_dir")}
# The one place that measures: the tuner, which the user runs on purpose; what it measured reaches a program only
# through the cache file above.
MEASURES = "pallas_fused/tune/"


def _nodes_outside(tree, path: str):
    """Every node of `tree` except those inside the functions ENVIRONMENT_READERS allows for `path`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.FunctionDef) and (path, node.name) in ENVIRONMENT_READERS:
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def test_library_reads_no_host_state():
    """pallas_fused itself imports no clock (but in the tuner), host randomness or host identity, and reads no
    environment variable but where ENVIRONMENT_READERS allows: its choices can only come from shapes, dtypes, the
    device and the tuning files."""
    offenders = []
    for path in sorted((ROOT / "pallas_fused").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in _nodes_outside(tree, str(path.relative_to(ROOT))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module.split(".")[0]]
            clocks = {"time"} if str(path.relative_to(ROOT)).startswith(MEASURES) else set()
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names
                          if n in HOST_STATE - clocks]
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "getpid", "gethostname"):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} reads {node.attr}")
    assert not offenders, offenders


def test_launcher_detection_and_arguments():
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from llama import distributed
    finally:
        sys.path.remove(str(ROOT / "examples"))
    detected = distributed.launcher_detected
    assert not detected({})
    assert detected({"SLURM_NTASKS": "4", "SLURM_STEP_ID": "0"})  # a job step started by srun
    assert not detected({"SLURM_NTASKS": "4"})  # the batch shell of an allocation: not a task of the job
    assert not detected({"SLURM_NTASKS": "1", "SLURM_STEP_ID": "0"})
    assert detected({"OMPI_COMM_WORLD_SIZE": "2"}) and not detected({"OMPI_COMM_WORLD_SIZE": "1"})
    assert detected({"JAX_COORDINATOR_ADDRESS": "host0:1234"})
    with pytest.raises(ValueError, match="all three or none"):
        distributed.initialize("127.0.0.1:1234", None, 0)
    with pytest.raises(ValueError, match="--process-id"):
        distributed.initialize("127.0.0.1:1234", 2, 2)
