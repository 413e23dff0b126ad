"""The sm90 skeleton's ping-pong schedule against its cooperative one and the peers (development probe).

    python -m benchmarks.results.fp8_dev.pingpong_probe OUT_DIR [fp8] [dora] [MxKxN[:tensorwise|:rowwise] ...]

fp8: at each shape (M x K x N; default: the shapes where the cooperative kernel trails torch._scaled_mm), in turn
(common.bench_interleaved, every candidate in every place): torch._scaled_mm, `kernel_sm90.scaled_matmul_nt` at the
tuned tile (`api.sm90_config`, cooperative) and the same tile with schedule="pingpong" at several ring depths.
dora: at 4096 tokens, 4096 -> 4096, rank 16, bf16: cuBLAS's x @ W, DoRA's forward GEMM (`dora.kernel_sm90`, the
low-rank step and the g + bias epilogue) and QDoRA's int8 one, each cooperative and ping-pong.
Each candidate is checked against XLA first (a mismatch is recorded and not timed); rows go to
OUT_DIR/pingpong_probe.json as they come, one line each with ms, TFLOP/s and the ratio to the case's reference.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.bench_fp8 import _sets, torch_scaled_mm_fn
from benchmarks.common import amortized, bench_interleaved, error_text, probe_recorder, rnd, torch_sync
from pallas_fused import _sm90
from pallas_fused.dora import kernel_sm90 as dora_sm90
from pallas_fused.fp8 import api, kernel_sm90, quantize

E4 = jnp.float8_e4m3fn
SHAPES = [(16384, 512, 2048, "tensorwise"), (16384, 2048, 5504, "rowwise"), (16384, 2048, 2048, "rowwise"),
          (16384, 2048, 512, "tensorwise"), (16384, 4096, 11008, "rowwise"), (2048, 16384, 5504, "tensorwise"),
          (8192, 8192, 8192, "rowwise")]
MAX_REL_ERR = 2e-2  # bf16 output rounding is ~4e-3 of the largest entry; a wrong tile or scale is O(1)


def timed(record, case, flops, cands, wants, ref_name, calls):
    """Check every candidate {name: (fn, args, sync or None (jax))} against its expected output (`wants[name]`), then
    time the good ones in turn; each row's vs_ref is ref_name's time over the candidate's."""
    good, syncs, errs = {}, {}, {}
    for name, (fn, args, sync) in cands.items():
        try:
            out = fn(*args)
            out = out[0] if isinstance(out, list) else out
            out = np.asarray(out, np.float32) if sync is None else out.float().cpu().numpy()
        except Exception as e:  # noqa: BLE001 - a config that fails to compile is a result
            record(case=case, impl=name, ms=None, error=error_text(e))
            continue
        errs[name] = float(np.abs(out - wants[name]).max() / np.abs(wants[name]).max())
        if errs[name] > MAX_REL_ERR:
            record(case=case, impl=name, ms=None, rel_err=errs[name], error="MISMATCH")
            continue
        good[name] = (fn, args)
        if sync is not None:
            syncs[name] = sync
    times = bench_interleaved(good, n=calls, reps=max(5, len(good)), syncs=syncs)
    ref = times.get(ref_name)
    for name, ms in times.items():
        record(case=case, impl=name, ms=round(ms, 5), tflops=round(flops / ms / 1e9, 1),
               vs_ref=None if ref is None else round(ref / ms, 3), rel_err=round(errs[name], 5))


def fp8_case(record, m, k, n, gran):
    count = _sets(m, k, n)
    flops = 2 * m * n * k
    calls = max(10, min(200, int(10e-3 * 1300e12 / flops)) // count)
    axis = None if gran == "tensorwise" else -1
    user_sets, vec_sets = [], []
    for i in range(count):
        a8, sa = quantize(rnd(10 * i + 1, (m, k), jnp.bfloat16), E4, axis)
        bt8, sb = quantize(rnd(10 * i + 2, (n, k), jnp.bfloat16), E4, axis)
        user_sets.append((a8, bt8, sa, sb))
        vec_sets.append((a8, bt8, jnp.broadcast_to(sa.reshape(-1), (m,)), jnp.broadcast_to(sb.reshape(-1), (n,))))
    want = np.asarray(api._mm_nt(*vec_sets[0], jnp.bfloat16, True, "xla"), np.float32)
    tuned = api.sm90_config(m, n, k)
    cands = {"torch._scaled_mm": (torch_scaled_mm_fn(user_sets, gran), (), torch_sync)}

    def kernel(config):
        fn = functools.partial(kernel_sm90.scaled_matmul_nt, out_dtype=jnp.bfloat16, config=config)
        return amortized(fn), (vec_sets,), None

    cands["cooperative"] = kernel(tuned)
    for steps in (4, 5, 6):
        config = dataclasses.replace(tuned, schedule="pingpong", max_concurrent_steps=steps)
        if _sm90.smem_bytes(config, 1, 1, 2) + 2048 <= _sm90.SMEM_LIMIT:
            cands[f"pingpong s{steps}"] = kernel(config)
    if tuned.cluster:
        cands["pingpong s5 no cluster"] = kernel(dataclasses.replace(tuned, schedule="pingpong",
                                                                     max_concurrent_steps=5, cluster=None))
    record(case=f"{m}x{k}x{n} {gran}", impl="tuned", config=str(tuned))
    timed(record, f"{m}x{k}x{n} {gran}", flops, cands, dict.fromkeys(cands, want), "torch._scaled_mm", calls)


def _qdora(x, q, xa, lb, colscale, bias, config):
    """dora_sm90.qdora_forward at a given tile."""
    return _sm90.matmul(x, q, b_layout="kn", col_vecs=(colscale, bias), dequant=dora_sm90._int8_codes,
                        lowrank=(xa, lb), epilogue=dora_sm90._scale_bias, out_dtype=x.dtype, config=config,
                        name="pallas_fused_qdora_gemm_sm90")


def dora_cases(record, tokens=4096, d_in=4096, d_out=4096, rank=16):
    bf = jnp.bfloat16
    x, w = rnd(1, (tokens, d_in), bf), rnd(2, (d_in, d_out), bf)
    xa, lb = rnd(3, (tokens, rank), bf), rnd(4, (rank, d_out), bf) * 0.1
    g, bias = 1.0 + 0.1 * rnd(5, (d_out,), jnp.float32), rnd(6, (d_out,), bf)
    flops = 2 * tokens * d_in * d_out
    want = np.asarray((x.astype(jnp.float32) @ w.astype(jnp.float32) + xa.astype(jnp.float32) @ lb.astype(
        jnp.float32)) * g + bias.astype(jnp.float32), np.float32)
    large = dora_sm90.config_for(tokens, d_out, d_in, rank)
    case = f"dora fwd {tokens}x{d_in}->{d_out} r{rank}"
    gemm = jax.jit(lambda x, w: x @ w)
    cands = {"cublas x@W": (gemm, (x, w), None)}
    want_base = np.asarray(gemm(x, w), np.float32)

    def dora(config):
        fn = jax.jit(lambda x, w, g, bias, xa, lb: dora_sm90.scaled_matmul(x, w, g, bias, lowrank=(xa, lb),
                                                                          config=config))
        return fn, (x, w, g, bias, xa, lb), None

    cands["dora cooperative"] = dora(large)
    for tile_k, steps in ((128, 2), (64, 4), (64, 5)):
        config = dataclasses.replace(large, schedule="pingpong", tile_k=tile_k, max_concurrent_steps=steps)
        if dora_sm90._smem(config, rank, 2) + 2048 <= _sm90.SMEM_LIMIT:
            cands[f"dora pingpong k{tile_k} s{steps}"] = dora(config)
    record(case=case, impl="tuned", config=str(large))
    # cuBLAS's x @ W has no low-rank term or epilogue: its row is checked against x @ W alone
    timed(record, case, flops, cands, {**dict.fromkeys(cands, want), "cublas x@W": want_base}, "cublas x@W", 20)

    # QDoRA int8: the codes and a per-column scale, the DoRA column scale g folded in
    wscale = jnp.max(jnp.abs(w.astype(jnp.float32)), axis=0) / 127.0
    q = jnp.clip(jnp.round(w.astype(jnp.float32) / wscale), -127, 127).astype(jnp.int8)
    colscale = (g * wscale).astype(jnp.float32)
    lbq = (lb.astype(jnp.float32) / wscale).astype(bf)
    qwant = np.asarray((x.astype(jnp.float32) @ q.astype(jnp.float32) + xa.astype(jnp.float32)
                        @ lbq.astype(jnp.float32)) * colscale + bias.astype(jnp.float32), np.float32)
    qconfig = dora_sm90.qdora_config(tokens, d_out, d_in, rank, bf)
    record(case="qdora", impl="tuned", config=str(qconfig))
    qfn = jax.jit(_qdora, static_argnames="config")
    qargs = (x, q, xa, lbq, colscale, bias)
    qcands = {"cublas x@W": (gemm, (x, w), None), "dora cooperative": cands["dora cooperative"],
              "qdora cooperative": (functools.partial(qfn, config=qconfig), qargs, None)}
    for tile_k, steps in ((64, 4), (64, 6), (128, 2)):
        config = dataclasses.replace(qconfig, schedule="pingpong", tile_k=tile_k, max_concurrent_steps=steps)
        if dora_sm90._smem(config, rank, 2, dequant=True) + 2048 <= _sm90.SMEM_LIMIT:
            qcands[f"qdora pingpong k{tile_k} s{steps}"] = (functools.partial(qfn, config=config), qargs, None)
    wants = {**dict.fromkeys(qcands, qwant), "cublas x@W": want_base, "dora cooperative": want}
    timed(record, f"qdora int8 fwd {tokens}x{d_in}->{d_out} r{rank}", flops, qcands, wants, "dora cooperative", 20)


def main():
    out_dir, args = sys.argv[1], sys.argv[2:]
    os.makedirs(out_dir, exist_ok=True)
    record = probe_recorder(os.path.join(out_dir, "pingpong_probe.json"))
    parts = {a for a in args if a in ("fp8", "dora")} or {"fp8", "dora"}
    shapes = []
    for arg in (a for a in args if a not in ("fp8", "dora")):
        dims, _, gran = arg.partition(":")
        m, k, n = (int(d) for d in dims.split("x"))
        shapes += [(m, k, n, g) for g in ([gran] if gran else ["tensorwise", "rowwise"])]
    start = time.time()
    print(jax.devices(), flush=True)
    if "dora" in parts:
        dora_cases(record)
    if "fp8" in parts:
        for shape in shapes or SHAPES:
            fp8_case(record, *shape)
    print(f"pingpong_probe: {time.time() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
