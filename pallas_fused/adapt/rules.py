"""The rules `adapt.apply` takes: which contractions of a model become LoRA, DoRA / QDoRA or FP8, and how.

Each rule type is also the provider of its behaviour (the interception in `_core` asks, never checks the type):
the adapter params it adds (`adapter_shapes`, `init_adapters`), the form its weight is stored in (`store`: QDoRA
and an FP8 base quantize), the op it runs (`product`), the plain weight that computes the same (`merged`), what
must be recomputed when the base weight changes (`refreshed`: DoRA's magnitude), and how `adapt.inspect` names it
(`describe`). A new rule type is one class here.

A rule's `module_path` is a regular expression matched with `re.fullmatch` against a module's path, the
`/`-joined names of its params in the params tree (``model/layers/0/self_attn/q_proj`` in HF's Flax Llama), or
against that path followed by ``/<weight name>`` (to pick one weight of a module that holds several). Rules are
tried in order and the first that matches wins, as in qwix.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from pallas_fused.adapt._layout import Layout, QuantizedWeight, weight_2d
from pallas_fused.dora.api import dora_dense
from pallas_fused.dora.flax import _merged, lora_scale
from pallas_fused.dora.fp8_base import dora_fp8_dense, lora_fp8_dense
from pallas_fused.dora.lora import lora_dense
from pallas_fused.dora.quant import FP8_RECIPES, dequantize
from pallas_fused.dora.reference import column_norm_reference
from pallas_fused.fp8.api import fp8_linear
from pallas_fused.fp8.config import Float8Config, as_config

QUANTIZE = (None, "int8", "nf4")
BASE_FP8 = (None, *FP8_RECIPES)


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

    # -- the provider: what the interception asks of a rule ------------------------------------------------------

    def describe(self) -> str:
        """What the rule makes of a weight, for `adapt.inspect`'s table (e.g. "DoRA r16 over an FP8 rowwise base")."""
        return ""

    def check(self, layout: Layout, where: str) -> None:
        """A ValueError if the rule cannot adapt a weight contracted as `layout`."""

    def adapter_shapes(self, name: str, layout: Layout) -> dict[str, tuple[int, ...]]:
        """The adapter params the rule adds beside weight `name`, by name."""
        return {}

    def store(self, w, layout: Layout, where: str):
        """The weight in the form the rule keeps it (`w` itself, or already in that form, is returned as is)."""
        return w

    def init_adapters(self, name: str, layout: Layout, stored, key) -> dict[str, jax.Array]:
        """Fresh adapters for the stored weight, with which the adapted op computes what the original does."""
        return {}

    def product(self, x2, w2, stored, layout: Layout, adapters: Mapping[str, Any], name: str):
        """The adapted (M, K) x (K, N) product: `w2` is the operand as (K, N) in the compute dtype, `stored` the
        weight as stored."""
        raise NotImplementedError

    def merged(self, name: str, layout: Layout, stored, adapters: Mapping[str, Any]):
        """The plain weight, in its stored shape and dtype, that computes what the adapted contraction does."""
        return stored

    def refreshed(self, name: str, layout: Layout, stored, adapters: Mapping[str, Any]) -> dict[str, jax.Array]:
        """The adapters that derive from the base weight, recomputed after it changed (new pretrained weights)."""
        return {}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraRule(Rule):
    """LoRA on the matched contractions: ``y = x W + s (x A) B`` with s = alpha / rank (alpha / sqrt(rank) with
    rsLoRA; alpha=None means alpha = rank). A starts from `lora_a_init`, B from zeros, so the adapted model starts
    out computing what the original does. The math is `pallas_fused.dora.lora_dense`'s.

    ``base_fp8="tensorwise" | "rowwise"``: the frozen W is quantized once (in `store`) to e4m3 codes with one scale
    or one per output feature (an `Fp8Kernel`, one byte per weight), and its product ``x W`` and input gradient
    run as FP8 GEMMs with torchao's recipe of that name (`pallas_fused.dora.lora_fp8_dense`); the adapters stay in
    the compute dtype. `implementation` is then the FP8 GEMMs' (`pallas_fused.fp8.frozen_fp8_matmul`)."""

    rank: int
    alpha: float | None = None
    use_rslora: bool = False
    implementation: str | None = None
    lora_a_init: Any = dataclasses.field(default=jax.nn.initializers.he_uniform(), repr=False)
    base_fp8: str | None = None

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"{self!r}: rank must be an int >= 1, got {self.rank!r}")
        if not (self.base_fp8 is None or isinstance(self.base_fp8, str)) or self.base_fp8 not in BASE_FP8:
            raise ValueError(f"{self!r}: base_fp8 must be None, 'tensorwise' or 'rowwise' (the recipes that scale "
                             f"the weight per tensor or per output feature, so that it is quantized once and "
                             f"stored; use adapt.Fp8Rule for the others), got {self.base_fp8!r}")

    @property
    def scale(self) -> float:
        return lora_scale(self.rank, self.alpha, self.use_rslora)

    @property
    def storage(self) -> str | None:
        """The format the frozen weight is stored in (`QuantizedWeight.quantize`'s), or None: as it is."""
        return None if self.base_fp8 is None else f"fp8_{self.base_fp8}"

    def describe(self):
        return self._over_base(f"LoRA r{self.rank}")

    def _over_base(self, adapters: str) -> str:
        return adapters if self.base_fp8 is None else f"{adapters} over an FP8 {self.base_fp8} base"

    def check(self, layout, where):
        if self.rank > min(layout.k, layout.n):
            raise ValueError(f"{self!r} at {where}: rank {self.rank} is larger than the layer, whose weight is "
                             f"{layout.k} x {layout.n} (K x N); the rank must be at most {min(layout.k, layout.n)}")

    def adapter_shapes(self, name, layout):
        return {f"{name}_lora_a": (layout.k, self.rank), f"{name}_lora_b": (self.rank, layout.n)}

    def store(self, w, layout, where):
        if self.storage is None or isinstance(w, QuantizedWeight):
            return w
        return QuantizedWeight.quantize(w, layout, self.storage, where)

    def init_adapters(self, name, layout, stored, key):
        """A from `lora_a_init`, B = 0."""
        a = self.lora_a_init(key, (layout.k, self.rank), stored.dtype)
        return {f"{name}_lora_a": a, f"{name}_lora_b": jnp.zeros((self.rank, layout.n), stored.dtype)}

    def product(self, x2, w2, stored, layout, adapters, name):
        if self.base_fp8 is not None:
            return lora_fp8_dense(x2, stored.kernel, adapters[f"{name}_lora_a"], adapters[f"{name}_lora_b"],
                                  scale=self.scale, implementation=self.implementation)
        return lora_dense(x2, w2, adapters[f"{name}_lora_a"], adapters[f"{name}_lora_b"], None, scale=self.scale,
                          implementation=self.implementation)

    def merged(self, name, layout, stored, adapters):
        a, b = adapters[f"{name}_lora_a"], adapters[f"{name}_lora_b"]
        w2 = dequantize(weight_2d(layout, stored), jnp.float32) + self.scale * (
            a.astype(jnp.float32) @ b.astype(jnp.float32))
        return layout.from_2d(w2).astype(stored.dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DoraRule(LoraRule):
    """DoRA on the matched contractions (`pallas_fused.dora.dora_dense`):
    ``y = (x W + s (x A) B) * m / ||W + s A B||``, the norm taken per output feature over the contraction, m
    starting at ||W|| (B = 0). With ``quantize="int8" | "nf4"`` the frozen W is stored quantized (QDoRA); with
    ``base_fp8`` (exclusive with `quantize`) it is stored in FP8 and its GEMMs run in FP8, as `LoraRule`'s, the
    norm taken from the dequantized weight those GEMMs use (`pallas_fused.dora.dora_fp8_dense`)."""

    quantize: str | None = None
    exact_norm_grad: bool = False
    save_merged: bool | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.quantize not in QUANTIZE:
            raise ValueError(f"{self!r}: quantize must be None, 'int8' or 'nf4', got {self.quantize!r}")
        if self.quantize is not None and self.base_fp8 is not None:
            raise ValueError(f"{self!r}: quantize and base_fp8 both set: the frozen weight is stored in one form, "
                             f"QDoRA's (quantize={self.quantize!r}) or FP8 (base_fp8={self.base_fp8!r})")

    @property
    def storage(self):
        return self.quantize or super().storage

    def describe(self):
        return self._over_base(f"{'QDoRA ' + self.quantize if self.quantize else 'DoRA'} r{self.rank}")

    def adapter_shapes(self, name, layout):
        return {**super().adapter_shapes(name, layout), f"{name}_magnitude": (layout.n,)}

    def init_adapters(self, name, layout, stored, key):
        """A, B = 0 as LoRA's, the magnitude the column norm of W (the DoRA paper's starting point)."""
        out = super().init_adapters(name, layout, stored, key)
        return {**out, **self.refreshed(name, layout, stored, out)}

    def product(self, x2, w2, stored, layout, adapters, name):
        if self.base_fp8 is not None:
            return dora_fp8_dense(x2, stored.kernel, adapters[f"{name}_lora_a"], adapters[f"{name}_lora_b"],
                                  adapters[f"{name}_magnitude"], scale=self.scale,
                                  exact_norm_grad=self.exact_norm_grad, implementation=self.implementation)
        kernel = stored.kernel if isinstance(stored, QuantizedWeight) else w2  # QDoRA: the packed codes
        return dora_dense(x2, kernel, adapters[f"{name}_lora_a"], adapters[f"{name}_lora_b"],
                          adapters[f"{name}_magnitude"], None, scale=self.scale, exact_norm_grad=self.exact_norm_grad,
                          implementation=self.implementation, save_merged=self.save_merged)

    def merged(self, name, layout, stored, adapters):
        w2 = _merged(weight_2d(layout, stored), adapters[f"{name}_lora_a"], adapters[f"{name}_lora_b"],
                     adapters[f"{name}_magnitude"], None, self.scale)["kernel"]
        return layout.from_2d(w2).astype(stored.dtype)

    def refreshed(self, name, layout, stored, adapters):
        """m = ||W + s A B|| per output feature, in the adapters' dtype."""
        a, b = adapters[f"{name}_lora_a"], adapters[f"{name}_lora_b"]
        m = column_norm_reference(weight_2d(layout, stored), a, b, self.scale, jnp.float32).astype(a.dtype)
        return {f"{name}_magnitude": m}


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

    def describe(self):
        return f"FP8 {self.recipe}" if isinstance(self.recipe, str) else "FP8"

    def product(self, x2, w2, stored, layout, adapters, name):
        return fp8_linear(x2, w2, self.config, implementation=self.implementation)


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
