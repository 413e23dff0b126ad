"""Backs the FP8 GEMM's cluster tuning and docs/performance.md's 'a cluster along N did not help'.

The sm90 FP8 GEMM's 2-CTA cluster against torch._scaled_mm (development probe).

    python -m benchmarks.probes.cluster_probe OUT_DIR [quick] [ctas] [MxKxN[:tensorwise|:rowwise] ...]

At each shape (M x K x N: a (M, K), bt (N, K); default: the shapes where the kernel trails cuBLAS, 8192^3 and
16384x4096x4096, with their granularity) it times, in one process: torch._scaled_mm (bf16 out, use_fast_accum=True;
scalar scales tensorwise, per-row scales rowwise), the user's call (`fp8.scaled_matmul_nt` fed by `quantize`),
then `kernel_sm90.scaled_matmul_nt` at the tuned tile (`kernel_sm90.config_for`) and its variants: first the tuned tile
without a cluster and with one along M / N (TileConfig.cluster); then, around the two fastest of those,
grid_tile_width 4 / 8 / 16 and grid_minor_dim m / n and the other warpgroup split (full mode). Each timed call is one
jit over several distinct operand sets that pass the L2 together (as common.bench_amortized times), so host dispatch
is not timed. Every config's output (and torch's) is checked against
XLA's fp8 dot with the same scales first; a mismatch is recorded as such and not timed. One line per (shape,
config): ms, TFLOP/s and the ratio to torch; rows go to OUT_DIR/cluster_probe.json as they come. Configs that start
after BUDGET_S seconds (default 420) are skipped, and each shape's grid variants stop at its share of that budget,
so the probe ends within a device call's limit; quick mode times the three cluster variants only, with fewer
calls. "ctas" adds 128 x 128 CTA tiles (tile_n 64 split along N, or tile_m 64 split along M; 4 or 6 stages, with
and without the cluster along M) and the tuned tile walking the grid along M, the tiles torch's rowwise CUTLASS
kernel and cuBLAS pick at the shapes where the tuned tile trails them.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.bench_fp8 import _sets, operand_pairs, quantized_sets, torch_scaled_mm_fn
from benchmarks.common import bench, bench_torch, error_text, probe_recorder
from pallas_fused.fp8 import api, kernel_sm90, scaled_matmul_nt

E4 = jnp.float8_e4m3fn
SHAPES = [(16384, 512, 2048, "tensorwise"), (16384, 2048, 512, "tensorwise"), (16384, 4096, 11008, "tensorwise"),
          (16384, 2048, 5504, "rowwise"), (16384, 4096, 4096, "rowwise"), (8192, 8192, 8192, "tensorwise"),
          (16384, 4096, 4096, "tensorwise")]
MAX_REL_ERR = 2e-2  # bf16 output rounding is ~4e-3 of the largest entry; a wrong tile or scale is O(1)


def parse(args):
    quick, ctas = "quick" in args, "ctas" in args
    shapes = []
    for arg in (a for a in args if a not in ("quick", "ctas")):
        dims, _, gran = arg.partition(":")
        m, k, n = (int(d) for d in dims.split("x"))
        shapes += [(m, k, n, g) for g in ([gran] if gran else ["tensorwise", "rowwise"])]
    return quick, ctas, shapes or SHAPES


def label(config, tuned) -> str:
    """The config's difference from the tuned tile."""
    diff = [f"{f.name}={getattr(config, f.name)}" for f in dataclasses.fields(config)
            if getattr(config, f.name) != getattr(tuned, f.name)]
    return "tuned" + (" " + " ".join(diff) if diff else "")


def variants(tuned, ctas=False):
    """The tuned tile with a cluster along M / N or none; with `ctas`, the 128 x 128 CTA tiles too."""
    out = [dataclasses.replace(tuned, cluster=c) for c in (None, "m", "n")]
    if ctas:
        out.append(dataclasses.replace(tuned, grid_minor_dim="m"))
        for split, tm, tn in (("n", 128, 64), ("m", 64, 128)):
            for stages, cluster in ((4, "m"), (6, "m"), (6, None)):
                out.append(dataclasses.replace(tuned, tile_m=tm, tile_n=tn, wg_split=split,
                                               max_concurrent_steps=stages, cluster=cluster))
    return out


def neighbours(config):
    """The grid walk's variants of `config` and its other warpgroup split."""
    out = [dataclasses.replace(config, grid_tile_width=w, grid_minor_dim=d) for w in (4, 8, 16) for d in "mn"]
    return out + [dataclasses.replace(config, wg_split="m" if config.wg_split == "n" else "n")]


def probe_shape(record, m, k, n, gran, quick, start, budget, share, ctas=False):
    """Every line of one shape; the neighbours phase stops `share` seconds after the probe's start."""
    case, flops = f"{m}x{k}x{n} {gran}", 2 * m * n * k
    count = _sets(m, k, n)
    # ~10 ms of GPU work per timed batch (at ~1300 TFLOP/s), as bench_fp8 times these GEMMs
    calls = max(3 if quick else 10, min(200, int(10e-3 * 1300e12 / flops)) // count)
    reps = 2 if quick else 3
    axis = None if gran == "tensorwise" else -1
    user_sets, vec_sets = quantized_sets(operand_pairs(m, k, n, count), axis)
    want = np.asarray(api._mm_nt(*vec_sets[0], jnp.bfloat16, True, "xla"), np.float32)
    scale = float(np.abs(want).max())

    def rel_err(out):
        return float(np.abs(np.asarray(out, np.float32) - want).max() / scale)

    torch_ms = None
    try:
        fn = torch_scaled_mm_fn(user_sets, gran)
        err = rel_err(fn()[0].float().cpu().numpy())
        if err > MAX_REL_ERR:
            record(case=case, impl="torch._scaled_mm", ms=None, rel_err=err, error="MISMATCH with XLA's fp8 dot")
        else:
            torch_ms = bench_torch(fn, n=calls, reps=reps) / count
            record(case=case, impl="torch._scaled_mm", ms=round(torch_ms, 5), tflops=round(flops / torch_ms / 1e9, 1),
                   rel_err=err, k=count)
    except Exception as e:  # noqa: BLE001 - a missing peer is a recorded result
        record(case=case, impl="torch._scaled_mm", ms=None, error=error_text(e))

    def timed(impl, fn, sets, **extra):
        """Checks fn on the first set, times it over all; its ms, or None."""
        if time.time() - start > budget:
            record(case=case, impl=impl, ms=None, error="skipped (time)", **extra)
            return None
        try:
            many = jax.jit(lambda sets: [fn(*args) for args in sets])  # common.bench_amortized's one jit
            err = rel_err(many(sets)[0])
            if err > MAX_REL_ERR:
                record(case=case, impl=impl, ms=None, rel_err=err, error="MISMATCH with XLA's fp8 dot", **extra)
                return None
            ms = bench(many, sets, n=calls, reps=reps) / len(sets)
        except Exception as e:  # noqa: BLE001 - a config that fails to compile is a result
            record(case=case, impl=impl, ms=None, error=error_text(e), **extra)
            return None
        ratio = None if torch_ms is None else round(torch_ms / ms, 3)
        record(case=case, impl=impl, ms=round(ms, 5), tflops=round(flops / ms / 1e9, 1), vs_torch=ratio,
               rel_err=err, k=count, **extra)
        return ms

    tuned = kernel_sm90.config_for(m, n, k)
    timed("user:scaled_matmul_nt", scaled_matmul_nt, user_sets, config=str(tuned))

    def kernel(config):
        if not kernel_sm90.supported(m, n, k, E4, E4, config):
            record(case=case, impl=label(config, tuned), ms=None, error="shape is no multiple of the tile")
            return None
        fn = functools.partial(kernel_sm90.scaled_matmul_nt, out_dtype=jnp.bfloat16, config=config)
        return timed(label(config, tuned), fn, vec_sets, config=dataclasses.asdict(config))

    results = {c: kernel(c) for c in dict.fromkeys(variants(tuned, ctas))}
    if not quick:
        best = sorted((ms, i, c) for i, (c, ms) in enumerate(results.items()) if ms is not None)[:2]
        for _, _, base in best:
            for config in neighbours(base):
                if config not in results and time.time() - start < share:
                    results[config] = kernel(config)
    ranked = sorted((ms, label(c, tuned)) for c, ms in results.items() if ms is not None)
    if ranked:
        ms, name = ranked[0]
        ratio = "" if torch_ms is None else f", {torch_ms / ms:.3f}x torch"
        print(f"== {case}: fastest {name}: {ms:.4f} ms, {flops / ms / 1e9:.1f} TFLOP/s{ratio}", flush=True)


def main():
    out_dir, (quick, ctas, shapes) = sys.argv[1], parse(sys.argv[2:])
    os.makedirs(out_dir, exist_ok=True)
    record = probe_recorder(os.path.join(out_dir, "cluster_probe.json"))
    start, budget = time.time(), float(os.environ.get("BUDGET_S", 420))
    print(jax.devices(), f"quick={quick} ctas={ctas}", flush=True)
    for index, (m, k, n, gran) in enumerate(shapes):
        # the neighbours of later shapes keep their share of the time
        probe_shape(record, m, k, n, gran, quick, start, budget, share=budget * (index + 1) / len(shapes), ctas=ctas)
    print(f"cluster_probe: {time.time() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
