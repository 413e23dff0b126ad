"""Sharded Pallas ops on 8 simulated CPU devices (the cases of a half in one subprocess: see _worker.py).

The cases come in two halves, each with `core` (`partitioned` itself, where jax's sharding APIs are met): under
`make test`'s --case-split the floor leg runs one half and the newest leg the other, so every op runs sharded on
one jax version and `partitioned` on both; without it both halves run."""

import pytest

from tests.sharding._worker import CASES, run_in_subprocess

HALVES = (("core", "dora", "embed_norm", "rotary_grad_vmap"), ("core", "fp8", "rotary", "swiglu"))


def test_halves_cover_every_case():
    assert set().union(*HALVES) == set(CASES)


@pytest.mark.parametrize("cases", HALVES, ids=("half0", "half1"))
def test_sharded(cases):
    run_in_subprocess("tests.sharding._worker", cases)
