"""Sharded Pallas ops on 8 simulated CPU devices (each case runs in a subprocess: see _worker.py)."""

import os
import subprocess
import sys

import pytest

from tests.sharding._worker import CASES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("name", sorted(CASES))
def test_sharded(name):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "tests.sharding._worker", name], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and f"ok {name}" in proc.stdout, proc.stdout + proc.stderr[-4000:]
