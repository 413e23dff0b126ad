"""Benchmark CLI: `python -m benchmarks.run [op ...] [--quick] [--out DIR]`.

Each op is a module benchmarks/bench_<op>.py with `run(rec, quick)` (found by name: e.g. `embed` and
`rms_norm`, the example step's embedding and norm). Ceilings are measured first, in
the same process, so every % is of what this device did in this run.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import signal
import sys
import time
import traceback

import benchmarks
from benchmarks.common import Ceilings, Recorder, write_results

ROW_WRITE_INTERVAL_S = 5.0


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def available_ops() -> list[str]:
    return sorted(m.name[len("bench_"):] for m in pkgutil.iter_modules(benchmarks.__path__)
                  if m.name.startswith("bench_"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("ops", nargs="*", help=f"ops to run (default: all of {available_ops()})")
    parser.add_argument("--quick", action="store_true", help="fewer shapes and repetitions")
    parser.add_argument("--out", default=None, help="also copy the results JSON and plot here")
    args = parser.parse_args(argv)
    ops = args.ops or available_ops()
    unknown = sorted(set(ops) - set(available_ops()))
    if unknown:
        parser.error(f"unknown op(s) {unknown}; available: {available_ops()}")
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = lambda it, **kw: it  # noqa: E731

    print("measuring ceilings ...", flush=True)
    ceilings = Ceilings.measure(quick=args.quick)
    print(f"  HBM {ceilings.hbm_gbps:.0f} GB/s, bf16 {ceilings.bf16_tflops:.0f} TFLOP/s, "
          f"tf32 {ceilings.tf32_tflops:.0f} TFLOP/s", flush=True)
    failed, started = [], []
    last_write = [time.monotonic()]

    def write_now():
        # Every row is on disk within a few seconds of being measured, without rewriting the file for each row.
        if started and time.monotonic() - last_write[0] >= ROW_WRITE_INTERVAL_S:
            write_results(rec, started, args.out, plot=False)
            last_write[0] = time.monotonic()

    rec = Recorder(ceilings, on_row=write_now)
    # `timeout` sends SIGTERM: turn it into an exception so what was measured is still written.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        for op in tqdm(ops, desc="ops", file=sys.stdout):
            start = time.time()
            started.append(op)
            print(f"== {op}", flush=True)
            try:
                importlib.import_module(f"benchmarks.bench_{op}").run(rec, args.quick)
            except Exception:  # noqa: BLE001 - one op's failure must not lose the others' numbers
                traceback.print_exc()
                failed.append(op)
            print(f"== {op} took {time.time() - start:.1f}s", flush=True)
            # Written after every op, so a run cut off by a time limit keeps what it measured.
            path = write_results(rec, started, args.out)
    except KeyboardInterrupt:
        print(f"interrupted during {started[-1] if started else 'setup'}: writing the rows measured so far")
        failed.append("interrupted")
        path = write_results(rec, started, args.out)
    print(f"results: {path}")
    if failed:
        print(f"FAILED ops: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
