"""Backs docs/dora.md's account of what DoRA adds over LoRA (a 16 us read of W, a 29 us pass for dy g).

Where DoRA's forward+backward spends its time beside plain LoRA and the base GEMM (development probe): each
layer's jit((x, dy) -> (y, grads)) timed, then traced (GPU kernel time per kernel name, launches per step).

    python benchmarks/probes/dora_profile.py OUT_DIR
"""

import os
import sys

import jax
import jax.numpy as jnp

from benchmarks.common import bench, probe_recorder, rnd
from benchmarks.trace import trace_steps
from pallas_fused.dora import dora_dense, lora_dense

OUT = sys.argv[1]
os.makedirs(OUT, exist_ok=True)
record = probe_recorder(f"{OUT}/dora_profile.json")
SCALE = 2.0


def layers(w, bias):
    def dora(impl):
        return lambda x, a, b, m: dora_dense(x, w, a, b, m, bias, scale=SCALE, implementation=impl)

    return {
        "base": lambda x, a, b, m: x @ w,
        "lora:pallas": lambda x, a, b, m: lora_dense(x, w, a, b, bias, scale=SCALE, implementation="pallas"),
        "dora:pallas": dora("pallas"),
        "dora:pallas:sm90": dora("pallas:sm90"),
        "dora:pallas:merged": dora("pallas:merged"),
    }


for tokens, fin, fout, r in ((4096, 4096, 4096, 16), (8192, 4096, 4096, 16)):
    x = rnd(1, (tokens, fin), jnp.bfloat16)
    w = rnd(2, (fin, fout), jnp.bfloat16, scale=fin ** -0.5)
    a = rnd(3, (fin, r), jnp.bfloat16, scale=r ** -0.5)
    b = rnd(4, (r, fout), jnp.bfloat16, scale=0.01)
    m = jnp.linalg.norm(w.astype(jnp.float32), axis=0).astype(jnp.bfloat16)
    dy = rnd(5, (tokens, fout), jnp.bfloat16)
    for name, f in layers(w, None).items():
        def fb(x, a, b, m, dy, f=f):
            y, pull = jax.vjp(f, x, a, b, m)
            return y, pull(dy)

        case = f"{tokens}x{fin}->{fout} r{r}"
        try:
            step = jax.jit(fb)
            ms = bench(step, x, a, b, m, dy)
            # trace_steps runs carry = f(*carry): the same arguments each time, the step's outputs waited for
            traced = trace_steps(lambda *c, step=step: (jax.block_until_ready(step(*c)), c)[1], (x, a, b, m, dy), 20,
                                 top=16)
            record(case=case, impl=name, ms=round(ms, 4), **traced)
        except Exception as e:  # noqa: BLE001
            record(case=case, impl=name, error=f"{type(e).__name__}: {e}"[:400])
