"""Backs docs/fp8.md's blockwise GEMM promotion schedules and the tuned blockwise tile (tuning data fp8_blockwise_sm90).

Blockwise FP8 GEMM on Hopper (dev probe): compile, check against the exact reference, time.

python -m benchmarks.probes.blockwise_probe [small|large|shapes|sweep|dense|schedules|quantize|cluster|walk ...]
(default: all but schedules, quantize and cluster)

small: 256x512x384 with every tile config that takes it; large: 8192^3 with the api's tile; shapes: the example's
GEMMs through the api (padding included); sweep: tile / stage variants at 8192^3; dense: the blockwise Dense
forward+backward (implementation None vs "xla"); schedules: the promotion's tuning (_sm90.TileConfig's
early_release) and the scalar read of b's block scales (scale_rows) by tile and stages at 8192^3, beside the
rowwise kernel at the same tiles (the ceiling without promotion); then the fastest four and the tuned tile with
vector scales at the example's GEMMs 16384x2048x{2048,5504,512} (M x K x N); torch._scaled_mm's blockwise mode
at each shape. With MOSAIC_GPU_DUMP_PTXAS=1 each kernel's ptxas report (registers, spills, wgmma serialization)
precedes its line on stderr ("compiling <label>" marks where each begins). cluster: the tuned tile as a 2-CTA
cluster along M and N beside it alone, at 8192^3 and the example's GEMMs. walk: the tuned tile walking the output
grid along N (its default) and along M (TileConfig.grid_minor_dim, as the rowwise kernel's tall GEMMs do), each with
the tuned 4 stages and with as many as fit (5), at 8192^3 and the example's GEMMs, timed in turn with torch's
blockwise mode.
quantize: the one-pass quantize kernel writing both copies at 16384x8192 bf16 by warps per program, in GB/s of HBM
traffic (4.8 TB/s peak); it runs before schedules, and both stop starting cases some BUDGET_S seconds (default 170)
after the probe starts.
(benchmarks/results/logs/h200_2026-11-26_blockwise_schedules.log also timed promotion schedules and a quantize
variant since removed as slower or equal.) Each case prints its SQNR
against the exact fp32 product of the dequantized operands (and against the bf16 inputs' product), its time and
TFLOP/s, or the full traceback of its failure, and the probe goes on to the next case.
"""
import dataclasses
import functools
import itertools
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import bench_fp8
from benchmarks.common import bench, bench_torch, rnd
from pallas_fused.fp8 import api, fp8_linear, kernel_sm90
from pallas_fused.fp8 import reference as ref

E4 = jnp.float8_e4m3fn
WHAT = sys.argv[1:] or ["small", "large", "shapes", "sweep", "dense"]
START, BUDGET_S = time.time(), float(os.environ.get("BUDGET_S", 170))
LINE = 100


def sqnr(out, exact):
    out, exact = out.astype(jnp.float32), exact.astype(jnp.float32)
    return float(10 * jnp.log10(jnp.sum(exact ** 2) / jnp.sum((out - exact) ** 2)))


def operands(m, k, n, b_block=(128, 128)):
    # Per-tile magnitudes 2^-5 .. 2^5 on top of normal values: a kernel that mixes up K blocks' scales fails.
    def tiles(seed, shape, block):
        e = jax.random.randint(jax.random.key(seed), (-(-shape[0] // block[0]), -(-shape[1] // 128)), -5, 6)
        return ref.expand_block_scales(jnp.exp2(e.astype(jnp.float32)), block, shape)

    a = (rnd(1, (m, k)) * tiles(2, (m, k), (1, 128))).astype(jnp.bfloat16)
    bt = (rnd(3, (n, k)) * tiles(4, (n, k), b_block)).astype(jnp.bfloat16)
    a8, sa = ref.quantize_blockwise_reference(a, E4, (1, 128))
    b8, sb = ref.quantize_blockwise_reference(bt, E4, b_block)
    want = jax.jit(functools.partial(ref.blockwise_scaled_matmul_nt_reference, a_block=(1, 128), b_block=b_block,
                                     out_dtype=jnp.float32))(a8, b8, sa, sb)
    sa_t = api._step_scales(api._Operand(a8, sa.T, block=(1, 128)), k)
    sb_t = api._step_scales(api._Operand(b8, sb.T, block=b_block), k)
    return (a8, b8, sa_t, sb_t), want, (a, bt)


def case(label, fn, args, want, flops, bf16=None, n=20):
    """Prints the case's line; returns its ms, or None when it failed."""
    try:
        print(f"compiling {label}", file=sys.stderr, flush=True)
        out = jax.block_until_ready(fn(*args))
        msg = f"sqnr vs exact {sqnr(out, want):6.1f} dB"
        if bf16 is not None:
            msg += f", vs bf16 {sqnr(out, ref.matmul_nt_fp32(*bf16, jnp.float32)):5.1f} dB"
        ms = bench(fn, *args, n=n, reps=3)
        print(f"{label:{LINE}s} {msg}  {ms:8.4f} ms {flops / ms / 1e9:7.1f} TFLOP/s", flush=True)
        return ms
    except Exception:  # noqa: BLE001 - the traceback is the result
        print(f"{label:{LINE}s} FAILED", flush=True)
        traceback.print_exc()
        sys.stdout.flush()
        return None


def direct(config, out_dtype=jnp.bfloat16, scale_rows=(1, 1)):
    return jax.jit(functools.partial(kernel_sm90.blockwise_matmul_nt, out_dtype=out_dtype, config=config,
                                     scale_rows=scale_rows))


def torch_blockwise_operands(args):
    """The probe's operands as torch._scaled_mm's blockwise mode takes them: (a, b column-major (K, N), a's
    1 x 128 scales, b's 128 x 128 block scales in the two layouts tried: as they are, and with the K-block count's
    stride padded to 4, which cuBLAS wants)."""
    import torch

    a8, b8, sa_t, sb_t = args
    ta, tb = bench_fp8._to_torch(a8), bench_fp8._to_torch(b8).t()
    tsa = torch.from_numpy(np.asarray(sa_t)).cuda().contiguous().t()  # (M, K / 128), stride (1, M)
    tsb = torch.from_numpy(np.asarray(sb_t[:, ::128].T)).cuda()  # (N / 128, K / 128): the weight's block scales
    kb = tsb.shape[1]
    padded = torch.nn.functional.pad(tsb, (0, -kb % 4))[:, :kb]
    return ta, tb, tsa, (tsb.t(), padded.t())


def torch_blockwise(label, args, want, flops, n):
    """torch._scaled_mm's blockwise mode on the same operands (1 x 128 scales for a, 128 x 128 for b, the layouts
    bench_fp8 passes), with and without fast accumulation; its lines, or its refusal."""
    import torch

    ta, tb, tsa, scale_b_layouts = torch_blockwise_operands(args)
    for fast in (False, True):
        errors = []
        for scale_b in scale_b_layouts:
            def fn(scale_b=scale_b, fast=fast):
                return torch._scaled_mm(ta, tb, scale_a=tsa, scale_b=scale_b, out_dtype=torch.bfloat16,
                                        use_fast_accum=fast)
            try:
                got = jnp.asarray(fn().float().cpu().numpy())
            except Exception as e:  # noqa: BLE001 - try the next layout
                errors.append(str(e)[:200])
                continue
            ms = bench_torch(fn, n=n, reps=3)
            print(f"{label + f' torch._scaled_mm blockwise fast_accum={fast}':{LINE}s} sqnr vs exact "
                  f"{sqnr(got, want):6.1f} dB  {ms:8.4f} ms {flops / ms / 1e9:7.1f} TFLOP/s", flush=True)
            break
        else:
            print(f"{label} torch._scaled_mm blockwise fast_accum={fast} FAILED: {' | '.join(errors)}", flush=True)


print(jax.devices(), flush=True)
if "small" in WHAT:
    m, k, n = 256, 512, 384
    args, want, bf16 = operands(m, k, n)
    large, small, _ = kernel_sm90.tiles()
    for base in (large, dataclasses.replace(large, wg_split="m"), small):
        if not kernel_sm90.supported(m, n, k, E4, E4, base):
            continue
        for out_dtype in (jnp.bfloat16, jnp.float32):
            cfg = kernel_sm90.blockwise_config(base, out_dtype)
            case(f"small {m}x{k}x{n} {jnp.dtype(out_dtype).name} {cfg}", direct(cfg, out_dtype), args, want,
                 2 * m * n * k, bf16)
if "large" in WHAT:
    m = k = n = 8192
    args, want, bf16 = operands(m, k, n)
    cfg = kernel_sm90.blockwise_tile(m, n, jnp.bfloat16)
    case(f"large {m}^3 {cfg}", direct(cfg), args, want, 2 * m * n * k, bf16, n=50)
if "shapes" in WHAT:
    for m, k, n in [(16384, 2048, 2048), (16384, 2048, 512), (16384, 2048, 5504), (16384, 5504, 2048),
                    (2048, 16384, 2048), (300, 520, 200)]:
        for b_block in ((128, 128), (1, 128)):
            args, want, bf16 = operands(m, k, n, b_block)
            fn = jax.jit(functools.partial(api._mm_nt_blockwise, out_dtype=jnp.bfloat16))
            cta = kernel_sm90.blockwise_tile(m, n, jnp.bfloat16).cta_tile
            case(f"api {m}x{k}x{n} b {b_block} {cta}", fn, args, want, 2 * m * n * k,
                 bf16, n=50)
if "sweep" in WHAT:
    m = k = n = 8192
    args, want, _ = operands(m, k, n)
    large, small, _ = kernel_sm90.tiles()
    # (rows, columns) per compute warpgroup and the split: 64-row warpgroups halve both fp32 accumulators
    # (DeepGEMM's shape: 64 x BLOCK_N per math warpgroup)
    bases = [dataclasses.replace(large, tile_m=tm, tile_n=tn, wg_split=split)
             for tm, tn, split in ((128, 128, "n"), (128, 128, "m"), (128, 64, "n"), (64, 128, "m"), (64, 128, "n"),
                                   (64, 256, "m"), (64, 64, "n"))]
    for base in bases:
        for stages in (3, 4, 6):
            cfg = dataclasses.replace(base, max_concurrent_steps=stages)
            if kernel_sm90.blockwise_config(cfg, jnp.bfloat16).max_concurrent_steps != stages:
                continue  # does not fit in shared memory
            case(f"sweep {m}^3 {cfg}", direct(cfg), args, want, 2 * m * n * k, n=30)
if "dense" in WHAT:
    for tokens, width in ((16384, 2048), (2048, 1024)):
        x, w, g = (rnd(5, (tokens, width), jnp.bfloat16), rnd(6, (width, width), jnp.bfloat16),
                   rnd(7, (tokens, width), jnp.bfloat16))

        def layer(x, w, impl, g=g):
            y, vjp = jax.vjp(lambda x, w: fp8_linear(x, w, "blockwise", implementation=impl), x, w)
            return (y, *vjp(g))

        want = jax.jit(functools.partial(layer, impl="xla"))(x, w)
        for impl in (None, "xla"):
            fn = jax.jit(functools.partial(layer, impl=impl))
            try:
                got = fn(x, w)
                db = [round(sqnr(a, b), 1) for a, b in zip(got, want)]
                ms = bench(fn, x, w, n=10, reps=3)
                print(f"dense {tokens}x{width}->{width} impl={impl}: y/dx/dw sqnr vs xla {db}, {ms:.3f} ms, "
                      f"{3 * 2 * tokens * width * width / ms / 1e9:.1f} TFLOP/s (quantize included)", flush=True)
            except Exception:  # noqa: BLE001
                print(f"dense {tokens}x{width} impl={impl} FAILED", flush=True)
                traceback.print_exc()
if "quantize" in WHAT:
    from pallas_fused.fp8 import kernel

    r, c = 16384, 8192
    x = rnd(6, (r, c), jnp.bfloat16)
    for name, block_n, block_t, written in (
            ("act q+qT", (1, 128), (128, 1), r * c * 2 + 4 * (r * -(-c // 128) + c * -(-r // 128))),
            ("weight q+qT", (128, 128), (128, 128), 2 * r * c + 4 * -(-r // 128) * -(-c // 128))):
        nbytes = r * c * 2 + written
        want = kernel.quantize_blockwise(x, dtype=E4, block_n=block_n, block_t=block_t, num_warps=4)
        for warps in (4, 8, 16):
            if time.time() - START > BUDGET_S:
                print(f"quantize {r}x{c} {name} skipped (time)", flush=True)
                continue
            fn = jax.jit(functools.partial(kernel.quantize_blockwise, dtype=E4, block_n=block_n, block_t=block_t,
                                           num_warps=warps))
            try:
                got = fn(x)
                same = all(bool(jnp.array_equal(g.view(jnp.uint8) if g.dtype == E4 else g,
                                                w.view(jnp.uint8) if w.dtype == E4 else w))
                           for g, w in zip(got, want) if g is not None)
                ms = bench(fn, x, n=30, reps=3)
                print(f"quantize {r}x{c} {name:12s} num_warps={warps:2d} "
                      f"{ms:.4f} ms {nbytes / ms / 1e6:7.0f} GB/s, equal to 4 warps: {same}", flush=True)
            except Exception:  # noqa: BLE001 - the traceback is the result
                print(f"quantize {name} num_warps={warps} FAILED", flush=True)
                traceback.print_exc()
if "schedules" in WHAT:
    # One compile + a ~0.1 s timing per candidate: 11 at 8192^3, then 5 at each of the example's three GEMMs;
    # past the budget the rest are skipped (the probe must end within a device call's limit).
    start, budget = START, BUDGET_S
    tuned = kernel_sm90.blockwise_tile(8192, 8192, jnp.bfloat16)
    # (tile, split, stage counts); b's scale read as a scalar (scale_rows 128) but in the first, the tuned kernel
    # with a vector
    grid = [((128, 64), "n", (3, 4)), ((128, 64), "m", (3,)), ((64, 128), "m", (3, 4))]
    candidates = [(kernel_sm90.blockwise_config(tuned, jnp.bfloat16), (1, 1))]
    for (tm, tn), split, stage_counts in grid:
        for early, stages in itertools.product((False, True), stage_counts):
            cfg = kernel_sm90.blockwise_config(dataclasses.replace(
                tuned, tile_m=tm, tile_n=tn, wg_split=split, early_release=early, max_concurrent_steps=stages),
                jnp.bfloat16)
            if cfg.max_concurrent_steps == stages:
                candidates.append((cfg, (1, 128)))

    def label(shape, cfg, rows):
        return (f"sched {shape} {cfg.tile_m}x{cfg.tile_n}/{cfg.wg_split} st{cfg.max_concurrent_steps}"
                f"{' early' if cfg.early_release else ''} {'scalar' if rows[1] > 1 else 'vector'} b")

    m = k = n = 8192
    args, want, _ = operands(m, k, n)
    # The ceiling without promotion: the rowwise kernel (one fp32 accumulator) at the blockwise tiles' wgmma shapes.
    for cfg in (dataclasses.replace(tuned, tile_m=128, tile_n=64, wg_split="n", max_concurrent_steps=4),
                dataclasses.replace(tuned, tile_m=64, tile_n=128, wg_split="m", max_concurrent_steps=4)):
        fn = jax.jit(functools.partial(kernel_sm90.scaled_matmul_nt, out_dtype=jnp.bfloat16, config=cfg))
        rw = (args[0], args[1], args[2][0], args[3][0])
        try:
            print(f"compiling rowwise {cfg}", file=sys.stderr, flush=True)
            ms = bench(fn, *rw, n=20, reps=3)
            print(f"{f'rowwise (no promotion) {m}^3 {cfg.tile_m}x{cfg.tile_n}/{cfg.wg_split} st4':{LINE}s} "
                  f"{ms:8.4f} ms {2 * m * n * k / ms / 1e9:7.1f} TFLOP/s", flush=True)
        except Exception:  # noqa: BLE001 - the traceback is the result
            traceback.print_exc()
    timed = []
    for cfg, rows in candidates:
        if time.time() - start > budget:
            print(f"{label(f'{m}^3', cfg, rows):{LINE}s} skipped (time)", flush=True)
            continue
        ms = case(label(f"{m}^3", cfg, rows), direct(cfg, scale_rows=rows), args, want, 2 * m * n * k, n=20)
        if ms is not None:
            timed.append((ms, cfg, rows))
    torch_blockwise(f"sched {m}^3", args, want, 2 * m * n * k, n=20)
    best = [(c, r) for _, c, r in sorted(timed, key=lambda t: t[0])[:4]]
    print("fastest at 8192^3:", *(f"{c} scale_rows={r}" for c, r in best), sep="\n  ", flush=True)
    for m, k, n in ((16384, 2048, 2048), (16384, 2048, 5504), (16384, 2048, 512)):
        args, want, _ = operands(m, k, n)
        here = kernel_sm90.blockwise_tile(m, n, jnp.bfloat16)
        for cfg, rows in dict.fromkeys([(here, (1, 1)), *best]):
            if not kernel_sm90.supported(m, n, k, E4, E4, cfg):
                cfg = dataclasses.replace(cfg, wg_split=here.wg_split)
            if not kernel_sm90.supported(m, n, k, E4, E4, cfg) or time.time() - start > budget + 30:
                continue
            case(label(f"{m}x{k}x{n}", cfg, rows) + (" (tuned)" if (cfg, rows) == (here, (1, 1)) else ""),
                 direct(cfg, scale_rows=rows), args, want, 2 * m * n * k, n=30)
        torch_blockwise(f"sched {m}x{k}x{n}", args, want, 2 * m * n * k, n=30)
    print(f"schedules: {time.time() - start:.0f} s", flush=True)

if "cluster" in WHAT:
    # The tuned tile as a 2-CTA cluster (TileConfig.cluster: "m" shares b's tiles and their scale rows by multicast,
    # "n" a's), at 8192^3 and the example's GEMMs, beside the tuned tile alone and torch's blockwise mode.
    for m, k, n in ((8192, 8192, 8192), (16384, 2048, 2048), (16384, 2048, 5504), (16384, 2048, 512)):
        if time.time() - START > BUDGET_S:
            break
        args, want, _ = operands(m, k, n)
        here = kernel_sm90.blockwise_tile(m, n, jnp.bfloat16)
        for cluster in (None, "m", "n"):
            cfg = dataclasses.replace(here, cluster=cluster)
            if not kernel_sm90.supported(m, n, k, E4, E4, cfg):
                continue
            case(f"cluster {m}x{k}x{n} {cfg.tile_m}x{cfg.tile_n}/{cfg.wg_split} st{cfg.max_concurrent_steps} "
                 f"cluster={cluster}", direct(cfg, scale_rows=(1, 128)), args, want, 2 * m * n * k, n=30)
        torch_blockwise(f"cluster {m}x{k}x{n}", args, want, 2 * m * n * k, n=30)

if "walk" in WHAT:
    import torch

    from benchmarks.common import bench_interleaved, torch_sync

    for m, k, n in ((8192, 8192, 8192), (16384, 2048, 2048), (16384, 2048, 5504), (16384, 2048, 512),
                    (16384, 5504, 2048)):
        if time.time() - START > BUDGET_S:
            break
        args, want, _ = operands(m, k, n)
        here = kernel_sm90.blockwise_tile(m, n, jnp.bfloat16)
        fns = {}
        for walk, steps in itertools.product(("n", "m"), (here.max_concurrent_steps, 8)):
            cfg = kernel_sm90.blockwise_config(dataclasses.replace(here, grid_minor_dim=walk,
                                                                   max_concurrent_steps=steps), jnp.bfloat16)
            name = f"along {walk} st{cfg.max_concurrent_steps}" + (" (tuned)" if cfg == here else "")
            fns[name] = (direct(cfg, scale_rows=(1, 128)), args)
            print(f"walk {m}x{k}x{n} {name}: sqnr vs exact {sqnr(fns[name][0](*args), want):.1f} dB", flush=True)
        ta, tb, tsa, (_, tsb) = torch_blockwise_operands(args)  # b's scales with the padded stride

        def peer(ta=ta, tb=tb, tsa=tsa, tsb=tsb):
            return torch._scaled_mm(ta, tb, scale_a=tsa, scale_b=tsb, out_dtype=torch.bfloat16, use_fast_accum=False)

        got = jnp.asarray(peer().float().cpu().numpy())
        print(f"walk {m}x{k}x{n} torch blockwise: sqnr vs exact {sqnr(got, want):.1f} dB", flush=True)
        fns["torch"] = (peer, ())
        times = bench_interleaved(fns, n=30, reps=5, syncs={"torch": torch_sync})
        for name, ms in times.items():
            print(f"walk {m}x{k}x{n} {name:24s} {ms:8.4f} ms {2 * m * n * k / ms / 1e9:7.1f} TFLOP/s "
                  f"({times['torch'] / ms:.3f}x torch)", flush=True)
