"""One benchmark harness: timing, device ceilings, result rows, the JSON file and the plot.

Timing follows ../shared/peers/peers_jax.py (the method behind ANCHORS.md), so our numbers and the
peers' compare directly: after a warm-up call, `n` calls are issued asynchronously and the device is
synchronised once; the mean time per call is taken, and the median of `reps` such means reported.
Inputs are sized well past the L2 cache so repeated calls do not measure the cache.

A benchmark module `benchmarks/bench_<op>.py` defines `run(rec: Recorder, quick: bool)` and records
one row per (case, implementation) with `rec.add(...)`; `benchmarks.run` discovers the modules.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# PF_RESULTS_DIR keeps a run's rows apart from the rows of record (a run on another jax version, say).
RESULTS_DIR = Path(os.environ.get("PF_RESULTS_DIR") or Path(__file__).parent / "results")


def _median_of_means(call: Callable, sync: Callable, n: int, reps: int) -> float:
    """Median over `reps` of the mean wall time (ms) of `n` asynchronous `call()`s, after a warm-up call;
    `sync` waits for the device once per rep."""
    sync(call())
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(n):
            out = call()
        sync(out)
        times.append((time.perf_counter() - start) / n * 1e3)
    return float(np.median(times))


def bench(fn: Callable, *args, n: int = 50, reps: int = 5) -> float:
    """Time `fn(*args)`: median over `reps` of the mean of `n` asynchronous calls (ms)."""
    return _median_of_means(lambda: fn(*args), jax.block_until_ready, n, reps)


def bench_carry(step: Callable, state: tuple, n: int = 50, reps: int = 5) -> float:
    """Like `bench` for a step that donates its inputs: `state = step(*state)` each call."""
    carry = [state]

    def call():
        carry[0] = step(*carry[0])
        return carry[0]

    return _median_of_means(call, jax.block_until_ready, n, reps)


def _interleaved(calls: dict[str, Callable[[], Any]], sync: Callable | dict[str, Callable], n: int, reps: int,
                 rounds: dict[str, list[float]] | None) -> dict[str, float]:
    """`_median_of_means` of several candidates {name: call} taken in turn: a warm-up call each, then `reps` rounds
    (at least one per candidate), each timing `n` calls of every candidate one after another, the order rotated by
    one each round, so that every candidate takes every place in the order once (the GPU's clocks drift down over the
    first rounds of sustained work: a candidate always timed early would gain); each candidate's median over the
    rounds (ms). `sync`: one wait for all, or one per candidate ({name: sync}: a torch peer synchronises its CUDA
    device). `rounds`, if given, receives every round's time per candidate."""
    syncs = sync if isinstance(sync, dict) else dict.fromkeys(calls, sync)
    times: dict[str, list[float]] = {} if rounds is None else rounds
    times.update({name: [] for name in calls})
    names = list(calls)
    if not names:
        return {}
    for name in names:
        syncs[name](calls[name]())
    for rep in range(max(reps, len(names))):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            call = calls[name]
            start = time.perf_counter()
            for _ in range(n):
                out = call()
            syncs[name](out)
            times[name].append((time.perf_counter() - start) / n * 1e3)
    return {name: float(np.median(t)) for name, t in times.items()}


def torch_sync(_=None) -> None:
    """Wait for the CUDA device (a torch peer's `sync`)."""
    import torch

    torch.cuda.synchronize()


def bench_interleaved(fns: dict[str, tuple[Callable, tuple]], n: int = 50, reps: int = 5,
                      rounds: dict[str, list[float]] | None = None,
                      syncs: dict[str, Callable] | None = None) -> dict[str, float]:
    """`bench` of several candidates {name: (fn, args)} taken in turn (`_interleaved`): candidates compared in one
    run then see the same drift of clocks and host latency within the process, where timed one after another the
    first one measured could run slower than the same call later. `syncs`: {name: sync} for candidates that are
    not jax (`torch_sync`); the others block on their output."""
    return _interleaved({name: (lambda fn=fn, args=args: fn(*args)) for name, (fn, args) in fns.items()},
                        {name: (syncs or {}).get(name, jax.block_until_ready) for name in fns}, n, reps, rounds)


def bench_carry_interleaved(steps: dict[str, tuple[Callable, tuple]], n: int = 50, reps: int = 5,
                            rounds: dict[str, list[float]] | None = None) -> dict[str, float]:
    """`bench_carry` of several candidates {name: (step, state)} taken in turn (`_interleaved`). A step whose host
    waits on the device every call (a lax.cond's predicate read-back) times host latency as much as GPU work, which
    drifts within a process (clocks, background compilation, allocator state): timed in turn, the candidates see
    the same drift."""
    def carried(step, state):
        carry = [state]

        def call():
            carry[0] = step(*carry[0])
            return carry[0]
        return call

    return _interleaved({name: carried(step, state) for name, (step, state) in steps.items()},
                        jax.block_until_ready, n, reps, rounds)


def amortized(fn: Callable) -> Callable:
    """One jit that runs fn on each argument tuple of its one argument, a list of them (`bench_amortized`'s call)."""
    return jax.jit(lambda sets: [fn(*args) for args in sets])


def bench_amortized(fn: Callable, arg_sets, n: int = 20, reps: int = 5) -> float:
    """ms of one `fn(*args)`: one jit runs fn on each of the k = len(arg_sets) argument tuples, `bench` of it / k.

    On the H200 a jitted call costs ~0.03 ms of host dispatch, so a single call of an op under ~0.05 ms times the
    dispatch, not the GPU; here it is paid once per k calls and overlaps their GPU work. Give distinct buffers
    that together pass the 50 MB L2, so the k calls do not measure the cache."""
    return bench(amortized(fn), list(arg_sets), n=n, reps=reps) / len(arg_sets)


def bench_carry_amortized(step: Callable, states, n: int = 50, reps: int = 5) -> float:
    """`bench_amortized` for a donating step `state = step(*state)`: the k distinct states are carried through one
    jit (copies of them, so `states` stay valid for the next candidate), divided by k."""
    many = jax.jit(lambda sts: [tuple(step(*st)) for st in sts], donate_argnums=0)
    carried = jax.tree.map(jnp.copy, states)
    return bench_carry(lambda sts: (many(sts),), (carried,), n=n, reps=reps) / len(states)


def bench_torch(fn: Callable, n: int = 50, reps: int = 5) -> float:
    """The same method for a torch peer (synchronising the CUDA device instead of blocking on arrays)."""
    return _median_of_means(fn, torch_sync, n, reps)


def error_text(e: Exception) -> str:
    """A failure as a results row records it."""
    return f"{type(e).__name__}: {str(e)[:300]}"


def rnd(seed: int, shape, dtype=jnp.float32, scale: float = 1.0) -> jax.Array:
    """Random normal benchmark data (never zeros: they can run faster than real data)."""
    return (jax.random.normal(jax.random.key(seed), shape, jnp.float32) * scale).astype(dtype)


def probe_command_line(name: str, default_cases) -> tuple[Callable[..., None], list[tuple[int, ...]]]:
    """A development probe's command line, OUT_DIR [TOKENSxINxOUT:R ...]: its recorder (`probe_recorder` of
    OUT_DIR/<name>.json, OUT_DIR made if missing) and the cases named, as int tuples, else `default_cases`."""
    out_dir, args = sys.argv[1], sys.argv[2:]
    os.makedirs(out_dir, exist_ok=True)
    cases = [tuple(int(v) for v in c.replace(":", "x").split("x")) for c in args] or list(default_cases)
    return probe_recorder(os.path.join(out_dir, f"{name}.json")), cases


def probe_recorder(path: str | os.PathLike) -> Callable[..., None]:
    """`record(**row)` for a development probe: prints the row and rewrites the JSON list at `path` after every row,
    so a probe cut off by a time limit keeps what it measured."""
    rows: list[dict] = []

    def record(**row):
        rows.append(row)
        print(" | ".join(f"{k}={v}" for k, v in row.items()), flush=True)
        with open(path, "w") as f:
            json.dump(rows, f, indent=1, default=str)

    return record


@dataclass
class Ceilings:
    """What this device does, measured in the same run as the benchmarks."""

    hbm_gbps: float  # XLA elementwise fp32, bytes read + written
    bf16_tflops: float  # XLA bf16 matmul 8192^3
    tf32_tflops: float  # XLA fp32 matmul 8192^3 at default precision

    @classmethod
    def measure(cls, quick: bool = False) -> Ceilings:
        n = 64 * 1024 * 1024 if quick else 256 * 1024 * 1024
        x = rnd(0, (n,))
        ms = bench(jax.jit(lambda x: x * 1.5 + 0.5), x, n=20)
        hbm = 2 * n * 4 / ms / 1e6
        del x
        size = 4096 if quick else 8192
        a, b = rnd(1, (size, size), jnp.bfloat16), rnd(2, (size, size), jnp.bfloat16)
        bf16 = 2 * size**3 / bench(jax.jit(jnp.matmul), a, b, n=10) / 1e9
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        tf32 = 2 * size**3 / bench(jax.jit(jnp.matmul), a, b, n=10) / 1e9
        return cls(hbm_gbps=hbm, bf16_tflops=bf16, tf32_tflops=tf32)


@dataclass
class Row:
    op: str
    case: str
    impl: str  # ours: "pallas", "pallas:<variant>", "xla"; peers: "peer:<name>"
    ms: float | None
    gbps: float | None = None
    tflops: float | None = None
    pct_hbm: float | None = None
    pct_matmul: float | None = None
    floor_ms: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class Recorder:
    """Collects rows; turns bytes and FLOPs into rates and % of the measured ceilings."""

    def __init__(self, ceilings: Ceilings, on_row: Callable[[], None] | None = None):
        self.ceilings = ceilings
        self.rows: list[Row] = []
        # Called after every row (the CLI writes the results file, at most every few seconds): a run killed in the
        # middle of an op, where no exception handler runs, keeps what it measured.
        self.on_row = on_row

    def add(self, op: str, case: str, impl: str, ms: float | None, *, nbytes: float | None = None,
            flops: float | None = None, matmul_ceiling: str = "bf16_tflops", **extra) -> Row:
        """Record one timing. `nbytes`: the fewest bytes the op must move (gives GB/s, % of HBM and the
        floor); `flops`: its arithmetic (gives TFLOP/s and % of the named matmul ceiling)."""
        row = Row(op=op, case=case, impl=impl, ms=ms, extra=extra)
        if nbytes:
            row.floor_ms = nbytes / (self.ceilings.hbm_gbps * 1e6)
        if ms:
            if nbytes:
                row.gbps = nbytes / ms / 1e6
                row.pct_hbm = 100 * row.gbps / self.ceilings.hbm_gbps
            if flops:
                row.tflops = flops / ms / 1e9
                peak = getattr(self.ceilings, matmul_ceiling, None) or extra.get("peak_tflops")
                if peak:
                    row.pct_matmul = 100 * row.tflops / peak
        self.rows.append(row)
        rate = f"{row.gbps:7.0f} GB/s {row.pct_hbm:5.1f}% HBM" if row.gbps else ""
        if row.tflops:
            rate += f" {row.tflops:7.1f} TFLOP/s"
        shown = f"{ms:8.4f} ms" if ms else "   failed"
        print(f"  {op:10s} {case:38s} {impl:30s} {shown} {rate}", flush=True)
        if self.on_row:
            self.on_row()
        return row

    def measure(self, op: str, case: str, impl: str, timing: Callable[[], float], **kw) -> Row:
        """Record the ms that `timing()` returns; a failure is recorded (ms=None, error text), not raised."""
        try:
            ms = timing()
        except Exception as e:  # noqa: BLE001 - a failing implementation is a result, not a crash
            return self.add(op, case, impl, None, error=error_text(e))
        return self.add(op, case, impl, ms, **kw)

    def time(self, op: str, case: str, impl: str, fn: Callable, *args, n: int = 50, reps: int = 5, **kw) -> Row:
        """Time `fn(*args)` (`bench`) and record it, as `measure`."""
        return self.measure(op, case, impl, lambda: bench(fn, *args, n=n, reps=reps), **kw)

    def time_interleaved(self, op: str, case: str, candidates: dict[str, tuple[Callable, tuple, dict]], n: int = 50,
                         reps: int = 5, calls: int = 1, carried: bool = False,
                         syncs: dict[str, Callable] | None = None, **kw) -> None:
        """Time candidates {impl: (fn, args, extra)} in turn (`bench_interleaved`) and record one row each (its
        `extra` and `kw` beside it, every round's time as `rounds_ms`), a time per call of fn / `calls` (the ops one
        call runs: `bench_amortized`'s k). A candidate whose first call fails is recorded as failed and left out; a
        failure while timing is recorded for all. `carried`: each fn is a donating step and its args the state it
        carries (`bench_carry_interleaved`), already the output of a first call. `syncs`: {impl: sync} for
        candidates that are not jax (a torch peer: `torch_sync`)."""
        rounds: dict[str, list[float]] = {}
        syncs = syncs or {}
        for impl, (fn, args, extra) in [] if carried else list(candidates.items()):
            try:
                syncs.get(impl, jax.block_until_ready)(fn(*args))
            except Exception as e:  # noqa: BLE001 - a failing candidate is a result, not a crash
                self.add(op, case, impl, None, error=error_text(e), **extra, **kw)
                candidates = {k: v for k, v in candidates.items() if k != impl}
        fns = {impl: (fn, args) for impl, (fn, args, _) in candidates.items()}
        try:
            if carried:
                times = bench_carry_interleaved(fns, n=n, reps=reps, rounds=rounds)
            else:
                times = bench_interleaved(fns, n=n, reps=reps, rounds=rounds, syncs=syncs)
        except Exception as e:  # noqa: BLE001 - a failing candidate is a result, not a crash
            for impl, (_, _, extra) in candidates.items():
                self.add(op, case, impl, None, error=error_text(e), **extra, **kw)
            return
        for impl, (_, _, extra) in candidates.items():
            self.add(op, case, impl, times[impl] / calls, timing="interleaved",
                     rounds_ms=[round(t / calls, 4) for t in rounds[impl]], **extra, **kw)

    def time_amortized(self, op: str, case: str, impl: str, fn: Callable, arg_sets, n: int = 20, reps: int = 5,
                       **kw) -> Row:
        """Time `fn` with `bench_amortized` over the k argument tuples and record it (k beside it), as `measure`."""
        return self.measure(op, case, impl, lambda: bench_amortized(fn, arg_sets, n=n, reps=reps), k=len(arg_sets),
                            **kw)


def device_slug() -> str:
    device = jax.devices()[0]
    name = getattr(device, "device_kind", device.platform)
    return "".join(ch if ch.isalnum() else "_" for ch in name.lower()).strip("_")


def write_results(rec: Recorder, ops: list[str], out_dir: str | os.PathLike | None = None, *,
                  plot: bool = True) -> Path:
    """Merge this run's rows into results/<device>.json (rows it did not measure again are kept); `plot`: redraw
    results/<device>.png too."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{device_slug()}.json"
    old = json.loads(path.read_text()) if path.exists() else {"rows": []}
    # A row is replaced by this run's row of the same (op, case, impl): a run of some sections (or a run cut
    # short) keeps the rows it did not measure again.
    measured = {(r.op, r.case, r.impl) for r in rec.rows}
    kept = [r for r in old.get("rows", []) if (r["op"], r["case"], r["impl"]) not in measured]
    run = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "jax": jax.__version__, "ops": list(ops),
           "ceilings": asdict(rec.ceilings)}
    # Each run's ceilings are kept beside the ops it measured: rows' % figures are of their own run's.
    live = {r.get("run") for r in kept}
    runs = [r for r in old.get("runs", []) if r["date"] in live] + [run]
    doc = {
        "device": jax.devices()[0].device_kind,
        "method": "median of reps of mean wall time of n async calls (peers_jax.py method)",
        "runs": runs,
        "rows": kept + [{**asdict(r), "run": run["date"]} for r in rec.rows],
    }
    # Written whole under another name, then renamed: a run killed while writing leaves the previous file intact.
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(path)
    if plot:
        plot_results(doc, path.with_suffix(".png"))
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        for p in (path, path.with_suffix(".png")):
            if p.exists():
                (Path(out_dir) / p.name).write_bytes(p.read_bytes())
    return path


def plot_results(doc: dict, path: Path) -> None:
    """One panel per op: time of each implementation per case, relative to the XLA reference."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    ops = sorted({r["op"] for r in doc["rows"]})
    if not ops:
        return
    fig, axes = plt.subplots(len(ops), 1, figsize=(11, 3.2 * len(ops)), squeeze=False)
    for ax, op in zip(axes[:, 0], ops):
        rows = [r for r in doc["rows"] if r["op"] == op and r["ms"]]
        cases = list(dict.fromkeys(r["case"] for r in rows))
        impls = list(dict.fromkeys(r["impl"] for r in rows))
        width = 0.8 / max(len(impls), 1)
        for i, impl in enumerate(impls):
            ys = [next((r["ms"] for r in rows if r["case"] == c and r["impl"] == impl), np.nan) for c in cases]
            ax.bar(np.arange(len(cases)) + i * width, ys, width, label=impl)
        ax.set_xticks(np.arange(len(cases)) + 0.4 - width / 2, cases, fontsize=7, rotation=12)
        ax.set_ylabel("ms (lower is better)")
        ax.set_title(f"{op} on {doc['device']}")
        ax.legend(fontsize=6, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# What a user writes against what they would use instead, one bar per pair: (label, op, case, ours, peer).
# Each pair is read from one run of the JSON; a pair whose two rows come from different runs is left out,
# because clocks and the machine's load differ between runs.
USER_PATH_PAIRS = [
    ("apply_rotary fwd+bwd vs XLA", "rotary", "B4 S4096 Hq32 Hk8 D128 fwd+bwd", "user:apply_rotary", "xla"),
    ("apply_rotary fwd+bwd vs torch.compile", "rotary", "B4 S4096 Hq32 Hk8 D128 fwd+bwd", "user:apply_rotary",
     "peer:torch_compile"),
    ("apply_rotary fwd vs XLA", "rotary", "B4 S4096 Hq32 Hk8 D128 fwd", "user:apply_rotary", "xla"),
    ("DoRADense fwd+bwd 4096->4096 vs XLA", "dora_fwdbwd", "4096x4096->4096 r16 bf16", "user:DoRADense", "xla"),
    ("DoRADense fwd+bwd 4096->11008 vs XLA", "dora_fwdbwd", "4096x4096->11008 r64 bf16", "user:DoRADense", "xla"),
    *[(f"QDoRA int8 dora_dense fwd+bwd {case} vs XLA dequantize + GEMM", "qdora_fwdbwd", f"{case} bf16",
       "pallas:int8", "xla:int8") for case in ("4096x4096->4096 r16", "4096x4096->11008 r64")],
    ("FP8 Dense tensorwise vs flax fp8", "fp8_dense", "16384x8192->8192 fwd+bwd", "pallas:tensorwise",
     "peer:flax_fp8_direct"),
    ("FP8 Dense rowwise vs bf16 nn.Dense", "fp8_dense", "16384x8192->8192 fwd+bwd", "pallas:rowwise",
     "peer:bf16_dense"),
    *[(f"scaled_matmul_nt {case} vs torch._scaled_mm", "fp8_mm", case, "user:scaled_matmul_nt",
       "peer:torch_scaled_mm")
      for case in ("8192x8192x8192 rowwise", "16384x16384x16384 rowwise", "4096x4096x4096 rowwise",
                   "16384x4096x11008 rowwise", "16384x2048x512 rowwise", "2048x16384x512 tensorwise")],
    *[(f"galore_adamw step {case} vs optax.contrib.galore", "galore", f"user path {case}", "pallas:tx",
       "peer:optax_contrib_galore")
      for case in ("4096x4096 r128 float32", "4096x11008 r128 float32", "4096x4096 r128 bfloat16")],
    *[(f"galore_adamw step {case}, refresh= from the host, vs optax.contrib.galore", "galore", f"user path {case}",
       "pallas:tx_host_refresh", "peer:optax_contrib_galore")
      for case in ("4096x4096 r128 float32", "4096x4096 r128 bfloat16", "llama7b layer r128 float32",
                   "llama7b layer r128 bfloat16")],
    ("galore_adamw, Llama-7B layer, refresh amortized", "galore", "llama7b layer r128 gap200", "pallas:tx",
     "peer:optax_contrib_galore"),
    ("adamw (composable) 105M vs optax.adamw", "adam", "105M fp32 params, 4x(4096, 6400)", "xla:optax",
     "peer:optax_adamw"),
    ("adamw_step 8-bit 105M vs optax.adamw", "adam", "105M fp32 params, 4x(4096, 6400)", "pallas:inplace_8bit",
     "peer:optax_adamw"),
]


def user_path_ratios(doc: dict, pairs=USER_PATH_PAIRS) -> list[tuple[str, float, str]]:
    """(label, peer ms / our ms, run) for each pair measured in one run: > 1 means ours is faster."""
    rows = {(r["op"], r["case"], r["impl"]): r for r in doc["rows"] if r.get("ms")}
    out = []
    for label, op, case, ours, peer in pairs:
        a, b = rows.get((op, case, ours)), rows.get((op, case, peer))
        if a is not None and b is not None and a.get("run") == b.get("run"):
            out.append((label, b["ms"] / a["ms"], a["run"]))
    return out


def plot_ratios(doc: dict, path: Path, pairs=USER_PATH_PAIRS) -> None:
    """A horizontal bar per pair: the peer's time over ours (log scale; right of 1 = ours faster)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios = user_path_ratios(doc, pairs)
    fig, ax = plt.subplots(figsize=(9, 0.38 * len(ratios) + 1.4))
    ys = np.arange(len(ratios))[::-1]
    values = [r for _, r, _ in ratios]
    # Bars grow from 1 (a tie) in either direction; within 3% of a tie is grey (run-to-run noise).
    colors = ["#8c8c8c" if abs(v - 1) < 0.03 else "#2a9d4b" if v > 1 else "#c0392b" for v in values]
    ax.barh(ys, [v - 1 for v in values], left=1.0, color=colors, height=0.7)
    for y, v in zip(ys, values):
        ax.text(v * (1.05 if v >= 1 else 0.95), y, f"{v:.2f}x", va="center", ha="left" if v >= 1 else "right",
                fontsize=7)
    ax.set_yticks(ys, [label for label, _, _ in ratios], fontsize=7)
    ax.set_xscale("log")
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_xlim(min(values + [1.0]) / 1.6, max(values + [1.0]) * 1.8)
    ax.set_xlabel("peer time / our time (log scale; > 1: ours faster), same run, same inputs")
    runs = sorted({run for _, _, run in ratios})
    ax.set_title(f"pallas_fused vs peers on one {doc['device']} (runs {runs[0][:10]} to {runs[-1][:10]})", fontsize=9)
    ax.grid(axis="x", alpha=0.3, which="both")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
