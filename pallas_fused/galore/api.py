"""GaLore Adam(W) as optax transforms, plus an in-place training step (kernels via kernel.py; no Pallas here).

    tx = galore_adamw(1e-3, rank=128, update_proj_gap=200, scale=0.25, weight_decay=0.01)
    state = tx.init(params)
    updates, state = tx.update(grads, state, params)          # optax path
    params = optax.apply_updates(params, updates)

    opt = galore_adamw_inplace(1e-3, rank=128, ...)           # same state, same numbers (fp32 with weight
                                                              # decay, same implementation: bit-identical)
    step = jax.jit(opt.step, donate_argnums=(0, 2))           # writes params in the update kernel
    params, state = step(params, grads, state)

Which leaves are projected: the 2-D leaves selected by `mask` (default: every non-empty 2-D leaf, as
optax.contrib.galore), each at rank min(rank, M, N): like optax.contrib.galore and galore-torch, a leaf whose
smaller side is <= rank is projected at full rank rather than silently left out. Every other leaf gets plain
Adam(W) from pallas_fused.adam's fused kernel (optax.adamw's numbers, m_hat / (sqrt(v_hat) + eps); its
non-finite policy: such elements are skipped) and the same decoupled weight decay. A leaf that is not 2-D and
is chosen by `mask` is a ValueError (N-D leaves are not reshaped, as optax's weight_dimension_numbers would).
Updates come in the params' dtype (the gradients' when `update` gets no params).

Semantics (`convention="galore"`, the default) are the reference GaLore (galore-torch `GaLoreAdamW`):
the projector is recomputed from the current gradient when the step count (before increment) is a
multiple of `update_proj_gap` (step 0 included); the low-rank moments are kept across refreshes;
m = b1 m + (1-b1) R, v = b2 v + (1-b2) R^2, R_n = m / (sqrt(v) + eps),
W <- W - lr sqrt(1-b2^t)/(1-b1^t) scale backproject(R_n) - lr wd W   (decay of the pre-step W, as AdamW
in optax; galore-torch decays the post-step W, a difference of order lr^2 wd).

`convention="optax"` reproduces optax.contrib.galore (with its default scale_by_adam base): its projector
side (proj_type "reverse_std": the smaller dimension is kept) and its eps placement
m_hat / (sqrt(v_hat) + eps); the learning rate is applied after scale and weight decay as there.

The refresh schedule on the host: `update(grads, state, params, refresh=...)` (through optax.chain too, which hands
its transforms every extra argument) and `step(params, grads, state, refresh=...)` take `refresh`, None (the default:
the schedule above, decided on the device by a lax.cond whose predicate the host reads back each step, so each step
waits for the one before it to finish) or a bool known when the step is traced: True refreshes every projector
unconditionally, False keeps them, with no conditional at all, so the host can queue steps ahead of the GPU (two
compiled steps: jit with static_argnames="refresh"). The host then owns the schedule: pass True on the first step
(projectors start at zero, and a zero projector gives a zero update) and every `update_proj_gap` steps after; a
refresh that saw a non-finite gradient sets `state.pending_refresh`, which only the next refresh=True clears.

    step = jax.jit(train_step, static_argnames="refresh", donate_argnums=(0, 1))
    for t in range(steps):
        params, state = step(params, state, batch, refresh=t % gap == 0)   # update(..., refresh=refresh) inside

Non-finite gradients: on a refresh step whose gradient (of a projected leaf) is not finite, that leaf
keeps its previous projector and moments and its update is zero (the step is skipped for that leaf, the
step count still advances) and every projector is refreshed again on the next step. On other steps a
projected leaf whose gradient is not finite (or whose squared low-rank gradient overflows) skips its step the
same way: params, low-rank moments and projector are kept and its update is zero; the check reads only the
small low-rank moments, never G again. Never a poisoned state: the projected leaves skip the whole leaf,
the other leaves (as pallas_fused.adam) skip the non-finite elements.

Sharding (FSDP: each weight, its gradient and its state split along one axis of a mesh; see
pallas_fused._sharding): under jit every kernel runs on each device's shard. The down-projection
R = G P^T (side right) or P^T G (side left) is local when its contraction is whole; when the contraction
is split, each device projects its shard and the small (M, r) / (r, N) partial projections are
all-reduced (never G) before the low-rank Adam kernel. The up-projection's contraction is the rank, so
W's shard needs only the matching rows/columns of P and N: local. `state_shardings(state,
param_shardings)` gives the matching state shardings. Projector refresh: "randomized" is GEMMs with a
sharded G that XLA partitions (all-reducing and at most gathering the (M or N, rank + oversample)
sketches, never G); "svd" (jnp.linalg.svd is not partitioned) gathers the full gradient of each projected
leaf on refresh steps (once every update_proj_gap steps): prefer "randomized" on large meshes. The refresh runs one
loop over each group of leaves of one shape, dtype and side, which takes one layout for the group: leaves of one
shape split alike (as FSDP splits a model's repeated projections) refresh as above; where one leaf of a group is
split differently (tensor parallelism's column- and row-split projections of one shape), XLA reshards its gradient
to the group's layout on refresh steps.

Hyperparameters learning_rate (float or schedule), b1, b2, eps, weight_decay, scale, update_proj_gap and
seed are runtime values: under `optax.inject_hyperparams(galore_adamw)` changing them does not recompile.
inject_hyperparams makes an array of every int argument, so `rank` is a traced value under a jitted init,
which needs it for the state's shapes: it is a constant of that trace, and init reads its value, so no
static_args are needed (where a traced rank is a real input of the traced function, a ValueError names
static_args=GALORE_STATIC_ARGS). Every update reads each leaf's rank off its projector.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_fused import _backend, _sharding
from pallas_fused import adam as fused_adam
from pallas_fused.galore import kernel, projector, reference
from pallas_fused.galore.reference import Scalars

CONVENTIONS = ("galore", "optax")
PROJECTORS = ("svd", "randomized")

# implementation="pallas:<variant>": how a projected leaf is stepped ("interpret:<variant>" runs its kernels in the
# Pallas interpreter). Plain "pallas" (and "interpret") takes `choose_kernel`'s measured pick per leaf, or XLA's
# graph for an update with no weight-decay term (see `_GaLore._leaf`).
VARIANTS = {
    "pallas:hybrid": _backend.Variant("XLA's down-projection GEMM, the elementwise Pallas low-rank Adam kernel, then "
                                      "the Pallas up-projection with the update in its epilogue"),
    "pallas:xla_up": _backend.Variant("XLA's down-projection GEMM, the elementwise Pallas low-rank Adam kernel, then "
                                      "XLA's up-projection GEMM with the update as jnp (which XLA may fuse into it)"),
}

_masked_node = optax.MaskedNode
_is_masked = lambda x: isinstance(x, optax.MaskedNode)


class GaLoreAdamState(NamedTuple):
    """Plain pytree state (checkpointable with orbax).

    count: int32 steps taken. pending_refresh: bool, refresh every projector on the next step (set when a
    refresh saw a non-finite gradient). projector: P of projected leaves ((r, N) on side "right", (M, r) on
    side "left"); MaskedNode for the other leaves. mu, nu: the low-rank moments of projected leaves, and
    the full-size Adam moments (pallas_fused.adam's layout) of the other leaves."""

    # Any: `state_shardings` returns this tuple with a sharding in each field.
    count: Any
    pending_refresh: Any
    mu: Any
    nu: Any
    projector: Any


class GaLoreInplace(NamedTuple):
    """`init(params) -> state`; `step(params, grads, state, refresh=None) -> (params, state)`: jit it with
    donate_argnums=(0, 2) so the update kernels write params and moments in place (`refresh`: see the module
    docstring)."""

    init: Callable
    step: Callable


def choose_kernel(shape: tuple[int, int], rank: int, side: str) -> str:
    """The variant (a name of `VARIANTS` without "pallas:") that implementation="pallas" runs for one leaf that
    decays or steps in place: the measured winner nearest in shape and rank (`kernel.choose_variant`: this GPU kind's
    tuning table, which the tuning sweep of benchmarks/bench_galore.py prints)."""
    return kernel.choose_variant(shape, rank, side)


# ------------------------------------------------------------------------------------------------ sharding
# The kernels partitioned with pallas_fused._sharding (FSDP: W, G and the moments/projector split along
# one axis). Factors: "m n" is the weight, "r" the rank (never split), "hp" the scalar operand. Under
# side "right" P is (r, N) and R, m, v are (M, r); under side "left" P is (M, r) and R, m, v are (r, N).


def _lowrank_adam(r, m, v, packed, *, interpret, n_dtype=jnp.float32, p=None):
    """The elementwise low-rank Adam kernel on each shard of R, m, v (and of P, cast to fp16 as a 4th result,
    when given)."""
    def local(r, m, v, packed, *p):
        return kernel.lowrank_adam(r, m, v, packed, interpret=interpret, n_dtype=n_dtype, p=p[0] if p else None)

    with_p = ", c d" if p is not None else ""
    return _sharding.partitioned(local, f"a b, a b, a b, hp{with_p} -> a b, a b, a b{with_p}",
                                 replicated=("hp",))(r, m, v, packed, *(() if p is None else (p,)))


def _up_update(w, n, p, packed, *, side, inplace, interpret, out_dtype=None, blocks=None):
    """The up-projection + update on each shard of W: its contraction is the rank, never split, so a
    shard of W needs only the matching rows of the (M, r) factor and columns of the (r, N) one.
    w=None (no weight decay, not in place): the update alone, in `out_dtype`, and W is never read."""
    a, b = (n, p) if side == "right" else (p, n)

    def local(w, a, b, packed):
        nn, pp = (a, b) if side == "right" else (b, a)
        return kernel.up_update(w, nn, pp, packed, side=side, inplace=inplace, interpret=interpret,
                                out_dtype=out_dtype, blocks=blocks)

    if w is None:
        return _sharding.partitioned(lambda a, b, packed: local(None, a, b, packed), "m r, r n, hp -> m n",
                                     replicated=("r", "hp"))(a, b, packed)
    return _sharding.partitioned(local, "m n, m r, r n, hp -> m n", replicated=("r", "hp"))(w, a, b, packed)


def _state_side(m_shape, p_shape) -> str:
    """A projected leaf's side, read off its state: m (M, r) and P (r, N) on side right, P (M, r) and m (r, N) on
    side left, with r <= min(M, N). The shapes fit both sides only when M = N = r, where the sides coincide."""
    right = m_shape[1] == p_shape[0] and m_shape[1] <= m_shape[0] and p_shape[0] <= p_shape[1]
    return "right" if right else "left"


def _refresh_arg(refresh) -> bool | None:
    """`update`'s / `step`'s `refresh`: None (the refresh schedule runs on the device) or a bool known when the step
    is traced (a Python or NumPy bool, or a concrete bool scalar array)."""
    if refresh is None:
        return None
    if isinstance(refresh, (bool, np.bool_)):
        return bool(refresh)
    if isinstance(refresh, jax.core.Tracer):
        raise ValueError("galore: refresh must be known when the step is traced (it selects the compiled step): got "
                         "a traced value; pass a Python bool and mark it static, e.g. jax.jit(train_step, "
                         "static_argnames='refresh')")
    if isinstance(refresh, (np.ndarray, jax.Array)) and refresh.shape == () and refresh.dtype == np.bool_:
        return bool(refresh)
    raise ValueError(f"galore: refresh must be None or a bool, got {refresh!r}")


def _check_grads(updates, state: GaLoreAdamState):
    """A ValueError naming the leaf (path, expected and actual shape) or both key lists, rather than a
    broadcasting error deep in a kernel."""
    got, want = jax.tree.structure(updates), jax.tree.structure(state.mu)
    if got != want:
        raise ValueError(f"galore: the gradients' tree does not match the state's (from init(params)): "
                         f"expected {want}, got {got}")
    flat_m, flat_p = want.flatten_up_to(state.mu), want.flatten_up_to(state.projector)
    for (path, g), m, p in zip(jax.tree_util.tree_leaves_with_path(updates), flat_m, flat_p):
        if _is_masked(p):
            expected = m.shape
        elif _state_side(m.shape, p.shape) == "right":
            expected = (m.shape[0], p.shape[1])
        else:
            expected = (p.shape[0], m.shape[1])
        if tuple(jnp.shape(g)) != tuple(expected):
            raise ValueError(f"galore: gradient leaf {jax.tree_util.keystr(path)} has shape {tuple(jnp.shape(g))}, "
                             f"expected {tuple(expected)} (the param's shape at init)")


def _skip_nonfinite(r, m, v, s: Scalars) -> Scalars:
    """`s` with ok = 0 when a projected leaf's step must be skipped: its low-rank gradient R is not finite, or its
    refresh failed (s.ok = 0 already). The step then keeps its moments and its update is zero (the Adam step and the
    up-projection read ok). A non-finite G makes R = G P^T (P^T G) non-finite exactly, inf * 0 included: every
    product with a NaN or inf element of G is NaN or +-inf (0 * inf is NaN), and a sum holding one is NaN or +-inf,
    so the row (column) of R it lands in is non-finite for any finite P. The new moments m = b1 m + (1-b1) R,
    v = b2 v + (1-b2) R^2 are then non-finite (as is v when R^2 overflows): `reference.lowrank_finite` tests them
    from the small R, m and v, never re-reading G, in one reduction before the step, which then writes its moments
    once (in place: the kept moments are the old ones, stored back) instead of selecting between new and old copies
    after it."""
    keep = reference.lowrank_finite(r, m, v, s) & (s.ok > 0)
    return s._replace(ok=keep.astype(jnp.float32))


_STATIC_HINT = ("optax.inject_hyperparams makes an array of every int argument, traced under jit: pass "
                "static_args=GALORE_STATIC_ARGS")


def _int_arg(name, value, minimum, *, static: bool):
    """An int argument: a Python int, or an integer scalar array (what optax.inject_hyperparams makes of an int)
    converted to one. A traced scalar is returned as it is where a runtime value serves (`static` False: the
    projector gap, the seed, the rank outside init); where the value sets a shape or a loop it is a ValueError."""
    if isinstance(value, bool) or not (isinstance(value, int) or (
            isinstance(value, (np.ndarray, np.generic, jax.Array)) and jnp.issubdtype(value.dtype, jnp.integer)
            and jnp.ndim(value) == 0)):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if isinstance(value, jax.core.Tracer):
        if static:
            raise ValueError(f"{name} sets a shape, so it must be known when the step is traced; got a traced "
                             f"value ({_STATIC_HINT}, or ({name!r},))")
        return value
    if minimum is not None and int(value) < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {int(value)}")
    return int(value)


def _static(default):
    """A field that is structure, not a number (listed in GALORE_STATIC_ARGS)."""
    return dataclasses.field(default=default, metadata={"static": True})


@dataclasses.dataclass(frozen=True)
class GaLoreConfig:
    """The arguments of the four GaLore constructors but the learning rate, with their defaults: the one place the
    defaults live (the constructors' keyword arguments read theirs from here; see their docstrings for each).
    `resolved()` checks them and fills in the defaults that follow the convention."""

    rank: int = _static(128)
    update_proj_gap: int = _static(200)
    scale: float | None = None  # 0.25 (convention "galore") or 1.0 ("optax")
    proj_type: str | None = _static(None)  # "std" or "reverse_std"
    b1: float = 0.9
    b2: float = 0.999
    eps: float | None = None  # 1e-6 or 1e-8
    weight_decay: float | None = 0.0  # None: no weight-decay term at all (galore_adam, scale_by_galore_adam)
    mask: Any = _static(None)
    weight_decay_mask: Any = _static(None)
    projector: str | None = _static(None)  # "randomized" or "svd"
    oversample: int | None = _static(None)  # 8
    power_iters: int | None = _static(None)  # 2
    seed: int = _static(0)
    convention: str = _static("galore")
    mu_dtype: Any = _static(None)
    nu_dtype: Any = _static(None)
    implementation: str | None = _static(None)

    def resolved(self) -> GaLoreConfig:
        """The arguments checked (a ValueError names the one at fault), ints made Python ints where they set shapes,
        the implementation resolved, and the defaults that follow the convention filled in: GaLore's (scale 0.25,
        eps 1e-6, proj_type "std", the randomized projector) or optax.contrib.galore's (scale 1.0,
        optax.scale_by_adam's eps 1e-8, "reverse_std", the exact SVD), so that convention="optax" alone reproduces
        optax's numbers."""
        if self.convention not in CONVENTIONS:
            raise ValueError(f"convention must be one of {CONVENTIONS}, got {self.convention!r}")
        galore = self.convention == "galore"
        proj_type = ("std" if galore else "reverse_std") if self.proj_type is None else self.proj_type
        if proj_type not in reference.PROJ_TYPES:
            raise ValueError(f"proj_type must be one of {reference.PROJ_TYPES}, got {proj_type!r}")
        projector_ = ("randomized" if galore else "svd") if self.projector is None else self.projector
        if projector_ not in PROJECTORS:
            raise ValueError(f"projector must be one of {PROJECTORS}, got {projector_!r}")
        randomized = projector_ == "randomized"  # the sketch's width and the iteration count: static there only
        return dataclasses.replace(
            self,
            # rank sets the state's shapes at init (checked there); update reads each leaf's rank off its projector
            rank=_int_arg("rank", self.rank, 1, static=False),
            update_proj_gap=_int_arg("update_proj_gap", self.update_proj_gap, 1, static=False),
            seed=_int_arg("seed", self.seed, None, static=False),
            oversample=_int_arg("oversample", 8 if self.oversample is None else self.oversample, 0, static=randomized),
            power_iters=_int_arg("power_iters", 2 if self.power_iters is None else self.power_iters, 0,
                                 static=randomized),
            scale=(0.25 if galore else 1.0) if self.scale is None else self.scale,
            eps=(1e-6 if galore else 1e-8) if self.eps is None else self.eps,
            proj_type=proj_type, projector=projector_,
            implementation=_backend.resolve_implementation(self.implementation, op="galore", variants=VARIANTS))


# Arguments that are structure, not numbers: optax.inject_hyperparams static_args where `rank` is an input of a
# traced function (inject_hyperparams' own array of it is a constant that init reads).
GALORE_STATIC_ARGS = tuple(f.name for f in dataclasses.fields(GaLoreConfig) if f.metadata.get("static"))


def leaf_step(variant: str, w, g, m, v, p, side: str, s: Scalars, *, inplace: bool, interpret: bool, dtype,
              up_blocks=None):
    """One projected leaf through the kernels of `variant` (a name of `VARIANTS` without "pallas:"): returns
    (out, m', v'), out being the update in `dtype` (W's, or G's when w is None: no weight-decay term) or, with
    `inplace`, the new W. A leaf whose low-rank step is not finite is skipped (`_skip_nonfinite`). `up_blocks` (a
    kernel.UpConfig) overrides the up-projection's launch (the tuning sweep of benchmarks/bench_galore.py)."""
    if f"pallas:{variant}" not in VARIANTS:
        raise ValueError(f"galore: variant must be one of {[k.partition(':')[2] for k in VARIANTS]}, got {variant!r}")
    # XLA's GEMM (partitioned by XLA: a sharded contraction is all-reduced), the finiteness flag (one reduction over
    # R, m, v, into the scalars both kernels read), then the elementwise kernel, which writes m and v in place (back
    # as they were on a skipped step)
    r = reference.project(g, p, side)
    s = _skip_nonfinite(r, m, v, s)
    packed = s.pack()
    if variant == "xla_up":  # XLA's GEMMs (partitioned by XLA) around the elementwise low-rank Adam kernel
        m, v, n = _lowrank_adam(r, m, v, packed, interpret=interpret)
        return reference.finish_step(w, n, p, side, s, inplace=inplace, dtype=dtype), m, v
    # an fp16 up-projection (kernel.up_config) takes N in fp16 from the Adam kernel, and P cast once with p16 (the
    # same launch: no separate one)
    n_dtype, p16 = kernel.up_operands(reference.projector_rank(p.shape, side), side, up_blocks)
    m, v, n, *cast = _lowrank_adam(r, m, v, packed, interpret=interpret, n_dtype=n_dtype, p=p if p16 else None)
    out = _up_update(w, n, cast[0] if p16 else p, packed, side=side, inplace=inplace, interpret=interpret,
                     out_dtype=dtype, blocks=up_blocks)
    return out, m, v


def _resolve_mask(mask, params, default):
    if mask is None:
        return jax.tree.map(default, params)
    if isinstance(mask, bool):  # a bool prefix of the whole tree, as optax accepts
        return jax.tree.map(lambda _: mask, params)
    return mask(params) if callable(mask) else mask


class _GaLore:
    """The shared core of the optax transforms and the in-place step."""

    def __init__(self, learning_rate, cfg: GaLoreConfig):
        self.lr, self.cfg = learning_rate, cfg.resolved()
        # filled in by resolved(): the str the steps read
        self.proj_type, self.implementation = str(self.cfg.proj_type), str(self.cfg.implementation)
        # The leaves that are not projected (a model's norms and biases: small, many) run pallas_fused.adam's own
        # default unless an implementation is asked for: on a GPU that is XLA's fused elementwise step, which XLA
        # merges across leaves into a few launches, where a kernel is a launch per leaf.
        self.adam_implementation = (None if cfg.implementation is None
                                    else _backend.split_implementation(self.implementation)[0])

    # ---------------------------------------------------------------------------------------------- init
    def _projected(self, params):
        """Which leaves are projected: `mask`'s choice (default: every 2-D leaf, as optax.contrib.galore). An empty
        leaf has nothing to project and steps as plain Adam(W); a selected leaf that is not 2-D is a ValueError."""
        flags = _resolve_mask(self.cfg.mask, params, lambda p: p.ndim == 2)
        flat_p, treedef = jax.tree.flatten(params)
        flat_f = treedef.flatten_up_to(flags)
        for path_leaf, p, f in zip(jax.tree_util.tree_leaves_with_path(params), flat_p, flat_f):
            if f and p.ndim != 2:
                where = jax.tree_util.keystr(path_leaf[0])
                raise ValueError(
                    f"galore: leaf {where} has shape {p.shape}: only 2-D leaves are projected (optax.contrib.galore's "
                    f"weight_dimension_numbers is not supported). Store it as a 2-D matrix (e.g. (embed, heads * "
                    f"head_dim)), or leave it out of `mask` (it then steps as plain Adam(W))")
        return [bool(f) and p.size > 0 for p, f in zip(flat_p, flat_f)], treedef

    def _rank(self, shape) -> int:
        """A projected leaf's rank: `rank`, clamped to min(M, N) as optax.contrib.galore and galore-torch do (a
        leaf whose smaller side is <= rank is projected at full rank: its moments take no less memory than Adam's
        but it is stepped in the gradient's singular basis, as the peers step it)."""
        rank = self.cfg.rank
        if isinstance(rank, jax.core.Tracer):
            # inject_hyperparams' array of an int is a constant of a jitted init's trace: its value is known.
            rank = _backend.trace_time_int(rank)
            if rank is None:
                raise ValueError(f"rank sets the state's shapes, so it must be known at init; got a traced value "
                                 f"that is an input of the traced function ({_STATIC_HINT}, or ('rank',); or call "
                                 "init outside jit)")
            if rank < 1:
                raise ValueError(f"rank must be >= 1, got {rank}")
        return min(rank, *shape)

    def init(self, params) -> GaLoreAdamState:
        cfg = self.cfg
        flags, treedef = self._projected(params)
        flat = treedef.flatten_up_to(params)
        mu, nu, proj = [], [], []
        for p, f in zip(flat, flags):
            if not f:  # plain Adam(W): pallas_fused.adam's per-leaf state (nu in the param's dtype, as optax)
                m, v = fused_adam.init_adam_leaf_state(p, mu_dtype=cfg.mu_dtype or jnp.float32)
                mu.append(m), nu.append(v), proj.append(_masked_node())
                continue
            side, rank = reference.projector_side(p.shape, self.proj_type), self._rank(p.shape)
            low = reference.lowrank_shape(p.shape, rank, side)
            mu.append(jnp.zeros(low, cfg.mu_dtype or jnp.float32))
            nu.append(jnp.zeros(low, cfg.nu_dtype or jnp.float32))
            proj.append(jnp.zeros(reference.projector_shape(p.shape, rank, side), p.dtype))
        return GaLoreAdamState(
            count=jnp.zeros([], jnp.int32),
            pending_refresh=jnp.zeros([], jnp.bool_),
            mu=treedef.unflatten(mu), nu=treedef.unflatten(nu), projector=treedef.unflatten(proj),
        )

    # ------------------------------------------------------------------------------------------ refresh
    @staticmethod
    def _finite_grad(g):
        """(G with its non-finite elements zeroed where it has any, G is finite): what a refresh reads."""
        finite = jnp.all(jnp.isfinite(g))
        return jnp.where(finite, g, 0).astype(g.dtype), finite

    def _refresh(self, g_safe, finite, p_old, side, key):
        """One leaf's new projector (its old one where G is not finite) from `_finite_grad`'s pair."""
        cfg = self.cfg
        rank = reference.projector_rank(p_old.shape, side)
        if cfg.projector == "svd":
            p_new = reference.svd_projector(g_safe, rank, side, p_old.dtype)
        else:
            kw = dict(oversample=cfg.oversample, power_iters=cfg.power_iters, dtype=p_old.dtype)
            # a zero projector (never computed) starts the range finder cold
            p_new = projector.randomized_projector(g_safe, rank, side, key, prev=p_old, **kw)
        return jnp.where(finite, p_new, p_old), finite

    def _refresh_all(self, flat_g, flat_p, sides, key):
        """Every projected leaf's refresh ({leaf index: (new projector, G finite)}), one loop per group of leaves of
        one shape, dtype and side: a model repeats a few shapes over its layers, so the program holds one copy of the
        refresh per group, not per leaf (its compile time and size grow with the groups). The loop (lax.fori_loop)
        selects leaf j's gradient with lax.switch, whose branch also zeroes a non-finite G (the copy `_finite_grad`
        makes anyway): one leaf's gradient is copied at a time, never the group's stacked, so a refresh step's
        peak memory stays that of the per-leaf refresh. The projectors are small and go through the loop stacked.
        Each leaf keeps its own key (folded with its index), so the numbers are the per-leaf refresh's."""
        groups: dict[tuple, list[int]] = {}
        for i, side in sides.items():
            g, p = flat_g[i], flat_p[i]
            groups.setdefault((g.shape, jnp.dtype(g.dtype), p.shape, jnp.dtype(p.dtype), side), []).append(i)
        out = {}
        for (*_, side), idx in groups.items():
            if len(idx) == 1:
                i = idx[0]
                out[i] = self._refresh(*self._finite_grad(flat_g[i]), flat_p[i], side, jax.random.fold_in(key, i))
                continue
            leaf_ids = jnp.asarray(idx, jnp.uint32)
            branches = [lambda i=i: self._finite_grad(flat_g[i]) for i in idx]

            def body(j, carry, branches=branches, leaf_ids=leaf_ids, side=side):
                projs, finite = carry
                p, ok = self._refresh(*lax.switch(j, branches), projs[j], side, jax.random.fold_in(key, leaf_ids[j]))
                return projs.at[j].set(p), finite.at[j].set(ok)

            projs, finite = lax.fori_loop(0, len(idx), body, (jnp.stack([flat_p[i] for i in idx]),
                                                              jnp.zeros(len(idx), jnp.bool_)))
            out.update({i: (projs[j], finite[j]) for j, i in enumerate(idx)})
        return out

    # ---------------------------------------------------------------------------------------- the step
    def _scalars(self, count, lr, with_lr: bool):
        f32 = jnp.float32
        b1, b2 = jnp.asarray(self.cfg.b1, f32), jnp.asarray(self.cfg.b2, f32)
        t = (count + 1).astype(f32)
        bc1, bc2 = 1 - b1**t, 1 - b2**t
        scale = jnp.asarray(self.cfg.scale, f32)
        sign_lr = -lr if with_lr else jnp.asarray(1.0, f32)
        if self.cfg.convention == "galore":
            alpha = beta = jnp.asarray(1.0, f32)
            c = sign_lr * scale * jnp.sqrt(bc2) / bc1
        else:
            alpha, beta = 1 / bc1, 1 / jnp.sqrt(bc2)
            c = sign_lr * scale
        return b1, b2, jnp.asarray(self.cfg.eps, f32), alpha, beta, c

    def _leaf(self, w, g, m, v, p, side, s: Scalars, inplace, dtype):
        base, variant = _backend.split_implementation(self.implementation)
        # With no weight-decay term on the optax path (w None, no variant forced), XLA's graph end to end as well: the
        # up-projection GEMM's output is the update itself, so the caller's `optax.apply_updates` adds p inside that
        # GEMM (cuBLAS's beta = 1) instead of writing the update and reading it back; and the finiteness test fuses
        # with the down-projection GEMM's partial-sum reduction, where the Pallas kernel would be a launch of its own
        # reading R back (benchmarks/results/user_path_dev/).
        if base == "xla" or (variant is None and w is None):
            # the skip as the kernels take it: the flag first, then one elementwise pass whose selects on it write
            # the moments (the old ones on a skipped step), so no new moments are kept beside the old
            r = reference.project(g, p, side)
            s = _skip_nonfinite(r, m, v, s)
            m_new, v_new, n = reference.lowrank_adam(r, m, v, s)
            return reference.finish_step(w, n, p, side, s, inplace=inplace, dtype=dtype), m_new, v_new
        if variant is None:
            variant = choose_kernel(g.shape, reference.projector_rank(p.shape, side), side)
        return leaf_step(variant, w, g, m, v, p, side, s, inplace=inplace, interpret=base == "interpret",
                         dtype=dtype)

    def _update(self, updates, state: GaLoreAdamState, params, inplace: bool, refresh: bool | None):
        cfg = self.cfg
        with_lr = self.lr is not None
        # A literal weight_decay=0 (the default) reads no W; a traced one (inject_hyperparams) may change.
        wd_arg = cfg.weight_decay
        has_wd = wd_arg is not None and not (isinstance(wd_arg, (int, float)) and wd_arg == 0)
        if (has_wd or inplace) and params is None:
            raise ValueError("galore: `params` are required (weight decay / the in-place step)")
        count = state.count
        lr = jnp.asarray(self.lr(count) if callable(self.lr) else (self.lr if with_lr else 1.0), jnp.float32)
        b1, b2, eps, alpha, beta, c = self._scalars(count, lr, with_lr)
        wd = jnp.asarray(wd_arg if has_wd else 0.0, jnp.float32)

        treedef = jax.tree.structure(updates)
        _check_grads(updates, state)
        flat_g = treedef.flatten_up_to(updates)
        flat_w = treedef.flatten_up_to(params) if params is not None else [None] * len(flat_g)
        flat_mu, flat_nu, flat_p = (treedef.flatten_up_to(x) for x in (state.mu, state.nu, state.projector))
        if has_wd:
            wd_flags = treedef.flatten_up_to(_resolve_mask(cfg.weight_decay_mask, params, lambda _: True))
        else:
            wd_flags = [False] * len(flat_g)

        # One lax.cond refreshes every projector: on a GPU each conditional costs a predicate read-back,
        # so one per step rather than one per leaf. Its other branch only passes its operands through (no kernel of
        # its own): the projectors, and the refresh flag, which is False whenever no refresh is due.
        proj_idx = [i for i, p in enumerate(flat_p) if not _is_masked(p)]
        sides = {i: reference.projector_side(flat_g[i].shape, self.proj_type) for i in proj_idx}

        def refresh_all():
            # The sketch's key inside the branch: between refreshes no step hashes it (small kernels that would run
            # before the predicate's read-back, on every step).
            key = jax.random.fold_in(jax.random.key(cfg.seed), count)
            new = self._refresh_all(flat_g, flat_p, sides, key)
            # a refresh that saw a non-finite gradient kept that leaf's projector: refresh them all next step
            return [new[i][0] for i in proj_idx], ~jnp.all(jnp.stack([new[i][1] for i in proj_idx]))

        def keep_all():
            return [flat_p[i] for i in proj_idx], state.pending_refresh

        if not proj_idx:
            new_projs, pending = [], jnp.zeros([], jnp.bool_)
        elif refresh is None:  # the schedule on the device: a read-back of the predicate per step
            due = (count % cfg.update_proj_gap == 0) | state.pending_refresh
            new_projs, pending = lax.cond(due, refresh_all, keep_all)
        else:  # the host's schedule (`refresh` static): no conditional, so nothing waits for the device
            new_projs, pending = refresh_all() if refresh else keep_all()
        refreshed = dict(zip(proj_idx, new_projs))
        outs, mus, nus, projs = [], [], [], []
        count_inc = optax.safe_int32_increment(count)
        # A leaf whose refresh saw a non-finite gradient kept its projector, and skips this step through the
        # finiteness test of its low-rank step (`_skip_nonfinite`): its low-rank gradient is not finite either.
        ok = jnp.asarray(1.0, jnp.float32)
        for i, (g, w, m, v, p, decay) in enumerate(zip(flat_g, flat_w, flat_mu, flat_nu, flat_p, wd_flags)):
            a = -lr * wd if decay else jnp.asarray(0.0, jnp.float32)
            dtype = g.dtype if w is None else w.dtype  # updates in the params' dtype, as optax's
            if _is_masked(p):  # not projected: one fused Adam(W) kernel pass (pallas_fused.adam)
                hp = dict(b1=b1, b2=b2, eps=eps, implementation=self.adam_implementation)
                if inplace:
                    out, m, v = fused_adam.adam_leaf_update(w, g, m, v, count_inc, learning_rate=lr,
                                                            weight_decay=wd if decay else 0.0, **hp)
                elif with_lr:
                    out, m, v = fused_adam.adam_leaf_direction(g, m, v, count_inc, learning_rate=lr,
                                                               param=w if decay else None,
                                                               weight_decay=wd if decay else 0.0,
                                                               update_dtype=dtype, **hp)
                else:
                    out, m, v = fused_adam.adam_leaf_direction(g, m, v, count_inc, update_dtype=dtype, **hp)
                outs.append(out), mus.append(m), nus.append(v), projs.append(p)
                continue
            side = sides[i]
            p = refreshed[i]
            s = Scalars(b1, b2, eps, alpha, beta, a, c, ok)
            out, m, v = self._leaf(w if decay or inplace else None, g, m, v, p, side, s, inplace, dtype)
            outs.append(out), mus.append(m), nus.append(v), projs.append(p)
        new_state = GaLoreAdamState(
            count=count_inc,
            pending_refresh=pending,
            mu=treedef.unflatten(mus), nu=treedef.unflatten(nus), projector=treedef.unflatten(projs),
        )
        return treedef.unflatten(outs), new_state

    def update(self, updates, state, params=None, *, refresh=None, **extra_args):
        del extra_args  # optax.chain hands every transform the extra arguments of all
        return self._update(updates, state, params, inplace=False, refresh=_refresh_arg(refresh))

    def step(self, params, grads, state, *, refresh=None):
        return self._update(grads, state, params, inplace=True, refresh=_refresh_arg(refresh))


def state_shardings(state: GaLoreAdamState, param_shardings, *, mesh=None) -> GaLoreAdamState:
    """Shardings for a GaLore `state` that match the params' (for jit's in/out_shardings).

    param_shardings: a tree of `NamedSharding`s like the params. A projected (M, N) weight split as
    P(a, b) gets low-rank moments and projector split along the dimension they share with it: side right,
    m, v (M, r) as P(a, None) and P (r, N) as P(None, b); side left, P (M, r) as P(a, None) and m, v (r, N)
    as P(None, b). The other leaves' Adam moments take their param's sharding; count and the refresh flag
    are replicated over the params' mesh, or over `mesh` (required when the params have no leaves).
    """
    leaves, treedef = jax.tree.flatten(param_shardings)
    mesh = _sharding.mesh_of(leaves, mesh, op="galore.state_shardings")
    flat_m, flat_p = treedef.flatten_up_to(state.mu), treedef.flatten_up_to(state.projector)
    mus, nus, projs = [], [], []
    for sh, m, p in zip(leaves, flat_m, flat_p):
        if _is_masked(p):
            mus.append(sh), nus.append(sh), projs.append(p)
            continue
        spec = tuple(sh.spec) + (None,) * (2 - len(tuple(sh.spec)))
        rows, cols = NamedSharding(sh.mesh, P(spec[0], None)), NamedSharding(sh.mesh, P(None, spec[1]))
        low, proj = (rows, cols) if _state_side(m.shape, p.shape) == "right" else (cols, rows)
        mus.append(low), nus.append(low), projs.append(proj)
    replicated = NamedSharding(mesh, P())
    return GaLoreAdamState(replicated, replicated, treedef.unflatten(mus), treedef.unflatten(nus),
                           treedef.unflatten(projs))


_DOC_ARGS = """

    Args:
      learning_rate: float or optax schedule (called with the step count).
      rank: projection rank r (an int), clamped per leaf to min(M, N) as optax.contrib.galore and galore-torch do: a
        leaf whose smaller side is <= rank is projected at full rank (its moments take no less memory than Adam's).
        It sets the state's shapes, so init needs its value: under `optax.inject_hyperparams` init reads it, under
        jit too (the array of it is a constant of the trace); update reads each leaf's rank off its projector.
      update_proj_gap: steps between projector refreshes (step 0 refreshes); a runtime value.
      scale: GaLore's update scale (alpha in the paper); default 0.25 (convention "galore") or 1.0 ("optax").
      proj_type: "std" | "reverse_std" | "right" | "left" (default "std"; "reverse_std" under
        convention="optax").
      b1, b2, eps: Adam's (eps default 1e-6, or 1e-8 under convention="optax").
      weight_decay: decoupled (AdamW) decay, applied as -lr * wd * W.
      mask: which leaves are projected: pytree of bools, a bool for all, or callable(params) -> pytree (default:
        every 2-D leaf, as optax.contrib.galore). Other leaves, and empty ones, get plain Adam(W). Only 2-D leaves
        are projected: a leaf of another rank chosen by `mask` is a ValueError naming it (optax.contrib.galore's
        weight_dimension_numbers, which reshapes N-D leaves, is not supported: store such a weight as a matrix).
      weight_decay_mask: which leaves decay (pytree of bools, a bool for all, or callable; default all).
      projector: "randomized" (the default under convention="galore": a range finder with `oversample` extra
        columns, default 8, and `power_iters` subspace iterations, default 2, warm-started from the previous
        projector; `seed`, a runtime value) or "svd" (exact, jnp.linalg.svd; the default under convention="optax",
        as optax.contrib.galore). On an H200 one refresh of a 4096x4096 gradient takes 3.6 ms randomized against
        1127 ms for the SVD, keeping 99.65% of the SVD's captured energy, and on a mesh "svd" gathers each gradient
        (benchmarks/results/nvidia_h200.json). oversample and power_iters set shapes and loops, so under
        `optax.inject_hyperparams` they must stay static when given (their None defaults are).
      convention: "galore" (reference GaLore, the default) or "optax" (optax.contrib.galore's numbers).
      mu_dtype, nu_dtype: moment dtypes (default fp32).
      implementation: None | "pallas" | "xla" | "interpret" | "pallas:<variant>" | "interpret:<variant>" (see
        pallas_fused._backend): how projected leaves are stepped. "pallas" picks a variant per leaf
        (`choose_kernel`'s measured table; with no weight-decay term on the optax path, XLA's graph, which the
        caller's apply_updates fuses into); "pallas:<variant>" forces one of `VARIANTS` (hybrid,
        xla_up). Precision: the Pallas up-projection fixes its own (TF32 or fp16 operands: as exact as TF32
        there), while the XLA GEMMs follow ``jax.default_matmul_precision`` (TF32 by default on a GPU); for full
        fp32 projections use implementation="xla" under ``jax.default_matmul_precision("highest")``.
"""


def _config(args: dict, **fixed) -> GaLoreConfig:
    """A constructor's keyword arguments (its `locals()`, the learning rate aside) as a GaLoreConfig."""
    return GaLoreConfig(**{k: v for k, v in args.items() if k != "learning_rate"}, **fixed)


_D = GaLoreConfig()  # the constructors' defaults, read from the one config


def galore_adamw(learning_rate, *, rank: int = _D.rank, update_proj_gap: int = _D.update_proj_gap,
                 scale: float | None = _D.scale, proj_type: str | None = _D.proj_type, b1: float = _D.b1,
                 b2: float = _D.b2, eps: float | None = _D.eps, weight_decay: float | None = _D.weight_decay,
                 mask=_D.mask, weight_decay_mask=_D.weight_decay_mask, projector: str | None = _D.projector,
                 oversample: int | None = _D.oversample, power_iters: int | None = _D.power_iters, seed: int = _D.seed,
                 convention: str = _D.convention, mu_dtype=_D.mu_dtype, nu_dtype=_D.nu_dtype,
                 implementation: str | None = _D.implementation) -> optax.GradientTransformationExtraArgs:
    """GaLore AdamW (reference GaLore semantics; see the module docstring): the full update, lr included.

    Projected leaves go through the Pallas kernels (XLA's down-projection GEMM, the low-rank Adam kernel, then the
    up-projection with the decay and the update in its epilogue) or, with no weight-decay term, XLA's graph, whose
    up-projection GEMM takes `optax.apply_updates`' add; `update` requires params when there is weight decay."""
    core = _GaLore(learning_rate, _config(locals()))
    return optax.GradientTransformationExtraArgs(core.init, core.update)


def galore_adam(learning_rate, *, rank: int = _D.rank, update_proj_gap: int = _D.update_proj_gap,
                scale: float | None = _D.scale, proj_type: str | None = _D.proj_type, b1: float = _D.b1,
                b2: float = _D.b2, eps: float | None = _D.eps, mask=_D.mask, projector: str | None = _D.projector,
                oversample: int | None = _D.oversample, power_iters: int | None = _D.power_iters, seed: int = _D.seed,
                convention: str = _D.convention, mu_dtype=_D.mu_dtype, nu_dtype=_D.nu_dtype,
                implementation: str | None = _D.implementation) -> optax.GradientTransformationExtraArgs:
    """GaLore Adam without weight decay (params not needed by `update`)."""
    core = _GaLore(learning_rate, _config(locals(), weight_decay=None))
    return optax.GradientTransformationExtraArgs(core.init, core.update)


# As pallas_fused.adam's factories: optax reads a factory's learning_rate annotation to know it takes a schedule.
for _factory in (galore_adamw, galore_adam):
    _factory.__annotations__["learning_rate"] = optax.ScalarOrSchedule
del _factory

def scale_by_galore_adam(*, rank: int = _D.rank, update_proj_gap: int = _D.update_proj_gap,
                         scale: float | None = _D.scale, proj_type: str | None = _D.proj_type, b1: float = _D.b1,
                         b2: float = _D.b2, eps: float | None = _D.eps, mask=_D.mask,
                         projector: str | None = _D.projector, oversample: int | None = _D.oversample,
                         power_iters: int | None = _D.power_iters, seed: int = _D.seed,
                         convention: str = _D.convention, mu_dtype=_D.mu_dtype, nu_dtype=_D.nu_dtype,
                         implementation: str | None = _D.implementation) -> optax.GradientTransformationExtraArgs:
    """The GaLore Adam direction without learning rate or weight decay, for `optax.chain` (like
    optax.scale_by_adam: positive sign; chain with optax.add_decayed_weights / scale_by_learning_rate).
    Under convention="galore" the bias correction sqrt(1-b2^t)/(1-b1^t) is included."""
    core = _GaLore(None, _config(locals(), weight_decay=None))
    return optax.GradientTransformationExtraArgs(core.init, core.update)


def galore_adamw_inplace(learning_rate, *, rank: int = _D.rank, update_proj_gap: int = _D.update_proj_gap,
                         scale: float | None = _D.scale, proj_type: str | None = _D.proj_type, b1: float = _D.b1,
                         b2: float = _D.b2, eps: float | None = _D.eps, weight_decay: float | None = _D.weight_decay,
                         mask=_D.mask, weight_decay_mask=_D.weight_decay_mask, projector: str | None = _D.projector,
                         oversample: int | None = _D.oversample, power_iters: int | None = _D.power_iters,
                         seed: int = _D.seed, convention: str = _D.convention, mu_dtype=_D.mu_dtype,
                         nu_dtype=_D.nu_dtype, implementation: str | None = _D.implementation) -> GaLoreInplace:
    """galore_adamw as one in-place step: `step(params, grads, state) -> (params, state)`.

    Same arguments, state and numbers as `galore_adamw` (fp32 with a weight-decay term: bit-identical to update +
    apply_updates; without one the optax path runs XLA's graph, within rounding of this step's kernels).
    The up-projection kernel writes each projected weight over its own buffer (input_output_aliases) and
    the low-rank Adam kernel its moments: jit `step` with donate_argnums=(0, 2) to save the extra
    passes over W that `optax.apply_updates` costs."""
    core = _GaLore(learning_rate, _config(locals()))
    return GaLoreInplace(core.init, core.step)


for _f in (galore_adamw, galore_adam, scale_by_galore_adam, galore_adamw_inplace):
    _f.__doc__ += _DOC_ARGS  # type: ignore[operator]  # each of the four has a docstring
