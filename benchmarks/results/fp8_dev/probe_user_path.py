"""FP8 user path vs torch._scaled_mm and the benchmark's private path, one process (dev probe).

python -m benchmarks.results.fp8_dev.probe_user_path OUTDIR [cliff|sweep|dense ...]
"""
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import bench, bench_torch, rnd
from pallas_fused.fp8 import api, kernel_sm90, quantize, scaled_matmul_nt

E4 = jnp.float8_e4m3fn
OUT = sys.argv[1]
WHAT = sys.argv[2:] or ["cliff", "sweep", "dense"]


def tf(ms, m, k, n):
    return 2 * m * n * k / ms / 1e9


def to_torch(x8):
    import torch
    raw = np.asarray(jax.lax.bitcast_convert_type(x8, jnp.uint8))
    return torch.from_numpy(raw).to("cuda").view(torch.float8_e4m3fn)


def torch_ms(a8, bt8, sa, sb, rowwise, n=20, reps=5):
    import torch
    ta, tb = to_torch(a8), to_torch(bt8).t()
    if rowwise:
        tsa = torch.from_numpy(np.asarray(sa, np.float32)).to("cuda").reshape(-1, 1).contiguous()
        tsb = torch.from_numpy(np.asarray(sb, np.float32)).to("cuda").reshape(1, -1).contiguous()
    else:
        tsa = torch.tensor(float(np.asarray(sa).reshape(())), device="cuda")
        tsb = torch.tensor(float(np.asarray(sb).reshape(())), device="cuda")
    return bench_torch(lambda: torch._scaled_mm(ta, tb, scale_a=tsa, scale_b=tsb, out_dtype=torch.bfloat16,
                                                use_fast_accum=True), n=n, reps=reps)


def hlo_summary(text):
    ops = {}
    for line in text.splitlines():
        for key in ("custom-call", "copy(", "transpose(", "fusion(", "pad(", "slice(", "broadcast("):
            if key in line and "=" in line:
                ops[key] = ops.get(key, 0) + 1
    return ops


def cliff():
    m, k, n = 16384, 4096, 11008
    x, wt = rnd(1, (m, k), jnp.bfloat16), rnd(2, (n, k), jnp.bfloat16)
    user = jax.jit(scaled_matmul_nt)
    for gran, ax in (("rowwise", -1), ("tensorwise", None)):
        a8, sa = quantize(x, E4, ax)
        bt8, sb = quantize(wt, E4, ax)
        print(f"[cliff {gran}] sa {sa.shape} {sa.dtype} sb {sb.shape} {sb.dtype} a8 {a8.shape} bt8 {bt8.shape}")
        t_user = bench(user, a8, bt8, sa, sb, n=20, reps=5)
        t_eager = bench(scaled_matmul_nt, a8, bt8, sa, sb, n=20, reps=5)
        sav, sbv = jnp.broadcast_to(sa.reshape(-1), (m,)), jnp.broadcast_to(sb.reshape(-1), (n,))
        priv = jax.jit(lambda a, b, s1, s2: api._mm_nt(a, b, s1, s2, jnp.bfloat16, True, "pallas:sm90"))
        t_priv = bench(priv, a8, bt8, sav, sbv, n=20, reps=5)
        t_kern = bench(jax.jit(lambda a, b, s1, s2: kernel_sm90.scaled_matmul_nt(a, b, s1, s2, out_dtype=jnp.bfloat16)),
                       a8, bt8, sav, sbv, n=20, reps=5)
        t_t = torch_ms(a8, bt8, sa, sb, gran == "rowwise")
        t_user2 = bench(user, a8, bt8, sa, sb, n=20, reps=5)
        # The benchmark's own operands: XLA quantize of b (K, N) along axis 0, then a transposed copy.
        b = wt.T.copy()
        a8x, sax = quantize(x, E4, 1 if ax is not None else None, implementation="xla")
        b8x, sbx = quantize(b, E4, 0 if ax is not None else None, implementation="xla")
        bt8x = b8x.T.copy()
        t_benchdata = bench(user, a8x, bt8x, sax.reshape(-1, 1) if ax is not None else sax,
                            sbx.reshape(-1, 1) if ax is not None else sbx, n=20, reps=5)
        same = bool(jnp.all(bt8x == bt8)) and bool(jnp.all(a8x == a8))
        for name, t in (("user jit", t_user), ("user eager", t_eager), ("private _mm_nt", t_priv),
                        ("kernel direct", t_kern), ("torch", t_t), ("user jit again", t_user2),
                        ("user jit, bench's xla-quantized data", t_benchdata)):
            print(f"[cliff {gran}] {name:40s} {t:.3f} ms  {tf(t, m, k, n):.0f} TFLOP/s")
        print(f"[cliff {gran}] xla-quantized bytes identical to pallas-quantized: {same}")
        text = user.lower(a8, bt8, sa, sb).compile().as_text()
        open(os.path.join(OUT, f"hlo_user_nt_{gran}.txt"), "w").write(text)
        print(f"[cliff {gran}] compiled HLO ops: {hlo_summary(text)}")
        out = user(a8, bt8, sa, sb)
        ref = (a8.astype(jnp.float32) * sa) @ (bt8.astype(jnp.float32) * sb).T
        print(f"[cliff {gran}] max rel err vs f32 ref {float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref))):.2e}")


EXAMPLE = [(16384, 2048, 2048), (16384, 2048, 512), (16384, 2048, 5504), (16384, 5504, 2048), (16384, 512, 2048),
           (2048, 16384, 2048), (512, 16384, 2048), (2048, 16384, 5504), (5504, 16384, 2048)]
SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (16384, 16384, 16384), (16384, 4096, 11008), (16384, 11008, 4096),
          (16384, 2048, 5504)] + EXAMPLE


def sweep():
    user = jax.jit(scaled_matmul_nt)
    default_cfg = api.sm90_config
    print(f"{'M x K x N':22s} {'gran':10s} {'ours':>7s} {'torch':>7s} {'ratio':>6s}  {'old tile':>8s}  (TFLOP/s)")
    for m, k, n in SHAPES:
        x, wt = rnd(1, (m, k), jnp.bfloat16), rnd(2, (n, k), jnp.bfloat16)
        for gran, ax in (("tensorwise", None), ("rowwise", -1)):
            a8, sa = quantize(x, E4, ax)
            bt8, sb = quantize(wt, E4, ax)
            t = bench(user, a8, bt8, sa, sb, n=20, reps=5)
            tt = torch_ms(a8, bt8, sa, sb, gran == "rowwise")
            old = ""
            if default_cfg(m, n, k) != kernel_sm90.DEFAULT:
                api.sm90_config = lambda *_: kernel_sm90.DEFAULT
                t_old = bench(jax.jit(scaled_matmul_nt), a8, bt8, sa, sb, n=20, reps=5)
                api.sm90_config = default_cfg
                old = f"{tf(t_old, m, k, n):8.0f}"
            print(f"{m}x{k}x{n:<10} {gran:10s} {tf(t, m, k, n):7.0f} {tf(tt, m, k, n):7.0f} {t and tt / t:6.3f}  {old}",
                  flush=True)


def dense(shapes=((16384, 8192, 8192), (16384, 2048, 5504), (16384, 5504, 2048)), with_y=True):
    import flax.linen as nn
    from flax.linen import fp8_ops

    from pallas_fused.fp8 import Float8DotGeneral
    for tokens, din, dout in shapes:
        x, g = rnd(4, (tokens, din), jnp.bfloat16), rnd(5, (tokens, dout), jnp.bfloat16)
        impls = [(r, lambda r=r: Float8DotGeneral(config=r)) for r in ("tensorwise", "rowwise", "rowwise_with_gw_hp")]
        impls += [("bf16", None), ("flax_fp8_direct", fp8_ops.Fp8DirectDotGeneralOp)]
        for name, cls in impls:
            mod = nn.Dense(dout, use_bias=False, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                           dot_general_cls=cls)
            v = mod.init(jax.random.key(0), x[:8])

            def fb(v, x, mod=mod, g=g):
                _, vjp = jax.vjp(lambda v, x: mod.apply(v, x), v, x)
                return vjp(g)

            def fby(v, x, mod=mod, g=g):
                y, vjp = jax.vjp(lambda v, x: mod.apply(v, x), v, x)
                return y, vjp(g)
            f = jax.jit(fb)
            t = bench(f, v, x, n=10, reps=5)
            ty = bench(jax.jit(fby), v, x, n=10, reps=5) if with_y else float("nan")
            print(f"[dense {tokens}x{din}->{dout}] {name:20s} fwd+bwd {t:.3f} ms   +y {ty:.3f} ms", flush=True)
            if name == "rowwise_with_gw_hp" and din == 8192:
                text = f.lower(v, x).compile().as_text()
                open(os.path.join(OUT, "hlo_dense_gwhp.txt"), "w").write(text)
                print(f"[dense gwhp] compiled HLO ops: {hlo_summary(text)}")



def _cfgs():
    import dataclasses
    d = kernel_sm90.DEFAULT
    return {"n d0": dataclasses.replace(d, delay_release=0), "n d1": dataclasses.replace(d, delay_release=1),
            "m d1": dataclasses.replace(d, wg_split="m", delay_release=1),
            "n64 d1": dataclasses.replace(d, tile_n=64, max_concurrent_steps=6, delay_release=1),
            "64x64 d1": dataclasses.replace(d, tile_m=64, tile_n=64, max_concurrent_steps=6, delay_release=1)}


def configs():
    """Each tile config on each shape, both granularities, against torch (same bytes)."""
    user = jax.jit(scaled_matmul_nt)
    orig = api.sm90_config
    shapes = [s for s in SHAPES if s not in ((16384, 16384, 16384),)]
    for m, k, n in shapes:
        x, wt = rnd(1, (m, k), jnp.bfloat16), rnd(2, (n, k), jnp.bfloat16)
        for gran, ax in (("tensorwise", None), ("rowwise", -1)):
            a8, sa = quantize(x, E4, ax)
            bt8, sb = quantize(wt, E4, ax)
            tt = torch_ms(a8, bt8, sa, sb, gran == "rowwise")
            ref = None
            row = []
            for name, cfg in _cfgs().items():
                if not kernel_sm90.supported(m, n, k, E4, E4, cfg):
                    continue
                if name == "64x64 d1" and m * n // (128 * 256) >= 264:
                    continue
                api.sm90_config = lambda *_, cfg=cfg: cfg
                f = jax.jit(scaled_matmul_nt)
                try:
                    out = f(a8, bt8, sa, sb)
                    if ref is None:
                        ref = out.astype(jnp.float32)
                    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)))
                    t = bench(f, a8, bt8, sa, sb, n=20, reps=5)
                    row.append(f"{name}={tf(t, m, k, n):.0f}({tt / t:.2f}{'' if err == 0 else f' err{err:.1e}'})")
                except Exception as e:  # noqa: BLE001
                    row.append(f"{name}=FAIL {type(e).__name__}: {str(e)[:80]}")
                api.sm90_config = orig
            tx = bench(jax.jit(lambda *a: scaled_matmul_nt(*a, implementation="xla")), a8, bt8, sa, sb, n=20, reps=5)
            print(f"{m}x{k}x{n} {gran:10s} torch={tf(tt, m, k, n):.0f} xla={tf(tx, m, k, n):.0f}({tt / tx:.2f}) "
                  + " ".join(row), flush=True)
    del user


def dense2():
    import dataclasses
    orig = api.sm90_config
    api.sm90_config = lambda m, n, k: dataclasses.replace(orig(m, n, k), delay_release=1)
    dense(((16384, 8192, 8192), (16384, 2048, 5504)), with_y=False)
    api.sm90_config = orig

print(jax.devices(), jax.__version__, flush=True)
for w in WHAT:
    start = time.time()
    globals()[w]()
    print(f"== {w} {time.time() - start:.0f}s", flush=True)
