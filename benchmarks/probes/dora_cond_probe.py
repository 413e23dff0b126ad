"""Backs what DoRA's zero-magnitude conditional costs: docs/performance.md's 5% (logs/h200_2026-11-26g_qdora_trace.log).

What DoRA's zero-magnitude conditional costs on the user's path (development probe).

    python -m benchmarks.probes.dora_cond_probe OUT_DIR [TOKENSxINxOUT:R ...]

Every `dora_dense` backward has a lax.cond for magnitudes of exactly 0 (`_dm_at_zero_magnitude`); the QDoRA forward
on Hopper has none (the column norm's q^T zeroes the columns of int8 scale 0). On a GPU, XLA reads a conditional's
predicate back to the host, which then waits for the device before it launches anything after it. At each case
(default 4096x4096->4096 r16) this times in turn, then traces (benchmarks.trace.time_then_trace: ms per call, the
host gap = wall minus GPU kernel time, the top kernels), forward and forward+backward: bf16 DoRA and int8 QDoRA as
they are and with the conditional compiled out (the module function patched to the identity while tracing).
Rows go to OUT_DIR/dora_cond_probe.json.
"""

from __future__ import annotations

from unittest import mock

import jax

from benchmarks.bench_dora import _data, _with_output
from benchmarks.common import probe_command_line
from benchmarks.trace import time_then_trace
from pallas_fused.dora import dora_dense, impls, quantize_int8

SCALE = 2.0


def no_conds():
    """The zero-magnitude conditional replaced by the identity (for tracing only: exact only without such
    magnitudes)."""
    return (mock.patch.object(impls, "_dm_at_zero_magnitude", lambda dm, *a: dm),)


def build_case(tokens, fin, fout, r):
    x, w, a, b, m, dy = _data(tokens, fin, fout, r)
    weights = {"bf16": w, "int8": quantize_int8(w)}

    def build(name):
        fmt, part, cond = name.split()
        qw = weights[fmt]
        if part == "fwd":
            def fn(x, a, b, m, dy):
                return dora_dense(x, qw, a, b, m, scale=SCALE)
        else:
            def fn(x, a, b, m, dy):
                return _with_output(lambda x, a, b, m: dora_dense(x, qw, a, b, m, scale=SCALE), x, a, b, m, dy=dy)
        jitted = jax.jit(fn)
        patches = no_conds() if cond == "no-cond" else ()
        for p in patches:
            p.start()
        try:
            out = jitted(x, a, b, m, dy)  # traced (and compiled) here, under the patches
        finally:
            for p in patches:
                p.stop()

        def step(_, *args):  # the output rides the carry, so each call's wait is on that call's work
            return (jitted(*args), *args)
        return step, (out, x, a, b, m, dy)

    return build


def main():
    record, cases = probe_command_line("dora_cond_probe", [(4096, 4096, 4096, 16)])
    print(jax.devices(), flush=True)
    for tokens, fin, fout, r in cases:
        build = build_case(tokens, fin, fout, r)
        for part in ("fwd", "fwdbwd"):
            names = [f"{fmt} {part} {cond}" for fmt in ("bf16", "int8") for cond in ("cond", "no-cond")]
            time_then_trace(build, names, record, ref=f"bf16 {part} cond", n=30, reps=len(names) + 1,
                            case=f"{tokens}x{fin}->{fout} r{r}")


if __name__ == "__main__":
    main()
