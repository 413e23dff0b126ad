"""Backs docs/performance.md's account of the GEMM parity misses: each case's kernels and the peer's, one launch each,
inside one profiler window, for Nsight Compute to read side by side.

    ncu --profile-from-start off --clock-control none --csv --page details [--section ...] \\
        python benchmarks/probes/gemm_ncu.py [CASE ...]

A CASE is `MxKxN:recipe`, recipe one of rowwise, tensorwise, blockwise (our kernel on pre-quantized operands against
torch._scaled_mm on the same bytes, as bench_fp8 times them: rowwise and tensorwise through the default path, the
sm90 kernel or, where `kernel_sm90.cublas_wins`, XLA's fp8 dot), `TOKENSxINxOUT:dora` (dora_dense's forward
at rank 16 in bf16 against the base GEMM x @ W through XLA) or `TOKENSxINxOUT:dora_fwdbwd` (its forward and
backward, W frozen, against the base layer's: x @ W and dy @ W^T). Every function is compiled and run twice before the
window opens (cudaProfilerStart / Stop through torch), so the profile holds the timed kernels only, in the order
printed on stderr.
"""

import sys

import jax
import jax.numpy as jnp

DEFAULT = ["2048x16384x5504:tensorwise", "16384x2048x512:tensorwise", "4096x4096x4096:rowwise",
           "16384x4096x11008:rowwise", "16384x2048x5504:rowwise", "8192x8192x8192:blockwise",
           "4096x4096x4096:dora"]


def _fp8(m, k, n, recipe):
    """(ours, torch's) zero-argument launches of one FP8 GEMM on the same quantized operands."""
    import functools

    import numpy as np
    import torch

    from benchmarks.bench_fp8 import E4, _to_torch, quantized_sets, torch_scaled_mm_fn
    from benchmarks.common import rnd
    from pallas_fused.fp8 import api
    from pallas_fused.fp8 import reference as ref

    a, bt = rnd(1, (m, k), jnp.bfloat16), rnd(2, (n, k), jnp.bfloat16)
    if recipe != "blockwise":
        user, vec = quantized_sets([(a, bt)], -1 if recipe == "rowwise" else None)
        ours = jax.jit(functools.partial(api._mm_nt, out_dtype=jnp.bfloat16, fast_accum=True, impl="pallas"))
        return (lambda: ours(*vec[0])), torch_scaled_mm_fn(user, recipe)
    act, wblock = (1, 128), (128, 128)
    a8, sa = ref.quantize_blockwise_reference(a, E4, act)
    b8, sb = ref.quantize_blockwise_reference(bt, E4, wblock)
    args = (a8, b8, api._step_scales(api._Operand(a8, sa.T, block=act), k),
            api._step_scales(api._Operand(b8, sb.T, block=wblock), k))
    ours = jax.jit(functools.partial(api._mm_nt_blockwise, out_dtype=jnp.bfloat16, scale_rows=(act[0], wblock[0])))
    ta, tb = _to_torch(a8), _to_torch(b8).t()
    tsa = torch.from_numpy(np.asarray(sa)).to("cuda").t().contiguous().t()
    tsb = torch.from_numpy(np.asarray(sb)).to("cuda").t()  # bench_fp8's first accepted layout, use_fast_accum=False
    return (lambda: ours(*args)), (lambda: torch._scaled_mm(ta, tb, scale_a=tsa, scale_b=tsb,
                                                            out_dtype=torch.bfloat16, use_fast_accum=False))


def _dora(tokens, fin, fout, backward=False):
    """(dora_dense, the base layer) at rank 16, bf16: forwards, or forwards and backwards (W frozen)."""
    from benchmarks.bench_dora import _data
    from pallas_fused.dora import dora_dense

    x, w, a, b, m, dy = _data(tokens, fin, fout, 16)

    def layer(x, a, b, m):
        return dora_dense(x, w, a, b, m, scale=2.0, implementation="pallas")

    if not backward:
        fwd = jax.jit(layer)
        base = jax.jit(lambda x, w: x @ w)
        return (lambda: fwd(x, a, b, m)), (lambda: base(x, w))
    fb = jax.jit(lambda x, a, b, m, dy: jax.vjp(layer, x, a, b, m)[1](dy))
    base_fb = jax.jit(lambda x, w, dy: (x @ w, dy @ w.T))
    return (lambda: fb(x, a, b, m, dy)), (lambda: base_fb(x, w, dy))


def main(cases):
    import torch

    print("jax", jax.__version__, jax.devices(), "torch", torch.__version__, file=sys.stderr, flush=True)
    launches = []
    for case in cases:
        print("setup:", case, file=sys.stderr, flush=True)  # names the case a crash before the window is in
        shape, recipe = case.split(":")
        dims = tuple(int(d) for d in shape.split("x"))
        pair = _dora(*dims, backward=recipe == "dora_fwdbwd") if recipe.startswith("dora") else _fp8(*dims, recipe)
        for who, fn in zip(("ours", "peer"), pair):
            for _ in range(2):  # compile, then one warm run outside the window
                out = fn()
            jax.block_until_ready(out) if who == "ours" else torch.cuda.synchronize()
            launches.append((f"{case} {who}", fn))
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for label, fn in launches:
        print("window:", label, file=sys.stderr, flush=True)
        out = fn()
        jax.block_until_ready(out) if isinstance(out, jax.Array) else torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main(sys.argv[1:] or DEFAULT)
