"""DoRA benchmarks (ANCHORS.md "DoRA" table): column norm, layer forward, forward+backward, QDoRA forward.

Cases: tokens x in -> out, rank, bf16. Implementations:
  pallas             the default (gemm="auto"): Pallas column norm + Pallas fused-epilogue forward GEMM +
                     Pallas backward column reductions, cuBLAS dx
  pallas:all_pallas  as pallas, with the Pallas dx GEMM too (gemm="pallas")
  pallas:xla_gemm    Pallas column norm + XLA GEMMs on g-scaled weights: x (W g) + (x A)(s B g)
  pallas:xla_concat  Pallas column norm + one XLA GEMM over the concatenated K: [x, xA] @ [W g; s B g]
  pallas:xla_epilogue Pallas column norm + cuBLAS x W + s (x A) B, g-scale and bias fused by XLA after
  xla                the plain-jnp reference under jit (what ANCHORS' "XLA" column measures)
  peer:base_matmul   x @ W alone (the forward target is <= 1.10x this)
QDoRA rows: pallas:<fmt> (dequantised in-kernel, the default), pallas:<fmt>_swapab (Config(quant_swap_ab=True):
dequantised W as the left MMA operand), xla:<fmt> (reference: dequantises W in full, for comparison only).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from benchmarks.common import Recorder, rnd
from pallas_fused.dora import Config, column_scale, column_scale_reference, dora_dense, quantize_int8, quantize_nf4

CASES = [(512, 4096, 4096, 16), (4096, 4096, 4096, 16), (8192, 4096, 4096, 16),
         (512, 4096, 11008, 64), (4096, 4096, 11008, 64), (8192, 4096, 11008, 64)]
QUICK = [(4096, 4096, 4096, 16), (4096, 4096, 11008, 64)]
GEMMS = {"pallas": "auto", "pallas:xla_gemm": "xla", "pallas:xla_concat": "xla_concat",
         "pallas:xla_epilogue": "xla_epilogue"}


def _data(tokens, fin, fout, r):
    dt = jnp.bfloat16
    x = rnd(1, (tokens, fin), dt)
    w = rnd(2, (fin, fout), dt, scale=fin ** -0.5)
    a = rnd(3, (fin, r), dt, scale=r ** -0.5)
    b = rnd(4, (r, fout), dt, scale=0.01)
    m = jnp.linalg.norm(w.astype(jnp.float32), axis=0).astype(dt)
    dy = rnd(5, (tokens, fout), dt)
    return x, w, a, b, m, dy


def _fwdbwd(impl, gemm, scale):
    """jit of (x, W, A, B, m, dy) -> grads of x, A, B, m (W frozen)."""
    def fb(x, w, a, b, m, dy):
        _, pull = jax.vjp(lambda x, a, b, m: dora_dense(x, w, a, b, m, scale=scale, implementation=impl, gemm=gemm),
                          x, a, b, m)
        return pull(dy)
    return jax.jit(fb)


def run(rec: Recorder, quick: bool) -> None:
    scale = 2.0
    for tokens, fin, fout, r in QUICK if quick else CASES:
        case = f"{tokens}x{fin}->{fout} r{r} bf16"
        x, w, a, b, m, dy = _data(tokens, fin, fout, r)
        item = 2
        # Column norm: must read W once (plus the tiny A, B, m; writes g).
        norm_bytes = (fin * fout + fin * r + r * fout + 2 * fout) * item
        norm_flops = 2 * fin * r * fout + 3 * fin * fout
        rec.time("dora_colnorm", case, "pallas", jax.jit(lambda w, a, b, m: column_scale(
            w, a, b, m, scale=scale, implementation="pallas")), w, a, b, m, nbytes=norm_bytes, flops=norm_flops)
        rec.time("dora_colnorm", case, "xla", jax.jit(lambda w, a, b, m: column_scale_reference(
            w, a, b, m, scale)), w, a, b, m, nbytes=norm_bytes, flops=norm_flops)

        # Layer forward: the base GEMM's FLOPs plus the low-rank terms; bytes: x, W, y once.
        fwd_flops = 2 * tokens * fin * fout + 2 * tokens * r * (fin + fout) + norm_flops
        fwd_bytes = (tokens * fin + fin * fout + tokens * fout) * item
        rec.time("dora_fwd", case, "peer:base_matmul", jax.jit(lambda x, w: x @ w), x, w,
                 nbytes=fwd_bytes, flops=2 * tokens * fin * fout)
        rec.time("dora_fwd", case, "xla", jax.jit(lambda x, w, a, b, m: dora_dense(
            x, w, a, b, m, scale=scale, implementation="xla")), x, w, a, b, m, nbytes=fwd_bytes, flops=fwd_flops)
        for impl, gemm in GEMMS.items():
            rec.time("dora_fwd", case, impl, jax.jit(lambda x, w, a, b, m, gemm=gemm: dora_dense(
                x, w, a, b, m, scale=scale, implementation="pallas", gemm=gemm)), x, w, a, b, m,
                nbytes=fwd_bytes, flops=fwd_flops)

        # Forward + backward (grads of x, A, B, m; W frozen), as ANCHORS' "XLA layer fwd+bwd".
        fb_flops = fwd_flops + 2 * tokens * fin * fout + 6 * tokens * r * (fin + fout)

        rec.time("dora_fwdbwd", case, "xla", _fwdbwd("xla", "pallas", scale), x, w, a, b, m, dy, flops=fb_flops)
        for impl, gemm in {**GEMMS, "pallas:all_pallas": "pallas"}.items():
            rec.time("dora_fwdbwd", case, impl, _fwdbwd("pallas", gemm, scale), x, w, a, b, m, dy, flops=fb_flops)

        # QDoRA forward: W int8 / NF4, dequantised inside the kernels (compare with the bf16 "pallas" forward).
        for name, quantize, wbytes in (("int8", quantize_int8, fin * fout), ("nf4", quantize_nf4, fin * fout // 2)):
            qw = quantize(w)
            rec.time("qdora_fwd", case, f"pallas:{name}", jax.jit(lambda x, qw, a, b, m: dora_dense(
                x, qw, a, b, m, scale=scale, implementation="pallas")), x, qw, a, b, m,
                nbytes=(tokens * fin + tokens * fout) * item + wbytes, flops=fwd_flops)
            rec.time("qdora_fwd", case, f"pallas:{name}_swapab", jax.jit(lambda x, qw, a, b, m: dora_dense(
                x, qw, a, b, m, scale=scale, implementation="pallas", config=Config(quant_swap_ab=True))),
                x, qw, a, b, m, nbytes=(tokens * fin + tokens * fout) * item + wbytes, flops=fwd_flops)
            rec.time("qdora_fwd", case, f"xla:{name}", jax.jit(lambda x, qw, a, b, m: dora_dense(
                x, qw, a, b, m, scale=scale, implementation="xla")), x, qw, a, b, m,
                nbytes=(tokens * fin + tokens * fout) * item + wbytes, flops=fwd_flops)
