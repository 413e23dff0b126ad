"""Sharded Pallas ops on 8 simulated CPU devices (every case in one subprocess: see _worker.py)."""

from tests.sharding._worker import CASES, run_in_subprocess


def test_sharded():
    run_in_subprocess("tests.sharding._worker", sorted(CASES))
