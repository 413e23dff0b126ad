"""DoRA benchmarks (ANCHORS.md "DoRA" table): column norm, layer forward, forward+backward, QDoRA forward.

Cases: tokens x in -> out, rank, bf16. Implementations:
  user:DoRADense     (fwd+bwd) the row of record: the linen `DoRADense` layer applied under jit, grads of x, A, B
                     and m (W frozen), every option at its default
  pallas             the default (impls.choose: "sm90" on a Hopper GPU where the shapes fit its tiles, else
                     "merged" or "epilogue" by a byte count); the column norm (or the merge pass) and the backward
                     column reductions are Pallas in every variant
  pallas:sm90        the column norm's read-only pass over W, then our Mosaic GPU GEMM (x W + (x A)(s B)) g + bias
                     (the low-rank product in its accumulator, g and the bias in its epilogue); backward
                     dx = (dy g) W^T + ((dy g)(s B)^T) A^T as one such GEMM, dy g written by the column launch.
                     fwdbwd configuration: pallas:sm90_cols_registers (ColumnsConfig(mma_sums=False): the column
                     launch's register path)
  lora:pallas        the same layer as plain LoRA, x W + s (x A) B (dora.lora_dense): on Hopper the sm90 GEMM
                     with the low-rank step both ways; lora:xla its XLA dots. What DoRA costs over LoRA.
  pallas:gemm        (fwdbwd) Pallas GEMMs both ways: the fused-epilogue forward and the Pallas dx GEMM
  xla                the plain-jnp reference under jit (what ANCHORS' "XLA" column measures)
  peer:base_matmul   x @ W alone (the forward target is <= 1.10x this); fwdbwd: x @ W and dx = dy W^T
  pallas:epilogue    cuBLAS x W, then one Pallas pass (x W + s (x A) B) * g + bias
  pallas:merged      the norm launch (partial sums over row ranges), one Pallas pass that finishes g and forms
                     (W + s A B) * g, then cuBLAS x (that); the backward's dx = dy (that)^T
QDoRA rows: pallas:<fmt> (dequantised in-kernel, the default: "sm90_dequant" for int8 on Hopper, the "gemm"
variant otherwise), pallas:int8_gemm (the Triton "gemm" variant), pallas:int8_merged (a transient merged weight,
then cuBLAS), xla:<fmt> (reference: dequantises W in full, for comparison only).

Floors (bf16, 4096 tokens, 4096 -> 4096, r16; HBM ~4.1 TB/s, cuBLAS x W 0.1895 ms on the H200):
  column norm: read W once, 32 MiB -> 0.008 ms. Timed amortized (see `norm_rows`).
  forward ("merged"): x W' on cuBLAS (0.19 ms) + the norm (read W: 8 us) + forming W' = (W + s A B) g (write W:
    8 us; its read of W hits L2 when W (32 MiB) fits the 50 MiB L2) = 0.206 ms = 1.09x the base matmul. At
    4096 -> 11008 (88 MiB, past L2): 0.496 + 22 + 44 us = 1.13x: the 1.10x target is out of reach for any
    cuBLAS-based forward there at 4096 tokens (it needs W' or an epilogue pass over y, both ~2 x 88 MiB).
  backward ("merged"): dx = dy W'^T on cuBLAS with W' kept from the forward (0.19 ms; memory: one bf16 copy of W
    per layer), then us = dy (s g B)^T (read dy), x A (read x), one Pallas pass over dy and y for dB, dm, dbias
    (xa^T dy, sum dy (y - bias)), dA = x^T us (read x): 5 x 32 MiB = 40 us. The fewest bytes any schedule needs
    is x, dy, y once each (24 us) - a single pass over tokens that also reduces over columns (us) and rows (dA)
    needs grid-wide reductions (atomics) - so fwd + bwd >= 0.19 + 0.19 + 16 + 24 us = 0.42 ms, against the
    0.43 ms target; with the separate passes above, ~0.44 ms.
  forward ("sm90"): our GEMM with the low-rank step (x W + (x A)(s B): one more wgmma per tile) + the column
    norm's read of W (8 us) + x A (read x: 8 us at 4096 tokens) = 1.09x at best; W + s A B is never written.
  512 tokens: the base matmul takes ~0.03 ms, so 1.10x leaves 3 us for everything else, less than the norm's
    own floor (8 us): out of reach at that size by construction.

Sections (DORA_SECTIONS, comma-separated; default main_cases,qdora,tuning): main_cases (the ANCHORS rows; --quick:
the 4096-token cases), qdora (QDoRA int8 / NF4 forward and forward+backward with peak memory, beside bf16 DoRA,
LoRA and the base GEMM at 4096 / 8192 tokens), tune_norm (column-norm candidates, amortized), tune_modes (the
cuBLAS-based variants per token count), tune_variants (Config variants of "pallas:merged" at 4096 tokens), tuning
(the three under one budget), parts (each launch of the merged forward + backward alone).
DORA_TUNE_BUDGET_S bounds each tuning section (what does not fit is recorded as skipped).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time

import jax
import jax.numpy as jnp

from benchmarks.common import Recorder, amortized, error_text, rnd
from pallas_fused.dora import (
    ColumnsConfig,
    Config,
    MergeConfig,
    NormConfig,
    NormTiles,
    column_scale,
    column_scale_reference,
    dora_dense,
    lora_dense,
    quantize_int8,
    quantize_nf4,
)

CASES = [(512, 4096, 4096, 16), (4096, 4096, 4096, 16), (8192, 4096, 4096, 16),
         (512, 4096, 11008, 64), (4096, 4096, 11008, 64), (8192, 4096, 11008, 64)]
QUICK = [(4096, 4096, 4096, 16), (4096, 4096, 11008, 64)]
IMPLS = ["pallas", "pallas:sm90", "pallas:epilogue", "pallas:merged"]
SM90_FWDBWD_CONFIGS = {"pallas:sm90_cols_registers": Config(columns=ColumnsConfig(mma_sums=False))}


def _wanted(names):
    """`names` restricted to the implementations named in DORA_IMPLS (comma-separated; unset: all)."""
    wanted = os.environ.get("DORA_IMPLS")
    return [k for k in names if wanted is None or k in wanted.split(",")]


def _data(tokens, fin, fout, r, seed=0):
    dt = jnp.bfloat16
    x = rnd(seed + 1, (tokens, fin), dt)
    w = rnd(seed + 2, (fin, fout), dt, scale=fin ** -0.5)
    a = rnd(seed + 3, (fin, r), dt, scale=r ** -0.5)
    b = rnd(seed + 4, (r, fout), dt, scale=0.01)
    m = jnp.linalg.norm(w.astype(jnp.float32), axis=0).astype(dt)
    dy = rnd(seed + 5, (tokens, fout), dt)
    return x, w, a, b, m, dy


AMORTIZE_TOKENS = 512  # layer rows at this many tokens or fewer are timed amortized over 4 distinct layers


class _LayerGroup:
    """The layer rows of one op and case, timed together: `add(impl, fn, n_args, **kw)` collects fn(*set[:n_args])
    (one call on the first (x, w, a, b, m, dy) set, or amortized over all of them when there are several, each with
    its own W: nothing per-weight is shared, k beside the row), `time()` times them in turn (`time_interleaved`): the
    first of several ~0.2 ms layers timed one after another can run slower than the same call later, which would
    tilt the ratios between them (DoRA over the base GEMM, over LoRA)."""

    def __init__(self, rec, op, case, sets):
        self.rec, self.op, self.case, self.sets, self.candidates = rec, op, case, sets, {}

    def add(self, impl, fn, n_args, **kw):
        args = [s[:n_args] for s in self.sets]
        if len(self.sets) == 1:
            self.candidates[impl] = (jax.jit(fn), tuple(args[0]), kw)
        else:
            self.candidates[impl] = (amortized(fn), (args,), dict(kw, k=len(args)))

    def time(self):
        self.rec.time_interleaved(self.op, self.case, self.candidates, calls=len(self.sets))


AMORTIZE_BYTES = 256e6  # column norm: k distinct weights per jit, together well past the 50 MB L2


def _norm_sets(fin, fout, r):
    """k (W, A, B, m) sets for amortized column-norm timing: k * W bytes >= AMORTIZE_BYTES (k = 8 at 4096^2, 4 at
    4096 x 11008). Every set distinct (A, B too: XLA would otherwise compute a shared A B once for all k)."""
    k = max(4, math.ceil(AMORTIZE_BYTES / (fin * fout * 2)))
    ws, as_, bs, ms = [], [], [], []
    for i in range(k):
        w = rnd(20 + i, (fin, fout), jnp.bfloat16, scale=fin ** -0.5)
        ws.append(w)
        as_.append(rnd(40 + i, (fin, r), jnp.bfloat16, scale=r ** -0.5))
        bs.append(rnd(60 + i, (r, fout), jnp.bfloat16, scale=0.01))
        ms.append(jnp.linalg.norm(w.astype(jnp.float32), axis=0).astype(jnp.bfloat16))
    return list(zip(ws, as_, bs, ms))


# Every forward+backward below returns the layer's output with the gradients, as a training step consumes it: with
# the gradients alone XLA drops whatever of the forward the backward does not need (all of x @ W for the base GEMM and
# plain LoRA, whose backward needs only x, dy and the weights), and the row would time the backward alone.
def _with_output(f, *args, dy):
    y, pull = jax.vjp(f, *args)
    return y, pull(dy)


def _fwdbwd(impl, scale, config=None):
    """jit of (x, W, A, B, m, dy) -> (y, grads of x, A, B, m) (W frozen)."""
    def fb(x, w, a, b, m, dy):
        return _with_output(lambda x, a, b, m: dora_dense(x, w, a, b, m, scale=scale, implementation=impl,
                                                          config=config), x, a, b, m, dy=dy)
    return jax.jit(fb)


def _base_fwdbwd(x, w, a, b, m, dy):
    """x @ W and its dx (W frozen): the two GEMMs every adapter layer pays."""
    del a, b, m
    return _with_output(lambda x: x @ w, x, dy=dy)


def _lora_fwdbwd(impl, scale):
    """jit of (x, W, A, B, m, dy) -> (y, grads of x, A, B) for plain LoRA (W frozen; m unused)."""
    def fb(x, w, a, b, m, dy):
        del m
        return _with_output(lambda x, a, b: lora_dense(x, w, a, b, scale=scale, implementation=impl), x, a, b, dy=dy)
    return jax.jit(fb)


def _module_fwdbwd(scale):
    """The user's path: the linen `DoRADense` (no bias, W frozen) forward+backward under jit, the same grads."""
    from pallas_fused.dora import DoRADense

    def fb(x, w, a, b, m, dy):
        rank = a.shape[1]
        layer = DoRADense(features=w.shape[1], rank=rank, alpha=scale * rank, use_bias=False, dtype=x.dtype,
                          param_dtype=w.dtype)
        return _with_output(lambda x, a, b, m: layer.apply(
            {"params": {"kernel": w, "lora_a": a, "lora_b": b, "magnitude": m}}, x), x, a, b, m, dy=dy)
    return jax.jit(fb)


def norm_rows(rec, case, fin, fout, r, scale):
    """dora_colnorm rows: ours and XLA amortized (the numbers to read: "pallas", "xla") and single-call.

    The column norm must read W once (plus the tiny A, B, m; it writes g). Timed amortized (k distinct weights in
    one jit, / k): a single call of a ~0.01-0.04 ms op measures the ~0.03 ms host dispatch. The single-call rows
    are kept for comparison with ANCHORS (its XLA 0.042 ms was timed single-call by peers_jax.py).
    """
    norm_bytes = (fin * fout + fin * r + r * fout + 2 * fout) * 2
    norm_flops = 2 * fin * r * fout + 3 * fin * fout
    sets = _norm_sets(fin, fout, r)
    ours = lambda w, a, b, m: column_scale(w, a, b, m, scale=scale, implementation="pallas")  # noqa: E731
    theirs = lambda w, a, b, m: column_scale_reference(w, a, b, m, scale)  # noqa: E731
    rec.time_amortized("dora_colnorm", case, "pallas", ours, sets, nbytes=norm_bytes, flops=norm_flops)
    rec.time_amortized("dora_colnorm", case, "xla", theirs, sets, nbytes=norm_bytes, flops=norm_flops)
    one = sets[0]
    rec.time("dora_colnorm", case, "pallas:single_call", jax.jit(ours), *one, nbytes=norm_bytes, flops=norm_flops)
    rec.time("dora_colnorm", case, "xla:single_call", jax.jit(theirs), *one, nbytes=norm_bytes, flops=norm_flops)
    return norm_flops


def main_cases(rec: Recorder, quick: bool) -> None:
    scale = 2.0
    normed = set()
    for tokens, fin, fout, r in QUICK if quick else CASES:
        case = f"{tokens}x{fin}->{fout} r{r} bf16"
        item = 2
        norm_flops = 2 * fin * r * fout + 3 * fin * fout
        if (fin, fout, r) not in normed:  # once per weight shape (the column norm does not see the tokens)
            normed.add((fin, fout, r))
            norm_rows(rec, f"{fin}->{fout} r{r} bf16", fin, fout, r, scale)
        # At few tokens a layer takes ~0.03-0.1 ms, near the ~0.03 ms host dispatch of one call: amortized there.
        sets = [_data(tokens, fin, fout, r, seed=10 * i) for i in range(4 if tokens <= AMORTIZE_TOKENS else 1)]
        x, w, a, b, m, dy = sets[0]
        # Layer forward: the base GEMM's FLOPs plus the low-rank terms; bytes: x, W, y once.
        fwd_flops = 2 * tokens * fin * fout + 2 * tokens * r * (fin + fout) + norm_flops
        fwd_bytes = (tokens * fin + fin * fout + tokens * fout) * item
        fwd = _LayerGroup(rec, "dora_fwd", case, sets)
        fwd.add("peer:base_matmul", lambda x, w: x @ w, 2, nbytes=fwd_bytes, flops=2 * tokens * fin * fout)
        fwd.add("xla", lambda x, w, a, b, m: dora_dense(x, w, a, b, m, scale=scale, implementation="xla"),
                5, nbytes=fwd_bytes, flops=fwd_flops)
        for impl in _wanted(IMPLS):
            fwd.add(impl, lambda x, w, a, b, m, impl=impl: dora_dense(
                x, w, a, b, m, scale=scale, implementation=impl), 5, nbytes=fwd_bytes, flops=fwd_flops)
        # The same layer as plain LoRA (x W + s (x A) B), what DoRA costs over it: fused (the sm90 kernel with the
        # low-rank step on Hopper) and XLA's dots.
        lora_flops = 2 * tokens * fin * fout + 2 * tokens * r * (fin + fout)
        for impl in ("pallas", "xla"):
            fwd.add(f"lora:{impl}", lambda x, w, a, b, impl=impl: lora_dense(
                x, w, a, b, scale=scale, implementation=impl), 4, nbytes=fwd_bytes, flops=lora_flops)
        fwd.time()

        # Forward + backward (grads of x, A, B, m; W frozen), as ANCHORS' "XLA layer fwd+bwd".
        fb_flops = fwd_flops + 2 * tokens * fin * fout + 6 * tokens * r * (fin + fout)
        fb = _LayerGroup(rec, "dora_fwdbwd", case, sets)
        fb.add("peer:base_matmul", _base_fwdbwd, 6, flops=4 * tokens * fin * fout)
        for impl in ("pallas", "xla"):
            fb.add(f"lora:{impl}", _lora_fwdbwd(impl, scale), 6,
                   flops=lora_flops + 2 * tokens * fin * fout + 6 * tokens * r * (fin + fout))
        fb.add("user:DoRADense", _module_fwdbwd(scale), 6, flops=fb_flops)
        fb.add("xla", _fwdbwd("xla", scale), 6, flops=fb_flops)
        for impl in _wanted([*IMPLS, "pallas:gemm"]):
            fb.add(impl, _fwdbwd(impl, scale), 6, flops=fb_flops)
        for impl in _wanted(SM90_FWDBWD_CONFIGS):
            fb.add(impl, _fwdbwd("pallas:sm90", scale, SM90_FWDBWD_CONFIGS[impl]), 6, flops=fb_flops)
        fb.time()

        # QDoRA forward: W int8 / NF4, dequantised inside the kernels (compare with the bf16 "pallas" forward).
        for name, quantize, wbytes in (("int8", quantize_int8, fin * fout), ("nf4", quantize_nf4, fin * fout // 2)):
            qw = quantize(w)
            rec.time("qdora_fwd", case, f"pallas:{name}", jax.jit(lambda x, qw, a, b, m: dora_dense(
                x, qw, a, b, m, scale=scale, implementation="pallas")), x, qw, a, b, m,
                nbytes=(tokens * fin + tokens * fout) * item + wbytes, flops=fwd_flops)
            if name == "int8":  # the Triton GEMM that the Hopper default replaced, for comparison
                rec.time("qdora_fwd", case, "pallas:int8_gemm", jax.jit(lambda x, qw, a, b, m: dora_dense(
                    x, qw, a, b, m, scale=scale, implementation="pallas:gemm")), x, qw, a, b, m,
                    nbytes=(tokens * fin + tokens * fout) * item + wbytes, flops=fwd_flops)
            if name == "int8":  # opt-in: a transient bf16 merged weight, then cuBLAS
                rec.time("qdora_fwd", case, "pallas:int8_merged", jax.jit(lambda x, qw, a, b, m: dora_dense(
                    x, qw, a, b, m, scale=scale, implementation="pallas:merged")), x, qw, a, b, m,
                    nbytes=(tokens * fin + tokens * fout) * item + wbytes, flops=fwd_flops)
            rec.time("qdora_fwd", case, f"xla:{name}", jax.jit(lambda x, qw, a, b, m: dora_dense(
                x, qw, a, b, m, scale=scale, implementation="xla")), x, qw, a, b, m,
                nbytes=(tokens * fin + tokens * fout) * item + wbytes, flops=fwd_flops)


QDORA_CASES = [(4096, 4096, 4096, 16), (8192, 4096, 4096, 16), (4096, 4096, 11008, 64), (8192, 4096, 11008, 64)]
# name -> (weight format, implementation): bf16 DoRA is the yardstick (issue targets: int8 <= 1.25x, NF4 <= 1.5x its
# forward and forward+backward); "pallas:int8" is the default ("sm90_dequant" on Hopper), "pallas:nf4" too ("merged":
# a transient merged weight, then cuBLAS), "pallas:<fmt>_gemm" the Triton GEMMs that dequantise in-kernel (never a
# full-precision W), "xla:<fmt>" dequantises W in full then XLA's GEMMs.
QDORA_IMPLS = {"pallas:bf16": (None, "pallas"), "pallas:int8": ("int8", "pallas"),
               "pallas:int8_sm90_dequant": ("int8", "pallas:sm90_dequant"), "pallas:int8_gemm": ("int8", "pallas:gemm"),
               "pallas:nf4": ("nf4", "pallas"), "pallas:nf4_gemm": ("nf4", "pallas:gemm"), "xla:int8": ("int8", "xla"),
               "xla:nf4": ("nf4", "xla")}


def _lora(x, w, a, b, scale=2.0):
    return x @ w + scale * ((x @ a) @ b)


def _peak_mib(fn, *args) -> float | None:
    """Peak device memory of one compiled call (arguments + outputs + XLA's temporaries), MiB."""
    stats = jax.jit(fn).lower(*args).compile().memory_analysis()
    if stats is None:
        return None
    return (stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes) / 2 ** 20


def qdora(rec: Recorder, quick: bool) -> None:
    """QDoRA beside bf16 DoRA and LoRA at the issue's shapes: qdora_fwd and qdora_fwdbwd rows (grads of x, A, B, m),
    each with its compiled program's peak memory (`peak_mib`: arguments, outputs and temporaries; W int8 is 1 byte
    per weight, NF4 ~0.53, bf16 2). peer:lora_xla is x W + s (x A) B under XLA (no norm), peer:base_matmul x W.
    A case's forward candidates are timed in turn, then its forward+backward ones (`Recorder.time_interleaved`)."""
    scale = 2.0
    quantizers = {"int8": quantize_int8, "nf4": quantize_nf4}
    for tokens, fin, fout, r in QDORA_CASES[:2] if quick else QDORA_CASES:
        case = f"{tokens}x{fin}->{fout} r{r} bf16"
        x, w, a, b, m, dy = _data(tokens, fin, fout, r)
        weights = {None: w, **{k: q(w) for k, q in quantizers.items()}}
        fwd_flops = 2 * tokens * fin * fout + 2 * tokens * r * (fin + fout)

        groups: dict[str, dict] = {"qdora_fwd": {}, "qdora_fwdbwd": {}}

        def add(op, impl, fn, *args, flops, groups=groups):
            try:
                peak = _peak_mib(fn, *args)
            except Exception:  # noqa: BLE001 - the timing records the failure
                peak = None
            groups[op][impl] = (jax.jit(fn), args, dict(peak_mib=peak, flops=flops))

        add("qdora_fwd", "peer:base_matmul", lambda x, w: x @ w, x, w, flops=2 * tokens * fin * fout)
        add("qdora_fwd", "peer:lora_xla", _lora, x, w, a, b, flops=fwd_flops)
        add("qdora_fwdbwd", "peer:lora_xla",
            lambda x, w, a, b, dy: _with_output(lambda x, a, b: _lora(x, w, a, b), x, a, b, dy=dy), x, w, a, b, dy,
            flops=3 * fwd_flops)
        for name in _wanted(QDORA_IMPLS):
            fmt, impl = QDORA_IMPLS[name]
            qw = weights[fmt]
            add("qdora_fwd", name, lambda x, qw, a, b, m, impl=impl: dora_dense(
                x, qw, a, b, m, scale=scale, implementation=impl), x, qw, a, b, m, flops=fwd_flops)

            def fb(x, qw, a, b, m, dy, impl=impl):
                return _with_output(lambda x, a, b, m: dora_dense(x, qw, a, b, m, scale=scale, implementation=impl),
                                    x, a, b, m, dy=dy)
            add("qdora_fwdbwd", name, fb, x, qw, a, b, m, dy, flops=3 * fwd_flops)
        for op, candidates in groups.items():  # each case's candidates in turn (one clock regime for all)
            rec.time_interleaved(op, case, candidates)


# ---------------------------------------------------------------------------------------------------- tuning
# Column-norm launch configurations: (mode, bn, bk, rows per program, warps, stages, weight shapes). "expand" rows with
# rows >= in features run one program per column strip with g computed in the kernel (one launch); others write
# partial sums over row ranges, summed and finished by XLA (a second, small launch). Timed amortized.
_R16, _R64 = (4096, 4096, 16), (4096, 11008, 64)
NORM_SWEEP = [  # "direct" loads the next W tile one step ahead
    ("expand", 64, 128, 1024, 8, 3, [_R16]),
    ("expand", 128, 64, 1024, 8, 4, [_R16, _R64]),
    ("expand", 64, 256, 1024, 8, 3, [_R16]),  # 32 KiB per step: half the per-step overhead per byte
    ("expand", 128, 128, 1024, 8, 3, [_R16]),
    ("expand", 64, 128, 1024, 4, 3, [_R16]),  # 4 warps: 3 programs per SM by registers
    ("expand", 32, 128, 4096, 4, 4, [_R16]),  # one launch, N/32 programs (one per SM at 4096), 8 KiB tiles
    ("expand", 32, 256, 4096, 4, 4, [_R16]),  # ... 16 KiB tiles, 3 in flight
    ("expand", 32, 256, 4096, 8, 4, [_R16]),
    ("expand", 16, 256, 4096, 4, 4, [_R16]),  # one launch, N/16 programs (2 per SM)
    ("expand", 64, 128, 4096, 8, 5, [_R16, _R64]),  # one launch, N/64 programs
    ("expand", 128, 128, 4096, 8, 3, [_R64]),  # one launch, N/128 programs
    ("expand", 128, 64, 512, 8, 3, [_R64]),
    ("direct", 64, 64, 512, 4, 2, [_R16, _R64]),  # the default "direct" launch
    ("direct", 128, 64, 1024, 8, 2, [_R16, _R64]),
    ("direct", 64, 128, 1024, 8, 2, [_R64]),
    ("direct", 128, 32, 512, 4, 2, [_R64]),
]
TUNE_WEIGHTS = [_R16, _R64]
TUNE_TOKENS = [4096, 8192, 512]  # in order of importance: what doesn't fit the budget is recorded as skipped
MODES = ["merged", "epilogue"]


def _merge(**fields):
    return Config(merge=MergeConfig(**fields))


def _expand(**fields):
    norm = NormConfig()
    return Config(norm=dataclasses.replace(norm, expand=dataclasses.replace(norm.expand, **fields)))


def _cols(**fields):
    return Config(columns=ColumnsConfig(**fields))


# "pallas:merged" configurations (label -> Config): the norm launch's rows per program (partial sums finished by the
# merge launch), the merge launch's tiles and order.
MERGED_SWEEP = {
    "mnorm_rows512": _merge(norm_rows=512),
    "mnorm_rows2048": _merge(norm_rows=2048),
    "mnorm_rows4096": _merge(norm_rows=4096),
    "mnorm bn128 bk64 s4": _expand(bn=128, bk=64, stages=4),
    "merge 64x128 w4": _merge(bk=64, bn=128),
    "merge 128x128 w8": _merge(bk=128, bn=128, warps=8),
    "merge 256x64 w8": _merge(bk=256, bn=64, warps=8),
    "merge 128x64 w4": _merge(bk=128, bn=64),
    "merge forward order": _merge(reverse=False),
    "merge rows512 (8 x 64x64)": _merge(rows=512),
    "merge rows1024 (16 x 64x64) w8": _merge(rows=1024, warps=8),
    "merge rows512 (8 x 64x128)": _merge(bk=64, bn=128, rows=512),
    "mnorm direct bn128 bk64 rows1024 w8": Config(norm=NormConfig(mode="direct", direct=NormTiles(
        bn=128, bk=64, rows=1024, warps=8, stages=2))),
    "merge 64x64 w8": _merge(warps=8),
    "mnorm s5": _expand(stages=5),
    "mnorm bk256": _expand(bk=256),
}
# Backward column reductions (ColumnsConfig), with "pallas:merged": label -> Config. rows >= tokens: one program per
# column strip over every token, dB / dm / dbias finished in the kernel.
COLS_SWEEP = {
    "cols elementwise sums": _cols(mma_sums=False),  # the sums in registers, y prefetched (default: on the MMA)
    "cols s3": _cols(stages=3),
    "cols bn128 bt64 rows512 w8": _cols(bn=128, warps=8),
    "cols bn64 bt128 rows1024 w8": _cols(bt=128, rows=1024, warps=8),
    "cols bn128 bt32 rows256 w4": _cols(bn=128, bt=32, rows=256),
    "cols bn32 bt64 rows8192 w4": _cols(bn=32, rows=8192),
    "cols bn32 bt128 rows8192 w8": _cols(bn=32, bt=128, rows=8192, warps=8),
    "cols bn16 bt128 rows8192 w4": _cols(bn=16, bt=128, rows=8192),
}
TUNE_BUDGET_S = float(os.environ.get("DORA_TUNE_BUDGET_S", "85"))


def tuning(rec: Recorder, quick: bool, parts=("norm", "modes", "variants")) -> None:
    """Sweeps that decide the defaults; each failure, and each case past the time budget, is a row (no raise):
    - dora_tune_colnorm: NORM_SWEEP (NormConfig), amortized over k distinct weights per jit (the
      single-call timing measures the host dispatch), with XLA's amortized time beside;
    - dora_mode: forward and forward+backward of the cuBLAS-based variants at 4096/8192/512 tokens, with the
      base matmul x W alone (plain "pallas" picks from a byte count: impls.choose), the
      MERGED_SWEEP variants of the forward (MergeConfig, NormConfig) and COLS_SWEEP of the backward (ColumnsConfig).
      These layer timings are one jit each and GPU-bound (>= 0.05 ms), so single-call timing is fine there.
    """
    deadline = time.perf_counter() + TUNE_BUDGET_S
    scale = 2.0
    skipped = "skipped: tuning time budget (DORA_TUNE_BUDGET_S)"

    until = [deadline]  # the current case's share of the budget (modes)

    def timed(op, case, impl, fn, *args, **kw):
        if time.perf_counter() > min(deadline, until[0]):
            return rec.add(op, case, impl, None, error=skipped)
        return rec.time(op, case, impl, fn, *args, n=20, reps=3, **kw)

    def colnorm(fin, fout, r, until):
        sets = _norm_sets(fin, fout, r)
        nbytes = (fin * fout + fin * r + r * fout + 2 * fout) * 2
        case = f"{fin}->{fout} r{r} bf16 amortized"
        for mode, bn, bk, rows, warps, stages, shapes in NORM_SWEEP:
            if (fin, fout, r) not in shapes:
                continue
            tiles = NormTiles(bn=bn, bk=bk, rows=rows, warps=warps, stages=stages)
            if mode == "direct":
                cfg = Config(norm=NormConfig(mode="direct", direct=tiles))
            else:
                cfg = Config(norm=NormConfig(expand_max_rank=128, expand=tiles))
            impl = f"pallas:{mode} bn{bn} bk{bk} rows{rows} w{warps} s{stages}"
            if time.perf_counter() > until:
                rec.add("dora_tune_colnorm", case, impl, None, error=skipped)
                continue
            rec.time_amortized("dora_tune_colnorm", case, impl, lambda w, a, b, m, cfg=cfg: column_scale(
                w, a, b, m, scale=scale, implementation="pallas", config=cfg), sets, n=10, reps=3, nbytes=nbytes)
        if time.perf_counter() <= until + 10:
            rec.time_amortized("dora_tune_colnorm", case, "xla", lambda w, a, b, m: column_scale_reference(
                w, a, b, m, scale), sets, n=10, reps=3, nbytes=nbytes)

    def modes(tokens, fin, fout, r, plain, variants):
        x, w, a, b, m, dy = _data(tokens, fin, fout, r)
        case = f"{tokens}x{fin}->{fout} r{r} bf16"
        fwd_bytes = (tokens * fin + fin * fout + tokens * fout) * 2
        fwd = dict(nbytes=fwd_bytes, flops=2 * tokens * fin * fout)
        if plain or variants:  # the reference points of the variants too
            timed("dora_mode", case + " fwd", "peer:base_matmul", jax.jit(lambda x, w: x @ w), x, w, **fwd)
        for mode in MODES if plain else ["merged"] if variants else []:
            timed("dora_mode", case + " fwd", f"pallas:{mode}", jax.jit(lambda x, w, a, b, m, mode=mode: dora_dense(
                x, w, a, b, m, scale=scale, implementation=f"pallas:{mode}")), x, w, a, b, m, **fwd)
            timed("dora_mode", case + " fwdbwd", f"pallas:{mode}", _fwdbwd(f"pallas:{mode}", scale),
                  x, w, a, b, m, dy, flops=6 * tokens * fin * fout)
        if not variants:
            return
        for label, cfg in MERGED_SWEEP.items():
            timed("dora_mode", case + " fwd", f"pallas:merged {label}", jax.jit(
                lambda x, w, a, b, m, cfg=cfg: dora_dense(x, w, a, b, m, scale=scale, implementation="pallas:merged",
                                                        config=cfg)), x, w, a, b, m, **fwd)
        timed("dora_mode", case + " fwdbwd", "pallas:merged save_merged=False", _fwdbwd(
            "pallas:merged", scale, Config(save_merged=False)), x, w, a, b, m, dy, flops=6 * tokens * fin * fout)
        for label, cfg in COLS_SWEEP.items():
            timed("dora_mode", case + " fwdbwd", f"pallas:merged {label}", _fwdbwd("pallas:merged", scale, cfg),
                  x, w, a, b, m, dy, flops=6 * tokens * fin * fout)

    # In order of importance. By estimate on an H200: the column-norm sweep ~70 s, the 4096-token modes with their
    # variants ~65 s, the 8192- and 512-token modes ~50 s (DORA_TUNE_BUDGET_S, per call of this function).
    if "norm" in parts:  # the budget shared between the weight shapes (and XLA's row always timed, 10 s of grace)
        for i, shape in enumerate(TUNE_WEIGHTS):
            now = time.perf_counter()
            colnorm(*shape, until=now + (deadline - now) / (len(TUNE_WEIGHTS) - i))
    # The budget shared between the cases: "modes" = the variants at every token count, "variants" = the Config
    # variants of "pallas:merged" (MERGED_SWEEP, COLS_SWEEP) at the first token count.
    calls = [(t, shape, True, False) for t in TUNE_TOKENS for shape in TUNE_WEIGHTS] if "modes" in parts else []
    calls += [(TUNE_TOKENS[0], shape, False, True) for shape in TUNE_WEIGHTS] if "variants" in parts else []
    weights = [3 if variants else 1 for *_, variants in calls]
    for i, (tokens, shape, plain, variants) in enumerate(calls):
        now = time.perf_counter()
        until[0] = now + (deadline - now) * weights[i] / sum(weights[i:])
        modes(tokens, *shape, plain=plain, variants=variants)


def parts(rec: Recorder, quick: bool) -> None:
    """dora_parts: each launch of the "pallas:merged" forward + backward alone, amortized over k distinct
    inputs per jit (k * the largest operand >= AMORTIZE_BYTES), at 4096 tokens. Their sum against the dora_mode
    fwd / fwdbwd rows shows what the gaps between launches cost; each row against its bytes (% HBM) shows which
    launch is short of the floor."""
    for shape in TUNE_WEIGHTS:
        _parts_at(rec, 4096, *shape)


def _parts_at(rec, tokens, fin, fout, r):
    from pallas_fused.dora import kernel_columns, kernel_merge, kernel_norm
    from pallas_fused.dora.config import DEFAULT as cfg

    scale = 2.0
    ss = jnp.float32(scale)
    interp = jax.default_backend() != "gpu"  # interpret mode off the GPU (a CPU smoke run of this section)
    case = f"{tokens}x{fin}->{fout} r{r} bf16"
    k = max(2, math.ceil(AMORTIZE_BYTES / (max(tokens, fin) * fout * 2)))
    from pallas_fused.dora.impls import pad_rank

    sets = []
    for _ in range(k):  # same values, distinct buffers; the rank zero-padded as the layer does (a no-op at 16, 64)
        x, w, a, b, m, dy = _data(tokens, fin, fout, r)
        sets.append((x, w, *pad_rank(a, b), m, dy))

    def row(name, fn, args, nbytes):
        return rec.time_amortized("dora_parts", case, name, fn, args, n=10, reps=3, nbytes=nbytes)

    def partials(w, a, b):
        return kernel_norm.column_partials((w,), "dense", a, b, ss, interpret=interp, config=cfg.norm,
                                           rows=cfg.merge.norm_rows)

    def merge(w, a, b, m, p):
        return kernel_merge.merge_weight((w,), "dense", a, b, ss, partials=p, magnitude=m, interpret=interp,
                                         config=cfg.merge)

    def cols(dy, y, xa, gs, m):
        return kernel_columns.backward_columns(dy, y, xa, None, interpret=interp, config=cfg.columns,
                                  finish=(gs, m, jnp.bfloat16, m.dtype, jnp.float32))

    wb, xb, yb = fin * fout * 2, tokens * fin * 2, tokens * fout * 2
    row("norm partials (fwd)", partials, [(w, a, b) for _, w, a, b, _, _ in sets], wb)
    pre = [(w, a, b, m, partials(w, a, b)) for _, w, a, b, m, _ in sets]
    row("merge (finishes g)", merge, pre, 2 * wb)
    wms = [merge(*t) for t in pre]  # (W', n, g, B g s)
    row("x @ W' (cuBLAS)", lambda x, wm: x @ wm, [(st[0], wm[0]) for st, wm in zip(sets, wms)], xb + wb + yb)
    row("dx = dy @ W'^T (cuBLAS)", lambda dy, wm: dy @ wm.T, [(st[5], wm[0]) for st, wm in zip(sets, wms)],
        xb + wb + yb)
    row("us = dy @ (B g s)^T", lambda dy, bg: dy @ bg.T, [(st[5], wm[3]) for st, wm in zip(sets, wms)], yb)
    row("xa = x @ A", lambda x, a: x @ a, [(st[0], st[2]) for st in sets], xb)
    us = [st[5] @ wm[3].T for st, wm in zip(sets, wms)]
    row("dA = x^T @ us", lambda x, u: x.T @ u, [(st[0], u) for st, u in zip(sets, us)], xb)
    cols_args = [(st[5], st[0] @ wm[0], st[0] @ st[2], wm[2] * scale, st[4]) for st, wm in zip(sets, wms)]
    row("column sums (dB, dm, dbias)", cols, cols_args, 2 * yb)


def tune_norm(rec: Recorder, quick: bool) -> None:
    """The column-norm sweep of `tuning` alone (its own DORA_TUNE_BUDGET_S)."""
    tuning(rec, quick, parts=("norm",))


def tune_modes(rec: Recorder, quick: bool) -> None:
    """The variants' dora_mode rows of `tuning` at every token count (its own DORA_TUNE_BUDGET_S)."""
    tuning(rec, quick, parts=("modes",))


def tune_variants(rec: Recorder, quick: bool) -> None:
    """The merged mode's Config variants (MERGED_SWEEP, COLS_SWEEP) at 4096 tokens (its own DORA_TUNE_BUDGET_S)."""
    tuning(rec, quick, parts=("variants",))


def run(rec: Recorder, quick: bool) -> None:
    """Sections: main_cases, qdora, tuning (= tune_norm + tune_modes + tune_variants under one budget), tune_norm,
    tune_modes, tune_variants, parts;
    DORA_SECTIONS=tune_norm,tune_modes (comma-separated names) runs a subset, each with its own time budget."""
    wanted = os.environ.get("DORA_SECTIONS", "main_cases,qdora,tuning").split(",")
    for section in (main_cases, qdora, tuning, tune_norm, tune_modes, tune_variants, parts):
        if section.__name__ not in wanted:
            continue
        start = time.time()
        try:
            section(rec, quick)
        except Exception as e:  # noqa: BLE001 - keep the other section's numbers
            rec.add("dora", section.__name__, "error", None, error=error_text(e))
        print(f"  [{section.__name__} {time.time() - start:.1f}s]", flush=True)
