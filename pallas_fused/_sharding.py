"""Sharding rules for Pallas kernels.

XLA does not partition a `pallas_call`: left alone, a kernel given sharded operands is fed the full
(gathered) arrays on every device. `partitioned` wraps a kernel launcher in `custom_partitioning` with
a Shardy sharding rule (einsum-like factors, e.g. "b s h d, b s -> b s h d"), so that each device runs
the kernel on its own shard and no operand is gathered along a factor the kernel can split.

- Factors named in `replicated` (a feature axis the kernel needs whole) are gathered if they arrive
  sharded; every other factor keeps its sharding.
- Factors named in `summed` (a dimension the kernel reduces by a sum, absent from some outputs) stay
  sharded: each device reduces its shard and the outputs without that factor are `psum`-ed (computed
  by `partial_fn` in a wider type first if given, so the result is rounded once, as on one device).
- Factors named in `reduced` (a dimension the kernel reduces otherwise, e.g. an amax) stay sharded:
  when one is, each device runs `reduced_fn(mesh_axes)` instead, a function that may use collectives
  (`lax.pmax`, ...) over those mesh axes.
- Under `jax.vmap` (custom_partitioning has no batching rule of its own) the local function is
  vmapped and the rule gains a leading factor for the batched operands: vmap keeps working and the
  vmapped axis can itself be sharded.
- On one device, and inside `shard_map` (all axes manual; a `pallas_call` there needs `check_vma=False`),
  the launcher runs as is.

Meshes: works with Auto axes (`jax.sharding.Mesh(devices, names)`, the default of `Mesh`, used by `jit`
with `NamedSharding`s and `with_sharding_constraint`) and inside `jax.shard_map`. With Explicit axes
(the default of `jax.make_mesh` in jax >= 0.7, set with `jax.set_mesh`), a `pallas_call` refuses to lower
outside `shard_map`, so the op runs in a `jax.shard_map` built from the same rule (shardings read from the
operands' types; the replicated factors are resharded first).

What each public op can be sharded along (everything else in an operand is gathered if sharded):

- `apply_rotary` (forward and backward kernels): batch, sequence and heads of q and k, and positions
  along with them; head_dim is gathered. Default positions (None) are materialised as arange(S) when
  more than one device is visible, so that a sequence shard rotates by its global positions.
- `fp8.quantize` (Pallas path; 2-D views of x): any axis. Along kept axes each device runs the kernel
  on its shard; when the reduced axis (every axis, tensorwise) is sharded, the amax is all-reduced
  (`pmax` of per-shard amaxes: a scalar or a vector, never x) and the cast runs as an XLA fusion on
  each shard (the kernel takes no external scale). The blockwise quantize kernel (`fp8_linear` with a
  blockwise config) is not partitioned (gathered): a shard may split a 128-row block of the transposed copy.
- `fp8.scaled_matmul` / `scaled_matmul_nt`: M data parallel, N tensor parallel, K (the contraction)
  split too: float32 partial products are all-reduced, then rounded once. `fp8_linear` inherits both
  per GEMM: with tokens on a data axis, dW = x^T dy is a K-split GEMM (all-reduce of dW, as XLA's own dot).
  The blockwise GEMMs (Hopper kernel): M and N split, K gathered (a split K would have to cut the per-K-block
  scale rows at the same 128-column boundaries, which the rule cannot promise).
- `dora_dense` / `column_scale` (dense and Int8 kernels): tokens (M) data parallel everywhere. Column
  norm: output features (N) split, input features (K) split too (per-shard sums of squares, all-reduced
  (N,) vector). Forward GEMM: M and N split, K gathered. Backward dx kernel: M and K split, N (its
  contraction) gathered. Backward column kernel: N split, tokens summed per shard and its (r, N), (N,)
  results all-reduced. The LoRA rank is never split. NF4 kernels are not partitioned (gathered).
- `embed` (the one-hot gradient kernel): tokens and features of dy split; each device sums its tokens and the
  (V, D) float32 partial gradients are all-reduced (as XLA's own scatter gradient is). The forward gather and
  the large-vocabulary segment sum are XLA's.
- `rms_norm` (forward and backward kernels): rows split, features gathered; the backward all-reduces the
  (D,) dscale of each row shard.
- `swiglu` (forward and backward kernels): elementwise, any axis of gate and up (features included).
- `adam` (adamw, adamw_step, ...): elementwise, any axis of any tensor. 8-bit states shard along their
  256-element blocks (a weight split along its leading axis with whole blocks per shard maps onto them;
  other splits are resharded by XLA). Helper: `pallas_fused.adam.state_shardings`.
- `galore` (galore_adamw, galore_adamw_inplace, scale_by_galore_adam): W, G and the low-rank state split
  along M and/or N; a split contraction of the down-projection is all-reduced as (M, r) / (r, N) partial
  projections; the rank is never split. The randomized projector refresh is XLA GEMMs on the sharded G;
  the SVD refresh gathers G. Helper: `pallas_fused.galore.state_shardings`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.extend
import jax.numpy as jnp
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec


def _parse(rule: str):
    """'a b, c -> a c' -> ([['a', 'b'], ['c']], [['a', 'c']]) (an empty term is a scalar)."""
    ins, _, outs = rule.partition("->")
    return [t.split() for t in ins.split(",")], [t.split() for t in outs.split(",")]


def _format(ins, outs) -> str:
    return ", ".join(" ".join(t) for t in ins) + " -> " + ", ".join(" ".join(t) for t in outs)


@dataclasses.dataclass(frozen=True)
class _Rule:
    operands: list  # factor names per operand, e.g. [["m", "k"], []]
    results: list
    replicated: tuple = ()
    summed: tuple = ()
    partial_fn: Callable | None = None
    reduced: tuple = ()
    reduced_fn: Callable | None = None


def partitioned(local_fn: Callable, rule: str, *, replicated: tuple[str, ...] = (), summed: tuple[str, ...] = (),
                partial_fn: Callable | None = None, reduced: tuple[str, ...] = (),
                reduced_fn: Callable | None = None) -> Callable:
    """`local_fn` run shard-by-shard under the einsum-like `rule` (one term per array operand and result,
    an empty term for a scalar).

    `local_fn` must be a pure function of its array operands (close over static configuration) and
    return one array or a tuple of arrays. See the module docstring for the factor lists and the two
    per-shard replacements `partial_fn` (same operands; partial sums in a wider type) and `reduced_fn`
    (called with a tuple of mesh axis names, returns a function of the same operands).
    """
    if jax.device_count() == 1:
        return local_fn
    operands, results = _parse(rule)
    spec = _Rule(operands, results, tuple(replicated), tuple(summed), partial_fn, tuple(reduced), reduced_fn)

    def call(*args):
        if _explicit_mesh() is not None:  # shard_map path: constants are fine there
            return _partitioned(local_fn, spec)(*args)
        # custom_partitioning refuses a function with captured constants (e.g. a numpy table a launcher
        # closes over): trace once and pass them as extra, replicated operands.
        closed, shapes = jax.make_jaxpr(local_fn, return_shape=True)(*args)
        if not closed.consts:
            return _partitioned(local_fn, spec)(*args)
        n, tree = len(args), jax.tree.structure(shapes)
        avals = [(a.shape, a.dtype) for a in closed.in_avals]

        def with_consts(*a):
            # Global shapes (the constant-free trace custom_partitioning makes): the constants are the extra
            # operands. Shard shapes (the per-device lowering, where constants are allowed): trace again.
            if [(jnp.shape(x), jnp.result_type(x)) for x in a[:n]] == avals:
                jaxpr = jax.extend.core.ClosedJaxpr(closed.jaxpr, a[n:])
            else:
                jaxpr = jax.make_jaxpr(local_fn)(*a[:n])
            return jax.tree.unflatten(tree, jax.extend.core.jaxpr_as_fun(jaxpr)(*a[:n]))

        const_terms = [[f"const{i}_{j}" for j in range(jnp.ndim(c))] for i, c in enumerate(closed.consts)]
        fn = _partitioned(with_consts, dataclasses.replace(
            spec, operands=operands + const_terms,
            replicated=spec.replicated + tuple(f for t in const_terms for f in t),
            partial_fn=None if partial_fn is None else lambda *a: partial_fn(*a[:n]),
            reduced_fn=None if reduced_fn is None else lambda axes: lambda *a: reduced_fn(axes)(*a[:n])))
        return fn(*args, *closed.consts)

    return call


def _explicit_mesh():
    mesh = jax.sharding.get_abstract_mesh()
    return mesh if not mesh.empty and jax.sharding.AxisType.Explicit in mesh.axis_types else None


def mesh_of(shardings, mesh=None, *, op: str):
    """The mesh of a list of NamedShardings (or `mesh` when given); a ValueError naming `op` when there is none."""
    if mesh is None and shardings:
        mesh = shardings[0].mesh
    if mesh is None:
        raise ValueError(f"{op}: the params have no leaves, so there is no mesh to place the step count on: "
                         f"pass mesh=")
    return mesh


def axes_size(mesh, axis) -> int:
    """Number of devices along a PartitionSpec entry (a mesh axis name, a tuple of them, or None)."""
    return 1 if axis is None else math.prod(mesh.shape[a] for a in _names(axis))


def _names(axis) -> tuple:
    return axis if isinstance(axis, tuple) else (axis,)


def _partitioned(local_fn, rule: _Rule):
    single = len(rule.results) == 1
    out_dtypes = []  # local_fn's output dtypes: filled at the call, read when XLA partitions

    def factor_axes(arg_shapes):
        """Mesh axes each splittable factor is sharded along, taken from the operands (first one wins)."""
        axes = {}
        for factors, shape in zip(rule.operands, arg_shapes):
            spec = tuple(shape.sharding.spec) + (None,) * (len(factors) - len(shape.sharding.spec))
            for f, axis in zip(factors, spec):
                # A mesh axis can shard one dimension of an array only: skip it if a factor sharing a term
                # with f already uses it.
                taken = {a for t in rule.operands + rule.results if f in t for g in t if g in axes
                         for a in _names(axes[g])}
                if f not in rule.replicated and axis is not None and f not in axes and not set(_names(axis)) & taken:
                    axes[f] = axis
        return axes

    def shardings(mesh, arg_shapes):
        axes = factor_axes(arg_shapes)
        args = tuple(NamedSharding(mesh, PartitionSpec(*(axes.get(f) for f in t))) for t in rule.operands)
        outs = tuple(NamedSharding(mesh, PartitionSpec(*(axes.get(f) for f in t))) for t in rule.results)
        return axes, args, outs

    def partition(mesh, arg_shapes, result_shape):
        axes, args, outs = shardings(mesh, arg_shapes)
        # Outputs that lack a sharded `summed` factor hold partial sums: add them up across its axes.
        sums = [tuple(a for f in rule.summed if f not in t and f in axes for a in _names(axes[f]))
                for t in rule.results]
        reduced_axes = tuple(a for f in rule.reduced if f in axes for a in _names(axes[f]))
        if reduced_axes:
            fn = rule.reduced_fn(reduced_axes)
        elif any(sums) and rule.partial_fn is not None:
            fn = rule.partial_fn
        else:
            fn = local_fn

        def lower(*local_args):
            dtypes = out_dtypes or [o.dtype for o in jax.tree.leaves(jax.eval_shape(local_fn, *local_args))]
            out = fn(*local_args)
            out = (out,) if single else tuple(out)
            out = tuple((jax.lax.psum(o, s) if s else o).astype(d) for o, s, d in zip(out, sums, dtypes))
            return out[0] if single else out

        return mesh, lower, (outs[0] if single else outs), args

    def infer(mesh, arg_shapes, result_shape):
        _, _, outs = shardings(mesh, arg_shapes)
        return outs[0] if single else outs

    wrapped = custom_partitioning(local_fn)
    wrapped.def_partition(partition=partition, infer_sharding_from_operands=infer,
                          sharding_rule=_format(rule.operands, rule.results),
                          reduction_factors=rule.summed, need_replication_factors=rule.replicated)

    def explicit(mesh, *args):
        """Explicit mesh axes: the shardings are in the types, so shard_map by the rule directly."""
        shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, jax.typeof(a).sharding.spec))
                  for a in args]
        _, lower, out_shardings, arg_shardings = partition(mesh, shapes, None)
        outs = (out_shardings,) if single else out_shardings
        args = [jax.sharding.reshard(a, s.spec) for a, s in zip(args, arg_shardings)]
        return jax.shard_map(lower, mesh=mesh, in_specs=tuple(s.spec for s in arg_shardings),
                             out_specs=outs[0].spec if single else tuple(o.spec for o in outs),
                             check_vma=False)(*args)

    def call(*args):
        mesh = _explicit_mesh()
        if mesh is not None:  # (a pallas_call cannot even be traced on Explicit types outside shard_map)
            return explicit(mesh, *args)
        out_dtypes[:] = [o.dtype for o in jax.tree.leaves(jax.eval_shape(local_fn, *args))]
        return wrapped(*args)

    batchable = custom_vmap(call)

    @batchable.def_vmap
    def _vmap_rule(axis_size, in_batched, *args):
        # vmap the local function; the vmapped axis becomes a new (shardable) leading factor.
        used = {f for t in rule.operands + rule.results for f in t}
        v = next(f"vmap{i}" for i in range(len(used) + 1) if f"vmap{i}" not in used)
        in_axes = tuple(0 if b else None for b in in_batched)
        batched = dataclasses.replace(
            rule, operands=[[v, *t] if b else t for t, b in zip(rule.operands, in_batched)],
            results=[[v, *t] for t in rule.results],
            partial_fn=None if rule.partial_fn is None else jax.vmap(rule.partial_fn, in_axes=in_axes),
            reduced_fn=None if rule.reduced_fn is None else lambda axes: jax.vmap(rule.reduced_fn(axes), in_axes))
        out = _partitioned(jax.vmap(local_fn, in_axes=in_axes), batched)(*args)
        return out, jax.tree.map(lambda _: True, out)

    return batchable
