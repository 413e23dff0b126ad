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


def test_rows_on_disk_before_an_op_ends(tmp_path, monkeypatch):
    """The CLI writes the results file as rows arrive: an op killed in its middle (here a SystemExit, which no
    handler of the CLI catches, as a SIGKILL or a call's time limit would end it) leaves its earlier rows on disk,
    and rows of record from other runs stay."""
    import json
    import sys
    import types

    from benchmarks import common, run
    from benchmarks.common import Ceilings

    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(run, "ROW_WRITE_INTERVAL_S", 0.0)
    monkeypatch.setattr(run.Ceilings, "measure", classmethod(lambda cls, quick=False: Ceilings(1.0, 1.0, 1.0)))
    monkeypatch.setattr(run, "available_ops", lambda: ["killed"])
    path = tmp_path / f"{common.device_slug()}.json"
    path.write_text(json.dumps({"runs": [{"date": "earlier"}],
                                "rows": [{"op": "other", "case": "c", "impl": "i", "ms": 1.0, "run": "earlier"}]}))

    def body(rec, quick):
        rec.add("killed", "case", "first", 1.0)
        rec.add("killed", "case", "second", 2.0)
        raise SystemExit("killed mid-op")

    monkeypatch.setitem(sys.modules, "benchmarks.bench_killed", types.SimpleNamespace(run=body))
    try:
        run.main(["killed"])
    except SystemExit:
        pass
    doc = json.loads(path.read_text())
    assert {(r["op"], r["impl"]) for r in doc["rows"]} == {("other", "i"), ("killed", "first"), ("killed", "second")}
    assert {r["date"] for r in doc["runs"]} >= {"earlier"}
    assert not list(tmp_path.glob("*.tmp"))
