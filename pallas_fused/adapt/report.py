"""What `adapt.inspect` returns: each contraction a model runs, the weight it reads, the rule that matched, and what
adapting it does."""

from __future__ import annotations

import dataclasses
import difflib

from pallas_fused.adapt.rules import Rule

ACTIONS = ("adapted", "refused", "untouched")


@dataclasses.dataclass(frozen=True)
class Contraction:
    """One contraction of the model: the module at `path` contracting its param `weight` (None: two activations),
    stored with shape `stored_shape` and seen as a (k, n) matrix; `rule` the first rule that matches it (or None),
    `action` one of "adapted", "refused" (a rule matches but it cannot be adapted: `reason` says why) or
    "untouched"."""

    path: str
    weight: str | None
    stored_shape: tuple[int, ...] | None
    k: int | None
    n: int | None
    rule: Rule | None
    action: str
    reason: str = ""

    @property
    def weight_path(self) -> str:
        if self.weight is None:
            return self.path
        return f"{self.path}/{self.weight}" if self.path else self.weight


class Inspection(tuple):
    """The contractions of a model, in the order it runs them (a tuple of `Contraction`); prints as a table."""

    @property
    def adapted(self) -> tuple[str, ...]:
        """The weight paths that are adapted."""
        return tuple(c.weight_path for c in self if c.action == "adapted")

    def __str__(self) -> str:
        rows = [("path", "stored", "K x N", "rule", "action", "reason")]
        for c in self:
            rows.append((c.weight_path or "(root)", "" if c.stored_shape is None else str(tuple(c.stored_shape)),
                         "" if c.k is None else f"{c.k} x {c.n}",
                         "" if c.rule is None else _rule(c.rule),
                         c.action, c.reason))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        return "\n".join(("  ".join(v.ljust(w) for v, w in zip(r[:5], widths)) + "  " + r[5]).rstrip()
                         for r in rows)

    def __repr__(self) -> str:
        return f"Inspection({len(self)} contractions, {len(self.adapted)} adapted)"


def _rule(rule: Rule) -> str:
    """A rule as the table shows it: its type, its path and what it makes of a weight ("DoRA r16 over an FP8
    rowwise base")."""
    what = rule.describe()
    return f"{type(rule).__name__}({rule.module_path!r})" + (f": {what}" if what else "")


def no_match(rules, seen) -> str:
    """The message for rules of which none matched any of the contractions `seen`: the nearest paths to each."""
    paths = sorted({c.weight_path for c in seen} | {c.path for c in seen if c.path})
    lines = [f"adapt: no rule matched any of the {len(seen)} contractions the model ran"]
    for r in rules:
        near = difflib.get_close_matches(r.module_path, paths, n=3, cutoff=0.0)
        lines.append(f"  {r.module_path!r}: nearest paths {near}")
    lines.append("(adapt.inspect(model, rules, *inputs) lists every contraction and its path)")
    return "\n".join(lines)
