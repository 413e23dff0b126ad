"""FSDP-sharded adamw / galore_adamw on 8 simulated CPU devices (each case in a subprocess: _optim_worker.py)."""

import os
import subprocess
import sys

import pytest

from tests.sharding._optim_worker import CASES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("name", sorted(CASES))
def test_sharded_optimizer(name):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "tests.sharding._optim_worker", name], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and f"ok {name}" in proc.stdout, proc.stdout + proc.stderr[-4000:]
