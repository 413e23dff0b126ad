"""The rules `adapt.apply` takes: which contractions of a model become LoRA, DoRA / QDoRA or FP8, and how.

A rule's `module_path` is a regular expression matched with `re.fullmatch` against a module's path, the
`/`-joined names of its params in the params tree (``model/layers/0/self_attn/q_proj`` in HF's Flax Llama), or
against that path followed by ``/<weight name>`` (to pick one weight of a module that holds several). Rules are
tried in order and the first that matches wins, as in qwix.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any

import jax

from pallas_fused.dora.flax import lora_scale
from pallas_fused.fp8.config import Float8Config, as_config

QUANTIZE = (None, "int8", "nf4")


@functools.cache
def _compiled(pattern: str) -> re.Pattern:
    return re.compile(pattern)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rule:
    """What every rule has: the module path it applies to."""

    module_path: str

    def __post_init__(self):
        if not isinstance(self.module_path, str):
            raise ValueError(f"{self!r}: module_path must be a regular expression (str), "
                             f"got {type(self.module_path).__name__}")
        try:
            _compiled(self.module_path)
        except re.error as e:
            raise ValueError(f"{self!r}: module_path {self.module_path!r} is not a regular expression: {e}") from None

    def matches(self, path: str, weight: str) -> bool:
        pattern = _compiled(self.module_path)
        return pattern.fullmatch(path) is not None or pattern.fullmatch(weight_path(path, weight)) is not None


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraRule(Rule):
    """LoRA on the matched contractions: ``y = x W + s (x A) B`` with s = alpha / rank (alpha / sqrt(rank) with
    rsLoRA; alpha=None means alpha = rank). A starts from `lora_a_init`, B from zeros, so the adapted model starts
    out computing what the original does. The math is `pallas_fused.dora.lora_dense`'s."""

    rank: int
    alpha: float | None = None
    use_rslora: bool = False
    implementation: str | None = None
    lora_a_init: Any = dataclasses.field(default=jax.nn.initializers.he_uniform(), repr=False)

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"{self!r}: rank must be an int >= 1, got {self.rank!r}")

    @property
    def scale(self) -> float:
        return lora_scale(self.rank, self.alpha, self.use_rslora)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DoraRule(LoraRule):
    """DoRA on the matched contractions (`pallas_fused.dora.dora_dense`):
    ``y = (x W + s (x A) B) * m / ||W + s A B||``, the norm taken per output feature over the contraction, m
    starting at ||W|| (B = 0). With ``quantize="int8" | "nf4"`` the frozen W is stored quantized (QDoRA)."""

    quantize: str | None = None
    exact_norm_grad: bool = False
    save_merged: bool | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.quantize not in QUANTIZE:
            raise ValueError(f"{self!r}: quantize must be None, 'int8' or 'nf4', got {self.quantize!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fp8Rule(Rule):
    """FP8 training on the matched contractions (`pallas_fused.fp8.fp8_linear`): `recipe` is a recipe name
    ("tensorwise", "rowwise", "rowwise_with_gw_hp", "blockwise") or a `Float8Config`. The weights stay as they
    are; scales are dynamic, so no state is added."""

    recipe: str | Float8Config = "tensorwise"
    implementation: str | None = None

    def __post_init__(self):
        super().__post_init__()
        try:
            as_config(self.recipe)
        except ValueError as e:
            raise ValueError(f"{self!r}: {e}") from None

    @property
    def config(self) -> Float8Config:
        return as_config(self.recipe)


def weight_path(module_path: str, weight: str) -> str:
    """A weight's path: its module's path and its name (the name alone at the root)."""
    return f"{module_path}/{weight}" if module_path else weight


def check_rules(rules) -> tuple[Rule, ...]:
    """The rules as a tuple, each a `Rule`."""
    if isinstance(rules, Rule):
        rules = (rules,)
    rules = tuple(rules)
    for i, r in enumerate(rules):
        if not isinstance(r, Rule):
            raise ValueError(f"rules[{i}] must be an adapt.LoraRule, DoraRule or Fp8Rule, got {type(r).__name__}")
    if not rules:
        raise ValueError("rules is empty: give at least one adapt.LoraRule, DoraRule or Fp8Rule")
    return rules


def first_match(rules, path: str, weight: str) -> Rule | None:
    for r in rules:
        if r.matches(path, weight):
            return r
    return None
