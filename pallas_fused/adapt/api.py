"""The public functions of `pallas_fused.adapt`, one each for linen and NNX models."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import optax
from flax import nnx

from pallas_fused.adapt import _core
from pallas_fused.adapt import linen as _linen
from pallas_fused.adapt import nnx as _nnx
from pallas_fused.adapt.report import Inspection
from pallas_fused.adapt.rules import Rule, check_rules


def apply(model, rules: Rule | Sequence[Rule], *example_inputs, methods: Sequence[str] = ("__call__",),
          rngs: nnx.Rngs | None = None, **example_kwargs):
    """A copy of `model` whose matched contractions run as the rules say; `model` is left untouched.

    linen: no inputs are needed; the adapters are created by ``init`` (and `from_pretrained` loads the base
    weights). `methods` are the model's methods that run adapted (those ``apply(..., method=...)`` calls).
    NNX: `example_inputs` / `example_kwargs` run the model's method once (eagerly) to find the adapted weights,
    whose adapters are created from the weights already in the model (DoRA magnitudes = their column norms), with
    `rngs` for A's initial values; a single method (`methods`) can be adapted.

    A contraction is matched when one operand is a param of the module that issues it (the array itself, or a
    cast, transpose or reshape of it: known by where it came from, never by its shape) and a rule's `module_path`
    fullmatches the module's path (or the path + ``/<weight name>``); the first matching rule wins. Covered:
    `jax.lax.dot_general` (nn.Dense, nn.DenseGeneral, nnx.Linear, nnx.LinearGeneral) and two-operand
    `jax.numpy.einsum` (nn.Einsum, nnx.Einsum, a plain jnp.einsum with a param), the weight on either side, any
    layout: the operand's contracting axes flatten into K, its other axes into N. A matched contraction with batch
    dimensions (one weight per expert), or a matched param in an einsum that is not one plain contraction, is a
    ValueError. Not covered: ``x @ w`` and `jnp.dot` / `jnp.matmul`. `inspect` shows what matches.
    """
    rules = check_rules(rules)
    if isinstance(model, nn.Module):
        if example_inputs or example_kwargs or rngs is not None:
            raise ValueError("adapt.apply: a linen model takes no example inputs or rngs (its adapters are created "
                             "by lmodel.init)")
        return _linen.apply(model, rules, tuple(methods))
    if isinstance(model, nnx.Module):
        if not example_inputs and not example_kwargs:
            raise ValueError("adapt.apply: an NNX model needs example inputs (adapt.apply(model, rules, *inputs, "
                             "rngs=nnx.Rngs(0))): the model runs once to find the weights its rules match")
        methods = tuple(methods)
        if len(methods) != 1:
            raise ValueError(f"adapt.apply: an NNX model adapts one method, got {methods}")
        return _nnx.apply(model, rules, methods[0], rngs, example_inputs, example_kwargs)
    raise ValueError(f"adapt.apply: model must be a flax.linen.Module or flax.nnx.Module, got {type(model).__name__}")


def from_pretrained(lmodel: nn.Module, variables, pretrained):
    """linen: `variables` (from ``lmodel.init``) with the base weights of `pretrained` (the original model's params,
    or variables holding them under "params") copied in: quantized where a rule quantizes them, each DoRA
    magnitude set to ||W + s A B|| (||W|| while B = 0), so the adapted model computes what the pretrained one does.
    Every pretrained leaf must be a param of the adapted model with its shape, and every param other than the
    adapters must come from `pretrained`."""
    return _linen.from_pretrained(lmodel, variables, pretrained)


def inspect(model, rules: Rule | Sequence[Rule], *inputs, method: str = "__call__", **kwargs) -> Inspection:
    """Every contraction `model` runs on `inputs` (and keyword inputs `kwargs`), with the weight it reads, that
    weight's stored shape and (K, N) layout, the rule that matches and what `apply` would do: "adapted",
    "refused" (a rule matches, and why it cannot be adapted) or "untouched". Then the weights a rule matches that
    no contraction reads. ``print(adapt.inspect(...))`` shows a table.

    `model` is the original model (linen or NNX), run abstractly (`jax.eval_shape`): nothing is allocated, no
    adapter is created, `model` is left as it was. A linen model draws its params from a fixed key."""
    rules = check_rules(rules)
    if isinstance(model, nn.Module):
        lmodel = _linen.apply(model, rules, (method,), dry=True)
        keys = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
        _core.eval_abstract(lambda a, k: lmodel.init(keys, *a, method=method, **k), inputs, kwargs)
        return Inspection(_linen.report(lmodel))
    if isinstance(model, nnx.Module):
        return Inspection(_nnx.inspect(model, rules, method, inputs, kwargs))
    raise ValueError(f"adapt.inspect: model must be a flax.linen.Module or flax.nnx.Module, got "
                     f"{type(model).__name__}")


def trainable(variables) -> Any:
    """linen: a pytree of bools like `variables`, True on the adapter leaves (``<weight>_lora_a``,
    ``<weight>_lora_b``, ``<weight>_magnitude``) only. Use it with `split` / `join` (gradients of the adapters
    alone), or `optimizer` (``optax.multi_transform`` with ``optax.set_to_zero()`` on the rest). Not with
    ``optax.masked`` alone: it passes the updates of the unmasked leaves through unchanged, so
    ``apply_updates`` adds the raw gradient to every frozen weight.
    (NNX: the adapters are ``nnx.LoRAParam``: ``nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)``.)"""
    return _linen.trainable(variables)


def optimizer(tx: optax.GradientTransformation, variables) -> optax.GradientTransformation:
    """linen: `tx` on the adapters of `variables` (variables, or their params), and zero updates for every other
    leaf: ``optax.multi_transform({"adapter": tx, "frozen": optax.set_to_zero()}, labels)``. Its updates fit the
    params tree (the one gradients are taken of), so the frozen weights stay bit for bit as they are. For QDoRA,
    whose integer codes `jax.grad` does not take, use `split` / `join`."""
    params = variables["params"] if isinstance(variables, Mapping) and "params" in variables else variables
    labels = jax.tree_util.tree_map(lambda m: "adapter" if m else "frozen", _linen.trainable(params))
    return optax.multi_transform({"adapter": tx, "frozen": optax.set_to_zero()}, labels)


def split(params, mask) -> tuple[Any, Any]:
    """(selected, rest): `params` split by a pytree of bools of its structure (`trainable(variables)["params"]`,
    say), each half holding None where the other has the leaf. Take gradients of the adapters alone with
    ``adapters, frozen = split(params, mask)`` and ``jax.grad(lambda a: loss(join(a, frozen)))(adapters)``: a
    QDoRA weight's integer codes, which ``jax.grad`` does not take, stay in `frozen`."""
    selected = jax.tree_util.tree_map(lambda x, m: x if m else None, params, mask)
    rest = jax.tree_util.tree_map(lambda x, m: None if m else x, params, mask)
    return selected, rest


def join(selected, rest) -> Any:
    """`split`'s inverse: each leaf from whichever half holds it."""
    return jax.tree_util.tree_map(lambda a, b: b if a is None else a, selected, rest, is_leaf=lambda x: x is None)


def merge(model, variables=None):
    """The adapters folded into the weights, for the original model.

    linen: ``merge(lmodel, variables)`` -> variables (or params, as given) of the original model: each adapted
    weight replaced by the plain weight that computes what the adapted contraction does, in its own shape and
    dtype (dequantized for QDoRA), the adapters dropped. FP8 rules leave their weights as they are.
    NNX: ``merge(nmodel)`` -> a model of the original class with the merged weights."""
    if isinstance(model, nn.Module):
        if variables is None:
            raise ValueError("adapt.merge: a linen model needs its variables: adapt.merge(lmodel, variables)")
        return _linen.merge(model, variables)
    if variables is not None:
        raise ValueError("adapt.merge: an NNX model holds its own weights: adapt.merge(nmodel)")
    return _nnx.merge(model)


def unused_rules(model) -> list[Rule]:
    """The rules that adapted no contraction (linen: after ``lmodel.init``). When no rule matched anything, all
    of them, with a warning that lists the nearest paths to each (`from_pretrained` and `merge` raise with the
    same message)."""
    if isinstance(model, nn.Module):
        return _linen.unused_rules(model)
    return _nnx.unused_rules(model)


def reset_magnitudes(nmodel) -> None:
    """NNX: each DoRA magnitude set to ||W + s A B|| again, after loading other base weights (``nnx.update``)."""
    _nnx.reset_magnitudes(nmodel)
