"""Backs the CHANGELOG's measurement of the int8 QDoRA GEMMs ("sm90_dequant") against bf16 DoRA.

QDoRA int8 on Hopper (development probe): how far is the int8 GEMM with B dequantised in shared memory from
bf16 DoRA (issue targets: int8 <= 1.25x bf16 DoRA forward and forward+backward)?

At 4096 and 8192 tokens, 4096 -> 4096 r16 and 4096 -> 11008 r64, bf16, forward and forward+backward (the forward
output returned beside the gradients of x, A, B and m, so XLA cannot drop the forward), each timed as one jitted
call (bench: median of means):

  int8                the sm90_dequant GEMMs: one scratch tile per warpgroup and a wait for each wgmma
                      (QDORA_HEURISTIC; its ring as deep as shared memory allows: 4 at r16, 3 at r64)
  bf16                bf16 DoRA (implementation="pallas": the sm90 GEMM at r16, cuBLAS on the merged weight at r64)
  xla:int8            W dequantised in full, then XLA's GEMMs (implementation="xla")
  base                x @ W alone (bf16), the floor

The int8 forward output and gradients are checked once per shape against the "xla" ones (relative Frobenius
error, `err`); `stages` is the ring depth its forward GEMM got. A row per (case, op, impl), with `x_bf16`
its time over bf16 DoRA's.

    python -m benchmarks.probes.qdora_probe OUT_DIR
    (NPROC=8 on a CPU: a dry run; set qdora_probe.CASES to small shapes first)
"""

import os
import sys
import time

import jax
import jax.numpy as jnp

from benchmarks.bench_dora import _data
from benchmarks.common import bench, error_text, probe_recorder
from pallas_fused.dora import dora_dense, impls, kernel_sm90, quantize_int8

OUT = sys.argv[1] if len(sys.argv) > 1 else "/tmp/qdora_probe"
os.makedirs(OUT, exist_ok=True)
record = probe_recorder(f"{OUT}/qdora_probe.json")
CASES = [(4096, 4096, 4096, 16), (4096, 4096, 11008, 64), (8192, 4096, 4096, 16), (8192, 4096, 11008, 64)]
SCALE = 2.0
# On a CPU (a dry run of the probe at small shapes) the kernels run in interpret mode.
CPU = jax.default_backend() == "cpu"
BF16_IMPL, INT8_IMPL = ("interpret", "interpret:sm90_dequant") if CPU else ("pallas", "pallas")


def layer(impl):
    def fwd(x, w, a, b, m):
        return dora_dense(x, w, a, b, m, scale=SCALE, implementation=impl)

    def fwdbwd(x, w, a, b, m, dy):
        y, pull = jax.vjp(lambda x, a, b, m: fwd(x, w, a, b, m), x, a, b, m)
        return y, *pull(dy)

    return jax.jit(fwd), jax.jit(fwdbwd)


def rel_err(got, want):
    errs = [jnp.linalg.norm((g.astype(jnp.float32) - w.astype(jnp.float32)).ravel())
            / jnp.maximum(jnp.linalg.norm(w.astype(jnp.float32).ravel()), 1e-30)
            for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want))]
    return round(float(max(errs)), 5)


def probe_case(tokens, fin, fout, r, t0):
    case = f"{tokens}x{fin}->{fout} r{r}"
    x, w, a, b, m, dy = _data(tokens, fin, fout, r)
    qw = quantize_int8(w)
    layer = impls.DoraArgs.shaped("int8", tokens, fin, fout, r, jnp.bfloat16)
    record(case=case, variant=impls.choose(layer, impls.current_device()).variant)
    times = {}

    def timed(op, impl, fn, *args, **extra):
        try:
            ms = bench(fn, *args, n=20, reps=5)
        except Exception as e:  # noqa: BLE001 - a failing configuration is a result
            record(case=case, op=op, impl=impl, error=error_text(e))
            return
        times[op, impl] = ms
        ratio = {"x_bf16": round(ms / times[op, "bf16"], 3)} if (op, "bf16") in times else {}
        record(case=case, op=op, impl=impl, ms=round(ms, 4), **ratio, **extra, t=round(time.time() - t0))

    timed("fwd", "base", jax.jit(lambda x, w: x @ w), x, w)
    fwd, fwdbwd = layer(BF16_IMPL)
    timed("fwd", "bf16", fwd, x, w, a, b, m)
    timed("fwdbwd", "bf16", fwdbwd, x, w, a, b, m, dy)
    xfwd, xfwdbwd = layer("xla")
    want_fwd, want_fb = xfwd(x, qw, a, b, m), xfwdbwd(x, qw, a, b, m, dy)
    timed("fwd", "xla:int8", xfwd, x, qw, a, b, m)
    timed("fwdbwd", "xla:int8", xfwdbwd, x, qw, a, b, m, dy)
    stages = kernel_sm90.qdora_config(tokens, fout, fin, -(-r // 16) * 16, jnp.bfloat16).max_concurrent_steps
    fwd, fwdbwd = layer(INT8_IMPL)
    try:
        err_fwd, err_fb = rel_err(fwd(x, qw, a, b, m), want_fwd), rel_err(fwdbwd(x, qw, a, b, m, dy), want_fb)
    except Exception as e:  # noqa: BLE001 - a failing kernel is a result
        record(case=case, impl="int8", error=error_text(e))
        return
    timed("fwd", "int8", fwd, x, qw, a, b, m, stages=stages, err=err_fwd)
    timed("fwdbwd", "int8", fwdbwd, x, qw, a, b, m, dy, stages=stages, err=err_fb)


def main():
    t0 = time.time()
    for tokens, fin, fout, r in CASES:
        probe_case(tokens, fin, fout, r, t0)


if __name__ == "__main__":
    main()
