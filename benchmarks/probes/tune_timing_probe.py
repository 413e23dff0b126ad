"""Why the tuner's FP8 GEMM timings and the benchmark's differ (development probe).

    timeout 200 python -m benchmarks.probes.tune_timing_probe [OUT_DIR] [KEY ...]

At each shape key (default: two where the tuner's time of its choice and the row of record's disagree), the shipped
table's choice and the rule's default config, each timed four ways, all in this process:

  data   "tuner": `gemm.gemm_operands` (normal fp8 codes, scales in [0.5, 2)), what the tuner times;
         "quantized": `quantize` of normal bf16 operands, what `benchmarks.run fp8` times (codes fill the fp8 range)
  timer  "measure": `tune.measure` (each candidate alone, ~20 ms per mean, as the tuner runs it);
         "interleaved": `benchmarks.common.bench_interleaved` over every (config, data) of the shape in turn, n=50,
         as the benchmark's rows are timed

Same kernel, same operand count, so a difference between the data columns is the data (power, clocks), and between
the timer columns the timing method. Rows go to OUT_DIR/tune_timing_probe.json; a table is printed last.
"""

from __future__ import annotations

import os
import sys

from benchmarks import bench_fp8
from benchmarks.common import bench_interleaved, probe_recorder
from pallas_fused import _tuning
from pallas_fused.fp8 import gemm
from pallas_fused.tune import measure

KEYS = ("16384x512x2048 float8_e4m3fn bfloat16 tensorwise", "16384x5504x2048 float8_e4m3fn bfloat16 rowwise")


def quantized_operands(key: str):
    """As many sets as `gemm.gemm_operands(key)`, the benchmark's user operands (`bench_fp8.quantized_sets`), with
    the scales in the shapes the key's GEMM takes."""
    args = gemm.args_of_key(key)
    rowwise = args.sa.ndim == 1
    pairs = bench_fp8.operand_pairs(args.m, args.k, args.n, len(gemm.gemm_operands(key)))
    user_sets, _ = bench_fp8.quantized_sets(pairs, -1 if rowwise else None)
    shape = (-1,) if rowwise else ()
    return [(a8, bt8, sa.reshape(shape), sb.reshape(shape)) for a8, bt8, sa, sb in user_sets]


def main() -> None:
    argv = sys.argv[1:]
    out_dir = argv.pop(0) if argv and " " not in argv[0] else os.environ.get("OUT", ".")
    keys = argv or list(KEYS)
    os.makedirs(out_dir, exist_ok=True)
    record = probe_recorder(os.path.join(out_dir, "tune_timing_probe.json"))
    summary = []
    for key in keys:
        candidates = gemm.gemm_candidates(key)
        configs = {"default": next(iter(candidates.values()))}
        entry = _tuning.choice(gemm.GEMM_OP, key)
        if entry is not None:
            configs["choice:" + entry["choice"]] = entry["config"]
        data = {"tuner": gemm.gemm_operands(key), "quantized": quantized_operands(key)}
        calls = {}
        for cname, config in configs.items():
            for dname, sets in data.items():
                call, n_ops = gemm.gemm_build(key, config, sets)
                ms = measure(call, n_ops)
                record(key=key, config=cname, data=dname, timer="measure", ms=ms)
                summary.append((key, cname, dname, "measure", ms))
                calls[f"{cname}|{dname}"] = (call, ())
        for name, ms in bench_interleaved(calls, n=50, reps=5).items():
            cname, dname = name.split("|")
            record(key=key, config=cname, data=dname, timer="interleaved", ms=ms / n_ops)
            summary.append((key, cname, dname, "interleaved", ms / n_ops))
    print(f"\n{'key':52s} {'config':34s} {'data':10s} {'timer':12s} {'ms':>8s}")
    for key, cname, dname, timer, ms in summary:
        print(f"{key:52s} {cname:34s} {dname:10s} {timer:12s} {ms:8.4f}")


if __name__ == "__main__":
    main()
