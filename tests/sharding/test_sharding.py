"""Sharded Pallas ops on 8 simulated CPU devices (each case runs in a subprocess: see _worker.py)."""

import pytest

from tests.sharding._worker import CASES, run_in_subprocess


@pytest.mark.parametrize("name", sorted(CASES))
def test_sharded(name):
    run_in_subprocess("tests.sharding._worker", name)
