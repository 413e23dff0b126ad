"""GaLore Adam step: fused Pallas kernels vs the XLA reference vs optax.contrib.galore; projector refresh
(SVD vs randomized); one Llama-7B layer with the refresh amortized.

Cases (ANCHORS.md): fp32 W and G, TF32 allowed, non-refresh step, proj_type "std".
  pallas:fused    fused down-projection + low-rank Adam kernel, up-projection update kernel, then W + update
  pallas:hybrid   XLA down-projection + elementwise low-rank Adam kernel, same up kernel, then W + update
  pallas:inplace  the best down variant + the up kernel writing W in place (donated): galore_adamw_inplace's path
  pallas:tx       the whole optax transform (galore_adamw update + apply_updates, count > 0: lax.cond skipped)
  xla             our plain-jnp reference step (donated), default precision (TF32)
  peer:optax_contrib_galore   optax.contrib.galore update + apply_updates (as ../shared/peers/peers_jax.py)
nbytes = (3 M N + 2 M r + 4 r N) * 4 (read G and W, write W; moments in/out; P) as in peers_jax.py.
Refresh energy is measured on a low-rank-plus-noise gradient (decaying spectrum): a Gaussian matrix has a
flat spectrum on which "captured energy" says nothing about real gradients.
"""

from __future__ import annotations

import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.common import bench_carry, rnd
from pallas_fused.galore import api, kernel, projector, reference

OP = "galore"
# On a machine without a GPU (a smoke run of this file) shapes shrink and the kernels run in interpret mode.
_CPU = jax.default_backend() == "cpu"
INTERPRET = _CPU


def _d(*dims):
    return tuple(d // 32 if _CPU else d for d in dims)


def _r(r):
    return max(r // 16, 2) if _CPU else r
LR, SCALE, B1, B2, EPS = 1e-3, 0.25, 0.9, 0.999, 1e-8


def _scalars():
    return reference.Scalars(B1, B2, EPS, 1.0, 1.0, -LR * 0.01, -LR * SCALE * 0.03, 1.0).pack()


def _state(M, N, r, side, seed=0):
    g = rnd(seed + 1, (M, N))
    p = jnp.linalg.qr(rnd(seed + 2, reference.projector_shape((M, N), r, side)[::-1] if side == "right"
                          else (M, r)))[0]
    p = p.T if side == "right" else p
    low = reference.lowrank_shape((M, N), r, side)
    return rnd(seed, (M, N)), g, jnp.zeros(low), jnp.zeros(low), p, _scalars()


def _steps(side):
    def down(variant, g, p, m, v, s):
        if variant == "fused":
            return kernel.down_adam_fused(g, p, m, v, s, side=side, interpret=INTERPRET)
        return kernel.lowrank_adam(reference.project(g, p, side), m, v, s, interpret=INTERPRET)

    def make(variant, inplace):
        @partial(jax.jit, donate_argnums=(0, 2, 3))
        def step(w, g, m, v, p, s):
            m, v, n = down(variant, g, p, m, v, s)
            if inplace:
                w = kernel.up_update(w, n, p, s, side=side, inplace=True, interpret=INTERPRET)
            else:
                w = w + kernel.up_update(w, n, p, s, side=side, interpret=INTERPRET)
            return w, g, m, v, p, s
        return step

    @partial(jax.jit, donate_argnums=(0, 2, 3))
    def xla(w, g, m, v, p, s):
        w, m, v = reference.galore_adam_step(w, g, m, v, p, side, reference.Scalars(*s), inplace=True)
        return w, g, m, v, p, s

    return make, xla


def _check(out, ref):
    """relative error of a Pallas result against the HIGHEST-precision reference (TF32 expected ~1e-3)."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def step_cases(rec, quick):
    shapes = [_d(4096, 4096), _d(4096, 11008)]
    ranks = [_r(r) for r in ([128] if quick else [32, 64, 128, 256, 512])]
    for (M, N) in shapes:
        side = reference.projector_side((M, N), "std")
        make, xla = _steps(side)
        for r in ranks:
            case = f"{M}x{N} r{r}"
            nbytes = (3 * M * N + 2 * M * r + 4 * r * N) * 4
            flops = 2 * 2 * M * N * r
            kw = dict(nbytes=nbytes, flops=flops, matmul_ceiling="tf32_tflops")
            # correctness of the compiled kernels against the HIGHEST-precision reference
            w, g, m, v, p, s = _state(M, N, r, side)
            ref_w, _, _ = reference.galore_adam_step(w, g, m, v, p, side, reference.Scalars(*s), inplace=True,
                                                     precision=jax.lax.Precision.HIGHEST)
            delta_ref = ref_w - w
            times = {}
            for impl, fn in [("pallas:fused", make("fused", False)), ("pallas:hybrid", make("hybrid", False)),
                             ("pallas:inplace_fused", make("fused", True)),
                             ("pallas:inplace_hybrid", make("hybrid", True)), ("xla", xla)]:
                try:
                    st = _state(M, N, r, side)
                    w0 = jnp.copy(st[0])
                    out = fn(*st)
                    err = _check(out[0] - w0, delta_ref)
                    ms = bench_carry(fn, out, n=20 if quick else 50)
                    times[impl] = ms
                    rec.add(OP, case, impl, ms, rel_err_update=err, **kw)
                    print(f"    {impl}: relative error of the update vs HIGHEST-precision reference {err:.2e}")
                except Exception as e:  # noqa: BLE001 - a failing kernel is a result
                    rec.add(OP, case, impl, None, error=f"{type(e).__name__}: {str(e)[:300]}")
            fused, hybrid = times.get("pallas:inplace_fused"), times.get("pallas:inplace_hybrid")
            if fused and hybrid:
                rec.add(OP, case, "pallas:inplace", min(fused, hybrid), winner="fused" if fused < hybrid else "hybrid",
                        auto_choice=api.choose_kernel((M, N), r, side), **kw)
            # the whole optax transforms, count > 0 (no refresh)
            for impl, tx_fn in [("pallas:tx", lambda r=r: api.galore_adamw(LR, rank=r, update_proj_gap=10**9,
                                                                           scale=SCALE, eps=EPS)),
                                ("peer:optax_contrib_galore", lambda r=r: optax.contrib.galore(
                                    LR, rank=r, update_proj_gap=10**9, scale=SCALE))]:
                if quick and impl == "pallas:tx" and r != _r(128):
                    continue
                try:
                    tx = tx_fn()
                    params, grads = {"w": rnd(3, (M, N))}, {"w": rnd(4, (M, N))}
                    state = tx.init(params)

                    @partial(jax.jit, donate_argnums=(0, 2))
                    def step(p, g, s, tx=tx):
                        u, s = tx.update(g, s, p)
                        return optax.apply_updates(p, u), g, s

                    ms = bench_carry(step, (params, grads, state), n=20 if quick else 30)
                    rec.add(OP, case, impl, ms, **kw)
                except Exception as e:  # noqa: BLE001
                    rec.add(OP, case, impl, None, error=f"{type(e).__name__}: {str(e)[:300]}")


def tuning(rec, quick):
    """Block configurations of the two GEMM kernels at 4096x4096 r128 (side right) and 4096x11008 (left)."""
    for (M, N) in [_d(4096, 4096), _d(4096, 11008)]:
        side = reference.projector_side((M, N), "std")
        r = _r(128)
        w, g, m, v, p, s = _state(M, N, r, side)
        n = jnp.ones(m.shape, jnp.float32)
        downs = [(64, 64, 4, 3), (32, 64, 4, 3), (32, 128, 4, 3), (16, 128, 4, 4), (64, 32, 8, 4)]
        ups = [(64, 128, 32, 4, 3), (128, 128, 32, 8, 3), (64, 64, 32, 4, 3), (128, 64, 32, 4, 3),
               (64, 256, 32, 8, 3), (128, 128, 64, 8, 2)]
        if quick:
            downs, ups = downs[1:4], ups[:4]
        for blocks in downs:
            f = jax.jit(lambda g, p, m, v, s, b=blocks, side=side: kernel.down_adam_fused(
                g, p, m, v, s, side=side, interpret=INTERPRET, blocks=b))
            rec.time(OP, f"tune down {M}x{N} r{r}", f"pallas:fused_down{blocks}", f, g, p, m, v, s, n=20,
                     nbytes=(M * N + 4 * r * max(M, N)) * 4)
        f = jax.jit(lambda g, p, m, v, s, side=side: kernel.lowrank_adam(
            reference.project(g, p, side), m, v, s, interpret=INTERPRET))
        rec.time(OP, f"tune down {M}x{N} r{r}", "pallas:hybrid_down", f, g, p, m, v, s, n=20,
                 nbytes=(M * N + 4 * r * max(M, N)) * 4)
        # the same two halves in XLA (breakdown: where the step's time goes)
        f = jax.jit(lambda g, p, side=side: reference.project(g, p, side))
        rec.time(OP, f"tune down {M}x{N} r{r}", "xla:down_gemm_only", f, g, p, n=20, nbytes=(M * N + r * max(M, N)) * 4)
        f = jax.jit(lambda w, n, p, s, side=side: w + reference.full_update(w, n, p, side, reference.Scalars(*s)),
                    donate_argnums=(0,))
        ms = bench_carry(lambda w, n, p, s, f=f: (f(w, n, p, s), n, p, s), (jnp.copy(w), n, p, s), n=20)
        rec.add(OP, f"tune up {M}x{N} r{r}", "xla:up_gemm_update", ms, nbytes=2 * M * N * 4)
        for blocks in ups:
            f = jax.jit(lambda w, n, p, s, b=blocks, side=side: kernel.up_update(
                w, n, p, s, side=side, inplace=True, interpret=INTERPRET, blocks=b), donate_argnums=(0,))
            try:
                ms = bench_carry(lambda w, n, p, s, f=f: (f(w, n, p, s), n, p, s), (jnp.copy(w), n, p, s), n=20)
                rec.add(OP, f"tune up {M}x{N} r{r}", f"pallas:up_inplace{blocks}", ms, nbytes=2 * M * N * 4)
            except Exception as e:  # noqa: BLE001
                rec.add(OP, f"tune up {M}x{N} r{r}", f"pallas:up_inplace{blocks}", None, error=str(e)[:300])


def _time_once(fn, *args, reps=3):
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append((time.perf_counter() - t) * 1e3)
    return float(np.median(ts))


def refresh_cases(rec, quick):
    shapes = [_d(4096, 4096)] if quick else [_d(4096, 4096), _d(4096, 11008)]
    for (M, N) in shapes:
        r = _r(128)
        side = reference.projector_side((M, N), "std")
        g = projector.low_rank_plus_noise(jax.random.key(0), (M, N), true_rank=4 * r, decay=0.99)
        g2 = g + 0.3 * projector.low_rank_plus_noise(jax.random.key(1), (M, N), true_rank=4 * r, decay=0.99)
        case = f"refresh {M}x{N} r{r}"
        svd = jax.jit(lambda g, r=r, side=side: reference.svd_projector(g, r, side))
        t_svd = _time_once(svd, g, reps=1 if quick else 3)
        exact, exact2 = svd(g), svd(g2)
        rec.add(OP, case, "xla:svd", t_svd, energy=1.0)
        configs = [(8, 2, "cholesky"), (8, 1, "cholesky"), (16, 2, "cholesky"), (8, 2, "householder")]
        if quick:
            configs = configs[:2]
        for over, q, qr in configs:
            kw = dict(oversample=over, power_iters=q, qr=qr)
            cold = jax.jit(lambda g, k, kw=kw, r=r, side=side: projector.randomized_projector(g, r, side, k, **kw))
            warm = jax.jit(lambda g, k, prev, kw=kw, r=r, side=side: projector.randomized_projector(
                g, r, side, k, prev=prev, **kw))
            key = jax.random.key(5)
            p = cold(g, key)
            e_cold = float(projector.captured_energy(g, p, exact, side))
            e_warm = float(projector.captured_energy(g2, warm(g2, key, p), exact2, side))
            name = f"randomized(os={over},q={q},{qr})"
            rec.add(OP, case, f"pallas:{name}:cold", _time_once(cold, g, key), energy=e_cold)
            rec.add(OP, case, f"pallas:{name}:warm", _time_once(warm, g2, key, p), energy=e_warm)
            print(f"    {name}: captured energy cold {e_cold:.4f}, warm (drifted gradient) {e_warm:.4f}")


def llama_layer(rec, quick):
    """The 7 matrices of a Llama-7B layer, rank 128, update_proj_gap 200: step + refresh / 200."""
    shapes = {"q": _d(4096, 4096), "k": _d(4096, 4096), "v": _d(4096, 4096), "o": _d(4096, 4096),
              "gate": _d(4096, 11008), "up": _d(4096, 11008), "down": _d(11008, 4096)}
    params = {k: rnd(i, s) for i, (k, s) in enumerate(shapes.items())}
    grads = {k: rnd(100 + i, s) for i, (k, s) in enumerate(shapes.items())}
    case = "llama7b layer r128 gap200"
    results = {}
    for impl, make in [
        ("pallas:inplace", lambda gap: api.galore_adamw_inplace(LR, rank=_r(128), update_proj_gap=gap,
                                                                scale=SCALE, projector="randomized")),
        ("pallas:tx", lambda gap: api.galore_adamw(LR, rank=_r(128), update_proj_gap=gap, scale=SCALE,
                                                   projector="randomized")),
        ("peer:optax_contrib_galore", lambda gap: optax.contrib.galore(LR, rank=_r(128), update_proj_gap=gap,
                                                                       scale=SCALE)),
    ]:
        try:
            opt = make(10**9)
            if impl == "pallas:inplace":
                def carry(p, g, s, opt=opt):
                    p, s = opt.step(p, g, s)
                    return p, g, s
                carry = jax.jit(carry, donate_argnums=(0, 2))
            else:
                def carry(p, g, s, opt=opt):
                    u, s = opt.update(g, s, p)
                    return optax.apply_updates(p, u), g, s
                carry = jax.jit(carry, donate_argnums=(0, 2))
            p0 = jax.tree.map(jnp.copy, params)
            st = opt.init(p0)
            # start past the refresh (count 1): the refresh is timed below
            one = jnp.ones([], jnp.int32)
            st = st._replace(count=one) if hasattr(st, "_replace") else (st[0]._replace(count=one), *st[1:])
            ms_step = bench_carry(carry, (p0, grads, st), n=10, reps=3)
            del p0
            # refresh cost: our refresh is the randomized projector per leaf; optax's is the SVD per leaf
            if impl.startswith("pallas"):
                fns = {}
                for s in set(shapes.values()):
                    side = reference.projector_side(s, "std")
                    fns[s] = jax.jit(lambda g, k, side=side: projector.randomized_projector(g, _r(128), side, k))
            else:
                fns = {s: jax.jit(lambda g: jnp.linalg.svd(g, full_matrices=False)) for s in set(shapes.values())}
            per_shape = {}
            for s, f in fns.items():
                args = (grads[next(k for k in shapes if shapes[k] == s)],)
                if impl.startswith("pallas"):
                    args = (*args, jax.random.key(0))  # (g, key)
                per_shape[s] = _time_once(f, *args, reps=1 if (quick or impl.startswith("peer")) else 3)
            ms_refresh = sum(per_shape[s] for s in shapes.values())
            amort = ms_step + ms_refresh / 200
            results[impl] = amort
            rec.add(OP, case, impl, amort, step_ms=ms_step, refresh_ms=ms_refresh)
        except Exception as e:  # noqa: BLE001
            rec.add(OP, case, impl, None, error=f"{type(e).__name__}: {str(e)[:300]}")
    if "peer:optax_contrib_galore" in results:
        for impl in ("pallas:inplace", "pallas:tx"):
            if impl in results:
                print(f"  llama layer speedup {impl}: {results['peer:optax_contrib_galore'] / results[impl]:.1f}x")


def state_memory(rec, quick):
    """Optimizer-state bytes for the Llama-7B layer: GaLore (r=128) beside AdamW (fp32 moments)."""
    shapes = {"q": _d(4096, 4096), "k": _d(4096, 4096), "v": _d(4096, 4096), "o": _d(4096, 4096),
              "gate": _d(4096, 11008), "up": _d(4096, 11008), "down": _d(11008, 4096)}
    abstract = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}
    nbytes = lambda tree: sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))
    galore = jax.eval_shape(api.galore_adamw(LR, rank=_r(128), implementation="xla").init, abstract)
    adamw = jax.eval_shape(optax.adamw(LR).init, abstract)
    rec.add(OP, "state bytes llama7b layer", "pallas:galore_r128", None, state_mb=nbytes(galore) / 2**20,
            adamw_mb=nbytes(adamw) / 2**20)
    print(f"  state: galore r128 {nbytes(galore) / 2**20:.1f} MiB vs adamw {nbytes(adamw) / 2**20:.1f} MiB")


def run(rec, quick: bool):
    for section in (state_memory, step_cases, refresh_cases, llama_layer, tuning):
        start = time.time()
        try:
            section(rec, quick)
        except Exception as e:  # noqa: BLE001 - keep the other sections' numbers
            rec.add(OP, section.__name__, "error", None, error=f"{type(e).__name__}: {str(e)[:300]}")
        print(f"  [{section.__name__} {time.time() - start:.1f}s]", flush=True)
