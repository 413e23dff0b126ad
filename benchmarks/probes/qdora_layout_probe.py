"""Backs the CHANGELOG's 'QDoRA int8 tile loads in other register layouts: within 5%' (logs/h200_2026-11-26e_*).

The QDoRA GEMM's int8 tile load (`_sm90._load_stored`) in each Mosaic GPU register layout (development probe).

    python -m benchmarks.probes.qdora_layout_probe OUT_DIR

At 4096 tokens, 4096 -> 4096, rank 16, bf16, in turn: cuBLAS's x @ W, DoRA's bf16 forward GEMM (`dora.kernel_sm90`)
and QDoRA's int8 one (`kernel_sm90.qdora_forward`'s GEMM) with the stored tile loaded in the layout Mosaic GPU
infers and in each explicit layout below (patched while tracing); each checked against XLA first. Rows go to
OUT_DIR/qdora_layout_probe.json.

It calls `_sm90.matmul(dequant=)`, the int8 b through a shared-memory scratch tile, which the register operand
(`a_dequant`) replaced: run it at commit 3cb8d5a.
"""

from __future__ import annotations

import functools
import os
import sys
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import bench_interleaved, error_text, probe_recorder, rnd
from pallas_fused import _backend, _sm90
from pallas_fused.dora import kernel_sm90 as dora_sm90
from pallas_fused.dora import quantize_int8


def layouts():
    plgpu = _backend.mosaic_gpu()
    out = {"inferred": None}
    for name in ("WGMMA", "WGMMA_8BIT", "WGMMA_UPCAST_2X"):
        out[name] = getattr(plgpu.Layout, name)
    out["SMEM_GMEM_COPY"] = plgpu.Layout.SMEM_GMEM_COPY((64, 128), jnp.int8, 128)
    return out


def main():
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    record = probe_recorder(os.path.join(out_dir, "qdora_layout_probe.json"))
    tokens, d_in, d_out, rank = 4096, 4096, 4096, 16
    bf = jnp.bfloat16
    x, w = rnd(1, (tokens, d_in), bf), rnd(2, (d_in, d_out), bf)
    xa, lb = rnd(3, (tokens, rank), bf), rnd(4, (rank, d_out), bf) * 0.1
    g, bias = 1.0 + 0.1 * rnd(5, (d_out,), jnp.float32), rnd(6, (d_out,), bf)
    qw = quantize_int8(w)
    q, wscale = qw.q, qw.scale
    lbq = (lb.astype(jnp.float32) / wscale).astype(bf)
    colscale = g * wscale
    f32 = jnp.float32
    want = np.asarray((x.astype(f32) @ q.astype(f32) + xa.astype(f32) @ lbq.astype(f32)) * colscale
                      + bias.astype(f32))
    config = dora_sm90.qdora_config(tokens, d_out, d_in, rank, bf)
    record(case="config", impl=str(config))
    cands = {"cublas x@W": (jax.jit(lambda x, w: x @ w), (x, w)),
             "dora bf16 gemm": (jax.jit(lambda *a: dora_sm90.scaled_matmul(a[0], a[1], a[2], a[3],
                                                                           lowrank=(a[4], a[5]))),
                                (x, w, g, bias, xa, lb))}
    for name, layout in layouts().items():
        # qdora_forward's GEMM, jitted afresh per layout: qdora_forward's own jit would reuse its first trace
        def fn(x, q, xa, lb, colscale, bias):
            return _sm90.matmul(x, q, b_layout="kn", col_vecs=(colscale, bias), dequant=dora_sm90._int8_codes,
                                lowrank=(xa, lb), epilogue=dora_sm90._scale_bias, out_dtype=bf, config=config,
                                name="pallas_fused_qdora_gemm_sm90")
        jitted = jax.jit(fn)
        load = (lambda ref: ref[...]) if layout is None else functools.partial(_backend.mosaic_load, layout=layout)
        args = (x, q, xa, lbq, colscale, bias)
        try:
            with mock.patch.object(_sm90, "_load_stored", load):
                out = np.asarray(jitted(*args), np.float32)
        except Exception as e:  # noqa: BLE001 - a layout Mosaic GPU refuses is a result
            record(case="qdora int8 gemm", impl=name, ms=None, error=error_text(e))
            continue
        err = float(np.abs(out - want).max() / np.abs(want).max())
        if err > 2e-2:
            record(case="qdora int8 gemm", impl=name, ms=None, rel_err=err, error="MISMATCH")
            continue
        cands[f"qdora {name}"] = (jitted, args)
    times = bench_interleaved(cands, n=20, reps=len(cands) + 1)
    for name, ms in times.items():
        record(case="qdora int8 gemm", impl=name, ms=round(ms, 5), vs_dora=round(ms / times["dora bf16 gemm"], 3))


if __name__ == "__main__":
    main()
