"""GaLore Adam step: fused Pallas kernels vs the XLA reference vs optax.contrib.galore; projector refresh
(SVD vs randomized); one Llama-7B layer with the refresh amortized.

Cases (ANCHORS.md): fp32 W and G, TF32 allowed, non-refresh step, proj_type "std".
  pallas:hybrid   XLA down-projection + elementwise low-rank Adam kernel, up-projection update kernel, then W + update
  pallas:inplace_<variant>  galore_adamw_inplace's path for each of api.VARIANTS (hybrid, xla_up),
                  default configurations; pallas:inplace is the best of them
  pallas:inplace_api  galore_adamw_inplace's step (count 1: the refresh lax.cond is taken but skips)
  pallas:tx       (section user_path, the rows of record) the user's path: jit(galore_adamw update ->
                  optax.apply_updates), params, grads and state donated, count > 0 (the refresh lax.cond skips),
                  fp32 and bf16 params, one matrix per step and a Llama-7B layer's seven in one step; with no
                  weight decay it is XLA's graph, whose up-projection GEMM takes apply_updates' add;
                  pallas:tx_wd with weight_decay=0.01 (the Pallas kernels);
                  pallas:tx_optax_convention with convention="optax": the peer's algorithm (it projects the larger
                  side: smaller moments, a larger projector), i.e. the same work as the peer's row;
                  pallas:tx_host_refresh / pallas:inplace_host_refresh: the refresh schedule on the host
                  (`refresh=False` static between refreshes): no conditional, so no predicate read-back per step
                  (section user_path_tree) the same on a whole 1B Llama's tree, 147 leaves, in one step
  xla             our plain-jnp reference step (donated), default precision (TF32)
  xla:g_copied    the same with G not donated (peers_jax.py's method: XLA returns G as a 2 x M N x 4 byte copy,
                  which ANCHORS.md's XLA and optax.contrib.galore figures include)
  peer:optax_contrib_galore   optax.contrib.galore update + apply_updates (params, grads, state donated)
Every step donates everything it carries (see `_steps`).
The `tuning` section is the sweep behind the "galore_up" and "galore_variant" sections of
pallas_fused/tuning/<device>.json (it prints them as JSON to paste there); run it alone with
`GALORE_SECTIONS=tuning python -m benchmarks.run galore`. Its timings are amortized over several distinct operand
sets per jit (a single call under ~0.05 ms times the host dispatch).
nbytes = (3 M N + 2 M r + 4 r N) * 4 (read G and W, write W; moments in/out; P) as in peers_jax.py.
Refresh energy is measured on a low-rank-plus-noise gradient (decaying spectrum): a Gaussian matrix has a
flat spectrum on which "captured energy" says nothing about real gradients.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from functools import partial
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.common import bench_carry, bench_carry_amortized, error_text, rnd
from pallas_fused import _backend
from pallas_fused.galore import api, kernel, projector, reference

OP = "galore"
VARIANT_NAMES = [name.partition(":")[2] for name in api.VARIANTS]
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
    """Jitted in-place / update steps over the carried state (w, g, m, v, p, s), all of it donated: a
    carried but undonated array comes back as an XLA copy (G: 2 x 64 MB at 4096x4096), which timed the
    copy along with the step (peers_jax.py's method does: see `xla:g_copied`)."""
    def make(variant, inplace, up_blocks=None):
        @partial(jax.jit, donate_argnums=(0, 1, 2, 3, 4, 5))
        def step(w, g, m, v, p, s):
            out, m, v = api.leaf_step(variant, w, g, m, v, p, side, reference.Scalars(*(s[i] for i in range(8))),
                                      inplace=inplace, interpret=INTERPRET, dtype=w.dtype, up_blocks=up_blocks)
            return (out if inplace else w + out), g, m, v, p, s
        return step

    def xla_step(w, g, m, v, p, s):
        w, m, v = reference.galore_adam_step(w, g, m, v, p, side, reference.Scalars(*s), inplace=True)
        return w, g, m, v, p, s

    xla = jax.jit(xla_step, donate_argnums=(0, 1, 2, 3, 4, 5))
    xla_g_copied = jax.jit(xla_step, donate_argnums=(0, 2, 3))  # as peers_jax.py: G, P, s come back as copies
    return make, xla, xla_g_copied


def _check(out, ref):
    """relative error of a Pallas result against the HIGHEST-precision reference (TF32 expected ~1e-3)."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def _nbytes(M, N, r):
    return (3 * M * N + 2 * M * r + 4 * r * N) * 4


def _time_step(rec, case, impl, fn, M, N, r, side, delta_ref, n, **extra):
    """Check one step against the HIGHEST-precision update, time it, record it; None on failure."""
    kw = dict(nbytes=_nbytes(M, N, r), flops=2 * 2 * M * N * r, matmul_ceiling="tf32_tflops")
    try:
        st = _state(M, N, r, side)
        w0 = jnp.copy(st[0])
        out = fn(*st)
        err = _check(out[0] - w0, delta_ref)
        ms = bench_carry(fn, out, n=n)
        rec.add(OP, case, impl, ms, rel_err_update=err, **kw, **extra)
        return ms
    except Exception as e:  # noqa: BLE001 - a failing kernel is a result
        rec.add(OP, case, impl, None, error=error_text(e))
        return None


def _delta_ref(M, N, r, side):
    w, g, m, v, p, s = _state(M, N, r, side)
    ref_w, _, _ = reference.galore_adam_step(w, g, m, v, p, side, reference.Scalars(*s), inplace=True,
                                             precision=jax.lax.Precision.HIGHEST)
    return ref_w - w


def step_cases(rec, quick):
    shapes = [_d(4096, 4096), _d(4096, 11008)]
    ranks = [_r(r) for r in ([128] if quick else [32, 64, 128, 256, 512])]
    for (M, N) in shapes:
        side = reference.projector_side((M, N), "std")
        make, xla, xla_g_copied = _steps(side)
        for r in ranks:
            case = f"{M}x{N} r{r}"
            kw = dict(nbytes=_nbytes(M, N, r), flops=2 * 2 * M * N * r, matmul_ceiling="tf32_tflops")
            delta_ref = _delta_ref(M, N, r, side)
            n = 20 if quick else 50
            times = {}
            for impl, fn in [("pallas:hybrid", make("hybrid", False)),
                             *[(f"pallas:inplace_{v}", make(v, True)) for v in VARIANT_NAMES], ("xla", xla)]:
                times[impl] = _time_step(rec, case, impl, fn, M, N, r, side, delta_ref, n)
            if r == _r(128):
                _time_step(rec, case, "xla:g_copied", xla_g_copied, M, N, r, side, delta_ref, n)
                # the same steps amortized over K_AMORT_STEP distinct leaves per jit (a multi-leaf optimizer step;
                # a single call near 0.05 ms also times the host dispatch): the auto-chosen variant and XLA
                auto = api.choose_kernel((M, N), r, side)
                k = 2 if _CPU else K_AMORT_STEP
                for impl, fn in [(f"pallas:inplace_{auto}:amortized_x{k}", make(auto, True)),
                                 (f"xla:amortized_x{k}", xla)]:
                    def timing(fn=fn, k=k, M=M, N=N, r=r, side=side, n=n):
                        return bench_carry_amortized(fn, [_state(M, N, r, side, seed=10 * i + 2) for i in range(k)], n)

                    rec.measure(OP, case, impl, timing, **kw)
            inplace = {v: times.get(f"pallas:inplace_{v}") for v in VARIANT_NAMES}
            inplace = {v: t for v, t in inplace.items() if t}
            if inplace:
                best = min(inplace, key=inplace.get)
                rec.add(OP, case, "pallas:inplace", inplace[best], winner=best,
                        auto_choice=api.choose_kernel((M, N), r, side), **kw)
            # the in-place API step (galore_adamw_inplace: the refresh lax.cond, scalars, the auto variant),
            # count 1 (no refresh): minus pallas:inplace_<auto_choice> it is the cost of the cond and the rest
            if r == _r(128):
                try:
                    opt = api.galore_adamw_inplace(LR, rank=r, update_proj_gap=10**9, scale=SCALE, eps=EPS)
                    params, grads = {"w": rnd(3, (M, N))}, {"w": rnd(4, (M, N))}
                    state = opt.init(params)._replace(count=jnp.ones([], jnp.int32))

                    @partial(jax.jit, donate_argnums=(0, 1, 2))
                    def api_step(p, g, s, opt=opt):
                        p, s = opt.step(p, g, s)
                        return p, g, s

                    ms = bench_carry(api_step, (params, grads, state), n=20 if quick else 30)
                    rec.add(OP, case, "pallas:inplace_api", ms, auto_choice=api.choose_kernel((M, N), r, side), **kw)
                except Exception as e:  # noqa: BLE001
                    rec.add(OP, case, "pallas:inplace_api", None, error=error_text(e))


# Candidate launch configurations of the tuning sweep: UpConfig(bm, bn, br, warps, stages, w_first, tn, tm, f16,
# p16). fp16 operands (f16: tiles cast in registers, N written in fp16 by the Adam kernel; p16: P cast to fp16 by
# the Adam kernel too) halve the L2 traffic of the N and P slices, and wgmma takes fp16 B operands N-contiguous
# (TF32 B must be K-major: Triton transposes fp32 P/N slices into shared memory with 4-byte cp.async).
# H200 (up alone, r128, amortized; the tuning rows of benchmarks/results/nvidia_h200.json), 4096^2 / 4096x11008 ms:
#   64x128x128/8 warps/2 stages w_first tm 8 f16  0.0518 / 0.1776   (170 registers: 1 CTA/SM, 256 programs)
#   64x64x128/4/2 w_first tm 8 f16 p16            0.0573 / 0.1264   (157 registers: 3 CTAs/SM)
#   64x128x128/4/2 tm 8 f16                       0.0533 / 0.1431
#   32x128x128/4/2 tm 8 f16                       0.0543 / 0.1316   (mma.sync)
#   64x64x128/4/2 w_first tm 8, fp32 operands     0.0596 / 0.1613   (the best without f16)
#   128x128x128/8/2 tm 4 f16 0.0698 / 0.1972, 64x256x128/8/2 tm 4 f16 0.0675 / 0.1827 (dropped)
# Why W's latency matters: in a tm/tn loop Triton pipelines (cp.async, num_stages) only the loads feeding the dot;
# W's tile is a plain load inside the loop (the ttgir shows it), so a program has one W tile in flight unless
# w_first prefetches the next one through the loop carry (two tiles, register-hungry); single-tile programs with
# w_first issue W before the GEMM and rely on several CTAs per SM instead. New here: tm 16 / 32 (4096^2 64x128
# tm 16: 128 programs, one wave at 1 CTA/SM; 4096x11008 64x64 tm 16: 688 programs, tm 32: 344, at 3 CTAs/SM),
# 32x128x128/4/2 w_first tm 8 p16 (204 registers: 2 CTAs/SM), single tiles with w_first (32x128x128/4/2 157
# registers, 64x128x128/4/2 222, 128x128x128/8/2 236). None spills (triton 3.6, ptxas sm_90a).
UP_CANDIDATES = [
    kernel.UpConfig(64, 64, 128, 4, 2, True, 1, 8),  # the best on fp32 operands (what f16 gains)
    kernel.UpConfig(64, 128, 128, 8, 2, True, 1, 8, True),
    kernel.UpConfig(64, 128, 128, 8, 2, True, 1, 16, True),
    kernel.UpConfig(64, 64, 128, 4, 2, True, 1, 8, True, True),
    kernel.UpConfig(64, 64, 128, 4, 2, True, 1, 16, True, True),
    kernel.UpConfig(64, 64, 128, 4, 2, True, 1, 32, True, True),
    kernel.UpConfig(64, 128, 128, 4, 2, False, 1, 8, True),
    kernel.UpConfig(32, 128, 128, 4, 2, False, 1, 8, True),
    kernel.UpConfig(32, 128, 128, 4, 2, True, 1, 8, True, True),
    kernel.UpConfig(32, 128, 128, 4, 2, True, 1, 1, True, True),
    kernel.UpConfig(64, 128, 128, 4, 2, True, 1, 1, True, True),
    kernel.UpConfig(128, 128, 128, 8, 2, True, 1, 1, True, True),
]
TUNING_BUDGET_S = 115.0
# Ops under 0.05 ms time the host dispatch (~0.03 ms a jitted call on the H200) unless amortized: the sweep runs
# each op on K_AMORT distinct operand sets (together well past the 50 MB L2) in one jit and divides by K_AMORT.
K_AMORT = 4
K_AMORT_STEP = 3


def _print_section(name, section):
    """One section of pallas_fused/tuning/<device>.json, printed to paste there (its "note" left to write: the
    timings above and the results file behind them)."""
    print(f"  paste into pallas_fused/tuning/{_backend.device_slug(_backend.device_name())}.json: "
          f"{json.dumps({name: {'note': '...', **section}})}", flush=True)


def tuning(rec, quick):
    """The sweep that sets the defaults, bounded to TUNING_BUDGET_S (what is left is recorded as skipped; every
    failure recorded). All timings amortized over K_AMORT (K_AMORT_STEP for whole steps) distinct operand sets.

    1. r128, 4096x4096 (side right) then 4096x11008 (side left): the up-projection kernel alone (in place, W
       donated) for each UP_CANDIDATES entry beside XLA's up-projection + update.
    2. ranks 128, 32, 512, 256 (the budget may cut the last ones): the whole in-place step for hybrid (the side's
       best up-projection of part 1) and xla_up, and the XLA reference.
    Prints the "galore_up" and "galore_variant" sections to paste into this device's
    pallas_fused/tuning/<device>.json (each beside a "note" citing the timings)."""
    deadline = time.time() + (TUNING_BUDGET_S if not _CPU else 20 * TUNING_BUDGET_S)
    n = 10 if quick else 20
    k_amort = 2 if _CPU else K_AMORT
    k_step = 2 if _CPU else K_AMORT_STEP

    def budget_left(case, impl):
        if time.time() < deadline:
            return True
        rec.add(OP, case, impl, None, error="skipped: tuning time budget spent")
        return False

    def timed(case, impl, op, states, **kw):
        if not budget_left(case, impl):
            return None
        return rec.measure(OP, case, impl, lambda: bench_carry_amortized(op, states, n), **kw).ms

    shapes = [_d(4096, 4096), _d(4096, 11008)]
    up_times = {}  # side -> {config: ms}
    for (M, N) in shapes:
        side = reference.projector_side((M, N), "std")
        r = _r(128)
        sts = [_state(M, N, r, side, seed=10 * i) for i in range(k_amort)]
        case = f"tune up {M}x{N} r{r} (amortized x{k_amort})"
        upb = 2 * M * N * 4
        # (w, n, p, s): N made by the Adam kernel from m = v = 0 would be 0: use ones (fp32 or fp16 as configured)
        ups = [(w, jnp.ones(m.shape, jnp.float32), p, sc) for (w, g, m, v, p, sc) in sts]
        del sts
        timed(case, "xla:up_gemm_update",
              lambda w, nl, p, sc, side=side: (w + reference.full_update(w, nl, p, side, reference.Scalars(*sc)),
                                               nl, p, sc), ups, nbytes=upb)
        for cfg in UP_CANDIDATES:
            def op(w, nl, p, sc, cfg=cfg, side=side):
                out = kernel.up_update(w, nl.astype(jnp.float16) if cfg.f16 else nl,
                                       p.astype(jnp.float16) if cfg.p16 else p, sc, side=side, inplace=True,
                                       interpret=INTERPRET, blocks=cfg)
                return out, nl, p, sc
            # (the fp16 casts of N and P are inside the timed jit: the real step makes N in fp16 for free and
            # casts P once, 2 MB; here they cost one small XLA op)
            ms = timed(case, "pallas:up" + "_".join(map(str, cfg)), op, ups, nbytes=upb)
            if ms:
                up_times.setdefault(side, {})[cfg] = ms
        del ups

    best_up = {side: min(ts, key=ts.get) for side, ts in up_times.items() if ts}
    if best_up:
        _print_section("galore_up", {side: cfg._asdict() for side, cfg in best_up.items()})
        rec.add(OP, "tune up best", "info:up_config", None, up_config=repr(best_up))

    winners, detail = {}, {}
    # ranks in order of importance (the budget may cut the tail): 128, 32, 512 and 256 at 4096^2, 256 and 512 at
    # 4096x11008
    for r, shs in [(_r(128), shapes), (_r(32), shapes), (_r(512), shapes[:1]), (_r(256), shapes),
                   (_r(512), shapes[1:])]:
        for (M, N) in shs:
            side = reference.projector_side((M, N), "std")
            make, xla, _ = _steps(side)
            case = f"tune step {M}x{N} r{r} (amortized x{k_step})"
            try:
                delta_ref = _delta_ref(M, N, r, side)
            except Exception as e:  # noqa: BLE001
                rec.add(OP, case, "reference", None, error=error_text(e))
                continue
            # (the fp32-operand up configurations lost by 0.012-0.04 ms in the tuning sweep's steps: left out)
            cands = [("hybrid", best_up.get(side)), ("xla_up", None)]
            times = {}
            kw = dict(nbytes=_nbytes(M, N, r), flops=2 * 2 * M * N * r, matmul_ceiling="tf32_tflops")
            step_states = [_state(M, N, r, side, seed=10 * i + 2) for i in range(k_step)]
            for variant, upc in cands:
                impl = f"pallas:inplace_{variant}" + ("+up" + "_".join(map(str, upc)) if upc else "")
                if not budget_left(case, impl):
                    continue
                fn = make(variant, True, up_blocks=upc)
                try:  # check one step against the HIGHEST-precision update, then time k_step leaves per jit
                    st = _state(M, N, r, side)
                    w0 = jnp.copy(st[0])
                    err = _check(fn(*st)[0] - w0, delta_ref)
                    del st
                    ms = bench_carry_amortized(fn, step_states, n)
                    rec.add(OP, case, impl, ms, rel_err_update=err, **kw)
                    if ms < times.get(variant, (float("inf"),))[0]:
                        times[variant] = (ms, upc)
                except Exception as e:  # noqa: BLE001
                    rec.add(OP, case, impl, None, error=error_text(e))
            timed(case, "xla", xla, step_states, **kw)
            del step_states
            if times:
                winners[(M, N, r, side)] = min(times, key=lambda v: times[v][0])
                detail[(M, N, r, side)] = times[winners[(M, N, r, side)]]
                print(f"    {case}: " + ", ".join(f"{v} {t[0]:.4f}" for v, t in sorted(times.items(),
                                                                                    key=lambda x: x[1][0])))
    if winners:
        _print_section("galore_variant", {"measured": [[*key, variant] for key, variant in winners.items()]})
        print(f"  (the winners' (ms, up) configurations: {detail!r}; galore_up must match)",
              flush=True)
        rec.add(OP, "tune step winners", "info:measured_variant", None, measured_variant=repr(winners))


def _time_once(fn, *args, reps=3):
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append((time.perf_counter() - t) * 1e3)
    return float(np.median(ts))


LLAMA7B_LAYER = {"q": (4096, 4096), "k": (4096, 4096), "v": (4096, 4096), "o": (4096, 4096),
                 "gate": (4096, 11008), "up": (4096, 11008), "down": (11008, 4096)}


def llama1b_tree(layers: int = 16) -> dict[str, tuple[int, ...]]:
    """A Llama-3.2-1B-shaped params tree, flattened (16 layers of d 2048, 32 heads, 8 key-value heads of 64, SwiGLU
    8192, vocab 128256, untied head): 147 leaves, the whole model a user hands to the optimizer, norms included
    (`layers` fewer for a quicker compile: 3 + 9 layers leaves)."""
    d, kv, ff, vocab = 2048, 512, 8192, 128256
    tree: dict[str, tuple[int, ...]] = {"embed": (vocab, d), "final_norm": (d,), "lm_head": (d, vocab)}
    for i in range(layers):
        tree.update({f"layers_{i}/{k}": s for k, s in {
            "q": (d, d), "k": (d, kv), "v": (d, kv), "o": (d, d), "gate": (d, ff), "up": (d, ff), "down": (ff, d),
            "attn_norm": (d,), "mlp_norm": (d,)}.items()})
    return tree


def _user_path_txs(r):
    """(row name, make the optimizer) for the user-path rows at rank r."""
    return [("pallas:tx", lambda: api.galore_adamw(LR, rank=r, update_proj_gap=10**9, scale=SCALE, eps=EPS)),
            ("pallas:tx_wd", lambda: api.galore_adamw(LR, rank=r, update_proj_gap=10**9, scale=SCALE, eps=EPS,
                                                      weight_decay=0.01)),
            # the peer's own algorithm (its side, eps and scale convention): the same work as the peer's row
            ("pallas:tx_optax_convention", lambda: api.galore_adamw(LR, rank=r, update_proj_gap=10**9, scale=SCALE,
                                                                    convention="optax")),
            ("peer:optax_contrib_galore", lambda: optax.contrib.galore(LR, rank=r, update_proj_gap=10**9,
                                                                       scale=SCALE)),
            ("pallas:inplace_api", lambda: api.galore_adamw_inplace(LR, rank=r, update_proj_gap=10**9, scale=SCALE,
                                                                    eps=EPS)),
            # the refresh schedule on the host (refresh= static): no conditional, no read-back between refreshes
            ("pallas:tx_host_refresh", lambda: api.galore_adamw(LR, rank=r, update_proj_gap=10**9, scale=SCALE,
                                                                eps=EPS)),
            ("pallas:inplace_host_refresh", lambda: api.galore_adamw_inplace(LR, rank=r, update_proj_gap=10**9,
                                                                             scale=SCALE, eps=EPS))]


def user_path_step(impl, make, shapes, dtype):
    """One candidate of the user path (`_user_path_txs`): its jitted step (params, grads, state donated) and the carry
    after its first call, the refresh step (count 0), so that timing starts between refreshes."""
    tx = make()
    params = {k: rnd(3 + i, s, dtype) for i, (k, s) in enumerate(shapes.items())}
    grads = {k: rnd(40 + i, s, dtype) for i, (k, s) in enumerate(shapes.items())}
    state = tx.init(params)
    # the host's schedule passes refresh (static) to the optimizer; the others leave it to the device (None)
    host = impl.endswith("_host_refresh")
    if impl.startswith("pallas:inplace"):
        def step(p, g, s, refresh=None):
            p, s = tx.step(p, g, s, refresh=refresh)
            return p, g, s
    else:
        def step(p, g, s, refresh=None):
            u, s = (tx.update(g, s, p, refresh=refresh) if host else tx.update(g, s, p))
            return optax.apply_updates(p, u), g, s
    step = jax.jit(step, donate_argnums=(0, 1, 2), static_argnames="refresh")
    if host:  # the refresh step, then the jitted step between refreshes (a jit of its own, as a user's would be)
        carry = step(params, grads, state, refresh=True)
        return jax.jit(partial(step, refresh=False), donate_argnums=(0, 1, 2)), carry
    return step, step(params, grads, state)


def probe_case(spec: str):
    """A development probe's case "MxN:r:dtype" -> (its name as the user-path rows name it, (M, N), r, dtype)."""
    dims, r, dtype = spec.split(":")
    dtype = jnp.dtype(dtype)
    return f"{dims} r{r} {dtype.name}", tuple(int(d) for d in dims.split("x")), int(r), dtype


def probe_step(name, r, shape, dtype, *, impl, patch=None):
    """A development probe's candidate on one (M, N) weight: optax.contrib.galore's user step for name "contrib",
    else `user_path_step(impl)` traced with `patch` = (object, attribute, value) in place (a variant of the
    package's code), which is restored after."""
    txs = dict(_user_path_txs(r))
    if name == "contrib":
        return user_path_step("peer", txs["peer:optax_contrib_galore"], {"w": shape}, dtype)
    with mock.patch.object(*patch) if patch else contextlib.nullcontext():
        return user_path_step(impl, txs[impl], {"w": shape}, dtype)


def _user_path_rows(rec, case, shapes, r, dtype, quick, kw, only=None):
    """Each optimizer's donated `update -> apply_updates` step (or the in-place step) on params {name: shape}, the
    candidates timed in turn (`bench_carry_interleaved`: every step waits on the refresh predicate's read-back, so
    host latency is part of each time and must drift alike for all)."""
    steps = {}
    for impl, make in _user_path_txs(r):
        if only is not None and impl not in only:
            continue
        try:
            steps[impl] = (*user_path_step(impl, make, shapes, dtype), {})
        except Exception as e:  # noqa: BLE001
            rec.add(OP, case, impl, None, error=error_text(e))
    rec.time_interleaved(OP, case, steps, n=20 if quick else 50, reps=5 if quick else 9, carried=True, **kw)


def _user_path_bytes(shapes, r, item):
    """The optax path's fewest bytes: read G, write the update, apply_updates reads it and p and writes p, plus the
    low-rank state (fp32 moments in and out, the projector); a vector (a norm's scale) takes full-size Adam moments."""
    def leaf(shape):
        if len(shape) == 1:
            return 4 * shape[0] * item + 4 * shape[0] * 4
        m, n = shape
        return 4 * m * n * item + (4 * min(m, n) * r + r * max(m, n)) * 4

    return sum(leaf(s) for s in shapes.values())


def user_path(rec, quick):
    """The rows of record: what a user writes, `jit(tx.update -> optax.apply_updates)` with params, grads and
    state donated, count > 0 (the refresh lax.cond is taken and skips), beside optax.contrib.galore and
    galore_adamw_inplace's step in the same harness: one (M, N) weight per step, and a Llama-7B layer's seven
    matrices in one step (the refresh predicate's read-back and the launches shared by the layer, as a model's
    step shares them). floor_ms: `_user_path_bytes`."""
    # --quick: rank 128 alone (the rank of the example and of the targets), so the section fits a short run
    cases = [(4096, 4096, 128, jnp.float32), (4096, 11008, 128, jnp.float32), (4096, 4096, 128, jnp.bfloat16),
             (4096, 11008, 128, jnp.bfloat16)]
    if not quick:
        cases += [(4096, 4096, 32, jnp.float32), (4096, 4096, 512, jnp.float32),
                  (4096, 11008, 32, jnp.float32), (4096, 11008, 512, jnp.float32), (4096, 4096, 32, jnp.bfloat16),
                  (4096, 4096, 512, jnp.bfloat16), (4096, 11008, 32, jnp.bfloat16), (4096, 11008, 512, jnp.bfloat16)]
    for M, N, r, dtype in cases:
        (M, N), r = _d(M, N), _r(r)
        shapes = {"w": (M, N)}
        _user_path_rows(rec, f"user path {M}x{N} r{r} {jnp.dtype(dtype).name}", shapes, r, dtype, quick,
                        dict(nbytes=_user_path_bytes(shapes, r, jnp.dtype(dtype).itemsize)))
    for dtype in (jnp.float32, jnp.bfloat16):
        shapes, r = {k: _d(*s) for k, s in LLAMA7B_LAYER.items()}, _r(128)
        _user_path_rows(rec, f"user path llama7b layer r{r} {jnp.dtype(dtype).name}", shapes, r, dtype, quick,
                        dict(nbytes=_user_path_bytes(shapes, r, jnp.dtype(dtype).itemsize)))


TREE_TXS = ("pallas:tx", "pallas:tx_host_refresh", "pallas:inplace_api", "peer:optax_contrib_galore")


def user_path_tree(rec, quick):
    """The case users run: a whole 1B model's tree (`llama1b_tree`, 147 leaves) through one jitted step of each
    optimizer in TREE_TXS, where a cost per leaf adds up 147 times. Its own section: each candidate compiles a
    147-leaf program."""
    for dtype in (jnp.float32, jnp.bfloat16):
        shapes, r = {k: _d(*s) for k, s in llama1b_tree().items()}, _r(128)
        _user_path_rows(rec, f"user path llama1b tree r{r} {jnp.dtype(dtype).name}", shapes, r, dtype, quick,
                        dict(nbytes=_user_path_bytes(shapes, r, jnp.dtype(dtype).itemsize), leaves=len(shapes)),
                        only=TREE_TXS)


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
    shapes = {k: _d(*s) for k, s in LLAMA7B_LAYER.items()}
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
                carry = jax.jit(carry, donate_argnums=(0, 1, 2))
            else:
                def carry(p, g, s, opt=opt):
                    u, s = opt.update(g, s, p)
                    return optax.apply_updates(p, u), g, s
                carry = jax.jit(carry, donate_argnums=(0, 1, 2))
            p0 = jax.tree.map(jnp.copy, params)
            st = opt.init(p0)
            # start past the refresh (count 1): the refresh is timed below
            one = jnp.ones([], jnp.int32)
            st = st._replace(count=one) if hasattr(st, "_replace") else (st[0]._replace(count=one), *st[1:])
            # the carried step donates params, grads and state: give it copies (the refresh below reads `grads`,
            # and the next implementation starts from the same arrays)
            g0 = jax.tree.map(jnp.copy, grads)
            ms_step = bench_carry(carry, (p0, g0, st), n=10, reps=3)
            del p0, g0, st
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
            rec.add(OP, case, impl, None, error=error_text(e))
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


SECTIONS = ("user_path", "user_path_tree", "state_memory", "step_cases", "refresh_cases", "llama_layer", "tuning")


def run(rec, quick: bool):
    """All sections, or those named (comma-separated) in $GALORE_SECTIONS."""
    names = [s for s in os.environ.get("GALORE_SECTIONS", ",".join(SECTIONS)).split(",") if s]
    for name in names:
        start = time.time()
        try:
            if name not in SECTIONS:
                raise ValueError(f"GALORE_SECTIONS: unknown section {name!r}; known: {SECTIONS}")
            globals()[name](rec, quick)
        except Exception as e:  # noqa: BLE001 - keep the other sections' numbers
            rec.add(OP, name, "error", None, error=error_text(e))
        print(f"  [{name} {time.time() - start:.1f}s]", flush=True)
