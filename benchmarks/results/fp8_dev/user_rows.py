"""The user-path rows of fp8 / DoRA / rotary in one short process (dev check; the full bench is benchmarks.run)."""
import dataclasses
import json
import sys
import time

import jax
import jax.numpy as jnp

from benchmarks import bench_dora, bench_fp8, bench_rotary
from benchmarks.common import Ceilings, Recorder, rnd

OUT = sys.argv[1]
rec = Recorder(Ceilings.measure(quick=True))
t0 = time.time()


printed = [0]


def dump():
    rows = [dataclasses.asdict(r) for r in rec.rows]
    json.dump(rows, open(f"{OUT}/rows.json", "w"), indent=1, default=str)
    for r in rows[printed[0]:]:
        rate = r.get("tflops") or ""
        print(f"{r['op']} | {r['case']} | {r['impl']} | {r['ms']} | {rate} | {(r.get('error') or '')[:60]}", flush=True)
    printed[0] = len(rows)


bench_fp8._matmul(rec, True)
dump()
print(f"== fp8 matmul {time.time() - t0:.0f}s", flush=True)
# DoRA: the user's layer and the XLA reference at 4096 tokens 4096->4096 r16.
x, w, a, b, m, dy = bench_dora._data(4096, 4096, 4096, 16)
for name, fn in (("user:DoRADense", bench_dora._module_fwdbwd(2.0)),
                 ("pallas", bench_dora._fwdbwd("pallas", "auto", 2.0)),
                 ("xla", bench_dora._fwdbwd("xla", "pallas", 2.0))):
    rec.time("dora_fwdbwd", "4096x4096->4096 r16 bf16", name, fn, x, w, a, b, m, dy, n=20, reps=5)
# Rotary: the public call and our reference.
q, k = rnd(1, (4, 4096, 32, 128), jnp.bfloat16), rnd(2, (4, 4096, 8, 128), jnp.bfloat16)
gq, gk = rnd(3, q.shape, jnp.bfloat16), rnd(4, k.shape, jnp.bfloat16)
pos = jnp.arange(4096, dtype=jnp.int32)
for impl in ("user", "xla"):
    fwd, fb = bench_rotary._jax_fns(pos, None, impl)
    rec.time("rotary", "B4 S4096 Hq32 Hk8 D128 fwd", impl, fwd, q, k, n=50, reps=5)
    rec.time("rotary", "B4 S4096 Hq32 Hk8 D128 fwd+bwd", impl, fb, q, k, gq, gk, n=50, reps=5)
dump()
print(f"== dora, rotary {time.time() - t0:.0f}s", flush=True)
# Dense fwd+bwd, gw_hp first (the target), then the other recipes and peers as time allows.
import flax.linen as nn  # noqa: E402
from flax.linen import fp8_ops  # noqa: E402

from pallas_fused.fp8 import Float8DotGeneral  # noqa: E402

xd, g = rnd(4, (16384, 8192), jnp.bfloat16), rnd(5, (16384, 8192), jnp.bfloat16)
for name, cls in (("pallas:rowwise_with_gw_hp", lambda: Float8DotGeneral(config="rowwise_with_gw_hp")),
                  ("peer:bf16_dense", None), ("pallas:rowwise", lambda: Float8DotGeneral(config="rowwise")),
                  ("peer:flax_fp8_direct", fp8_ops.Fp8DirectDotGeneralOp),
                  ("pallas:tensorwise", lambda: Float8DotGeneral(config="tensorwise"))):
    mod = nn.Dense(8192, use_bias=False, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, dot_general_cls=cls)
    v = mod.init(jax.random.key(0), xd[:8])

    def fb(v, x, mod=mod):
        return jax.vjp(lambda v, x: mod.apply(v, x), v, x)[1](g)
    rec.time("fp8_dense", "16384x8192->8192 fwd+bwd", name, jax.jit(fb), v, xd, n=10, reps=5)
    dump()
    print(f"== dense {name} {time.time() - t0:.0f}s", flush=True)
