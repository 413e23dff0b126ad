"""FP8 benchmarks: scaled matmul, the quantize passes, and Dense forward+backward per recipe.

scaled_matmul (e4m3 x e4m3 -> bf16, fast accumulation), rowwise and tensorwise scales, TFLOP/s with
flops = 2 M N K, % of the datasheet dense fp8 peak (1979 TFLOP/s on H100/H200, `peak_tflops`). Every row is the
time of one GEMM amortized over k (`_sets`; the row's "k") distinct operand sets per timed call: one jit runs the k
GEMMs (jax) or one Python call issues k (torch), so the ~0.03 ms host dispatch of a jitted call does not hide a
0.03 ms GEMM, and together the sets pass the L2, so no row reads a cached operand. The large GEMMs take k = 1.
  user:scaled_matmul_nt  the row of record, what a user writes: jit(scaled_matmul_nt) on the outputs of the
                       public `quantize` (x (M, K) and w_t (N, K), axis=-1 or None: (M, 1) / (N, 1) or scalar
                       scales), default implementation
  pallas:sm90          kernel only: our Mosaic GPU kernel through the private `_mm_nt`, operands K-major
                       (a (M, K), bt (N, K): the layout the Dense path provides), scale vectors given
  pallas:sm90_pingpong  kernel only: our Mosaic GPU kernel on the ping-pong schedule (`_sm90`'s
                       TileConfig.schedule="pingpong": each compute warpgroup owns whole 128 x 128 tiles, every other
                       one of the CTA's walk, so one's epilogue overlaps the other's main loop), 128-deep K steps
                       through a 4-stage ring, the tuned tile's grid walk, no cluster, through
                       `kernel_sm90.scaled_matmul_nt` with the user's scales ((M,) / (N,) rowwise, (1,) tensorwise)
  pallas:sm90_pingpong_s6  the same with a 6-stage ring (bf16 out: 192 KiB of ring beside the epilogue's staging):
                       what the H200's tuning table gives tall GEMMs with K up to 4096 (`fp8_sm90.tall_pingpong`)
  pallas:sm90_pingpong_cluster  the 6-stage ring on 2-CTA clusters along the longer of M and N (the tile the
                       two CTAs share multicast), where the shape is a multiple of the cluster tile
  pallas:triton        our Triton-lowered kernel (the portable fallback)
  xla                  our reference: XLA's fp8 dot (fp32 out) + fp32 rescale, b (K, N)
  xla:dequantize_dot   tensorwise only: the dequantize-then-dot form XLA's GPU compiler rewrites into one fp8
                       cuBLAS call with both scales in it and a bf16 output (flax's FP8 ops take this path), in
                       place of the fp32 product and the separate rescale pass of the "xla" row (a speed row: the
                       scales are rounded to bf16 there, as flax's are, which the library's path may not do)
  peer:torch_scaled_mm torch._scaled_mm, use_fast_accum=True (cuBLAS / CUTLASS rowwise)
  peer:bf16_xla        XLA bf16 matmul, same shape

Blockwise quantize ("fp8_quantize_blockwise"): the recipe's quantize pass, "pallas" (one read of x writes q and q^T
with their 1 x 128 scales, or a weight's shared 128 x 128 tiles: an activation's two copies from
`kernel_sm90_quantize` on Hopper, the rest from `kernel.quantize_blockwise`, which "pallas:triton" times alone where
they differ) beside `reference.quantize_blockwise_reference` under jit, GB/s and % of the measured copy ceiling.

blockwise (DeepSeek-V3's recipe: a in 1 x 128 tiles, b in 128 x 128 blocks, e4m3 -> bf16), at 8192^3 and the
example's shapes, TFLOP/s as above:
  pallas:sm90_blockwise  our Mosaic GPU kernel with per-K-block promotion, through the private `_mm_nt_blockwise`
                       (operands K-major, scales as its per-K-step rows); sqnr_vs_bf16 = SQNR in dB of the output
                       against the fp32 product of the bf16 inputs
  pallas:sm90_rowwise    our rowwise kernel on the same inputs (its sqnr_vs_bf16 beside it)
  xla:blockwise        our reference: the exact fp32 product of the dequantized operands (what the recipe runs
                       off Hopper)
  peer:torch_scaled_mm_blockwise  torch._scaled_mm with 1 x 128 / 128 x 128 scales (cuBLAS >= 12.9), or its error
  fp8_dense_blockwise: the Dense forward+backward of the recipe (all three GEMMs, quantize on XLA) on the default
                       path and forced to "xla".

Dense forward+backward (the user's path: `nn.Dense(dot_general_cls=Float8DotGeneral(config=recipe))`, rows
pallas:<recipe>): 16384 tokens, n -> n, bf16 params and activations, ANCHORS.md's method:
  jax.vjp(apply, params, x)[1](g) timed under jit. Only the gradients are returned, so XLA drops
  the forward GEMM (y is unused): what is timed is the two backward GEMMs plus every quantize pass,
  for ours and the peers alike. The "+y" cases also return y (all three GEMMs).

Sections (FP8_SECTIONS, comma-separated; default all): matmul, quantize, blockwise_quantize, blockwise, dense
(FP8_SECTIONS=blockwise: the blockwise GEMM rows alone, with the recipe's Dense forward+backward).
FP8_SHAPES (comma-separated M x K x N, e.g. 2048x16384x512) runs the matmul section at those shapes only.
"""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp

from benchmarks.common import amortized, bench_torch, error_text, rnd, torch_sync

FP8_PEAK = 1979.0  # datasheet dense fp8 TFLOP/s (H100 SXM / H200)
L2_PASS_BYTES = 100e6  # operand sets of one timed call pass the 50 MB L2 together (see `_sets`)
E4 = jnp.float8_e4m3fn
# (M, K, N): the shapes, then the example's (examples/train_llama.py's GPU preset: 16 x 1024 tokens,
# d_model 2048, 4 kv heads of 128, SwiGLU 5504): forward x W, dx = dy W^T, dW = x^T dy of each projection.
SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (16384, 16384, 16384), (16384, 4096, 11008),
          (16384, 11008, 4096), (16384, 2048, 5504),
          (16384, 2048, 2048), (16384, 2048, 512), (16384, 5504, 2048), (16384, 512, 2048),
          (2048, 16384, 2048), (2048, 16384, 512), (2048, 16384, 5504), (5504, 16384, 2048)]


def _to_torch(x8):
    """An fp8 jax array on the CUDA device as torch.float8_e4m3fn: its bytes moved as uint8 and reinterpreted (no
    float round trip)."""
    import numpy as np
    import torch

    raw = np.asarray(jax.lax.bitcast_convert_type(x8, jnp.uint8))
    return torch.from_numpy(raw).to("cuda").view(torch.float8_e4m3fn)


def _sets(m, k, n):
    """How many distinct operand sets one timed call cycles through: enough that they pass the 50 MB L2 together
    (k calls of a small GEMM then read HBM, as a training step's do), at most 8; 1 for the large GEMMs."""
    return min(8, max(1, math.ceil(L2_PASS_BYTES / (m * k + n * k + 2 * m * n))))


def operand_pairs(m, k, n, count):
    """`count` distinct bf16 operand pairs (a (M, K), w_t (N, K)) of one GEMM shape."""
    return [(rnd(10 * i + 1, (m, k), jnp.bfloat16), rnd(10 * i + 2, (n, k), jnp.bfloat16)) for i in range(count)]


def quantized_sets(pairs, axis):
    """The user's operand sets, `quantize` of each pair along `axis` (-1 rowwise, None tensorwise): (a8, bt8, sa, sb)
    with sa (M, 1) / (N, 1) or scalar scales; and the same with the scales as (M,) / (N,) vectors, as the kernel-only
    rows take them."""
    from pallas_fused.fp8 import quantize

    user_sets, vec_sets = [], []
    for a, wt in pairs:
        a8, sa = quantize(a, E4, axis)
        bt8, sb = quantize(wt, E4, axis)
        user_sets.append((a8, bt8, sa, sb))
        vec_sets.append((a8, bt8, jnp.broadcast_to(sa.reshape(-1), a.shape[:1]),
                         jnp.broadcast_to(sb.reshape(-1), wt.shape[:1])))
    return user_sets, vec_sets


def dequantize_dot(a8, bt8, sa, sb):
    """(a8 * sa) @ (bt8 * sb)^T in bf16 with scalar scales: the dequantize-then-dot that XLA's GPU compiler rewrites
    into one fp8 GEMM with the scales in it."""
    a = a8.astype(jnp.bfloat16) * sa.astype(jnp.bfloat16)
    b = bt8.astype(jnp.bfloat16) * sb.astype(jnp.bfloat16)
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16)


def pingpong_configs(m, n, k):
    """The ping-pong rows' configurations at an (M, K) x (N, K) GEMM (`fp8.kernel_sm90.pingpong_tiles`, what the
    tuner times too): 128 x 128 x 128 tiles walked as the tuned tile walks that shape, 4 and 6 ring stages, and 6 on
    a 2-CTA cluster along the longer side; each only where the shape is a multiple of its (cluster) tile."""
    from pallas_fused.fp8 import kernel_sm90

    return {f"pallas:{name}": config for name, config in kernel_sm90.pingpong_tiles(m, n, k).items()}


def _matmul(rec, quick):
    from pallas_fused import _tuning
    from pallas_fused.fp8 import api, gemm, kernel, kernel_sm90, scaled_matmul_nt

    shapes = SHAPES if quick else SHAPES + [(16384, 4096, 4096)]
    only = os.environ.get("FP8_SHAPES")  # e.g. "2048x16384x512,8192x8192x8192" (M x K x N): a subset
    if only:
        shapes = [tuple(int(d) for d in name.split("x")) for name in only.split(",")]
    for m, k, n in shapes:
        count = _sets(m, k, n)
        hp = operand_pairs(m, k, n, count)
        flops = 2 * m * n * k
        # ~10 ms of GPU work per timed batch (at ~1300 TFLOP/s), so the small GEMMs (0.03-0.1 ms) are not noise.
        calls = max(3 if quick else 10, min(200, int(10e-3 * 1300e12 / flops)) // count)
        n_rep = dict(n=calls, reps=3 if quick else 5)
        for gran in ("rowwise", "tensorwise"):
            axis = -1 if gran == "rowwise" else None
            user_sets, vec_sets = quantized_sets(hp, axis)
            case = f"{m}x{k}x{n} {gran}"
            sm90 = functools.partial(api._mm_nt, out_dtype=jnp.bfloat16, fast_accum=True, impl="pallas:sm90")
            # the reference: XLA's fp8 dot (cuBLASLt) to fp32, then an fp32 rescale pass
            xla = functools.partial(api._mm_nt, out_dtype=jnp.bfloat16, fast_accum=True, impl="xla")
            # each timed call runs the k operand sets (one jit for ours, k calls for torch); the candidates in turn
            # what plain "pallas" runs there: the tuning tables' choice (pallas_fused.tune), else the rule
            tuned = _tuning.choice(gemm.GEMM_OP, gemm.gemm_key(m, k, n, E4, jnp.bfloat16, axis == -1, axis == -1))
            cands = {"user:scaled_matmul_nt": (amortized(scaled_matmul_nt), (user_sets,),
                                               dict(tile=str(kernel_sm90.config_for(m, n, k)),
                                                    choice=tuned["choice"] if tuned else "rule")),
                     "pallas:sm90": (amortized(sm90), (vec_sets,), dict(layout="a (M,K), bt (N,K)")),
                     "xla": (amortized(xla), (vec_sets,), {})}
            # the ping-pong schedule, with the scales as the user's path passes them (a tensorwise one as (1,))
            f32 = jnp.float32
            pp_sets = [(a8, bt8, jnp.reshape(sa, (-1,)).astype(f32), jnp.reshape(sb, (-1,)).astype(f32))
                       for a8, bt8, sa, sb in user_sets]
            if gran == "tensorwise":
                cands["xla:dequantize_dot"] = (amortized(dequantize_dot), (user_sets,), {})
            for name, config in pingpong_configs(m, n, k).items():
                pp = functools.partial(kernel_sm90.scaled_matmul_nt, out_dtype=jnp.bfloat16, config=config)
                cands[name] = (amortized(pp), (pp_sets,), dict(tile=str(config)))
            if m == 8192 or (not quick and m * n * k <= 8192**3):  # the portable fallback: ~3.5x slower
                tri = functools.partial(kernel.scaled_matmul_nt, out_dtype=jnp.bfloat16)
                cands["pallas:triton"] = (amortized(tri), (vec_sets,), {})
            try:  # torch._scaled_mm over the same operand sets, use_fast_accum=True
                cands["peer:torch_scaled_mm"] = (torch_scaled_mm_fn(user_sets, gran), (), {})
            except Exception as e:  # noqa: BLE001 - a missing peer is a recorded result
                rec.add("fp8_mm", case, "peer:torch_scaled_mm", None, error=error_text(e))
            rec.time_interleaved("fp8_mm", case, cands, calls=count, syncs={"peer:torch_scaled_mm": torch_sync},
                                 k=count, flops=flops, matmul_ceiling="fp8_peak", peak_tflops=FP8_PEAK, **n_rep)
            if gran == "rowwise" and not quick:
                rec.time_amortized("fp8_mm", case, "peer:bf16_xla", lambda a, wt: a @ wt.T, hp, flops=flops, **n_rep)


def torch_scaled_mm_fn(sets, gran):
    """A function running torch._scaled_mm once on each of the user's operand sets (a8, bt8, sa, sb: quantize's
    outputs, scalar scales tensorwise, (rows, 1) rowwise), bf16 out, use_fast_accum=True; it returns the outputs."""
    import numpy as np
    import torch

    dev = "cuda"

    def scales(sa, sb):
        if gran == "rowwise":
            return (torch.from_numpy(np.asarray(sa)).to(dev).reshape(-1, 1).contiguous(),
                    torch.from_numpy(np.asarray(sb)).to(dev).reshape(1, -1).contiguous())
        return torch.tensor(float(sa), device=dev), torch.tensor(float(sb), device=dev)

    # b column-major (K, N) (bt.t()), what _scaled_mm wants
    tsets = [(_to_torch(a8), _to_torch(bt8).t(), *scales(sa, sb)) for a8, bt8, sa, sb in sets]

    def fn():
        return [torch._scaled_mm(ta, tb, scale_a=tsa, scale_b=tsb, out_dtype=torch.bfloat16, use_fast_accum=True)
                for ta, tb, tsa, tsb in tsets]

    return fn


def _quantize(rec, quick):
    from pallas_fused.fp8 import kernel, reference

    r, c = 16384, 8192
    x = rnd(3, (r, c), jnp.bfloat16)
    for axis in (None, 1, 0):
        for emit_t in (True,) if quick else (False, True):
            case = f"{r}x{c} bf16 axis={axis} {'q+qT' if emit_t else 'q'}"
            written = r * c * (2 if emit_t else 1)
            nbytes = 2 * r * c + written  # the floor: read x once, write the fp8 copies
            f = jax.jit(functools.partial(kernel.quantize_2d, dtype=E4, axis=axis, power_of_2=True, emit_t=emit_t))
            rec.time("fp8_quantize", case, "pallas:two_phase", f, x, nbytes=nbytes, bytes_moved=nbytes + 2 * r * c,
                     note="two reads of x (amax, cast)")

            def ref(x, axis=axis, emit_t=emit_t):
                q, s = reference.quantize_reference(x, E4, axis, True)
                return (q, q.T, s) if emit_t else (q, s)

            rec.time("fp8_quantize", case, "xla", jax.jit(ref), x, nbytes=nbytes)


def _blockwise_quantize(rec, quick):
    """The one-pass blockwise quantize beside XLA's reference under jit, at the example's activation shape and a
    weight: bytes = read x + write q (+ q^T) + the fp32 scales. "pallas" is what the recipe's layers call (the api's
    "pallas" path: both copies from the Hopper kernel where it runs, else the Triton kernel); "pallas:triton" the
    Triton kernel by itself where that differs. Amortized (`time_amortized`): each timed call quantizes k distinct
    inputs, together past the L2, so a 0.05 ms pass does not time the host's dispatch."""
    from pallas_fused.fp8 import api, kernel

    act, weight = (1, 128), (128, 128)
    shapes = [(16384, 2048), (16384, 8192)] + ([] if quick else [(16384, 5504), (2048, 5504)])
    for (r, c), dtype in [(s, jnp.bfloat16) for s in shapes] + ([] if quick else [((16384, 2048), jnp.float32)]):
        size = r * c * jnp.dtype(dtype).itemsize
        xs = [(rnd(6 + i, (r, c), dtype),) for i in range(max(2, -(-200 * 2**20 // size)))]
        cases = [("act q+qT", act, act[::-1], r * c * 2 + 4 * (r * -(-c // 128) + c * -(-r // 128))),
                 ("act q", act, None, r * c + 4 * r * -(-c // 128)),
                 ("weight q+qT", weight, weight, 2 * r * c + 4 * -(-r // 128) * -(-c // 128))]
        for name, block_n, block_t, written in cases:
            case = f"{r}x{c} {jnp.dtype(dtype).name} {name}"
            nbytes = size + written
            ours = functools.partial(api._quantize_blockwise, block_n=block_n, block_t=block_t, dtype=E4, pow2=False,
                                     impl="pallas")
            rec.time_amortized("fp8_quantize_blockwise", case, "pallas", ours, xs, nbytes=nbytes)
            if api._quantize_on_sm90(xs[0][0], block_n, block_t):
                triton = functools.partial(kernel.quantize_blockwise, dtype=E4, block_n=block_n, block_t=block_t)
                rec.time_amortized("fp8_quantize_blockwise", case, "pallas:triton", triton, xs, nbytes=nbytes)

            # the same outputs from the reference (the api's "xla" path: a shared tile quantized once)
            ref = functools.partial(api._quantize_blockwise, block_n=block_n, block_t=block_t, dtype=E4, pow2=False,
                                    impl="xla")
            rec.time_amortized("fp8_quantize_blockwise", case, "xla", ref, xs, nbytes=nbytes)


def _dense(rec, quick):
    import flax.linen as nn
    from flax.linen import fp8_ops

    from pallas_fused.fp8 import Float8DotGeneral

    tokens = 16384
    for n in (8192,) if quick else (4096, 8192):
        x, g = rnd(4, (tokens, n), jnp.bfloat16), rnd(5, (tokens, n), jnp.bfloat16)
        flops = 2 * 2 * tokens * n * n  # the two GEMMs that survive (see the module docstring)
        impls = [(f"pallas:{r}", functools.partial(Float8DotGeneral, config=r)) for r in
                 ("tensorwise", "rowwise", "rowwise_with_gw_hp")]
        if not quick:
            impls += [(f"xla:{r}", functools.partial(Float8DotGeneral, config=r, implementation="xla"))
                      for r in ("tensorwise", "rowwise")]
        impls += [("peer:bf16_dense", None), ("peer:flax_fp8_direct", fp8_ops.Fp8DirectDotGeneralOp)]
        for name, cls in impls:
            m = nn.Dense(n, use_bias=False, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, dot_general_cls=cls)
            v = m.init(jax.random.key(0), x[:8])

            def fb(v, x, m=m, g=g):
                _, vjp = jax.vjp(lambda v, x: m.apply(v, x), v, x)
                return vjp(g)

            def fby(v, x, m=m, g=g):
                y, vjp = jax.vjp(lambda v, x: m.apply(v, x), v, x)
                return y, vjp(g)

            n_rep = dict(n=10, reps=3) if quick else dict(n=20, reps=5)
            rec.time("fp8_dense", f"{tokens}x{n}->{n} fwd+bwd", name, jax.jit(fb), v, x, flops=flops, **n_rep)
            if not quick or name in ("pallas:tensorwise", "peer:bf16_dense"):
                rec.time("fp8_dense", f"{tokens}x{n}->{n} fwd+bwd +y", name, jax.jit(fby), v, x,
                         flops=flops * 3 // 2, **n_rep)


BLOCKWISE_SHAPES = [(8192, 8192, 8192), (16384, 2048, 2048), (16384, 2048, 512), (16384, 2048, 5504),
                    (16384, 5504, 2048)]


def _sqnr(out, exact) -> float:
    out, exact = out.astype(jnp.float32), exact.astype(jnp.float32)
    return float(10 * jnp.log10(jnp.sum(exact ** 2) / jnp.sum((out - exact) ** 2)))


def _blockwise(rec, quick):
    from pallas_fused.fp8 import api, fp8_linear, kernel_sm90
    from pallas_fused.fp8 import reference as ref

    act, wblock = (1, 128), (128, 128)
    for m, k, n in BLOCKWISE_SHAPES:
        count = _sets(m, k, n)
        hp = [(rnd(10 * i + 6, (m, k), jnp.bfloat16), rnd(10 * i + 7, (n, k), jnp.bfloat16)) for i in range(count)]
        exact = jax.jit(ref.matmul_nt_fp32, static_argnums=2)(*hp[0], jnp.float32)
        flops = 2 * m * n * k
        calls = max(3 if quick else 10, min(200, int(10e-3 * 1300e12 / flops)) // count)
        kw = dict(flops=flops, matmul_ceiling="fp8_peak", peak_tflops=FP8_PEAK, n=calls, reps=3 if quick else 5)
        case = f"{m}x{k}x{n} blockwise"
        ref_sets, kernel_sets, row_sets = [], [], []
        for a, bt in hp:
            a8, sa = ref.quantize_blockwise_reference(a, E4, act)
            b8, sb = ref.quantize_blockwise_reference(bt, E4, wblock)
            ref_sets.append((a8, b8, sa, sb))
            kernel_sets.append((a8, b8, api._step_scales(api._Operand(a8, sa.T, block=act), k),
                                api._step_scales(api._Operand(b8, sb.T, block=wblock), k)))
            ar8, sar = ref.quantize_reference(a, E4, 1, True)
            br8, sbr = ref.quantize_reference(bt, E4, 1, True)
            row_sets.append((ar8, br8, sar.reshape(-1), sbr.reshape(-1)))
        # The weight's 128 x 128 blocks: one scale covers 128 rows of bt, as fp8_linear tells the kernel.
        ours = functools.partial(api._mm_nt_blockwise, out_dtype=jnp.bfloat16, scale_rows=(act[0], wblock[0]))
        rowwise = functools.partial(api._mm_nt, out_dtype=jnp.bfloat16, fast_accum=True, impl="pallas:sm90")
        tile = str(kernel_sm90.blockwise_tile(m, n, jnp.bfloat16))
        for impl, fn, sets, extra in (("pallas:sm90_blockwise", ours, kernel_sets, dict(tile=tile)),
                                      ("pallas:sm90_rowwise", rowwise, row_sets, {})):
            try:
                extra = dict(extra, sqnr_vs_bf16=_sqnr(jax.jit(fn)(*sets[0]), exact))
            except Exception as e:  # noqa: BLE001 - the timing below records the failure
                extra = dict(extra, sqnr_error=error_text(e))
            rec.time_amortized("fp8_mm", case, impl, fn, sets, **extra, **kw)
        xla = functools.partial(ref.blockwise_scaled_matmul_nt_reference, a_block=act, b_block=wblock)
        rec.time_amortized("fp8_mm", case, "xla:blockwise", xla, ref_sets[:1], **{**kw, "n": 3})
        _torch_blockwise(rec, case, *ref_sets[0], exact, kw)
    for tokens, width in ((16384, 2048),) if quick else ((16384, 2048), (16384, 8192)):
        x, w, g = rnd(8, (tokens, width), jnp.bfloat16), rnd(9, (width, width), jnp.bfloat16), rnd(
            10, (tokens, width), jnp.bfloat16)
        for name, impl in (("pallas:blockwise", None), ("xla:blockwise", "xla")):
            def fby(x, w, impl=impl, g=g):
                y, vjp = jax.vjp(lambda x, w: fp8_linear(x, w, "blockwise", implementation=impl), x, w)
                return y, vjp(g)

            rec.time("fp8_dense_blockwise", f"{tokens}x{width}->{width} fwd+bwd +y", name, jax.jit(fby), x, w,
                     flops=3 * 2 * tokens * width * width, n=10 if quick else 20, reps=3 if quick else 5)


def _torch_blockwise(rec, case, a8, b8, sa, sb, exact, kw):
    """torch._scaled_mm with 1 x 128 scales for a ((M, K / 128), outer-dim-major) and 128 x 128 ones for b, as
    pytorch's test_scaled_matmul_cuda.py passes them; a refusal is recorded with its error text."""
    extra = {k: v for k, v in kw.items() if k not in ("n", "reps")}
    try:
        import numpy as np
        import torch

        dev = "cuda"
        ta, tb = _to_torch(a8), _to_torch(b8).t()  # b column-major (K, N)
        tsa = torch.from_numpy(np.asarray(sa)).to(dev).t().contiguous().t()  # (M, K / 128), stride (1, M)
        tsb = torch.from_numpy(np.asarray(sb)).to(dev)  # (N / 128, K / 128)
        kb = tsb.shape[1]
        padded = torch.nn.functional.pad(tsb, (0, -kb % 4))[:, :kb]  # cuBLAS: the K-block count padded to 4
        errors = []
        for fast_accum in (False, True):
            for scale_b in (tsb.t(), padded.t()):
                def fn(scale_b=scale_b, fast_accum=fast_accum):
                    return torch._scaled_mm(ta, tb, scale_a=tsa, scale_b=scale_b, out_dtype=torch.bfloat16,
                                            use_fast_accum=fast_accum)
                try:
                    out = fn()
                except Exception as e:  # noqa: BLE001 - try the next layout
                    errors.append(error_text(e))
                    continue
                got = jnp.asarray(out.float().cpu().numpy())
                ms = bench_torch(fn, n=kw["n"], reps=kw["reps"])
                rec.add("fp8_mm", case, "peer:torch_scaled_mm_blockwise", ms, sqnr_vs_bf16=_sqnr(got, exact),
                        use_fast_accum=fast_accum, **extra)
                return
        rec.add("fp8_mm", case, "peer:torch_scaled_mm_blockwise", None, error=" | ".join(errors), **extra)
    except Exception as e:  # noqa: BLE001 - a missing peer is a recorded result
        rec.add("fp8_mm", case, "peer:torch_scaled_mm_blockwise", None, error=error_text(e), **extra)


SECTIONS = {"matmul": "_matmul", "quantize": "_quantize", "blockwise_quantize": "_blockwise_quantize",
            "blockwise": "_blockwise", "dense": "_dense"}


def run(rec, quick: bool):
    """All sections, or those named (comma-separated) in $FP8_SECTIONS."""
    for name in os.environ.get("FP8_SECTIONS", ",".join(SECTIONS)).split(","):
        if name not in SECTIONS:
            raise ValueError(f"FP8_SECTIONS: unknown section {name!r}; known: {list(SECTIONS)}")
        globals()[SECTIONS[name]](rec, quick)
