"""Fused AdamW step: 105M and 419M fp32 parameters as 4 tensors of (4096, n), as in ANCHORS.md.

Implementations (all jitted with params and state donated, timed with `bench_carry`; a step returns
(params, state) and the grads stay fixed outside the carry):
  pallas:inplace        adamw_step: one kernel per tensor reading p, g, m, v and writing p, m, v
  pallas:optax          adamw(...).update + optax.apply_updates (the composable path)
  pallas:inplace_8bit   adamw_step on state_bits=8 states
  pallas:optax_8bit     the composable path on state_bits=8 states
  xla                   adamw_step with implementation="xla" (our jnp reference, fused by XLA)
  xla:optax             the composable path with implementation="xla" (XLA may fuse it with apply_updates)
  peer:optax_adamw      optax.adamw + apply_updates
  peer:optax_adamw_returns_grads  the same timed as ANCHORS.md's peers_jax.py does: the step returns the grads
                        too, and that costs a copy of every gradient (a non-donated input returned as an output;
                        worse, XLA hands the donated moment buffers to those outputs, so an in-place kernel's
                        aliasing then needs two more copies per tensor: 0.4 ms at 105M, seen in the compiled HLO)
  peer:torch_fused_adamw torch.optim.AdamW(fused=True).step() (skipped without torch/CUDA)
Without --quick the in-place kernels are also swept (105M case only, bounded to SWEEP_SECONDS) over block
size, warps and how the streaming loads are issued (kernel.LOAD_MODES: evict_first / plain / volatile), each
launch (`kernel.Launch`) passed to the kernels of an in-place step: "pallas:inplace_b<B>w<W>_<mode>" and
"pallas:inplace_8bit_w<W>_<mode>"; a launch that fails or does not fit the time is recorded with an error, not
raised. The fastest row of each sweep is the device's tuning entry ("adam_launch" in
pallas_fused/tuning/<device>.json, read by kernel.default_launch).

Floor bytes per parameter: fp32 states 7 passes x 4 B = 28 B (read p, g, m, v; write p, m, v);
8-bit states: p 4+4, g 4, m and v codes 1+1 each, absmax 4+4 B per 256 elements each = 16 + 16/256 B.
`extra.state_bytes` is the optimizer state's size.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import optax

import pallas_fused.adam as A
from benchmarks.common import bench_carry, bench_torch, error_text, rnd
from pallas_fused import _backend
from pallas_fused.adam import kernel as K

LR, WD = 1e-3, 0.01
FP32_BYTES = 28.0
Q8_BYTES = 16.0 + 16.0 / 256
SIZES_M = [100, 400]  # millions (2**20) of parameters
IMPL = "pallas" if _backend.gpu_device() is not None else None  # explicit on a GPU: never time a fallback
SWEEP_SECONDS = 90.0
# (block, warps, load mode) for the fp32-state kernel; (warps, load mode) for the 8-bit one (one block of 256 per
# program). Most telling first: the sweep is time-bounded.
FP32_SWEEP = [(1024, 4, "volatile"), (4096, 8, "volatile"), (1024, 4, "plain"), (512, 4, "volatile"),
              (4096, 8, "plain"), (2048, 8, "volatile"), (512, 2, "volatile"), (2048, 4, "volatile"),
              (1024, 4, "evict_first")]
Q8_SWEEP = [(1, "volatile"), (2, "volatile"), (1, "plain"), (1, "evict_first"), (4, "volatile")]


def _inplace_step(impl=IMPL):
    def step(params, grads, state):
        return A.adamw_step(params, grads, state, learning_rate=LR, weight_decay=WD, implementation=impl)

    return jax.jit(step, donate_argnums=(0, 2))


def _launch_step(launch):
    """adamw_step's in-place work on one device with the kernels launched as `launch`: one kernel per tensor
    reading p, g, m, v and writing p, m, v (or the 8-bit codes and absmaxes) over their buffers."""
    from pallas_fused.adam import api

    def leaf(s, p, g, m, v):
        flat = lambda x: x.reshape(-1)  # noqa: E731
        if isinstance(m, A.QuantizedMoment):
            out, mc, ma, vc, va = K.adam_q8(s, flat(g), m.codes, m.absmax, v.codes, v.absmax, flat(p), inplace=True,
                                            interpret=False, launch=launch)
            return out.reshape(p.shape), A.QuantizedMoment(mc, ma), A.QuantizedMoment(vc, va)
        out, m2, v2 = K.adam_fp32(s, flat(g), flat(m), flat(v), flat(p), inplace=True, interpret=False,
                                  launch=launch)
        return out.reshape(p.shape), m2.reshape(m.shape), v2.reshape(v.shape)

    def step(params, grads, state):
        count = optax.safe_increment(state.count)
        s = api._scalars(-LR, 0.9, 0.999, 1e-8, 0.0, WD, count)
        is_q = lambda x: isinstance(x, A.QuantizedMoment)  # noqa: E731
        mus = jax.tree.leaves(state.mu, is_leaf=is_q)
        nus = jax.tree.leaves(state.nu, is_leaf=is_q)
        outs = [leaf(s, p, g, m, v) for p, g, m, v in zip(params, grads, mus, nus)]
        new_params = [o[0] for o in outs]
        mu = jax.tree.unflatten(jax.tree.structure(state.mu, is_leaf=is_q), [o[1] for o in outs])
        nu = jax.tree.unflatten(jax.tree.structure(state.nu, is_leaf=is_q), [o[2] for o in outs])
        return new_params, A.FusedAdamState(count, mu, nu)

    return jax.jit(step, donate_argnums=(0, 2))


def _optax_step(opt, return_grads=False):
    def step(params, grads, state):
        updates, state = opt.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        return (params, grads, state) if return_grads else (params, state)

    return jax.jit(step, donate_argnums=(0, 2))


def _xla_step():
    return _inplace_step("xla")


def _time(rec, case, impl, make_step, init_state, shapes, n, reps, nbytes, **extra):
    """Fresh params/grads/state per implementation (each donated run consumes them)."""
    try:
        params = [rnd(i, s) for i, s in enumerate(shapes)]
        grads = [rnd(10 + i, s, scale=1e-2) for i, s in enumerate(shapes)]
        state = init_state(params)
        state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
        step = make_step()
        if extra.pop("returns_grads", False):  # peers_jax.py's method: grads ride along in the carry
            ms = bench_carry(step, (params, grads, state), n=n, reps=reps)
        else:
            ms = bench_carry(lambda p, s: step(p, grads, s), (params, state), n=n, reps=reps)
    except Exception as e:  # noqa: BLE001 - a failing implementation is a result
        return rec.add("adam", case, impl, None, error=error_text(e))
    finally:
        params = grads = state = None
    return rec.add("adam", case, impl, ms, nbytes=nbytes, state_bytes=state_bytes, **extra)


def _torch(rec, case, shapes, n, reps, nbytes):
    try:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device for torch")
    except Exception as e:  # noqa: BLE001
        print(f"  adam: torch peer skipped ({e})")
        return
    ps = [torch.randn(s, device="cuda", requires_grad=True) for s in shapes]
    for p in ps:
        p.grad = torch.randn_like(p) * 1e-2
    opt = torch.optim.AdamW(ps, lr=LR, weight_decay=WD, fused=True)
    ms = bench_torch(opt.step, n=n, reps=reps)
    rec.add("adam", case, "peer:torch_fused_adamw", ms, nbytes=nbytes, state_bytes=8 * sum(p.numel() for p in ps))
    del opt, ps
    torch.cuda.empty_cache()


def run(rec, quick: bool):
    n, reps = (10, 3) if quick else (30, 5)
    for numel_m in SIZES_M[:1] if quick else SIZES_M:
        shapes = [(4096, int(numel_m * 1024 * 1024) // 4096 // 4)] * 4
        count = sum(a * b for a, b in shapes)
        case = f"{count / 1e6:.0f}M fp32 params, 4x{shapes[0]}"
        fp32, q8 = FP32_BYTES * count, Q8_BYTES * count
        ours32 = A.adamw(LR, weight_decay=WD, implementation=IMPL)
        ours8 = A.adamw(LR, weight_decay=WD, state_bits=8, implementation=IMPL)
        init32, init8 = ours32.init, ours8.init
        _time(rec, case, "pallas:inplace", _inplace_step, init32, shapes, n, reps, fp32,
              **dataclasses.asdict(K.default_launch("fp32")))
        _time(rec, case, "pallas:optax", functools.partial(_optax_step, ours32), init32, shapes, n, reps,
              fp32)
        _time(rec, case, "pallas:inplace_8bit", _inplace_step, init8, shapes, n, reps, q8,
              **dataclasses.asdict(K.default_launch("q8")))
        _time(rec, case, "pallas:optax_8bit", functools.partial(_optax_step, ours8), init8,
              shapes, n, reps, q8)
        _time(rec, case, "xla", _xla_step, init32, shapes, n, reps, fp32)
        ours_xla = A.adamw(LR, weight_decay=WD, implementation="xla")
        _time(rec, case, "xla:optax", functools.partial(_optax_step, ours_xla), ours_xla.init, shapes, n, reps, fp32)
        peer = optax.adamw(LR, weight_decay=WD)
        _time(rec, case, "peer:optax_adamw", functools.partial(_optax_step, peer), peer.init, shapes, n, reps, fp32)
        _time(rec, case, "peer:optax_adamw_returns_grads", functools.partial(_optax_step, peer, return_grads=True),
              peer.init, shapes, n, reps, fp32, returns_grads=True)
        _torch(rec, case, shapes, n, reps, fp32)
        if quick or numel_m != SIZES_M[0]:
            continue
        _sweep(rec, case, shapes, n, reps, fp32, q8, init32, init8)


def _sweep(rec, case, shapes, n, reps, fp32, q8, init32, init8):
    """Tuning sweeps of the in-place kernels, bounded to SWEEP_SECONDS in all: each launch passed to the kernels
    of an in-place step (`_launch_step`)."""
    deadline = time.perf_counter() + SWEEP_SECONDS
    fp32_jobs = [(f"pallas:inplace_b{b}w{w}_{mode}", init32, fp32, K.Launch(b, w, mode)) for b, w, mode in FP32_SWEEP]
    q8_jobs = [(f"pallas:inplace_8bit_w{w}_{mode}", init8, q8, K.Launch(256, w, mode)) for w, mode in Q8_SWEEP]
    # The fp32 launch sits at the HBM ceiling already: the 8-bit launches go first.
    for impl, init, nbytes, launch in q8_jobs + fp32_jobs:
        knobs = dict(block=launch.block, num_warps=launch.num_warps, load_mode=launch.load_mode)
        if time.perf_counter() > deadline:
            rec.add("adam", case, impl, None, error=f"skipped: sweep time ({SWEEP_SECONDS:.0f} s) used up", **knobs)
            continue
        _time(rec, case, impl, lambda launch=launch: _launch_step(launch), init, shapes, n, reps, nbytes, **knobs)
