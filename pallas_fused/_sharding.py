"""Sharding rules for Pallas kernels.

XLA does not partition a `pallas_call`: left alone, a kernel given sharded operands is fed the full
(gathered) arrays on every device. `partitioned` wraps a kernel launcher in `custom_partitioning` with
a Shardy sharding rule (einsum-like factors, e.g. "b s h d, b s -> b s h d"), so that each device runs
the kernel on its own shard and no operand is gathered along a factor the kernel can split.

- Factors named in `replicated` (a feature axis the kernel needs whole) are gathered if they arrive
  sharded; every other factor keeps its sharding.
- Factors named in `summed` (a dimension the kernel reduces by a sum, absent from some outputs) stay
  sharded: each device reduces its shard and the outputs without that factor are `psum`-ed.
- Under `jax.vmap` (custom_partitioning has no batching rule of its own) the local function is
  vmapped and the rule gains a leading factor for the batched operands: vmap keeps working and the
  vmapped axis can itself be sharded.
- On one device, and inside `shard_map` (all axes manual), the launcher runs as is.

Meshes: works with Auto axes (`jax.sharding.Mesh(devices, names)`, the default of `Mesh`, used by `jit`
with `NamedSharding`s and `with_sharding_constraint`) and inside `jax.shard_map`. With Explicit axes
(the default of `jax.make_mesh` in jax >= 0.7, set with `jax.set_mesh`), a `pallas_call` refuses to lower
outside `shard_map`, so the op runs in a `jax.shard_map` built from the same rule (shardings read from the
operands' types; the replicated factors are resharded first).

What each public op can be sharded along (everything else in an operand is gathered if sharded):

- `apply_rotary` (forward and backward kernels): batch, sequence and heads of q and k, and positions
  along with them; head_dim is gathered. Default positions (None) are materialised as arange(S) when
  more than one device is visible, so that a sequence shard rotates by its global positions.
- `fp8.quantize` axiswise (Pallas path): every axis but the reduced one (rowwise scales of an (M, K)
  operand: M sharded, K gathered). Tensorwise quantize needs a global amax inside the kernel call:
  its input is gathered.
- `fp8.scaled_matmul` / `scaled_matmul_nt` (Triton kernel): M data parallel, N tensor parallel, the
  contraction K gathered. `fp8_linear` inherits these per GEMM (its casts as quantize above).
- `dora_dense` (dense kernels): tokens (M) data parallel everywhere; output features (N) tensor
  parallel in the column norm and the forward GEMM; the backward dx kernel splits M and the input
  features K (N gathered: it is the contraction); the backward column kernel sums over tokens per
  shard and all-reduces its (r, N)/(N,) results. The LoRA rank is never split. Int8/NF4 kernels are
  not partitioned (gathered).
"""

from __future__ import annotations

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


def partitioned(local_fn: Callable, rule: str, *, replicated: tuple[str, ...] = (),
                summed: tuple[str, ...] = ()) -> Callable:
    """`local_fn` run shard-by-shard under the einsum-like `rule` (one term per array operand/result).

    `local_fn` must be a pure function of its array operands (close over static configuration) and
    return one array or a tuple of arrays. See the module docstring for `replicated` and `summed`.
    """
    if jax.device_count() == 1:
        return local_fn
    operand_factors, result_factors = _parse(rule)

    def call(*args):
        if _explicit_mesh() is not None:  # shard_map path: constants are fine there
            return _partitioned(local_fn, operand_factors, result_factors, replicated, summed)(*args)
        # custom_partitioning refuses a function with captured constants (e.g. a numpy table a launcher
        # closes over): trace once and pass them as extra, replicated operands.
        closed, shapes = jax.make_jaxpr(local_fn, return_shape=True)(*args)
        if not closed.consts:
            return _partitioned(local_fn, operand_factors, result_factors, replicated, summed)(*args)
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
        fn = _partitioned(with_consts, operand_factors + const_terms, result_factors,
                          tuple(replicated) + tuple(f for t in const_terms for f in t), summed)
        return fn(*args, *closed.consts)

    return call


def _explicit_mesh():
    mesh = jax.sharding.get_abstract_mesh()
    return mesh if not mesh.empty and jax.sharding.AxisType.Explicit in mesh.axis_types else None


def _partitioned(local_fn, operand_factors, result_factors, replicated, summed):
    single = len(result_factors) == 1

    def factor_axes(arg_shapes):
        """Mesh axes each splittable factor is sharded along, taken from the operands (first one wins)."""
        axes = {}
        for factors, shape in zip(operand_factors, arg_shapes):
            spec = tuple(shape.sharding.spec) + (None,) * (len(factors) - len(shape.sharding.spec))
            for f, axis in zip(factors, spec):
                if f not in replicated and axis is not None:
                    axes.setdefault(f, axis)
        return axes

    def shardings(mesh, arg_shapes):
        axes = factor_axes(arg_shapes)
        args = tuple(NamedSharding(mesh, PartitionSpec(*(axes.get(f) for f in t))) for t in operand_factors)
        outs = tuple(NamedSharding(mesh, PartitionSpec(*(axes.get(f) for f in t))) for t in result_factors)
        return axes, args, outs

    def partition(mesh, arg_shapes, result_shape):
        axes, args, outs = shardings(mesh, arg_shapes)
        # Outputs that lack a sharded `summed` factor hold partial sums: add them up across its axes.
        sums = [tuple(a for f in summed if f not in t and f in axes
                      for a in (axes[f] if isinstance(axes[f], tuple) else (axes[f],)))
                for t in result_factors]

        def lower(*local_args):
            out = local_fn(*local_args)
            out = (out,) if single else tuple(out)
            out = tuple(jax.lax.psum(o, s) if s else o for o, s in zip(out, sums))
            return out[0] if single else out

        return mesh, lower, (outs[0] if single else outs), args

    def infer(mesh, arg_shapes, result_shape):
        _, _, outs = shardings(mesh, arg_shapes)
        return outs[0] if single else outs

    wrapped = custom_partitioning(local_fn)
    rule = _format(operand_factors, result_factors)
    wrapped.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule,
                          reduction_factors=tuple(summed), need_replication_factors=tuple(replicated))

    def explicit(mesh, *args):
        """Explicit mesh axes: the shardings are in the types, so shard_map by the rule directly."""
        types = [jax.typeof(a).sharding.spec for a in args]
        shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, t)) for a, t in zip(args, types)]
        _, lower, out_shardings, arg_shardings = partition(mesh, shapes, None)
        outs = (out_shardings,) if single else out_shardings
        args = [jax.sharding.reshard(a, s.spec) for a, s in zip(args, arg_shardings)]
        return jax.shard_map(lower, mesh=mesh, in_specs=tuple(s.spec for s in arg_shardings),
                             out_specs=outs[0].spec if single else tuple(o.spec for o in outs),
                             check_vma=False)(*args)

    def call(*args):
        mesh = _explicit_mesh()
        if mesh is not None:
            return explicit(mesh, *args)
        return wrapped(*args)

    batchable = custom_vmap(call)

    @batchable.def_vmap
    def _vmap_rule(axis_size, in_batched, *args):
        # vmap the local function; the vmapped axis becomes a new (shardable) leading factor.
        used = {f for t in operand_factors + result_factors for f in t}
        v = next(f"vmap{i}" for i in range(len(used) + 1) if f"vmap{i}" not in used)
        ins = [[v, *t] if b else t for t, b in zip(operand_factors, in_batched)]
        outs = [[v, *t] for t in result_factors]
        in_axes = tuple(0 if b else None for b in in_batched)
        fn = _partitioned(jax.vmap(local_fn, in_axes=in_axes), ins, outs, replicated, summed)
        out = fn(*args)
        return out, jax.tree.map(lambda _: True, out)

    return batchable
