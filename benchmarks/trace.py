"""GPU kernel time from a jax.profiler trace, summed by kernel name.

    with trace_kernels() as result:          # a temporary trace directory
        for _ in range(n): step(...)
    result.per_kernel  # {kernel name: total microseconds}, GPU stream events only

jax writes a Perfetto JSON (`create_perfetto_trace=True`) beside its xplane file; the GPU's kernels are the
complete ("X") events on the device process' "Stream" threads (its "XLA Ops" / "XLA Modules" lines repeat the
same time by op and module, so they are left out). Without a GPU there are no such events and the table is empty,
unless `parse(..., host=True)`: then the XLA CPU client's thunks (one event per fused op) stand in, so a CPU smoke
run of a profiling script has something to tabulate.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import pathlib
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field

import jax


@dataclass
class KernelTimes:
    per_kernel: dict[str, float] = field(default_factory=dict)  # name -> total us
    counts: dict[str, int] = field(default_factory=dict)
    threads: list[str] = field(default_factory=list)  # the device threads seen (for a reader of the table)
    # Idle time: between the first kernel's start and the last one's end, the time no kernel ran (on any stream),
    # and each such gap charged to the kernel that ended it (the launch the GPU waited for).
    span_us: float = 0.0
    idle_us: float = 0.0
    idle_before: dict[str, float] = field(default_factory=dict)  # name -> us of idle time ended by its launches
    gaps_before: dict[str, int] = field(default_factory=dict)  # name -> how many idle gaps its launches ended

    def top(self, k: int = 25) -> list[tuple[str, float, int]]:
        items = sorted(self.per_kernel.items(), key=lambda kv: -kv[1])[:k]
        return [(name, us, self.counts[name]) for name, us in items]

    @property
    def total_us(self) -> float:
        return float(sum(self.per_kernel.values()))


# The thread that runs XLA's CPU thunks (jax 0.10, jax 0.12), and its bookkeeping events.
_CPU_THREADS = ("tf_XLAPjRtCpuClient", "tf_XLAExecute")
_CPU_NOISE = ("ThreadpoolListener", "end: ", "ThunkExecutor")


def parse(trace_dir: str | pathlib.Path, host: bool = False) -> KernelTimes:
    files = sorted(pathlib.Path(trace_dir).rglob("perfetto_trace.json.gz"))
    out = KernelTimes()
    if not files:
        return out
    with gzip.open(files[-1], "rt") as f:
        doc = json.load(f)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e["pid"]] = e.get("args", {}).get("name", "")
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e.get("tid"))] = e.get("args", {}).get("name", "")
    gpu = {pid for pid, name in procs.items() if "GPU" in name or "gpu" in name}
    streams = {key for key, name in threads.items() if key[0] in gpu and name.lower().startswith("stream")}
    out.threads = sorted({threads[k] for k in threads if k[0] in gpu})
    cpu = set()
    if host and not gpu:
        cpu = {key for key, name in threads.items() if name.startswith(_CPU_THREADS)}
        out.threads = sorted({threads[k] for k in cpu})
    per, counts = defaultdict(float), defaultdict(int)
    intervals: list[tuple[float, float, str]] = []
    for e in events:
        if e.get("ph") != "X":
            continue
        if cpu:
            if (e["pid"], e.get("tid")) not in cpu or e["name"].startswith(_CPU_NOISE):
                continue
        elif e.get("pid") not in gpu or (streams and (e["pid"], e.get("tid")) not in streams):
            continue
        per[e["name"]] += float(e.get("dur", 0.0))
        counts[e["name"]] += 1
        intervals.append((float(e.get("ts", 0.0)), float(e.get("dur", 0.0)), e["name"]))
    out.per_kernel, out.counts = dict(per), dict(counts)
    out.span_us, out.idle_us, out.idle_before, out.gaps_before = idle(intervals)
    return out


def idle(intervals: list[tuple[float, float, str]]) -> tuple[float, float, dict[str, float], dict[str, int]]:
    """(span, idle, idle by the kernel that ended each gap, gaps by that kernel) of (start us, duration us, name)
    events: the span runs from the first start to the last end; idle is the part of it that no event covers."""
    if not intervals:
        return 0.0, 0.0, {}, {}
    ordered = sorted(intervals)
    busy_until = ordered[0][0] + ordered[0][1]
    total, by, gaps = 0.0, defaultdict(float), defaultdict(int)
    for start, dur, name in ordered[1:]:
        if start > busy_until:
            total += start - busy_until
            by[name] += start - busy_until
            gaps[name] += 1
        busy_until = max(busy_until, start + dur)
    return busy_until - ordered[0][0], total, dict(by), dict(gaps)


@contextlib.contextmanager
def trace_kernels(trace_dir: str | pathlib.Path | None = None):
    """Profile the body; on exit the yielded KernelTimes holds the GPU kernel time per kernel name."""
    result = KernelTimes()
    with contextlib.ExitStack() as stack:
        if trace_dir is None:
            trace_dir = stack.enter_context(tempfile.TemporaryDirectory())
        with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
            yield result
        parsed = parse(trace_dir)
        for name in ("per_kernel", "counts", "threads", "span_us", "idle_us", "idle_before", "gaps_before"):
            setattr(result, name, getattr(parsed, name))


def trace_steps(step, carry, steps: int, top: int = 12) -> dict:
    """Run `carry = step(*carry)` `steps` times under the profiler: GPU kernel time per step (`kernel_us_per_step`)
    and the `top` kernels as (name, us per step, launches per step)."""
    with trace_kernels() as kt:
        for _ in range(steps):
            carry = step(*carry)
        jax.block_until_ready(carry)
    return dict(kernel_us_per_step=round(kt.total_us / steps, 2),
                top=[(name, round(us / steps, 2), c // steps) for name, us, c in kt.top(top)])


def time_then_trace(build, names, record, *, ref: str, n: int = 50, reps: int = 7, steps: int = 20, top: int = 8,
                    **row) -> None:
    """Development probes' comparison of donating steps: `build(name) -> (step, carry)` for each name, the steps timed
    in turn (`bench_carry_interleaved`), then each built again (the timed carries were donated) and traced; one
    `record(**row, impl=name, ...)` per name with its ms, every round's time, its ratio to `ref`'s time, its host gap
    (wall minus GPU kernel time, us) and `trace_steps`' table. A name that fails is recorded with its error."""
    from benchmarks.common import bench_carry_interleaved, error_text

    built = {}
    for name in names:
        try:
            built[name] = build(name)
        except Exception as e:  # noqa: BLE001 - a failing candidate is a result
            record(**row, impl=name, error=error_text(e))
    rounds: dict = {}
    times = bench_carry_interleaved(built, n=n, reps=reps, rounds=rounds)
    del built
    for name in times:
        try:
            tr = trace_steps(*build(name), steps, top=top)
            record(**row, impl=name, ms=round(times[name], 4), rounds=[round(t, 4) for t in rounds[name]],
                   ratio_vs_ref=round(times[name] / times[ref], 3) if ref in times else None,
                   host_gap_us=round(times[name] * 1e3 - tr["kernel_us_per_step"], 1), **tr)
        except Exception as e:  # noqa: BLE001
            record(**row, impl=name, error=error_text(e))
