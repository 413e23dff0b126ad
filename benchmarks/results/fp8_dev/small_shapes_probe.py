"""Where our sm90 FP8 GEMM loses to cuBLAS (development probe): at the example's narrow shapes (N or K = 512), time
the default tile, other sm90 tiles, XLA's fp8 dot in two forms and torch._scaled_mm, tensorwise and rowwise, in one
process. "xla:f32_rescale" is our reference (fp8 dot to fp32, then a rescale pass); "xla:fused_scalar" is the
dequantize-then-dot pattern that XLA's GEMM rewriter turns into one cuBLASLt fp8 call with the scalar scales and the
bf16 output inside it (tensorwise only).

    python benchmarks/results/fp8_dev/small_shapes_probe.py OUT_DIR
"""

import dataclasses
import json
import sys

import jax
import jax.numpy as jnp

from benchmarks.bench_fp8 import _torch_scaled_mm
from benchmarks.common import bench, rnd
from pallas_fused.fp8 import api, kernel_sm90, quantize

OUT = sys.argv[1]
E4 = jnp.float8_e4m3fn
SHAPES = [(16384, 2048, 512), (16384, 512, 2048), (2048, 16384, 512), (16384, 2048, 2048), (16384, 2048, 5504),
          (16384, 5504, 2048), (2048, 16384, 2048), (512, 16384, 2048), (4096, 4096, 4096)]
rows = []


class Rec:  # _torch_scaled_mm's recorder interface
    def add(self, op, case, impl, ms, **kw):
        record(case=case, impl=impl, ms=ms, **{k: v for k, v in kw.items() if k in ("error",)})


def record(**row):
    rows.append(row)
    print(" | ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    with open(f"{OUT}/small_shapes_probe.json", "w") as f:
        json.dump(rows, f, indent=1, default=str)


large, small, _ = kernel_sm90.tiles()
CONFIGS = {"large": large, "large_split_m": dataclasses.replace(large, wg_split="m"), "small": small,
           "small_split_m": dataclasses.replace(small, wg_split="m"),
           "large_3stage": dataclasses.replace(large, max_concurrent_steps=3),
           "small_6stage": dataclasses.replace(small, max_concurrent_steps=6),
           "large_gw4": dataclasses.replace(large, grid_tile_width=4),
           "large_minor_m": dataclasses.replace(large, grid_minor_dim="m")}

for m, k, n in SHAPES:
    a, wt = rnd(1, (m, k), jnp.bfloat16), rnd(2, (n, k), jnp.bfloat16)
    flops = 2 * m * n * k
    calls = min(200, max(20, int(10e-3 * 1300e12 / flops)))
    for gran in ("tensorwise", "rowwise"):
        axis = None if gran == "tensorwise" else -1
        a8, sa = quantize(a, E4, axis)
        bt8, sb = quantize(wt, E4, axis)
        sav, sbv = jnp.broadcast_to(sa.reshape(-1), (m,)), jnp.broadcast_to(sb.reshape(-1), (n,))
        case = f"{m}x{k}x{n} {gran}"
        ref = api._mm_nt(a8, bt8, sav, sbv, jnp.bfloat16, True, "xla").astype(jnp.float32)

        def t(impl, fn, *args, ref=ref, case=case, flops=flops, calls=calls, **extra):
            try:
                out = jax.block_until_ready(fn(*args))
                err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)) / (jnp.max(jnp.abs(ref)) + 1e-30))
                ms = bench(fn, *args, n=calls, reps=3)
                record(case=case, impl=impl, ms=round(ms, 5), tflops=round(flops / ms / 1e9, 1), rel_err=err, **extra)
            except Exception as e:  # noqa: BLE001
                record(case=case, impl=impl, ms=None, error=f"{type(e).__name__}: {str(e)[:300]}")

        t("user:scaled_matmul_nt", jax.jit(api.scaled_matmul_nt), a8, bt8, sa, sb, tile=str(api.sm90_config(m, n, k)))
        for name, cfg in CONFIGS.items():
            if not kernel_sm90.supported(m, n, k, E4, E4, cfg):
                continue
            f = jax.jit(lambda a, bt, sa, sb, cfg=cfg: kernel_sm90.scaled_matmul_nt(
                a, bt, sa, sb, out_dtype=jnp.bfloat16, config=cfg))
            t(f"sm90:{name}", f, a8, bt8, sav, sbv)
        t("xla:f32_rescale", jax.jit(lambda a, bt, sa, sb: api._mm_nt(a, bt, sa, sb, jnp.bfloat16, True, "xla")),
          a8, bt8, sav, sbv)
        if gran == "tensorwise":
            def fused(a, bt, sa, sb):
                da = a.astype(jnp.bfloat16) * sa.astype(jnp.bfloat16)
                db = bt.astype(jnp.bfloat16) * sb.astype(jnp.bfloat16)
                return jax.lax.dot_general(da, db, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16)
            t("xla:fused_scalar", jax.jit(fused), a8, bt8, sa, sb)
            hlo = jax.jit(fused).lower(a8, bt8, sa, sb).compile().as_text()
            record(case=case, impl="info:fused_scalar_hlo", ms=None,
                   custom_calls=sorted({ln.split("custom_call_target=")[1].split(",")[0]
                                        for ln in hlo.splitlines() if "custom_call_target=" in ln}))
        _torch_scaled_mm(Rec(), case, [(a8, bt8, sa, sb)], gran, dict(n=calls, reps=3))
