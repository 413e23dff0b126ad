"""The splitk variant (and an fp16 up-projection) FSDP-sharded on 8 simulated CPU devices:
`python -m tests.galore._splitk_worker <case>` (the harness of tests/sharding/_optim_worker.py)."""

from __future__ import annotations

from tests.sharding._optim_worker import GALORE_SHAPES, sharded_vs_single

CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def _leaf_steps(up, down):
    """In-place GaLore steps of every projected leaf through `api.leaf_step("splitk", ...)` with the launches `up`
    and `down` (a fixed orthonormal projector; other leaves unchanged): (step, init) for `sharded_vs_single`."""
    import jax
    import jax.numpy as jnp

    from pallas_fused.galore import api, reference

    opt = api.galore_adamw_inplace(1e-2, rank=4, weight_decay=0.1, implementation="interpret:splitk")
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
            new_p[k], new_m[k], new_v[k] = api.leaf_step("splitk", params[k], grads[k], m, state.nu[k], p, side, s,
                                                         inplace=True, interpret=True, dtype=params[k].dtype,
                                                         up_blocks=up, down_blocks=down)
        return new_p, state._replace(mu=new_m, nu=new_v)

    return step, init


@case
def galore_splitk_fp16_up():
    """The splitk variant in place, with an fp16 (p16) up-projection launch: the split-K kernel where the
    contraction is whole, XLA's GEMM + psum of the partial projections where it is split; N and the fp16 P come
    out of the Adam kernel sharded as m and P; nothing of W, G or the state gathered."""
    from pallas_fused.galore import kernel, state_shardings

    up = kernel.UpConfig(16, 16, 16, 4, 2, True, 1, 2, True, True)
    down = kernel.DownConfig(16, 16, 2, 16, 4, 2, True, True)
    sharded_vs_single(lambda: _leaf_steps(up, down), state_shardings, GALORE_SHAPES, 2e-4,
                      "galore splitk fp16 up inplace")


if __name__ == "__main__":
    from tests.sharding._worker import main

    main(CASES)
