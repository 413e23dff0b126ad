"""FSDP-sharded optimizers on 8 simulated CPU devices: `python -m tests.sharding._optim_worker <case>`.

Each case runs K optimizer steps under jit with params, grads and optimizer states split along one axis
of each weight over an 8-device "fsdp" mesh axis (rows of some weights, columns of others), compares
every step's params and state with the single-device run, and checks the compiled HLO: no collective
moves as many elements as a sharded weight, gradient or state leaf (nothing of theirs is gathered).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

CASES = {}
K = 3  # steps per case


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def mesh():
    return Mesh(np.array(jax.devices()), ("fsdp",))


def rand(seed, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def params_and_specs(shapes: dict):
    """{name: (shape, spec)} -> (params, NamedShardings)."""
    params = {k: rand(i, shape) for i, (k, (shape, _)) in enumerate(sorted(shapes.items()))}
    shardings = {k: NamedSharding(mesh(), P(*spec)) for k, (_, spec) in shapes.items()}
    return params, shardings


def grads_for(params, step):
    return {k: rand(1000 * step + i, v.shape) for i, (k, v) in enumerate(sorted(params.items()))}


def collective_sizes(hlo: str):
    """(element count, line) of every collective in a compiled HLO text (tuple collectives: the largest)."""
    for line in hlo.splitlines():
        op = re.search(r"= (.*?) (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(-start)?\(",
                       line)
        if op:
            yield max(int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
                      for dims in re.findall(r"\w+\[([\d,]*)\]", op.group(1))), line


def check_no_gather(step, args, what):
    """No collective of the compiled step (args: params, grads, state) moves a sharded leaf's worth of
    elements, nor as many as the smallest weight (XLA:CPU replicates with an all-reduce of a zero-padded
    buffer rather than an all-gather, so every kind counts). GaLore's all-reduced partial projections
    ((M, r) or (r, N)) and the randomized refresh's (gathered) sketches ((M or N, rank + oversample)) are
    smaller than every weight here and no sharded leaf's size."""
    hlo = step.lower(*args).compile().as_text()
    leaves = [x for x in jax.tree.leaves(args) if isinstance(getattr(x, "sharding", None), NamedSharding)
              and any(tuple(x.sharding.spec))]
    sizes = {x.size for x in leaves}
    bound = min(x.size for x in jax.tree.leaves(args[0]) if x.ndim == 2)  # the smallest weight
    for size, line in collective_sizes(hlo):
        assert size not in sizes and size < bound, f"{what}: a collective moves {size} elements {sizes}:\n{line}"
        assert "pallas_fused_" not in line, f"{what}: a collective inside a kernel:\n{line}"
    return hlo


def run_steps(step, params, state, shardings, state_sh, *, sharded: bool):
    """K steps of step(params, grads, state); returns every step's (params, state) as numpy."""
    history = []
    if sharded:
        params, state = jax.device_put(params, shardings), jax.device_put(state, state_sh)
    else:
        dev = jax.devices()[0]
        params, state = jax.device_put(params, dev), jax.device_put(state, dev)
    for k in range(K):
        grads = grads_for(params, k)
        grads = jax.device_put(grads, shardings if sharded else jax.devices()[0])
        params, state = step(params, grads, state)
        history.append(jax.tree.map(np.asarray, (params, state)))
        if sharded:  # the outputs keep the FSDP layout (no silent replication between steps)
            for x, sh in zip(jax.tree.leaves(params), jax.tree.leaves(shardings)):
                assert x.sharding.is_equivalent_to(sh, x.ndim), (x.sharding, sh)
    return history, params, grads, state


def compare(hist_a, hist_b, tol, what):
    for k, (a, b) in enumerate(zip(hist_a, hist_b)):
        for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
            x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
            err = float(np.max(np.abs(x - y))) if x.size else 0.0
            scale = max(1.0, float(np.max(np.abs(y)))) if y.size else 1.0
            assert err <= tol * scale, f"{what}: step {k} {jax.tree_util.keystr(path)} differs by {err}"


def sharded_vs_single(make_step, state_shardings_fn, shapes, tol, what, *, hlo=True):
    params, shardings = params_and_specs(shapes)
    step, init = make_step()
    state = init(params)
    state_sh = state_shardings_fn(state, shardings)
    jstep = jax.jit(step, out_shardings=(shardings, state_sh))
    single, *_ = run_steps(jax.jit(step), params, state, shardings, state_sh, sharded=False)
    multi, p_last, g_last, s_last = run_steps(jstep, params, state, shardings, state_sh, sharded=True)
    compare(multi, single, tol, what)
    if hlo:
        check_no_gather(jstep, (p_last, g_last, s_last), what)


# ---------------------------------------------------------------------------------------------- adam

# (64, 256) split by rows: 8 rows of 256 per device, whole 8-bit blocks per shard; (128, 64) by columns
# (8-bit: XLA reshards into the block layout, so the HLO check is only for fp32 states there); a
# replicated bias.
ADAM_SHAPES = {"w_rows": ((64, 256), ("fsdp", None)), "w_cols": ((128, 64), (None, "fsdp")), "b": ((48,), ())}


def _adam_steps(state_bits, inplace):
    import optax

    from pallas_fused import adam

    hp = dict(learning_rate=1e-2, weight_decay=0.1, implementation="interpret")
    tx = adam.adamw(state_bits=state_bits, **hp)

    def step(params, grads, state):
        if inplace:
            return adam.adamw_step(params, grads, state, **hp)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step, tx.init


@case
def adam_fp32():
    from pallas_fused.adam import state_shardings

    for inplace in (False, True):
        sharded_vs_single(lambda inplace=inplace: _adam_steps(None, inplace), state_shardings, ADAM_SHAPES, 1e-6,
                          f"adamw fp32 inplace={inplace}")


@case
def adam_8bit():
    from pallas_fused.adam import state_shardings

    rows_only = {k: v for k, v in ADAM_SHAPES.items() if k != "w_cols"}
    sharded_vs_single(lambda: _adam_steps(8, True), state_shardings, rows_only, 1e-6, "adamw 8-bit in place")
    # with a column-split weight: the state's block layout is row-major, XLA reshards around the kernel
    sharded_vs_single(lambda: _adam_steps(8, False), state_shardings, ADAM_SHAPES, 1e-6, "adamw 8-bit, columns",
                      hlo=False)


# ---------------------------------------------------------------------------------------------- galore

# Both projector sides (std: right when M >= N) and both split axes (the contraction of the
# down-projection split or not); a non-projected bias.
GALORE_SHAPES = {
    "right_rows": ((64, 48), ("fsdp", None)),  # side right, M split: R = G P^T local
    "right_cols": ((48, 32), (None, "fsdp")),  # side right, N split: R all-reduced, back-projection local
    "left_rows": ((32, 80), ("fsdp", None)),  # side left, M split: R = P^T G all-reduced
    "left_cols": ((24, 64), (None, "fsdp")),  # side left, N split: local
    "b": ((40,), ()),
}


def _galore_steps(projector, variant, inplace):
    import optax

    from pallas_fused.galore import galore_adamw, galore_adamw_inplace

    hp = dict(rank=4, update_proj_gap=2, weight_decay=0.1, projector=projector,
              implementation=f"interpret:{variant}")
    if inplace:
        opt = galore_adamw_inplace(1e-2, **hp)
        return opt.step, opt.init
    tx = galore_adamw(1e-2, **hp)

    def step(params, grads, state):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step, tx.init


@case
def galore_randomized():
    """Randomized refresh (steps 0 and 2) on sharded gradients: sketches only, never G. The hybrid kernel path,
    in-place step."""
    from pallas_fused.galore import state_shardings

    sharded_vs_single(lambda: _galore_steps("randomized", "hybrid", True), state_shardings, GALORE_SHAPES, 2e-4,
                      "galore randomized hybrid inplace")


def _galore_leaf_steps(up):
    """In-place GaLore steps of every projected leaf through `api.leaf_step("hybrid", ...)` with the up-projection
    launch `up` (a fixed orthonormal projector; other leaves unchanged): (step, init) for `sharded_vs_single`."""
    from pallas_fused.galore import api, reference

    opt = api.galore_adamw_inplace(1e-2, rank=4, weight_decay=0.1, implementation="interpret:hybrid")
    s = reference.Scalars(0.9, 0.999, 1e-6, 1.0, 1.0, -1e-3, -2.5e-3, 1.0)

    def init(params):
        state = opt.init(params)

        def orthonormal(p):
            if api._is_masked(p):
                return p
            q = jnp.linalg.qr(jax.random.normal(jax.random.key(p.size), (max(p.shape), min(p.shape))))[0]
            return q.T if p.shape[0] < p.shape[1] else q

        return state._replace(projector=jax.tree.map(orthonormal, state.projector, is_leaf=api._is_masked))

    def step(params, grads, state):
        new_p, new_m, new_v = dict(params), dict(state.mu), dict(state.nu)
        for k, p in state.projector.items():
            if api._is_masked(p):
                continue
            m = state.mu[k]
            side = api._state_side(m.shape, p.shape)
            new_p[k], new_m[k], new_v[k] = api.leaf_step("hybrid", params[k], grads[k], m, state.nu[k], p, side, s,
                                                         inplace=True, interpret=True, dtype=params[k].dtype,
                                                         up_blocks=up)
        return new_p, state._replace(mu=new_m, nu=new_v)

    return step, init


@case
def galore_fp16_up():
    """The hybrid variant in place with an fp16 (p16) up-projection launch (a CPU's default launch has fp32
    operands): N and the fp16 P come out of the low-rank Adam kernel sharded as m and P; nothing of W, G or the
    state gathered."""
    from pallas_fused.galore import kernel, state_shardings

    up = kernel.UpConfig(16, 16, 16, 4, 2, True, 1, 2, True, True)
    sharded_vs_single(lambda: _galore_leaf_steps(up), state_shardings, GALORE_SHAPES, 2e-4,
                      "galore hybrid fp16 up inplace")


@case
def galore_hybrid():
    """The hybrid kernel path (XLA's down-projection + the elementwise low-rank Adam kernel), optax path."""
    from pallas_fused.galore import state_shardings

    split_contraction = {k: GALORE_SHAPES[k] for k in ("right_cols", "left_rows", "b")}
    sharded_vs_single(lambda: _galore_steps("randomized", "hybrid", False), state_shardings, split_contraction,
                      2e-4, "galore randomized hybrid optax-path")


# Two groups of leaves of one shape (the refresh runs one loop per group, `api._GaLore._refresh_all`), each split
# alike, as FSDP splits a model's repeated projections: side right with R local, side left with R all-reduced.
GALORE_GROUP_SHAPES = {
    "q0": ((64, 48), ("fsdp", None)), "q1": ((64, 48), ("fsdp", None)),
    "u0": ((32, 80), ("fsdp", None)), "u1": ((32, 80), ("fsdp", None)), "b": ((40,), ()),
}


@case
def galore_grouped_refresh():
    """The grouped refresh on sharded gradients, on the optax path: sketches only, never G (the loop selects one
    leaf's gradient at a time, in its own layout)."""
    from pallas_fused.galore import state_shardings

    sharded_vs_single(lambda: _galore_steps("randomized", "hybrid", False), state_shardings, GALORE_GROUP_SHAPES,
                      2e-4, "galore grouped randomized refresh")


@case
def galore_svd():
    """SVD refresh: jnp.linalg.svd is not partitioned, so XLA gathers G (documented); the step between
    refreshes gathers nothing (checked with update_proj_gap beyond the run)."""
    from pallas_fused.galore import state_shardings

    sharded_vs_single(lambda: _galore_steps("svd", "hybrid", True), state_shardings, GALORE_SHAPES, 2e-4,
                      "galore svd", hlo=False)


if __name__ == "__main__":
    from tests.sharding._worker import main

    main(CASES)
