"""Every ```python block of README.md and docs/*.md runs on the CPU.

The blocks of one file run in order in one namespace, as a reader would paste them into one session
(a later block may use what an earlier one defined). A block that is not meant to run here is marked by
an HTML comment right before it, `<!-- skip: why -->`; the reason is required and shows in the test
report as the skip reason of `test_skipped_block`.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
SKIP = re.compile(r"<!--\s*skip(?::\s*(.*?))?\s*-->$", re.S)


def blocks(path: Path):
    """(line, code, skip reason or None) of each python block; the reason is "" for a bare skip mark."""
    text = path.read_text()
    for match in FENCE.finditer(text):
        if match.group(1) != "python":
            continue
        line = text.count("\n", 0, match.start()) + 1
        before = text[: match.start()].rstrip()
        mark = SKIP.match(before[before.rfind("<!--"):]) if before.endswith("-->") else None
        yield line, match.group(2), None if mark is None else (mark.group(1) or "")


ALL = [(path, line, code, reason) for path in FILES for line, code, reason in blocks(path)]


def _id(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT)}:{line}"


def test_there_are_snippets():
    assert sum(reason is None for *_, reason in ALL) >= 20


@pytest.mark.parametrize("path", [p for p in FILES if any(a[0] == p and a[3] is None for a in ALL)],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_snippets_run(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a snippet that writes files writes them here
    namespace: dict = {"__name__": "__docs__"}
    for p, line, code, reason in ALL:
        if p != path or reason is not None:
            continue
        try:
            exec(compile(code, f"{_id(path, line)}", "exec"), namespace)
        except Exception as err:
            raise AssertionError(f"the python block at {_id(path, line)} failed: {err!r}") from err


@pytest.mark.parametrize("path,line,reason", [(p, line, r) for p, line, _, r in ALL if r is not None],
                         ids=[_id(p, line) for p, line, _, r in ALL if r is not None])
def test_skipped_block(path, line, reason):
    assert reason, f"{_id(path, line)}: a skipped block must say why: <!-- skip: reason -->"
    pytest.skip(reason)
