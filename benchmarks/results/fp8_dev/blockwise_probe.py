"""Blockwise FP8 GEMM on Hopper (dev probe): compile, check against the exact reference, time.

python -m benchmarks.results.fp8_dev.blockwise_probe [small|large|shapes|sweep|dense ...]   (default: all)

small: 256x512x384 with every tile config that takes it; large: 8192^3 with the api's tile; shapes: the example's
GEMMs through the api (padding included); sweep: tile / stage variants at 8192^3; dense: the blockwise Dense
forward+backward (implementation None vs "xla"). Each case prints its SQNR against the exact fp32 product of the
dequantized operands (and against the bf16 inputs' product), its time and TFLOP/s, or the full traceback of its
failure, and the probe goes on to the next case.
"""
import dataclasses
import functools
import sys
import traceback

import jax
import jax.numpy as jnp

from benchmarks.common import bench, rnd
from pallas_fused.fp8 import api, fp8_linear, kernel_sm90
from pallas_fused.fp8 import reference as ref

E4 = jnp.float8_e4m3fn
WHAT = sys.argv[1:] or ["small", "large", "shapes", "sweep", "dense"]


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
    try:
        out = jax.block_until_ready(fn(*args))
        msg = f"sqnr vs exact {sqnr(out, want):6.1f} dB"
        if bf16 is not None:
            msg += f", vs bf16 {sqnr(out, ref.matmul_nt_fp32(*bf16, jnp.float32)):5.1f} dB"
        ms = bench(fn, *args, n=n, reps=3)
        print(f"{label:60s} {msg}  {ms:8.4f} ms {flops / ms / 1e9:7.1f} TFLOP/s", flush=True)
    except Exception:  # noqa: BLE001 - the traceback is the result
        print(f"{label:60s} FAILED", flush=True)
        traceback.print_exc()
        sys.stdout.flush()


def direct(config, out_dtype=jnp.bfloat16):
    return jax.jit(functools.partial(kernel_sm90.blockwise_matmul_nt, out_dtype=out_dtype, config=config))


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
