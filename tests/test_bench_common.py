"""The benchmark harness' interleaved timer: every candidate is carried through its own steps, timed the same number
of rounds, and no candidate always starts a round."""

import jax.numpy as jnp

from benchmarks.common import bench_carry_interleaved, bench_interleaved


def test_interleaved_rounds_carry_and_rotate():
    order = []

    def make(name):
        def step(x):
            order.append(name)
            return (x + 1,)
        return step, (jnp.zeros(()),)

    steps = {name: make(name) for name in ("a", "b", "c")}
    rounds: dict = {}
    times = bench_carry_interleaved(steps, n=2, reps=3, rounds=rounds)
    assert set(times) == {"a", "b", "c"} and all(t > 0 for t in times.values())
    assert {name: len(r) for name, r in rounds.items()} == {"a": 3, "b": 3, "c": 3}
    assert order[:3] == ["a", "b", "c"]  # one warm-up call each
    timed = order[3:]
    assert [timed[i * 6] for i in range(3)] == ["a", "b", "c"]  # round k starts at the k-th candidate
    assert all(order.count(name) == 1 + 3 * 2 for name in "abc")  # each carried through all its own steps


def test_interleaved_every_candidate_takes_every_place():
    # fewer rounds asked than candidates: the rounds grow to one per candidate, so each is timed first once, second
    # once, ... (a candidate always timed early in a round would gain from the clocks' downward drift); a torch-style
    # candidate waits through its own sync
    order, synced = [], []

    def make(name):
        def step(x):
            order.append(name)
            return (x + 1,)
        return step, (jnp.zeros(()),)

    names = ("a", "b", "c", "d")
    rounds: dict = {}
    bench_interleaved({name: (make(name)[0], make(name)[1]) for name in names}, n=1, reps=2, rounds=rounds,
                      syncs={"d": lambda out: synced.append(out)})
    assert {name: len(r) for name, r in rounds.items()} == dict.fromkeys(names, 4)
    timed = order[4:]
    places = {name: sorted(timed[r * 4:(r + 1) * 4].index(name) for r in range(4)) for name in names}
    assert places == dict.fromkeys(names, [0, 1, 2, 3])
    assert len(synced) == 1 + 4  # the warm-up and one wait per round, for "d" alone
