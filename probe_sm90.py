"""Device probe 3 (untracked): merge-pass variants (MMA vs FMA low-rank, tiles), copy ceilings, DoRA fwd/fwdbwd."""
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from benchmarks.common import bench, bench_amortized, rnd
from pallas_fused import _backend
from pallas_fused.dora import Config, dora_dense
from pallas_fused.dora import kernel as K

OUT = os.environ.get("OUT", "/tmp")
T0 = time.time()
BUDGET = float(sys.argv[1]) if len(sys.argv) > 1 else 400
rows = []
bf, f32 = jnp.bfloat16, jnp.float32


def rec(**kw):
    rows.append(kw)
    print(json.dumps(kw), flush=True)
    json.dump(rows, open(f"{OUT}/probe_sm90.json", "w"), indent=1)


def timer(sets):
    def t(fn):
        return bench_amortized(fn, sets) if len(sets) > 1 else bench(jax.jit(fn), *sets[0])
    return t


def copy2d(w, bk, bn, warps):
    Kd, N = w.shape
    def kern(w_ref, o_ref):
        i, j = pl.program_id(0), pl.program_id(1)
        t = _backend.load(w_ref.at[pl.ds(i * bk, bk), pl.ds(j * bn, bn)])
        _backend.store(o_ref.at[pl.ds(i * bk, bk), pl.ds(j * bn, bn)], t)
    return _backend.triton_call(kern, out_shape=jax.ShapeDtypeStruct(w.shape, w.dtype), grid=(Kd // bk, N // bn),
                                name="copy2d", interpret=False, num_warps=warps)(w)


def copy1d(w, block, warps):
    flat = w.reshape(-1)
    def kern(w_ref, o_ref):
        i = pl.program_id(0)
        _backend.store(o_ref.at[pl.ds(i * block, block)], _backend.load(w_ref.at[pl.ds(i * block, block)]))
    return _backend.triton_call(kern, out_shape=jax.ShapeDtypeStruct(flat.shape, w.dtype), grid=(flat.size // block,),
                                name="copy1d", interpret=False, num_warps=warps)(flat).reshape(w.shape)


MERGE = {
    "dot bk32 rows128": Config(merge_bk=32),
    "dot bk32 rows64": Config(merge_bk=32, merge_rows=64),
    "dot bk16 rows128": Config(merge_bk=16),
    "dot bk32 bn128 rows128": Config(merge_bk=32, merge_bn=128),
    "fma bk64 bn64 rows128": Config(merge_fma_rank=64),
    "fma bk32 bn128 rows128": Config(merge_fma_rank=64, merge_bk=32, merge_bn=128),
    "fma bk32 bn256 rows128": Config(merge_fma_rank=64, merge_bk=32, merge_bn=256),
    "fma bk32 bn256 rows128 w8": Config(merge_fma_rank=64, merge_bk=32, merge_bn=256, merge_warps=8),
    "fma bk16 bn256 rows64": Config(merge_fma_rank=64, merge_bk=16, merge_bn=256, merge_rows=64),
    "fma bk64 bn128 rows256 w8": Config(merge_fma_rank=64, merge_bk=64, merge_bn=128, merge_rows=256, merge_warps=8),
    "fma bk32 bn128 rows512": Config(merge_fma_rank=64, merge_bk=32, merge_bn=128, merge_rows=512),
}
for (Kd, N, r) in [(4096, 4096, 16), (4096, 11008, 64)]:
    sets = [(rnd(20 + i, (Kd, N), bf, scale=Kd ** -0.5), rnd(30 + i, (Kd, r), bf), 0.01 * rnd(40 + i, (r, N), bf),
             1 + jnp.abs(rnd(50 + i, (N,), f32))) for i in range(4)]
    t = timer(sets)
    case = [Kd, N, r]
    for bk, bn, wp in [(32, 128, 4), (64, 128, 4), (32, 256, 4), (64, 256, 8), (16, 512, 4)]:
        if N % bn == 0:
            rec(what="copy", case=case, impl=f"copy2d {bk}x{bn} w{wp}",
                ms=t(lambda w, a, b, m, bk=bk, bn=bn, wp=wp: copy2d(w, bk, bn, wp)))
    for blk, wp in [(8192, 4), (16384, 8)]:
        rec(what="copy", case=case, impl=f"copy1d {blk} w{wp}", ms=t(lambda w, a, b, m, blk=blk, wp=wp: copy1d(w, blk, wp)))
    rec(what="copy", case=case, impl="xla w*2", ms=t(lambda w, a, b, m: w * 2))
    for name, cfg in MERGE.items():
        try:
            rec(what="merge", case=case, impl=f"emit_partials {name}", ms=t(
                lambda w, a, b, m, cfg=cfg: K.merge_weight((w,), "dense", a, b, 2.0, emit_partials=True,
                                                           interpret=False, config=cfg)))
        except Exception as e:  # noqa: BLE001
            rec(what="merge", case=case, impl=f"emit_partials {name}", error=f"{type(e).__name__}: {str(e)[:200]}")
print("merge part done in", time.time() - T0, flush=True)

# 3. DoRA fwd / fwdbwd: merged vs sm90 (default merge, best merge config of section 1) vs base
best = {}
for row in rows:
    if row["what"] == "merge" and "ms" in row:
        key = tuple(row["case"][:2])
        if key not in best or row["ms"] < best[key][0]:
            best[key] = (row["ms"], MERGE[row["impl"].split(" ", 1)[1]])
rec(what="best_merge", best={str(k): [v[0], str(v[1])] for k, v in best.items()})
for (M, Kd, N, r) in [(4096, 4096, 4096, 16), (8192, 4096, 4096, 16), (4096, 4096, 11008, 64), (512, 4096, 4096, 16),
                      (8192, 4096, 11008, 64), (512, 4096, 11008, 64)]:
    if time.time() - T0 > BUDGET * 0.92:
        break
    k = 4 if M <= 512 else 1
    sets = [(rnd(10 + i, (M, Kd), bf), rnd(20 + i, (Kd, N), bf, scale=Kd ** -0.5), rnd(30 + i, (Kd, r), bf),
             0.01 * rnd(40 + i, (r, N), bf), 1 + jnp.abs(rnd(50 + i, (N,), f32)), rnd(60 + i, (M, N), bf))
            for i in range(k)]
    t = timer(sets)
    case = [M, Kd, N, r]
    rec(what="dora", case=case, impl="base x@w", ms=t(lambda x, w, a, b, m, dy: jnp.dot(x, w)))
    cfg_best = best.get((Kd, N), (None, None))[1]
    for label, gemm, cfg in [("merged", "merged", None), ("sm90", "sm90", None), ("sm90 best-merge", "sm90", cfg_best)]:
        try:
            rec(what="dora", case=case, impl=f"fwd {label}", ms=t(lambda x, w, a, b, m, dy, gemm=gemm, cfg=cfg: dora_dense(
                x, w, a, b, m, scale=2.0, implementation="pallas", gemm=gemm, config=cfg)))
            def fb(x, w, a, b, m, dy, gemm=gemm, cfg=cfg):
                _, pull = jax.vjp(lambda x, a, b, m: dora_dense(x, w, a, b, m, scale=2.0, implementation="pallas",
                                                                gemm=gemm, config=cfg), x, a, b, m)
                return pull(dy)
            rec(what="dora", case=case, impl=f"fwdbwd {label}", ms=t(fb))
        except Exception as e:  # noqa: BLE001
            rec(what="dora", case=case, impl=label, error=f"{type(e).__name__}: {str(e)[:300]}")
print("probe done in", time.time() - T0)
