"""Fused AdamW step: 105M and 419M fp32 parameters as 4 tensors of (4096, n), as in ANCHORS.md.

Implementations (all jitted with params and state donated, timed with `bench_carry`):
  pallas:inplace        adamw_step: one kernel per tensor reading p, g, m, v and writing p, m, v
  pallas:optax          adamw(...).update + optax.apply_updates (the composable path)
  pallas:inplace_8bit   adamw_step on state_bits=8 states
  pallas:optax_8bit     the composable path on state_bits=8 states
  xla                   adamw_step with implementation="xla" (our jnp reference, fused by XLA)
  peer:optax_adamw      optax.adamw + apply_updates (what ANCHORS.md measured)
  peer:torch_fused_adamw torch.optim.AdamW(fused=True).step() (skipped without torch/CUDA)
Without --quick the in-place kernels are also swept over block sizes / warps ("pallas:inplace_b<B>w<W>").

Floor bytes per parameter: fp32 states 7 passes x 4 B = 28 B (read p, g, m, v; write p, m, v);
8-bit states: p 4+4, g 4, m and v codes 1+1 each, absmax 4+4 B per 256 elements each = 16 + 16/256 B.
`extra.state_bytes` is the optimizer state's size.
"""

from __future__ import annotations

import functools

import jax
import optax

import pallas_fused.adam as A
from benchmarks.common import bench_carry, bench_torch, rnd
from pallas_fused import _backend
from pallas_fused.adam import kernel as K

LR, WD = 1e-3, 0.01
FP32_BYTES = 28.0
Q8_BYTES = 16.0 + 16.0 / 256
SIZES_M = [100, 400]  # millions (2**20) of parameters
IMPL = "pallas" if _backend.gpu_device() is not None else None  # explicit on a GPU: never time a fallback


def _inplace_step():
    def step(params, grads, state):
        params, state = A.adamw_step(params, grads, state, learning_rate=LR, weight_decay=WD, implementation=IMPL)
        return params, grads, state

    return jax.jit(step, donate_argnums=(0, 2))


def _optax_step(opt):
    def step(params, grads, state):
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), grads, state

    return jax.jit(step, donate_argnums=(0, 2))


def _xla_step():
    def step(params, grads, state):
        params, state = A.adamw_step(params, grads, state, learning_rate=LR, weight_decay=WD, implementation="xla")
        return params, grads, state

    return jax.jit(step, donate_argnums=(0, 2))


def _time(rec, case, impl, make_step, init_state, shapes, n, reps, nbytes, **extra):
    """Fresh params/grads/state per implementation (each donated run consumes them)."""
    try:
        params = [rnd(i, s) for i, s in enumerate(shapes)]
        grads = [rnd(10 + i, s, scale=1e-2) for i, s in enumerate(shapes)]
        state = init_state(params)
        state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
        ms = bench_carry(make_step(), (params, grads, state), n=n, reps=reps)
    except Exception as e:  # noqa: BLE001 - a failing implementation is a result
        return rec.add("adam", case, impl, None, error=f"{type(e).__name__}: {str(e)[:300]}")
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
              block=K.BLOCK, num_warps=K.NUM_WARPS)
        _time(rec, case, "pallas:optax", functools.partial(_optax_step, ours32), init32, shapes, n, reps,
              fp32)
        _time(rec, case, "pallas:inplace_8bit", _inplace_step, init8, shapes, n, reps, q8,
              rows=K.QROWS, num_warps=K.Q_NUM_WARPS)
        _time(rec, case, "pallas:optax_8bit", functools.partial(_optax_step, ours8), init8,
              shapes, n, reps, q8)
        _time(rec, case, "xla", _xla_step, init32, shapes, n, reps, fp32)
        peer = optax.adamw(LR, weight_decay=WD)
        _time(rec, case, "peer:optax_adamw", functools.partial(_optax_step, peer), peer.init, shapes, n, reps, fp32)
        _torch(rec, case, shapes, n, reps, fp32)
        if quick or numel_m != SIZES_M[0]:
            continue
        # Tuning sweeps (the defaults above are K.BLOCK / K.NUM_WARPS and K.QROWS / K.Q_NUM_WARPS).
        saved = K.BLOCK, K.NUM_WARPS, K.QROWS, K.Q_NUM_WARPS
        try:
            for block, warps in [(1024, 4), (2048, 4), (2048, 8), (4096, 4), (8192, 8), (8192, 16)]:
                K.BLOCK, K.NUM_WARPS = block, warps
                _time(rec, case, f"pallas:inplace_b{block}w{warps}", _inplace_step, init32,
                      shapes, n, reps, fp32, block=block, num_warps=warps)
            for rows, warps in [(2, 4), (4, 4), (8, 4), (16, 8), (32, 8)]:
                K.QROWS, K.Q_NUM_WARPS = rows, warps
                _time(rec, case, f"pallas:inplace_8bit_r{rows}w{warps}", _inplace_step, init8,
                      shapes, n, reps, q8, rows=rows, num_warps=warps)
        finally:
            K.BLOCK, K.NUM_WARPS, K.QROWS, K.Q_NUM_WARPS = saved
