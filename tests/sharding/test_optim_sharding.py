"""FSDP-sharded adamw / galore_adamw on 8 simulated CPU devices (every case in one subprocess: _optim_worker.py)."""

from tests.sharding._optim_worker import CASES
from tests.sharding._worker import run_in_subprocess


def test_sharded_optimizer():
    run_in_subprocess("tests.sharding._optim_worker", sorted(CASES))
