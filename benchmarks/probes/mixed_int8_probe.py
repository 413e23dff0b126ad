"""Backs the CHANGELOG's int8-as-A example kernel: 1.06x cuBLAS's bf16 GEMM at 4096^3 (logs/h200_2026-11-26e_*).

How fast an int8 x bf16 GEMM runs with the int8 operand converted in registers as wgmma's A operand
(jax's example kernel jax.experimental.pallas.ops.gpu.hopper_mixed_type_matmul_mgpu, where the installed jax ships
it), against cuBLAS's bf16 GEMM and our QDoRA GEMM (int8 B through a shared-memory scratch tile) at the same shape
(development probe, for QDoRA's design).

    python -m benchmarks.probes.mixed_int8_probe OUT_DIR

M = N = K = 4096: the example's q^T (N, K) int8 as A times x^T as B is QDoRA's forward transposed. Timed in turn
(common.bench_interleaved); rows go to OUT_DIR/mixed_int8_probe.json.

Its "ours" row calls `_sm90.matmul(dequant=)`, the int8 b through a shared-memory scratch tile, which the register
operand (`a_dequant`) replaced: run it at commit 3cb8d5a.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import bench_interleaved, error_text, probe_recorder, rnd
from pallas_fused import _sm90
from pallas_fused.dora import kernel_sm90 as dora_sm90


def main():
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    record = probe_recorder(os.path.join(out_dir, "mixed_int8_probe.json"))
    n = 4096
    bf = jnp.bfloat16
    q = jnp.clip(jnp.round(rnd(1, (n, n), jnp.float32) * 40), -127, 127).astype(jnp.int8)
    x = rnd(2, (n, n), bf)
    want = np.asarray(jnp.dot(q.astype(jnp.float32), x.astype(jnp.float32)), np.float32)
    cands = {"cublas bf16": (jax.jit(lambda a, b: a @ b), (q.astype(bf), x))}
    config = dora_sm90.qdora_config(n, n, n, 0, bf)
    ours = jax.jit(lambda a, b: _sm90.matmul(a, b, b_layout="kn", dequant=dora_sm90._int8_codes,
                                             epilogue=lambda acc, r, c: acc, out_dtype=bf, config=config,
                                             name="qdora_b_smem"))
    cands["ours: x^T (A) @ q^T (B, int8 via SMEM scratch)"] = (ours, (x.T, q.T))
    try:
        mm = importlib.import_module("jax.experimental.pallas.ops.gpu.hopper_mixed_type_matmul_mgpu")
        dim = mm.MatmulDimension
        for tile_m, tile_n, tile_k, wg in ((128, 128, 64, dim.N), (128, 128, 128, dim.N), (128, 256, 64, dim.M),
                                           (64, 256, 64, dim.M), (128, 128, 64, dim.M)):
            cfg = mm.TuningConfig(tile_m=tile_m, tile_n=tile_n, tile_k=tile_k, max_concurrent_steps=4,
                                  grid_minor_dim=dim.N, grid_tile_width=8, wg_dimension=wg)
            cands[f"jax mixed: q (A, int8 in registers) {tile_m}x{tile_n}x{tile_k} wg {wg}"] = (
                jax.jit(functools.partial(mm.mixed_matmul_kernel, out_dtype=bf, config=cfg)), (q, x))
    except Exception as e:  # noqa: BLE001 - an older jax without the example is a result
        record(impl="jax mixed", error=error_text(e))
    good = {}
    for name, (fn, args) in cands.items():
        try:
            out = np.asarray(fn(*args), np.float32)
            if name.startswith("ours"):
                out = out.T
            err = float(np.abs(out - want).max() / np.abs(want).max())
        except Exception as e:  # noqa: BLE001
            record(impl=name, error=error_text(e))
            continue
        if err > 1e-2:
            record(impl=name, rel_err=err, error="MISMATCH")
            continue
        good[name] = (fn, args)
    times = bench_interleaved(good, n=20, reps=len(good) + 1)
    for name, ms in times.items():
        record(impl=name, ms=round(ms, 5), tflops=round(2 * n ** 3 / ms / 1e9, 1),
               vs_cublas=round(ms / times["cublas bf16"], 3))


if __name__ == "__main__":
    main()
