"""benchmarks/perf_docs.py's table of the pairs of record measured again on another jax version."""

from __future__ import annotations

from benchmarks import perf_docs


def _doc(jax_version: str, ours_ms: float, peer_ms: float, run: str) -> dict:
    case = perf_docs.ADAM_CASE
    rows = [{"op": "adam", "case": case, "impl": "pallas:inplace_8bit", "ms": ours_ms, "run": run},
            {"op": "adam", "case": case, "impl": "peer:optax_adamw", "ms": peer_ms, "run": run},
            # a pair measured in two runs is not a pair: not shown
            {"op": "adam", "case": case, "impl": "pallas:inplace", "ms": 1.0, "run": "another run"},
            {"op": "adam", "case": case, "impl": "peer:torch_fused_adamw", "ms": 1.0, "run": "a third run"}]
    return {"runs": [{"date": run, "jax": jax_version}], "rows": rows}


def test_versions_table_marks_moves_over_ten_percent():
    base = _doc("0.11.2", 0.5, 0.75, "2026-11-25 19:29:00")
    lines = perf_docs.versions_table(base, _doc("0.12.0.1", 0.65, 0.75, "2026-11-29 06:58:53")).splitlines()
    assert len(lines) == 3  # the heading, its rule, the one pair both runs measured
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[4:] == ["1.50x", "jax 0.11.2", "1.15x", "jax 0.12.0.1", "**-23%**"]
    same = perf_docs.versions_table(base, _doc("0.12.0.1", 0.52, 0.75, "2026-11-29 06:58:53")).splitlines()[2]
    assert same.rstrip().endswith("| -4% |")


def test_versions_table_skips_pairs_the_other_run_lacks():
    base = _doc("0.11.2", 0.5, 0.75, "r0")
    other = {"runs": [{"date": "r1", "jax": "0.12.0.1"}], "rows": []}
    assert len(perf_docs.versions_table(base, other).splitlines()) == 2
