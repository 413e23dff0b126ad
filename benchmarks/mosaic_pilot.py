"""The Mosaic GPU pilot: the in-place fp32 AdamW step on the Mosaic GPU backend ("pallas:sm90") against the
Triton kernel ("pallas"), XLA's fused step and a device-to-device copy, in one process.

Bytes: the in-place step moves 28 bytes per parameter (reads p, g, m, v; writes p, m, v; fp32); the copy
2 x 4 bytes per element of a 1 GiB buffer. GB/s = bytes / time, and "% copy" is that rate over the copy's.
The Mosaic GPU kernel is swept over (block, steps, concurrent) launches (kernel_mosaic.MosaicLaunch), each timed
through the same step with the launch passed to the kernel; the best is the "adam_mosaic" section of
pallas_fused/tuning/<device>.json (printed to paste there).

    python -m benchmarks.mosaic_pilot --out DIR      # one JSON of rows + the printed table
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import pallas_fused.adam as A
from benchmarks.common import bench, bench_carry, error_text, rnd
from pallas_fused import _backend
from pallas_fused.adam import kernel as K

LR, WD = 1e-3, 0.01
FP32_BYTES = 28.0
# (block, steps, concurrent): shared memory per pipeline step is 7 x 4 x block bytes (4 inputs, 3 outputs)
MOSAIC_SWEEP = [(2048, 8, 2), (1024, 16, 4), (2048, 16, 3), (1024, 32, 6), (4096, 8, 1), (4096, 8, 2)]


def _copy_gbps(n: int = 256 * 1024 * 1024, calls: int = 20) -> float:
    x = rnd(0, (n,))
    ms = bench(jax.jit(jnp.copy), x, n=calls)
    return 2 * n * 4 / ms / 1e6


def _time_step(impl: str, shapes, calls: int, reps: int, launch=None) -> float:
    """ms of one donated in-place step of the public API (`impl`), or with `launch` of the Mosaic GPU kernel
    itself on the same flat leaves and scalars (`kernel_mosaic.adam_fp32`, the launch passed in)."""
    from pallas_fused.adam import kernel_mosaic as KM

    params = [rnd(i, s) for i, s in enumerate(shapes)]
    grads = [rnd(10 + i, s, scale=1e-2) for i, s in enumerate(shapes)]
    state = A.adamw(LR, weight_decay=WD).init(params)
    if launch is None:
        def step(params, state):
            return A.adamw_step(params, grads, state, learning_rate=LR, weight_decay=WD, implementation=impl)

        return bench_carry(jax.jit(step, donate_argnums=(0, 1)), (params, state), n=calls, reps=reps)
    s = K.scalar_operand([-LR, 0.9, 0.1, 0.999, 0.001, 1e-8, 0.0, WD, 0.19, 0.002])
    flat = [g.reshape(-1) for g in grads]

    def kernel_step(ps, ms, vs):
        outs = [KM.adam_fp32(s, g, m, v, p, inplace=True, launch=launch) for g, p, m, v in zip(flat, ps, ms, vs)]
        return tuple(list(x) for x in zip(*outs))

    carry = tuple([x.reshape(-1) for x in xs] for xs in (params, [jnp.zeros_like(p) for p in params],
                                                           [jnp.zeros_like(p) for p in params]))
    return bench_carry(jax.jit(kernel_step, donate_argnums=(0, 1, 2)), carry, n=calls, reps=reps)


def check() -> dict:
    """The Mosaic GPU kernel against the reference on 1M + 37 rows of 128 (the default launch, a tail of rows),
    in place, fp32, with non-finite gradients: the largest differences."""
    from pallas_fused.adam import kernel_mosaic as KM
    from pallas_fused.adam import reference as R

    n = (1 << 20) + 128 * 37
    p, g, m = rnd(1, (n,)), rnd(2, (n,), scale=1e-2), rnd(3, (n,), scale=1e-3)
    v = jnp.abs(rnd(4, (n,), scale=1e-4)) + 1e-6
    g = g.at[5].set(jnp.nan).at[n - 1].set(jnp.inf)
    s = K.scalar_operand([-LR, 0.9, 0.1, 0.999, 0.001, 1e-8, 0.0, WD, 0.19, 0.002])
    got = KM.adam_fp32(s, g, m, v, p, inplace=True)
    want = R.adam_leaf_reference(g, m, v, s, p, inplace=True)
    return {name: float(jnp.max(jnp.abs(a - b) / (jnp.abs(b) + 1e-30)))
            for name, a, b in zip(("p", "m", "v"), got, want)}


def measure(quick: bool = False) -> list[dict]:
    from pallas_fused.adam import kernel_mosaic as KM

    calls, reps = (10, 3) if quick else (30, 5)
    copy = _copy_gbps()
    rows = [dict(case="1 GiB fp32 buffer", impl="xla:copy", ms=2 * 256 * 1024 * 1024 * 4 / copy / 1e6,
                 gbps=copy, pct_copy=100.0)]
    numel_m = 100
    shapes = [(4096, numel_m * 1024 * 1024 // 4096 // 4)] * 4
    count = sum(a * b for a, b in shapes)
    case = f"{count / 1e6:.0f}M fp32 params, 4x{shapes[0]}"
    nbytes = FP32_BYTES * count
    jobs = [("pallas", "pallas", None, dataclasses.asdict(K.default_launch("fp32"))), ("xla", "xla", None, {}),
            ("pallas:sm90", "pallas:sm90", None, dataclasses.asdict(KM.default_launch()))]
    jobs += [(f"pallas:sm90_b{b}s{s}c{c}", "pallas:sm90", KM.MosaicLaunch(b, s, c),
              dict(block=b, steps=s, concurrent=c)) for b, s, c in (MOSAIC_SWEEP[:2] if quick else MOSAIC_SWEEP)]
    best = {}
    for name, impl, launch, extra in jobs:
        start = time.perf_counter()
        try:
            ms = _time_step(impl, shapes, calls, reps, launch)
            row = dict(case=case, impl=name, ms=ms, gbps=nbytes / ms / 1e6, **extra)
            row["pct_copy"] = 100 * row["gbps"] / copy
            if launch is not None and ms < best.get("ms", float("inf")):
                best = dict(ms=ms, launch=launch)
        except Exception as e:  # noqa: BLE001 - a failing configuration is a result
            row = dict(case=case, impl=name, ms=None, error=error_text(e), **extra)
        row["seconds"] = round(time.perf_counter() - start, 1)
        rows.append(row)
        print(_fmt(row), flush=True)
    if best:
        section = {"adam_mosaic": {"note": "...", "fp32": dataclasses.asdict(best["launch"])}}
        print(f"paste into pallas_fused/tuning/{_backend.device_slug(_backend.device_name())}.json: "
              f"{json.dumps(section)}", flush=True)
    return rows


def _fmt(row: dict) -> str:
    if row.get("ms") is None:
        return f"{row['impl']:32s} FAILED {row.get('error', '')}"
    return f"{row['impl']:32s} {row['ms']:8.4f} ms {row['gbps']:7.0f} GB/s {row['pct_copy']:5.1f}% of copy"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if _backend.gpu_device() is None:
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    print(f"{_backend.device_name()}, jax {jax.__version__}", flush=True)
    errors = check()
    print(f"max relative difference to the reference (1M + 37 rows, in place): {errors}", flush=True)
    rows = measure(args.quick)
    print(_fmt(rows[0]))
    if args.out:
        out = Path(args.out) / "adam_mosaic.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(dict(device=_backend.device_name(), jax=jax.__version__, check=errors, rows=rows),
                                  indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
