"""Does XLA's own fp8 GEMM (cuBLASLt with the scales as its scale pointers, 16-bit output) reach torch._scaled_mm's
tensorwise speed, where the sm90 kernel stays under 0.9x (development probe)? Each formulation is timed amortized
over the same operand sets as benchmarks/bench_fp8.py's rows (quantize's outputs), beside the user path and torch in
the same run; its optimized HLO is searched for the cuBLASLt fp8 custom call, its output compared with the fp32
reference of the same quantized operands.

  xla_qdq      dot(convert(a8) * sa, convert(bt8) * sb) in bf16: the dequantize pattern XLA:GPU rewrites into one fp8
               cuBLASLt call with the two scalars as its scale operands (flax's fp8 ops rely on it)
  xla_qdq_f32  the same pattern in fp32, output rounded to bf16
  xla_f32out   what "xla" runs now: the fp8 dot to fp32, then the rescale and the rounding in a pass of their own

    python benchmarks/results/fp8_dev/xla_tensorwise_probe.py [OUT_DIR]     (FP8_SHAPES=MxKxN,... for a subset)
"""

from __future__ import annotations

import functools
import os
import sys

import jax
import jax.numpy as jnp

from benchmarks.bench_fp8 import _sets, torch_scaled_mm_fn
from benchmarks.common import bench_amortized, bench_torch, error_text, probe_recorder, rnd
from pallas_fused.fp8 import api, quantize, scaled_matmul_nt

OUT = sys.argv[1] if len(sys.argv) > 1 else "/tmp/xla_tensorwise_probe"
os.makedirs(f"{OUT}/hlo", exist_ok=True)
E4 = jnp.float8_e4m3fn
SHAPES = [(16384, 512, 2048), (16384, 2048, 512), (2048, 16384, 5504), (16384, 2048, 2048), (16384, 2048, 5504),
          (8192, 8192, 8192), (16384, 4096, 11008), (4096, 4096, 4096)]
record = probe_recorder(f"{OUT}/xla_tensorwise_probe.json")


def xla_qdq(a8, bt8, sa, sb, wide=jnp.bfloat16):
    a = a8.astype(wide) * sa.astype(wide)
    b = bt8.astype(wide) * sb.astype(wide)
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=wide).astype(jnp.bfloat16)


FORMS = {
    "xla_qdq": xla_qdq,
    "xla_qdq_f32": functools.partial(xla_qdq, wide=jnp.float32),
    "xla_f32out": lambda a8, bt8, sa, sb: api._mm_nt(a8, bt8, jnp.broadcast_to(sa, (a8.shape[0],)),
                                                     jnp.broadcast_to(sb, (bt8.shape[0],)), jnp.bfloat16, True, "xla"),
    "user": scaled_matmul_nt,
}


def main():
    only = os.environ.get("FP8_SHAPES")
    shapes = [tuple(int(d) for d in s.split("x")) for s in only.split(",")] if only else SHAPES
    for m, k, n in shapes:
        count = _sets(m, k, n)
        flops = 2 * m * n * k
        calls = max(5, min(200, int(10e-3 * 1300e12 / flops)) // count)
        sets = []
        for i in range(count):
            a8, sa = quantize(rnd(10 * i + 1, (m, k), jnp.bfloat16), E4, None)
            bt8, sb = quantize(rnd(10 * i + 2, (n, k), jnp.bfloat16), E4, None)
            sets.append((a8, bt8, sa, sb))
        a8, bt8, sa, sb = sets[0]
        exact = jax.jit(lambda a8, bt8, sa, sb: (a8.astype(jnp.float32) @ bt8.astype(jnp.float32).T) * sa * sb)(
            a8, bt8, sa, sb)
        case = f"{m}x{k}x{n} tensorwise"
        for name, fn in FORMS.items():
            try:
                hlo = jax.jit(fn).lower(*sets[0]).compile().as_text()
                with open(f"{OUT}/hlo/{m}x{k}x{n}_{name}.txt", "w") as f:
                    f.write(hlo)
                out = jax.jit(fn)(*sets[0]).astype(jnp.float32)
                rel = float(jnp.linalg.norm(out - exact) / jnp.linalg.norm(exact))
                ms = bench_amortized(fn, sets, n=calls, reps=3)
                record(case=case, impl=name, ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1),
                       cublaslt_f8="cublas$lt$matmul$f8" in hlo, rel_err=f"{rel:.2e}")
            except Exception as e:  # noqa: BLE001 - a failing formulation is a result
                record(case=case, impl=name, error=error_text(e))
        for gran in ("tensorwise", "rowwise"):
            try:
                if gran == "rowwise":
                    tsets = []
                    for i in range(count):
                        a8r, sar = quantize(rnd(10 * i + 1, (m, k), jnp.bfloat16), E4, -1)
                        bt8r, sbr = quantize(rnd(10 * i + 2, (n, k), jnp.bfloat16), E4, -1)
                        tsets.append((a8r, bt8r, sar, sbr))
                else:
                    tsets = sets
                ms = bench_torch(torch_scaled_mm_fn(tsets, gran), n=calls, reps=3) / count
                record(case=case, impl=f"torch_{gran}", ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1))
            except Exception as e:  # noqa: BLE001
                record(case=case, impl=f"torch_{gran}", error=error_text(e))


if __name__ == "__main__":
    main()
