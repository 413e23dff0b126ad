"""FSDP-sharded adamw / galore_adamw on 8 simulated CPU devices (the cases of a half in one subprocess:
_optim_worker.py).

The cases come in two halves, each with an adamw and GaLore refreshes: under `make test`'s --case-split the floor
leg runs one half and the newest leg the other, so every case runs on one jax version and both optimizers on both;
without it both halves run."""

import pytest

from tests.sharding._optim_worker import CASES
from tests.sharding._worker import run_in_subprocess

HALVES = (("adam_8bit", "galore_fp16_up", "galore_grouped_refresh"),
          ("adam_fp32", "galore_hybrid", "galore_randomized", "galore_svd"))


def test_halves_cover_every_case():
    assert set().union(*HALVES) == set(CASES) and not set(HALVES[0]) & set(HALVES[1])


@pytest.mark.parametrize("cases", HALVES, ids=("half0", "half1"))
def test_sharded_optimizer(cases):
    run_in_subprocess("tests.sharding._optim_worker", cases)
