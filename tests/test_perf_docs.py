"""benchmarks/perf_docs.py: the tables of the pairs of record, per device and across jax versions."""

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


def test_a_device_with_some_rows_gets_their_lines_and_names_the_rest():
    doc = _doc("0.11.2", 0.5, 0.75, "r0")
    lines = perf_docs.headline_table(doc).splitlines()
    assert [line.split("|")[1].strip() for line in lines[2:-2]] == ["Fused AdamW"]
    assert "1.50x" in lines[2]
    absent = [h.capability for h in perf_docs.HEADLINE if h.capability != "Fused AdamW"]
    assert lines[-1] == "Not measured on this GPU yet: " + ", ".join(absent) + "."
    table = perf_docs.section_table(doc, perf_docs.SECTIONS["Fused AdamW"])
    assert "| 0.500 | 0.750 (1.50x) |" in table  # ours, then the peer and its ratio
    assert table.count("| 105M") == 2  # a line per Rows that has ours (`adamw` + optax.apply_updates has none)
    assert perf_docs.section_table(doc, perf_docs.SECTIONS["SwiGLU"]) == ""


def test_unmeasured_names_rows_of_record_no_device_has():
    doc = _doc("0.11.2", 0.5, 0.75, "r0")
    missing = perf_docs.unmeasured([doc])
    assert ("adam", perf_docs.ADAM_CASE, "pallas:inplace_8bit") not in missing
    assert ("rotary", f"{perf_docs.ROTARY} fwd+bwd", "user:apply_rotary") in missing
