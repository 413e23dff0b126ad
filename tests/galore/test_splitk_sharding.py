"""The splitk variant under FSDP sharding (8 simulated CPU devices, each case in a subprocess)."""

import pytest

from tests.galore._splitk_worker import CASES
from tests.sharding._worker import run_in_subprocess


@pytest.mark.parametrize("name", sorted(CASES))
def test_sharded_splitk(name):
    run_in_subprocess("tests.galore._splitk_worker", [name])
