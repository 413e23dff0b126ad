"""Fused Adam / AdamW: optax transformations and an in-place step, one kernel pass per tensor.

Two ways to use it; both keep the same state (`FusedAdamState`) and give the same numbers as
`optax.adamw` (fp32: to within rounding):

1. Composable (drop-in for optax): `adamw(...)`, `adam(...)`, `scale_by_adam(...)` return
   `optax.GradientTransformation`s. Each leaf's update is one kernel pass that reads g, m, v (and p
   for the weight decay) and writes the update, m and v: the learning rate and the weight decay are
   fused in, so `optax.apply_updates` is the only other pass. They work inside `optax.chain`,
   `optax.multi_transform`, `optax.MultiSteps`, `optax.apply_if_finite` and
   `optax.inject_hyperparams` (hyperparameters are runtime kernel operands: changing them does not
   recompile).

2. In place: `adamw_step(params, grads, state, ...)` returns `(new_params, new_state)`; each tensor
   is one kernel pass reading p, g, m, v and writing p, m, v over their inputs. Jit it with
   `donate_argnums=(0, 2)` (params and state) to move every byte once (7 passes for fp32 states).
   `adam_leaf_update` / `adam_leaf_direction` are the same thing for a single tensor (used by
   GaLore for the leaves it does not project).

Implementation: `implementation=None` on a GPU runs the Pallas kernel for 8-bit states and XLA's fused
elementwise step for fp32/bf16 states, which ties the kernel in place and fuses with `apply_updates` on the
composable path (see impls.py: each backend an object, `impls.choose` the default's choice);
`implementation="pallas"` forces the kernel; `"pallas:sm90"` its Mosaic GPU port (fp32/bf16 states, jax >= 0.11,
Hopper; see kernel_mosaic.py), named as every op names its Mosaic GPU kernel. `"pallas:mosaic"`, its name in 0.2,
still works for one release, with a DeprecationWarning.

Low-bit states: `state_bits=8` stores both moments of every tensor of >= 4096 elements blockwise
quantized (blocks of 256, a bitsandbytes-style dynamic map: signed for m, unsigned for v, per-block
fp32 absmax) as `QuantizedMoment(codes, absmax)`; smaller tensors keep fp32 moments. Dequantize, step
and requantize happen inside the kernel. State memory: 2 bytes + 8/256 bytes per parameter instead
of 8.

Non-finite gradients: an element whose new moments would not be finite (a NaN/inf gradient, or g*g
overflowing) is skipped: its parameter and moments are kept and its update is 0; every other element
steps normally and `count` increments. So a bad gradient never poisons the state (optax.adamw would
write NaN into m and v forever). To skip the whole step instead (the AMP loss-scaling convention),
wrap the transformation: `optax.apply_if_finite(adamw(...), max_consecutive_errors)`.

Sharding (FSDP, data parallel; see pallas_fused._sharding): under jit the kernel runs on each device's
shard of every tensor, whatever axes are split (the step is elementwise), so params, grads and fp32
states sharded alike never move. 8-bit states are a row-major flattening cut into blocks of 256: they
shard along blocks, which matches a weight split along its leading axis with whole blocks per shard;
another split is resharded by XLA around the kernel (see `impls.q8_sharded`). `state_shardings(state,
param_shardings)` gives the matching state shardings for jit's in/out_shardings.

`state_bits` defaults to None (= 32, full-precision states) rather than 32 so that
`optax.inject_hyperparams(adamw)` does not take it for a numeric hyperparameter. Given as an int (8), inject_hyperparams
makes an array of it: init reads its value (under `jax.jit(init)` too, where the array is a constant of the trace),
and update never needs it (the state's layout says which moments it holds). No static_args are needed; changing
`state.hyperparams["state_bits"]` after init changes nothing, as the layout is fixed by then.

Updates come in the params' dtype (promoted with the gradient's) when `update` gets params, as optax's; without
params, in the gradient's dtype promoted with the moments'.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from pallas_fused import _backend, _sharding
from pallas_fused.adam import impls
from pallas_fused.adam import kernel as _kernel
from pallas_fused.adam import reference as _ref

ScalarOrSchedule = float | jax.Array | Callable[[jax.Array], jax.Array]


class QuantizedMoment(NamedTuple):
    """One moment of one tensor in 8 bits: a byte code per element, an fp32 absmax per 256 elements.

    codes: uint8 (blocks * 256,), the flattened tensor padded to whole blocks; absmax: fp32 (blocks,).
    `dequantize_moment(q, shape, signed)` gives the fp32 values back.
    """

    codes: jax.Array
    absmax: jax.Array


class FusedAdamState(NamedTuple):
    """State of the fused Adam transforms: like optax.ScaleByAdamState (count, mu, nu).

    mu / nu leaves are arrays (fp32 or the params'/mu_dtype) or `QuantizedMoment`s (state_bits=8).
    count is the number of steps taken (int32); the learning-rate schedule is evaluated at it.
    """

    count: Any  # an int32 array; Any: `state_shardings` returns this tuple with a sharding in each field
    mu: Any
    nu: Any


def dequantize_moment(q: QuantizedMoment, shape, signed: bool) -> jax.Array:
    """fp32 values of a `QuantizedMoment` (signed=True for mu, False for nu)."""
    return _ref.dequantize_blockwise(q.codes, q.absmax, tuple(shape), signed)


# ----------------------------------------------------------------------------------------------
# argument checks


def _check_bits(state_bits, *, traced_ok: bool = False) -> int | None:
    """state_bits as an int (None: 32). An integer scalar array (what optax.inject_hyperparams makes of an int)
    counts as its value, and so does a traced one that is a constant of the trace (inject_hyperparams' array
    under a jitted init). Any other traced value is unknown: `update` does not need it (the state's layout says
    which moments it holds), so with `traced_ok` it gives None; init needs it."""
    if state_bits is None:
        return 32
    if isinstance(state_bits, jax.core.Tracer) and jnp.ndim(state_bits) == 0 and jnp.issubdtype(
            state_bits.dtype, jnp.integer):
        known = _backend.trace_time_int(state_bits)
        if known is not None:
            state_bits = known
        elif traced_ok:
            return None
        else:
            raise ValueError("state_bits chooses the moments' layout, so init needs its value; got a traced value "
                             "that is an input of the traced function, not a constant: pass "
                             "static_args=('state_bits',) to optax.inject_hyperparams, or call init outside jit")
    if isinstance(state_bits, (np.ndarray, np.generic, jax.Array)) and state_bits.ndim == 0 and jnp.issubdtype(
            state_bits.dtype, jnp.integer):
        state_bits = int(state_bits)
    if isinstance(state_bits, bool) or not isinstance(state_bits, numbers.Integral) or state_bits not in (8, 32):
        raise ValueError(f"state_bits must be None, 32 or 8, got {state_bits!r}")
    return int(state_bits)


def _is_concrete_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check_hparams(learning_rate, b1, b2, eps, eps_root, weight_decay):
    """Range checks on values known at call time (arrays and tracers from inject_hyperparams pass)."""
    checks = [
        ("learning_rate", learning_rate, lambda x: x >= 0, ">= 0"),
        ("b1", b1, lambda x: 0 <= x < 1, "in [0, 1)"),
        ("b2", b2, lambda x: 0 <= x < 1, "in [0, 1)"),
        ("eps", eps, lambda x: x >= 0, ">= 0"),
        ("eps_root", eps_root, lambda x: x >= 0, ">= 0"),
        ("weight_decay", weight_decay, lambda x: x >= 0, ">= 0"),
    ]
    for name, value, ok, expected in checks:
        if value is None or callable(value):
            continue
        if not (_is_concrete_number(value) or isinstance(value, jax.Array)):
            raise ValueError(f"{name} must be a number, a scalar array or (learning_rate, weight_decay) a schedule, "
                             f"got {type(value).__name__}")
        if isinstance(value, jax.Array) and value.ndim != 0:
            raise ValueError(f"{name} must be a scalar, got an array of shape {value.shape}")
        if _is_concrete_number(value) and not ok(value):
            raise ValueError(f"{name} must be {expected}, got {value}")


# Variants of "pallas" that force one port of the kernel: the Mosaic GPU backend (fp32/bf16 states only). Its
# kernels use the API of jax >= 0.11: `plgpu.kernel` + `plgpu.emit_pipeline`, and refs (`jax.new_ref`) that the
# kernel writes in place (how a `plgpu.kernel` aliases its inputs; `pl.pallas_call` no longer lowers to Mosaic GPU
# there).
SM90 = "pallas:sm90"
VARIANTS = {SM90: _backend.Variant("the Mosaic GPU port of the Triton kernel", needs=(9, 0), min_jax=(0, 11),
                                   interpretable=False)}
# Its name in 0.2, accepted (with a DeprecationWarning) for the release that renames it, removed in the one after.
RENAMED = {"pallas:mosaic": SM90}


def _implementation(implementation) -> str:
    return _backend.resolve_implementation(implementation, op="adam", variants=VARIANTS, renamed=RENAMED)


def _leaf_implementation(requested, mu) -> impls.Implementation | None:
    """The implementation one tensor runs (`impls.IMPLEMENTATIONS`), resolved (and checked) once per leaf; None where
    `implementation=None` chooses on a GPU (`impls.choose`, per leaf: XLA's fused step for fp32/bf16 states, the
    Triton kernel for 8-bit ones). Asking for "pallas" explicitly always runs the Triton kernel."""
    impl = _implementation(requested)
    if requested is None and impl == "pallas":
        return None
    return impls.IMPLEMENTATIONS[impl]


# ----------------------------------------------------------------------------------------------
# one tensor


def _quantized(state_bits: int | None, size: int) -> bool:
    return state_bits == 8 and size >= _ref.MIN_QUANTIZED_SIZE


def init_adam_leaf_state(param: jax.Array, *, mu_dtype=None, state_bits: int | None = None):
    """(mu, nu) for one tensor: zeros in the 32-bit layout (mu in mu_dtype or the param's dtype, nu in the
    param's dtype, as optax), or two `QuantizedMoment`s for state_bits=8 (fp32 zeros under 4096 elements)."""
    bits = _check_bits(state_bits)
    if _quantized(bits, param.size):
        nb = _ref.num_blocks(param.size)

        def zeros():
            return QuantizedMoment(jnp.zeros((nb * _ref.QBLOCK,), jnp.uint8), jnp.zeros((nb,), jnp.float32))

        return zeros(), zeros()
    if bits == 8:
        return jnp.zeros(param.shape, jnp.float32), jnp.zeros(param.shape, jnp.float32)
    mu_dtype = jnp.dtype(mu_dtype) if mu_dtype is not None else param.dtype
    return jnp.zeros(param.shape, mu_dtype), jnp.zeros(param.shape, param.dtype)


def _scalars(neg_lr, b1, b2, eps, eps_root, weight_decay, count):
    """The kernel's scalar operand; 1 - b and the bias corrections computed exactly as optax does."""
    return _kernel.scalar_operand([
        neg_lr, b1, 1 - b1, b2, 1 - b2, eps, eps_root, weight_decay, 1 - b1**count, 1 - b2**count])


def _check_leaf(grad, mu, nu, param):
    if isinstance(mu, QuantizedMoment) != isinstance(nu, QuantizedMoment):
        raise ValueError("mu and nu must both be arrays or both be QuantizedMoment")
    if isinstance(mu, QuantizedMoment):
        nb = _ref.num_blocks(grad.size)
        for name, q in (("mu", mu), ("nu", nu)):
            if q.codes.shape != (nb * _ref.QBLOCK,) or q.codes.dtype != jnp.uint8 or q.absmax.shape != (nb,):
                raise ValueError(f"{name}: expected QuantizedMoment(codes uint8 ({nb * _ref.QBLOCK},), absmax ({nb},)) "
                                 f"for a gradient of {grad.size} elements, got codes {q.codes.dtype}{q.codes.shape}, "
                                 f"absmax {q.absmax.shape}")
    else:
        for name, x in (("mu", mu), ("nu", nu)):
            if x.shape != grad.shape:
                raise ValueError(f"{name}: expected shape {grad.shape} (the gradient's), got {x.shape}")
    if param is not None and param.shape != grad.shape:
        raise ValueError(f"param: expected shape {grad.shape} (the gradient's), got {param.shape}")
    for name, x in (("grad", grad), ("param", param)):
        if x is not None and not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name}: expected a floating dtype, got {x.dtype}")


def _update_dtype(grad, mu, nu, param):
    """The update's dtype: the params' when given (promoted with the grad's: fp32 params with bf16 grads give fp32
    updates, as optax's arithmetic), else the grad's promoted with the moments'."""
    if param is not None:
        return jnp.promote_types(grad.dtype, param.dtype)
    moment_dtype = jnp.float32 if isinstance(mu, QuantizedMoment) else jnp.promote_types(mu.dtype, nu.dtype)
    return jnp.promote_types(grad.dtype, moment_dtype)


def _leaf(grad, mu, nu, param, s, *, inplace: bool, implementation: impls.Implementation | None, u_dtype=None):
    """Run one leaf through `implementation` (None: `impls.choose`'s). Returns (update or new param, mu, nu).
    u_dtype: the update's dtype (default `_update_dtype` with `param`)."""
    _check_leaf(grad, mu, nu, param)
    if grad.size == 0:
        return (param if inplace else grad.astype(u_dtype or grad.dtype)), mu, nu
    u_dtype = None if inplace else (u_dtype or _update_dtype(grad, mu, nu, param))
    args = impls.LeafArgs(grad, mu, nu, param, s, inplace, u_dtype)
    config = None
    if implementation is None:
        implementation, config = impls.choose(args, impls.current_device())
    why = implementation.refuses(args)
    if why is not None:
        raise ValueError(f"adam: implementation={implementation.name!r} {why}")
    out, mu, nu = implementation(args, config)
    if args.quantized:
        return out, QuantizedMoment(*mu), QuantizedMoment(*nu)
    return out, mu, nu


def adam_leaf_direction(grad, mu, nu, count, *, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, param=None,
                        learning_rate=None, weight_decay=0.0, implementation=None, update_dtype=None):
    """One tensor's Adam update in one kernel pass: returns (update, new_mu, new_nu).

    count: the step number *after* incrementing (1 on the first step), for the bias corrections.
    With learning_rate=None the update is the Adam direction (as optax.scale_by_adam); otherwise it is
    -learning_rate * (direction + weight_decay * param) (as optax.adamw; param needed if weight_decay).
    mu / nu: arrays or `QuantizedMoment`s (see `init_adam_leaf_state`). The update's dtype: `update_dtype`, or
    the grad's promoted with the param's (or, without param, the moments'), as optax's arithmetic does.
    """
    if learning_rate is None and param is not None:
        raise ValueError("param: only used with learning_rate (for the weight decay); got learning_rate=None")
    neg_lr = 1.0 if learning_rate is None else -learning_rate
    s = _scalars(neg_lr, b1, b2, eps, eps_root, weight_decay, count)
    return _leaf(grad, mu, nu, param, s, inplace=False, implementation=_leaf_implementation(implementation, mu),
                 u_dtype=update_dtype)


def adam_leaf_update(param, grad, mu, nu, count, *, learning_rate, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0,
                     weight_decay=0.0, implementation=None):
    """One tensor's AdamW step in place: returns (new_param, new_mu, new_nu) from one kernel pass.

    Reads p, g, m, v and writes p, m, v over the param and moment buffers (input_output_aliases): jit
    the caller with those donated. p_new = p - lr * (mhat / (sqrt(vhat + eps_root) + eps) + wd * p),
    computed in fp32 and rounded once to p's dtype. count: the step number after incrementing (>= 1).
    """
    s = _scalars(-learning_rate, b1, b2, eps, eps_root, weight_decay, count)
    return _leaf(grad, mu, nu, param, s, inplace=True, implementation=_leaf_implementation(implementation, mu))


# ----------------------------------------------------------------------------------------------
# trees


def _decay_tree(weight_decay, mask, params):
    """Per-leaf weight decay: `weight_decay` where mask (a prefix pytree of bools, or a callable of the
    params returning one) is True, 0 elsewhere."""
    if mask is None:
        return jax.tree.map(lambda _: weight_decay, params)
    mask_tree = mask(params) if callable(mask) else mask
    return jax.tree.map(lambda mk, sub: jax.tree.map(lambda _: weight_decay if mk else 0.0, sub), mask_tree, params)


def _lr_at(value, count):
    """A hyperparameter's value at this step: schedules are evaluated at the count before increment."""
    return value(count) if callable(value) else value


def _tree_step(grads, state: FusedAdamState, params, *, learning_rate, b1, b2, eps, eps_root, weight_decay, mask,
               inplace, implementation, dtype_params=None):
    """params: read for the weight decay (None: no decay). dtype_params: the caller's params (or None), whose dtypes
    the updates take, as optax's."""
    _implementation(implementation)  # a bad choice fails here, before any leaf
    count_inc = optax.safe_increment(state.count)
    lr = _lr_at(learning_rate, state.count)
    neg_lr = 1.0 if lr is None else -lr
    weight_decay = _lr_at(weight_decay, state.count)  # a schedule too, as optax.add_decayed_weights
    g_paths, treedef = jax.tree_util.tree_flatten_with_path(grads)
    g_leaves = [g for _, g in g_paths]
    try:
        mu_leaves = treedef.flatten_up_to(state.mu)
        nu_leaves = treedef.flatten_up_to(state.nu)
    except ValueError:  # name what was expected first (the state, from init(params)), then what came
        is_q = lambda x: isinstance(x, QuantizedMoment)  # noqa: E731
        want = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(state.mu, is_leaf=is_q)[0]]
        raise ValueError(f"adam: the gradients' leaves do not match the state's (from init(params)): expected "
                         f"{want}, got {[jax.tree_util.keystr(k) for k, _ in g_paths]}") from None
    if params is None:
        p_leaves, wd_leaves = [None] * len(g_leaves), [0.0] * len(g_leaves)
    else:
        p_leaves = treedef.flatten_up_to(params)
        wd_leaves = treedef.flatten_up_to(_decay_tree(weight_decay, mask, params))
    d_leaves = [None] * len(g_leaves) if dtype_params is None else treedef.flatten_up_to(dtype_params)
    outs, mus, nus = [], [], []
    operands = {}  # one scalar operand per distinct weight decay (masked leaves get 0), shared by leaves
    for (path, g), m, v, p, wd, d in zip(g_paths, mu_leaves, nu_leaves, p_leaves, wd_leaves, d_leaves):
        if id(wd) not in operands:
            operands[id(wd)] = (wd, _scalars(neg_lr, b1, b2, eps, eps_root, wd, count_inc))
        s = operands[id(wd)][1]
        try:
            u_dtype = None if d is None else jnp.promote_types(g.dtype, jnp.result_type(d))
            o, m, v = _leaf(g, m, v, p, s, inplace=inplace, implementation=_leaf_implementation(implementation, m),
                            u_dtype=u_dtype)
        except ValueError as e:  # name the leaf: a shape or dtype error says which tensor
            raise ValueError(f"leaf {jax.tree_util.keystr(path)}: {e}") from None
        outs.append(o)
        mus.append(m)
        nus.append(v)
    unflat = lambda xs: jax.tree.unflatten(treedef, xs)  # noqa: E731
    return unflat(outs), FusedAdamState(count_inc, unflat(mus), unflat(nus))


def _init_tree(params, mu_dtype, state_bits) -> FusedAdamState:
    leaves, treedef = jax.tree.flatten(params)
    pairs = [init_adam_leaf_state(p, mu_dtype=mu_dtype, state_bits=state_bits) for p in leaves]
    return FusedAdamState(
        count=jnp.zeros([], jnp.int32),
        mu=jax.tree.unflatten(treedef, [m for m, _ in pairs]),
        nu=jax.tree.unflatten(treedef, [v for _, v in pairs]),
    )


def _fused(learning_rate, b1, b2, eps, eps_root, weight_decay, mask, mu_dtype, state_bits, implementation):
    _check_hparams(learning_rate, b1, b2, eps, eps_root, weight_decay)
    _check_bits(state_bits, traced_ok=True)
    _implementation(implementation)  # fail early on a bad choice

    def init_fn(params):
        return _init_tree(params, mu_dtype, state_bits)

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args  # accepted (and ignored) so that chains passing extra args through work, as optax's own
        if weight_decay is not None and params is None:
            raise ValueError("adamw: params must be passed to update() (the weight decay needs them)")
        return _tree_step(updates, state, params if weight_decay is not None else None,
                          learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
                          weight_decay=weight_decay, mask=mask, inplace=False, implementation=implementation,
                          dtype_params=params)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def scale_by_adam(b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, mu_dtype=None, state_bits=None,
                  implementation=None) -> optax.GradientTransformation:
    """Fused `optax.scale_by_adam`: the Adam direction of each leaf from one kernel pass (reads g, m, v;
    writes the direction, m, v). Same numbers and hyperparameters as optax; state `FusedAdamState`.

    state_bits: None or 32 (moments in mu_dtype / the params' dtype) or 8 (blockwise 8-bit moments).
    implementation: None (Pallas on a GPU, XLA elsewhere), "pallas", "pallas:sm90" (its Mosaic GPU port, Hopper),
        "xla" or "interpret".
    """
    return _fused(None, b1, b2, eps, eps_root, None, None, mu_dtype, state_bits, implementation)


def adam(learning_rate: ScalarOrSchedule, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, mu_dtype=None,
         state_bits=None, implementation=None) -> optax.GradientTransformation:
    """Fused `optax.adam`: the update -lr * direction comes out of one kernel pass per leaf.

    learning_rate: a number or an optax schedule (evaluated at the state's count, as optax does).
    See `scale_by_adam` for the other arguments.
    """
    return _fused(learning_rate, b1, b2, eps, eps_root, None, None, mu_dtype, state_bits, implementation)


def adamw(learning_rate: ScalarOrSchedule, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, weight_decay=1e-4,
          mask=None, mu_dtype=None, state_bits=None, implementation=None) -> optax.GradientTransformation:
    """Fused `optax.adamw`: -lr * (direction + weight_decay * params) from one kernel pass per leaf
    (reads g, m, v, p; writes the update, m, v), then `optax.apply_updates` as usual.

    learning_rate, weight_decay: numbers or optax schedules. mask: as optax (a pytree of bools, a prefix of
    the params, or a callable returning one): weight decay only where True. Usable in optax.chain /
    multi_transform / MultiSteps / inject_hyperparams: every hyperparameter is a runtime kernel operand.
    For the fastest step see `adamw_step`.
    """
    return _fused(learning_rate, b1, b2, eps, eps_root, weight_decay, mask, mu_dtype, state_bits, implementation)


# optax tells a factory that takes a schedule by its learning_rate annotation being optax.ScalarOrSchedule (its
# conformance suite's schedule test skips any other); this module's annotations are strings (postponed evaluation),
# so the object is set here.
for _factory in (adam, adamw):
    _factory.__annotations__["learning_rate"] = optax.ScalarOrSchedule
del _factory

def adamw_step(params, grads, state: FusedAdamState, *, learning_rate: ScalarOrSchedule, b1=0.9, b2=0.999,
               eps=1e-8, eps_root=0.0, weight_decay=1e-4, mask=None, implementation=None):
    """The in-place AdamW step: returns (new_params, new_state), one kernel pass per tensor.

    Each pass reads p, g, m, v and writes p, m, v into the same buffers (input_output_aliases), so jit
    it with params and state donated: `jax.jit(step, donate_argnums=(0, 2))`. The state is the one
    `adamw(...).init(params)` makes (any state_bits): the in-place and the optax paths are
    interchangeable, with the same numbers (params rounded once to their dtype here).
    """
    _check_hparams(learning_rate, b1, b2, eps, eps_root, weight_decay)
    if not isinstance(state, FusedAdamState):
        raise ValueError(f"state: expected a FusedAdamState (from adamw(...).init(params)), got {type(state).__name__}")
    p_struct, g_struct = jax.tree.structure(params), jax.tree.structure(grads)
    if p_struct != g_struct:
        raise ValueError(f"grads: expected the structure of params {p_struct}, got {g_struct}")
    new_params, new_state = _tree_step(
        grads, state, params, learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
        weight_decay=weight_decay, mask=mask, inplace=True, implementation=implementation)
    return new_params, new_state


def adam_state_bytes(state: FusedAdamState) -> int:
    """Bytes of optimizer state (moments and count): what state_bits=8 shrinks."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))


def state_shardings(state: FusedAdamState, param_shardings, *, mesh=None) -> FusedAdamState:
    """Shardings for `state` that match the params' (for jit's in/out_shardings, or jax.device_put).

    param_shardings: a tree of `NamedSharding`s like the params. Array moments take their param's
    sharding; a `QuantizedMoment` (a flat block layout) is split along its blocks over the mesh axes of
    the param's leading axis (replicated if those do not divide the block count: see `impls.q8_sharded`);
    count is replicated over the params' mesh, or over `mesh` (required when the params have no leaves).
    """
    leaves, treedef = jax.tree.flatten(param_shardings)
    mesh = _sharding.mesh_of(leaves, mesh, op="adam.state_shardings")

    def moment(q, sh):
        if not isinstance(q, QuantizedMoment):
            return sh
        lead = tuple(sh.spec)[0] if len(tuple(sh.spec)) else None
        size = 1 if lead is None else _sharding.axes_size(sh.mesh, lead)
        axis = lead if size > 1 and q.absmax.shape[0] % size == 0 else None
        return QuantizedMoment(NamedSharding(sh.mesh, PartitionSpec(axis)), NamedSharding(sh.mesh, PartitionSpec(axis)))

    def tree(moments):
        return treedef.unflatten([moment(q, sh) for q, sh in zip(treedef.flatten_up_to(moments), leaves)])

    return FusedAdamState(NamedSharding(mesh, PartitionSpec()), tree(state.mu), tree(state.nu))
