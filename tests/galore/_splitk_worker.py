"""The splitk variant (and an fp16 up-projection) FSDP-sharded on 8 simulated CPU devices:
`python -m tests.galore._splitk_worker <case>` (the harness of tests/sharding/_optim_worker.py)."""

from __future__ import annotations

from tests.sharding._optim_worker import GALORE_SHAPES, _galore_steps, sharded_vs_single

CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


@case
def galore_splitk_fp16_up():
    """implementation="interpret:splitk", in-place step, with an fp16 (p16) default up configuration: the split-K
    kernel where the contraction is whole, XLA's GEMM + psum of the partial projections where it is split; N and
    the fp16 P come out of the Adam kernel sharded as m and P; nothing of W, G or the state gathered."""
    from pallas_fused.galore import kernel, state_shardings

    kernel.UP_CONFIG = kernel.UpConfig(16, 16, 16, 4, 2, True, 1, 2, True, True)
    kernel.DOWN_CONFIG = kernel.DownConfig(16, 16, 2, 16, 4, 2, True, True)
    sharded_vs_single(lambda: _galore_steps("randomized", "splitk", True), state_shardings, GALORE_SHAPES, 2e-4,
                      "galore randomized splitk fp16 up inplace")


if __name__ == "__main__":
    from tests.sharding._worker import main

    main(CASES)
