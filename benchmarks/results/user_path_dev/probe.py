"""Where the user paths lose (development probe, H200): GaLore through optax against optax.contrib.galore, and the
FP8 GEMM shapes below 0.9x cuBLAS.

GaLore: the donated optax step `update -> apply_updates` at 4096x4096 and 4096x11008 r128 fp32, as written, and
with single parts taken away (the refresh `lax.cond` replaced by its keep branch, the non-finite skip, the Pallas
low-rank Adam kernel replaced by XLA), beside optax.contrib.galore with and without its cond; then a profile of
both steps (GPU kernel time per kernel). FP8: scaled_matmul_nt at the losing shapes, our sm90 kernel with other
tiles, XLA's fp8 dot (the "xla" implementation, NT layout) and torch._scaled_mm.

    python benchmarks/results/user_path_dev/probe.py OUT_DIR [galore] [fp8]
"""

import contextlib
import dataclasses
import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import optax

from benchmarks.common import bench, bench_carry, bench_torch, rnd
from benchmarks.trace import trace_kernels

OUT = sys.argv[1]
PARTS = set(sys.argv[2:]) or {"galore", "fp8"}
rows = []
t0 = time.time()


def record(**row):
    rows.append(row)
    print(" | ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    with open(f"{OUT}/probe_rows.json", "w") as f:
        json.dump(rows, f, indent=1, default=str)


@contextlib.contextmanager
def keep_branch_only():
    """lax.cond(pred, true, false) -> false() while tracing: the step without its conditional."""
    orig = jax.lax.cond
    jax.lax.cond = lambda pred, t, f, *ops, **kw: f(*ops)
    try:
        yield
    finally:
        jax.lax.cond = orig


def galore():
    from pallas_fused.galore import api

    lr = 1e-3
    for M, N in ((4096, 4096), (4096, 11008)):
        case = f"{M}x{N} r128 fp32"
        txs = {
            "ours": lambda: api.galore_adamw(lr, rank=128, update_proj_gap=10**9),
            "ours_xla": lambda: api.galore_adamw(lr, rank=128, update_proj_gap=10**9, implementation="xla"),
            "ours_hybrid": lambda: api.galore_adamw(lr, rank=128, update_proj_gap=10**9,
                                                      implementation="pallas:hybrid"),
            "contrib": lambda: optax.contrib.galore(lr, rank=128, update_proj_gap=10**9),
        }
        for name, make in txs.items():
            for variant in ("as_written", "no_cond", "no_skip") if name == "ours" else ("as_written", "no_cond"):
                tx = make()
                params, grads = {"w": rnd(3, (M, N))}, {"w": rnd(4, (M, N))}
                state = tx.init(params)
                # one real step first (it refreshes the projector), outside any patch
                u, state = jax.jit(tx.update)(grads, state, params)
                state = jax.tree.map(jnp.copy, state)

                @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
                def step(p, g, s, tx=tx):
                    u, s = tx.update(g, s, p)
                    return optax.apply_updates(p, u), g, s

                ctx = keep_branch_only() if variant == "no_cond" else contextlib.nullcontext()
                orig_skip = api._skip_nonfinite
                if variant == "no_skip":
                    api._skip_nonfinite = lambda mo, vo, m, v, s: (m, v, s)
                try:
                    with ctx:
                        carry = step(params, grads, state)
                        jax.block_until_ready(carry)
                    ms = bench_carry(step, carry, n=50, reps=7)
                    record(part="galore", case=case, impl=name, variant=variant, ms=round(ms, 4))
                    if variant == "as_written" and M == N:
                        carry = step(*carry)
                        with trace_kernels() as kt:
                            for _ in range(20):
                                carry = step(*carry)
                            jax.block_until_ready(carry)
                        record(part="galore_profile", case=case, impl=name, threads=kt.threads,
                               total_us_per_step=round(kt.total_us / 20, 2),
                               top=[(n_, round(us / 20, 2), c // 20) for n_, us, c in kt.top(15)])
                except Exception as e:  # noqa: BLE001
                    record(part="galore", case=case, impl=name, variant=variant, error=f"{type(e).__name__}: {e}"[:400])
                finally:
                    api._skip_nonfinite = orig_skip
    print(f"== galore {time.time() - t0:.0f}s", flush=True)


def fp8():
    import numpy as np
    import torch

    from pallas_fused.fp8 import api, kernel_sm90, quantize

    E4 = jnp.float8_e4m3fn
    base = kernel_sm90.DEFAULT
    tiles = {
        "default": None,
        "128x128": dataclasses.replace(base, tile_n=64),
        "split_m": dataclasses.replace(base, wg_split="m"),
    }
    shapes = [(16384, 2048, 512), (16384, 512, 2048), (2048, 16384, 512), (16384, 4096, 11008), (512, 16384, 2048),
              (2048, 16384, 2048), (16384, 2048, 2048)]
    for m, k, n in shapes:
        a, wt = rnd(1, (m, k), jnp.bfloat16), rnd(2, (n, k), jnp.bfloat16)
        flops = 2 * m * n * k
        calls = min(200, max(20, int(10e-3 * 1300e12 / flops)))
        for gran in ("rowwise", "tensorwise"):
            axis = -1 if gran == "rowwise" else None
            a8, sa = quantize(a, E4, axis)
            bt8, sb = quantize(wt, E4, axis)
            sav, sbv = jnp.broadcast_to(sa.reshape(-1), (m,)), jnp.broadcast_to(sb.reshape(-1), (n,))
            case = f"{m}x{k}x{n} {gran}"

            def rate(ms, flops=flops):
                return round(flops / ms / 1e9, 1)

            for tname, cfg in tiles.items():
                if cfg is not None and not kernel_sm90.supported(m, n, k, E4, E4, cfg):
                    continue
                try:
                    if cfg is None:
                        fn = jax.jit(api.scaled_matmul_nt)
                        ms = bench(fn, a8, bt8, sa, sb, n=calls, reps=5)
                    else:
                        fn = jax.jit(functools.partial(kernel_sm90.scaled_matmul_nt, out_dtype=jnp.bfloat16,
                                                       config=cfg))
                        ms = bench(fn, a8, bt8, sav, sbv, n=calls, reps=5)
                    record(part="fp8", case=case, impl=f"sm90:{tname}", ms=round(ms, 4), tflops=rate(ms))
                except Exception as e:  # noqa: BLE001
                    record(part="fp8", case=case, impl=f"sm90:{tname}", error=f"{type(e).__name__}: {e}"[:300])
            xla = jax.jit(lambda a, bt, sa, sb: api._mm_nt(a, bt, sa, sb, jnp.bfloat16, True, "xla"))
            ms = bench(xla, a8, bt8, sav, sbv, n=calls, reps=5)
            record(part="fp8", case=case, impl="xla_nt", ms=round(ms, 4), tflops=rate(ms))
            if gran == "tensorwise":  # scalar scales: the pattern XLA can hand to cuBLASLt with its scale operands
                def xla_s(a, bt, sa, sb):
                    acc = jax.lax.dot_general(a, bt, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
                    return (acc * (sa * sb)).astype(jnp.bfloat16)

                xla_s = jax.jit(xla_s)
                ms = bench(xla_s, a8, bt8, sa, sb, n=calls, reps=5)
                record(part="fp8", case=case, impl="xla_nt_scalar", ms=round(ms, 4), tflops=rate(ms))

            def to_torch(x8):
                raw = np.asarray(jax.lax.bitcast_convert_type(x8, jnp.uint8))
                return torch.from_numpy(raw).to("cuda").view(torch.float8_e4m3fn)

            ta, tb = to_torch(a8), to_torch(bt8).t()
            if gran == "rowwise":
                tsa = torch.from_numpy(np.asarray(sa)).cuda().reshape(-1, 1).contiguous()
                tsb = torch.from_numpy(np.asarray(sb)).cuda().reshape(1, -1).contiguous()
            else:
                tsa, tsb = torch.tensor(float(sa), device="cuda"), torch.tensor(float(sb), device="cuda")
            def torch_mm(ta=ta, tb=tb, tsa=tsa, tsb=tsb):
                return torch._scaled_mm(ta, tb, scale_a=tsa, scale_b=tsb, out_dtype=torch.bfloat16, use_fast_accum=True)

            ms = bench_torch(torch_mm, n=calls, reps=5)
            record(part="fp8", case=case, impl="torch_scaled_mm", ms=round(ms, 4), tflops=rate(ms))
    print(f"== fp8 {time.time() - t0:.0f}s", flush=True)


if "galore" in PARTS:
    galore()
if "fp8" in PARTS:
    fp8()
