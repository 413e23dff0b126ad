"""The autotuner: time each op's candidates at the shapes a function runs, on this GPU, and keep the fastest.

    result = pallas_fused.tune(train_step, params, batch, budget_s=300)
    print(result.table())

    python -m pallas_fused.tune [--budget 420] [--cache-dir DIR] [--ops fp8,dora] [--shapes MxKxN,...]

`tune` traces `fn` once (`jax.eval_shape`: ShapeDtypeStructs serve as example arguments) while recording every
per-shape lookup a tunable op makes (`_tuning.choice`), then times each candidate configuration of each (op, shape)
on the device: one compile per candidate, a warm-up call whose outputs must agree with the shape's first candidate's
(`disagreement`: a candidate that computes something else counts as failed), then `ROUNDS` rounds that take the
shape's candidates in turn, each round timing each candidate as the median of several means of back-to-back calls
(each call running the op on a few distinct operand sets, past the L2, so that the host's dispatch is amortized, as
benchmarks/common.py times); a candidate's time is its median over the rounds. The rounds matter on a GPU held at
its power limit: a candidate timed alone, right after the idle of its compile, runs at clocks that the sustained
load of a training step does not give it, and a kernel that draws more power gains more from them, enough to
reverse the order of two FP8 GEMM tiles (docs/performance.md, "Why the tuner and the rows of record disagreed").
The winners (the op's untuned choice on a tie), with every
candidate's time, go to the user's tuning cache, <cache dir>/<device>.json, written atomically; this process then
reads it, and so does every later one, before the shipped table (pallas_fused/_tuning.py). In a multi-process job
every process times its own GPU, then writes process 0's results, so that every host holds the same file (a shared
cache dir gets the same bytes from each). The time is bounded by `budget_s`: once it is spent, the remaining
candidates are left untimed (a candidate started before then finishes), and a shape keeps the fastest of those
timed, its untuned choice always first (rounds cut short by the budget: a median over the rounds each candidate got).

On a machine without a GPU nothing is timed (the recording still runs); a test passes its own `timer`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from pallas_fused import _backend, _tuning

# timer(op, shape key, candidate name, config) -> ms per op call, one round's time (called once per round)
Timer = Callable[[str, str, str, dict], float]

ROUNDS = 3  # times each candidate of a shape is timed, taken in turn with the shape's other candidates


@dataclasses.dataclass
class TuneResult:
    """What `tune` found: the entries written ({op: {key: {"choice", "config", "ms"}}}), the cache file (None where
    nothing was written), the (op, key) lookups recorded, how many candidates the budget left untimed, the time."""

    entries: dict[str, dict[str, dict[str, Any]]]
    path: Path | None
    recorded: list[tuple[str, str]]
    untimed: int
    elapsed_s: float

    def table(self) -> str:
        """One line per tuned shape: the choice, its time, the untuned choice's time and the gain."""
        lines = [f"{'op':<10} {'shape':<58} {'choice':<24} {'ms':>8} {'untuned':>8} {'gain':>6}"]
        for op, entries in self.entries.items():
            for key, entry in entries.items():
                first = next(iter(entry["ms"].values()))
                best = entry["ms"][entry["choice"]]
                gain = f"{first / best:5.2f}x" if first else "     -"
                untuned = f"{first:8.4f}" if first else "       -"
                lines.append(f"{op:<10} {key:<58} {entry['choice']:<24} {best:8.4f} {untuned} {gain}")
        lines.append(f"{sum(map(len, self.entries.values()))} shapes tuned, {self.untimed} candidates left untimed "
                     f"by the budget, {self.elapsed_s:.0f} s; cache: {self.path}")
        return "\n".join(lines)


def measure(call: Callable[[], Any], ops: int = 1, *, target_ms: float = 20.0, reps: int = 5) -> float:
    """ms per op of `call()`, which runs `ops` of them: after a warm-up call (the compile), the median over `reps` of
    the mean time of n back-to-back calls, n chosen so that each mean spans about `target_ms`."""
    jax.block_until_ready(call())
    start = time.perf_counter()
    jax.block_until_ready(call())
    once = max(time.perf_counter() - start, 1e-6) * 1e3
    n = max(3, min(200, math.ceil(target_ms / once)))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(n):
            out = call()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / n * 1e3)
    return float(np.median(times)) / ops


# Candidates of one shape compute the same thing from the same operands (each build makes them from fixed seeds),
# in different orders of float32 accumulation: their outputs differ by rounding, far below this relative
# (Frobenius) difference, where a tile or schedule the kernel gets wrong gives a difference of order one.
AGREE_RTOL = 2.0**-5

_first: dict[tuple[str, str], tuple[str, Any]] = {}  # (op, key) -> (candidate, outputs) of the first one timed


def disagreement(got: Any, want: Any, rtol: float = AGREE_RTOL) -> str | None:
    """Why `got` is not `want` up to rounding (a leaf's relative Frobenius difference above `rtol`, or not finite
    where `want` is), or None where they agree. Computed on the device: no output is copied to the host."""
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    if len(got_leaves) != len(want_leaves):
        return f"{len(got_leaves)} outputs where the first candidate gave {len(want_leaves)}"
    for i, (g, w) in enumerate(zip(got_leaves, want_leaves)):
        if g.shape != w.shape:
            return f"output {i} has shape {g.shape}, the first candidate's {w.shape}"
        g32, w32 = g.astype(jax.numpy.float32), w.astype(jax.numpy.float32)
        diff = float(jax.numpy.linalg.norm((g32 - w32).ravel()))
        scale = float(jax.numpy.linalg.norm(w32.ravel()))
        if not (diff <= rtol * scale):  # NaN compares false: a non-finite output disagrees
            return f"output {i} differs from the first candidate's by {diff / max(scale, 1e-30):.3g} (relative)"
    return None


_built: dict[tuple[str, str, str], tuple[Callable[[], Any], int]] = {}  # this shape's calls, compiled once


def time_candidate(op: str, key: str, name: str, config: dict) -> float:
    """The default timer: `measure` of the op's own benchmark call (`_tuning.Tunable.build`), built and compiled on
    the candidate's first round, after checking that its outputs agree with those of the first candidate of the
    shape that ran (the untuned choice, unless it failed): a candidate that computes something else raises, so it is
    recorded as failed and never chosen."""
    if (op, key, name) not in _built:
        call, ops = _tuning.TUNABLES[op].build(key, config)
        out = jax.block_until_ready(call())
        if (op, key) not in _first:
            _first.clear()  # one shape's reference outputs and calls on the device at a time
            _built.clear()
            _first[(op, key)] = (name, out)
        else:
            first, want = _first[(op, key)]
            why = disagreement(out, want)
            if why is not None:
                raise ValueError(f"{name} disagrees with {first}: {why}")
        del out
        _built[(op, key, name)] = (call, ops)
    return measure(*_built[(op, key, name)])


class _Progress:
    """A tqdm bar where tqdm is installed, else one plain line per step (on stderr); nothing where off."""

    def __init__(self, total: int, enabled: bool):
        self.bar, self.enabled, self.total, self.done = None, enabled, total, 0
        if enabled:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                return
            self.bar = tqdm(total=total, desc="pallas_fused.tune", unit="candidate")

    def step(self, text: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(text[-60:], refresh=False)
            self.bar.update(1)
        elif self.enabled:
            print(f"[{self.done}/{self.total}] {text}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def pick(ms: dict[str, float | None]) -> str | None:
    """The fastest candidate timed, the earlier one on a tie (the op's untuned choice comes first); None where none
    was timed."""
    timed = [(t, i, name) for i, (name, t) in enumerate(ms.items()) if t is not None]
    return min(timed)[2] if timed else None


def tune(fn: Callable, *example_args, budget_s: float = 600.0, cache_dir: str | os.PathLike | None = None,
         progress: bool = True, timer: Timer | None = None, clock: Callable[[], float] = time.monotonic) -> TuneResult:
    """Tune every tunable op `fn(*example_args)` runs, at its shapes, on this device; see the module docstring.

    budget_s: seconds of timing (compiles included) after which the remaining candidates are left untimed.
    cache_dir: where the cache file goes (default `_tuning.cache_dir()`); this process reads it from then on.
    progress: a progress bar (tqdm if installed, else plain lines on stderr).
    timer, clock: `timer(op, key, candidate, config) -> ms` (default: compile and time it on the device) and the
    clock the budget is counted on; tests pass their own.
    """
    if budget_s <= 0:
        raise ValueError(f"tune: budget_s must be positive, got {budget_s}")
    start = clock()
    jax.clear_caches()  # a function traced before would not be traced again, and its lookups not recorded
    with _tuning.recording() as recorded:
        jax.eval_shape(fn, *example_args)
    work = [(op, key) for op, key in recorded if op in _tuning.TUNABLES]
    if timer is None:
        if _backend.gpu_device() is None:
            warnings.warn("pallas_fused.tune: no GPU in this process, nothing timed", RuntimeWarning, stacklevel=2)
            return TuneResult({}, None, list(recorded), 0, clock() - start)
        timer = time_candidate
    plan = [(op, key, _tuning.TUNABLES[op].candidates(key)) for op, key in work]
    bar = _Progress(sum(len(c) for *_, c in plan), progress)
    times: dict[tuple[str, str], dict[str, float | None]] = {}
    untimed = 0
    try:
        for op, key, candidates in plan:
            rounds: dict[str, list[float]] = {}
            failed: set[str] = set()
            for round_ in range(ROUNDS):
                for name, config in candidates.items():
                    if name in failed or clock() - start >= budget_s:
                        continue
                    try:
                        ms = float(timer(op, key, name, config))
                        rounds.setdefault(name, []).append(ms)
                        note = f"{ms:.4f} ms"
                    except Exception as err:  # noqa: BLE001 - a candidate that fails to compile or run is not chosen
                        failed.add(name)
                        note = f"failed: {type(err).__name__}: {str(err)[:120]}"
                    if round_ == 0:
                        bar.step(f"{op} {key} {name}: {note}")
            untimed += sum(name not in rounds and name not in failed for name in candidates)
            times[(op, key)] = {name: None if name in failed else float(np.median(rounds[name]))
                                for name in candidates if name in rounds or name in failed}
    finally:
        bar.close()
        _first.clear()
        _built.clear()
    entries: dict[str, dict[str, dict[str, Any]]] = {}
    for (op, key), ms in times.items():
        winner = pick(ms)
        if winner is not None:
            configs = dict(plan[work.index((op, key))][2])
            entries.setdefault(op, {})[key] = {"choice": winner, "config": configs[winner], "ms": ms}
    entries = process_zeros(entries)
    directory = Path(cache_dir).expanduser() if cache_dir is not None else _tuning.cache_dir()
    path = write_cache(directory, entries) if entries else None
    if cache_dir is not None:
        _tuning.set_cache_dir(directory)
    _tuning.reload()
    jax.clear_caches()  # the next trace of a function reads the new choices
    return TuneResult(entries, path, list(recorded), untimed, clock() - start)


def process_zeros(entries: dict) -> dict:
    """Process 0's `entries` in every process of a multi-process job (each timed its own GPU, and a budget may have
    cut them off at different candidates): every host then writes the same file and makes the same choices."""
    if jax.process_count() == 1:
        return entries
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(entries).encode(), np.uint8)
    size = int(multihost_utils.broadcast_one_to_all(np.int32(data.size)))
    padded = np.zeros(size, np.uint8)
    padded[:min(size, data.size)] = data[:size]
    return json.loads(bytes(np.asarray(multihost_utils.broadcast_one_to_all(padded))).decode())


def write_cache(directory: Path, entries: dict[str, dict[str, dict[str, Any]]]) -> Path:
    """`entries` merged into this device's cache file in `directory` (its other entries kept; a file that is not a
    valid cache of this device is replaced), written atomically: a reader sees the old file or the new one."""
    device = _tuning.current_device()
    path = directory / f"{_tuning.device_slug(device.kind)}.json"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the file being replaced was warned about where it was read
        old = dict(_tuning.read_table(path, device.kind))
    shapes = old.pop(_tuning.SHAPES, {})
    for op, found in entries.items():
        shapes[op] = {**shapes.get(op, {}), **found}
    from pallas_fused import __version__

    data = {"schema": _tuning.SCHEMA, "device_kind": device.kind,
            "compute_capability": list(device.compute_capability) if device.compute_capability else None,
            "num_sms": device.num_sms, "written_by": "pallas_fused.tune", "jax": jax.__version__,
            "pallas_fused": __version__}
    data.update({k: v for k, v in sorted(old.items()) if k not in _tuning.HEADER})
    data[_tuning.SHAPES] = {op: dict(sorted(shapes[op].items())) for op in sorted(shapes)}
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
