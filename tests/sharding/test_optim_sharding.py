"""FSDP-sharded adamw / galore_adamw on 8 simulated CPU devices (each case in a subprocess: _optim_worker.py)."""

import pytest

from tests.sharding._optim_worker import CASES
from tests.sharding._worker import run_in_subprocess


@pytest.mark.parametrize("name", sorted(CASES))
def test_sharded_optimizer(name):
    run_in_subprocess("tests.sharding._optim_worker", name)
