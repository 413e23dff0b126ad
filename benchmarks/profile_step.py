"""Profile the example's training step: GPU kernel time per step by kernel family, ours against the baseline.

    python benchmarks/profile_step.py --preset gpu --steps 10 --out runs/profile
    python benchmarks/profile_step.py --preset gpu --steps 10 --attention cudnn --fp8 none,tensorwise --out ...
    python benchmarks/profile_step.py --preset cpu --d-model 64 --n-layers 1 --steps 2 --out /tmp/p   # CPU smoke

Each run builds the step exactly as examples/train_llama.py does (its presets, model config, optimizers
and `llama.train.place`): "baseline" is the plain flax/optax run (implementation "xla", optax.contrib.galore,
bf16 nn.Dense); "ours" is pallas_fused at `--implementation` (default: the kernels on a GPU), once per `--fp8`
recipe ("none" = bf16 block projections). `--attention` is the same for every run. Each run compiles and
takes `--warmup` steps (the GaLore projector refresh of step 0 among them), then `--steps` steps are traced
with `jax.profiler.trace(..., create_perfetto_trace=True)`; the gzipped perfetto JSON is parsed and every
GPU kernel event summed by family (`classify`), divided by the number of traced steps.

Writes <out>/profile.md (a table of ms per step by family for every run, then each run's top kernels),
<out>/profile.json (the same numbers, every kernel name with its ms per step and call count, and the trace
threads read) and the traces under <out>/traces/<run>/ (the perfetto JSON only; `--keep-xplane` keeps the
.xplane.pb too).

Which events count (`benchmarks.trace.parse`): on a GPU, the device processes' stream threads, i.e. the
kernels and memcpy/memset as they ran ("XLA Ops" / "XLA Modules" repeat them and are skipped). Without a GPU
(the CPU smoke run), the XLA CPU client's thunks on the host stand in, so the table is produced; only its
families mean little there.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
if str(ROOT) not in sys.path:
    sys.path.insert(1, str(ROOT))

import train_llama as example  # noqa: E402  (examples/train_llama.py: presets, model config, optimizers)
from llama import data  # noqa: E402
from llama.model import Llama  # noqa: E402
from llama.train import TrainState, place  # noqa: E402

from benchmarks import trace  # noqa: E402  (the perfetto parser: GPU stream events, or the CPU thunks)

FAMILIES = ("pallas_fused", "gemm", "attention", "scatter", "transpose/copy", "xla fusion", "other")

# Substrings of kernel names, checked in this order (the first match wins; names compared lower-case).
_RULES = (
    ("pallas_fused", ("pallas_fused",)),
    ("scatter", ("scatter",)),
    ("attention", ("flash", "fmha", "sdpa", "attention", "cudnn")),
    ("gemm", ("gemm", "cublas", "cutlass", "xmma", "nvjet", "matmul", "sm90_", "sm80_", "dot")),
    ("transpose/copy", ("transpose", "copy", "memcpy", "memset", "concatenate", "dynamic_update_slice")),
    ("xla fusion", ("fusion", "reduce", "convert", "wrapped_", "broadcast", "select", "slice")),
)


def classify(name: str) -> str:
    """The family of one kernel name (see FAMILIES)."""
    low = name.lower()
    for family, keys in _RULES:
        if any(k in low for k in keys):
            return family
    return "other"


def summarize(times: trace.KernelTimes, steps: int) -> dict:
    """ms per step by family and by kernel name (with calls per step)."""
    kernels = sorted(({"name": n, "family": classify(n), "ms_per_step": us / 1e3 / steps,
                       "calls_per_step": times.counts[n] / steps} for n, us in times.per_kernel.items()),
                     key=lambda k: -k["ms_per_step"])
    families = {f: 0.0 for f in FAMILIES}
    for k in kernels:
        families[k["family"]] += k["ms_per_step"]
    idle_before = sorted(({"name": n, "family": classify(n), "ms_per_step": us / 1e3 / steps,
                           "gaps_per_step": times.gaps_before[n] / steps} for n, us in times.idle_before.items()),
                         key=lambda k: -k["ms_per_step"])
    return {"families_ms": families, "total_ms": sum(families.values()), "kernels": kernels,
            "span_ms_per_step": times.span_us / 1e3 / steps, "idle_ms_per_step": times.idle_us / 1e3 / steps,
            "idle_before": idle_before}


def _settings(args) -> dict:
    s = dict(example.PRESETS[args.preset])
    for key in ("batch_size", "seq_len", "n_layers", "d_model", "dtype"):
        if getattr(args, key) is not None:
            s[key] = getattr(args, key)
    return s


def _batches(s: dict, count: int, seed: int) -> list[np.ndarray]:
    # Real text (the example's pretraining split): the embedding gradient's row collisions depend on it.
    stream = data.load_split("pretrain", max_bytes=s["max_bytes"] or 64 * 1024 * 1024)
    it = data.Batches(stream, s["batch_size"], s["seq_len"], seed)
    return [next(it) for _ in range(count)]


def profile_run(name: str, *, baseline: bool, fp8: str | None, s: dict, args, batches, trace_dir: pathlib.Path) -> dict:
    implementation = "xla" if baseline else args.implementation
    cfg = example.model_config(s, implementation=implementation, fp8=None if baseline else fp8,
                               attention=args.attention)
    init_cfg = example.model_config(s, implementation="xla")
    params = jax.jit(lambda key, t: Llama(init_cfg).init(key, t)["params"])(jax.random.PRNGKey(args.seed),
                                                                            jnp.asarray(batches[0][:1, :-1]))
    tx = example.pretrain_optimizer(s, params, baseline=baseline, implementation=implementation,
                                    projector="randomized", inplace=True)
    state = TrainState(step=jnp.zeros((), jnp.int32), trainable=params, frozen={}, opt_state=tx.init(params))
    every = example.host_refresh_every(s, baseline=baseline)
    state, train_step, put = place(state, Llama(cfg), tx, None, s["batch_size"])

    def refresh(i):  # as the example's loop: GaLore's refresh named by the host where the optimizer takes it
        return None if every is None else i % every == 0

    start = time.perf_counter()
    state, loss = train_step(state, put(batches[0]), refresh(0))
    loss.block_until_ready()
    compile_s = time.perf_counter() - start
    for i in range(1, args.warmup):
        state, loss = train_step(state, put(batches[i]), refresh(i))
    loss.block_until_ready()
    inputs = [put(b) for b in batches[args.warmup:args.warmup + args.steps]]
    jax.block_until_ready(inputs)
    if trace_dir.exists():
        shutil.rmtree(trace_dir)
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        start = time.perf_counter()
        for i, batch in enumerate(inputs):
            with jax.profiler.StepTraceAnnotation("train", step_num=args.warmup + i):
                state, loss = train_step(state, batch, refresh(args.warmup + i))
        loss.block_until_ready()
        wall_ms = (time.perf_counter() - start) * 1e3 / len(inputs)
    paths = sorted(trace_dir.rglob("perfetto_trace.json.gz"))
    if not paths:
        raise RuntimeError(f"{name}: no perfetto_trace.json.gz under {trace_dir}")
    gpu = example.has_gpu()
    times = trace.parse(trace_dir, host=not gpu)
    if not args.keep_xplane:
        for p in trace_dir.rglob("*.xplane.pb"):
            p.unlink()
    if gpu and not times.per_kernel:
        print(f"WARNING {name}: the trace has no GPU kernel events (is CUPTI available to the profiler?)", flush=True)
    return {"name": name, "implementation": implementation or "auto", "fp8": None if baseline else fp8,
            "attention": args.attention, "steps_traced": len(inputs), "wall_ms_per_step": wall_ms,
            "compile_s": compile_s, "final_loss": float(loss), "trace": str(paths[-1]), "device": gpu,
            "threads": times.threads, **summarize(times, len(inputs))}


def _short(name: str) -> str:
    return name if len(name) <= 90 else name[:87] + "..."


def markdown(runs: list[dict], top: int) -> str:
    lines = ["# Training step profile: GPU kernel time per step by family (ms)", ""]
    lines.append("| family | " + " | ".join(r["name"] for r in runs) + " |")
    lines.append("|---|" + "---:|" * len(runs))
    for fam in FAMILIES:
        cells = [f"{r['families_ms'][fam]:.2f} ({100 * r['families_ms'][fam] / max(r['total_ms'], 1e-9):.0f}%)"
                 for r in runs]
        lines.append(f"| {fam} | " + " | ".join(cells) + " |")
    lines.append("| **kernel sum** | " + " | ".join(f"**{r['total_ms']:.2f}**" for r in runs) + " |")
    lines.append("| wall ms / step (traced) | " + " | ".join(f"{r['wall_ms_per_step']:.2f}" for r in runs) + " |")
    lines.append("| GPU idle ms / step (no kernel running, first kernel to last) | "
                 + " | ".join(f"{r['idle_ms_per_step']:.2f}" for r in runs) + " |")
    lines += ["", "Runs: " + "; ".join(f"{r['name']}: implementation={r['implementation']}, fp8={r['fp8']}, "
                                       f"attention={r['attention'] or 'xla'}, {r['steps_traced']} steps traced"
                                       for r in runs), ""]
    for r in runs:
        lines += [f"## {r['name']}: top {top} kernels", "", "| kernel | family | ms / step | calls / step |",
                  "|---|---|---:|---:|"]
        for k in r["kernels"][:top]:
            lines.append(f"| `{_short(k['name'])}` | {k['family']} | {k['ms_per_step']:.3f} | "
                         f"{k['calls_per_step']:g} |")
        lines += ["", f"## {r['name']}: GPU idle time by the kernel launched after it (top {top})", "",
                  "| kernel | family | idle ms / step before it | gaps / step |", "|---|---|---:|---:|"]
        for k in r["idle_before"][:top]:
            lines.append(f"| `{_short(k['name'])}` | {k['family']} | {k['ms_per_step']:.3f} | {k['gaps_per_step']:g} |")
        lines.append("")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", choices=sorted(example.PRESETS), default=None,
                   help="the example's preset (default: gpu if a GPU is visible, else cpu)")
    p.add_argument("--steps", type=int, default=10, help="steps traced per run")
    p.add_argument("--warmup", type=int, default=10, help="steps run before the trace (the first compiles)")
    p.add_argument("--variants", default="baseline,ours", help="comma list of baseline, ours")
    p.add_argument("--fp8", default="none,tensorwise",
                   help="comma list of FP8 recipes for the 'ours' runs (none = bf16 block projections)")
    p.add_argument("--attention", choices=["xla", "cudnn"], default=None,
                   help="jax.nn.dot_product_attention implementation for every run (default: XLA)")
    p.add_argument("--implementation", choices=["pallas", "xla", "interpret"], default=None,
                   help="for the 'ours' runs (default: pallas on a GPU, the XLA reference on CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--top", type=int, default=25, help="kernels listed per run in the markdown")
    p.add_argument("--keep-xplane", action="store_true", help="keep the .xplane.pb files next to the perfetto JSON")
    p.add_argument("--out", type=pathlib.Path, required=True, help="output directory")
    for key, typ in (("batch_size", int), ("seq_len", int), ("n_layers", int), ("d_model", int), ("dtype", str)):
        p.add_argument("--" + key.replace("_", "-"), type=typ, default=None, help="override the preset")
    args = p.parse_args(argv)
    args.preset = args.preset or ("gpu" if example.has_gpu() else "cpu")
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not set(args.variants) <= {"baseline", "ours"} or not args.variants:
        p.error(f"--variants: expected a comma list of baseline, ours; got {args.variants}")
    args.fp8 = [None if r.strip() == "none" else r.strip() for r in args.fp8.split(",") if r.strip()]
    recipes = {None, "tensorwise", "rowwise", "rowwise_with_gw_hp"}
    if not set(args.fp8) <= recipes:
        p.error(f"--fp8: expected a comma list of none, tensorwise, rowwise, rowwise_with_gw_hp; got {args.fp8}")
    if args.steps < 1 or args.warmup < 1:
        p.error("--steps and --warmup: expected >= 1")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    s = _settings(args)
    batches = _batches(s, args.warmup + args.steps, args.seed)
    plan = [("baseline", True, None)] if "baseline" in args.variants else []
    if "ours" in args.variants:
        plan += [("ours" + (f" fp8 {r}" if r else ""), False, r) for r in args.fp8]
    args.out.mkdir(parents=True, exist_ok=True)
    runs = []
    for name, baseline, fp8 in plan:
        print(f"== {name}", flush=True)
        run = profile_run(name, baseline=baseline, fp8=fp8, s=s, args=args, batches=batches,
                          trace_dir=args.out / "traces" / name.replace(" ", "_"))
        print(f"   kernel sum {run['total_ms']:.2f} ms/step, wall {run['wall_ms_per_step']:.2f} ms/step, "
              + ", ".join(f"{f} {v:.2f}" for f, v in run["families_ms"].items()), flush=True)
        runs.append(run)
    from pallas_fused import _backend

    result = {"device": _backend.device_name(), "jax": jax.__version__, "preset": args.preset,
              "settings": {k: (str(v) if k == "dtype" else v) for k, v in s.items()}, "command": "python "
              + " ".join(["benchmarks/profile_step.py"] + list(sys.argv[1:] if argv is None else argv)), "runs": runs}
    (args.out / "profile.json").write_text(json.dumps(result, indent=1))
    text = markdown(runs, args.top) + f"\nDevice: {result['device']}, jax {result['jax']}; `{result['command']}`\n"
    (args.out / "profile.md").write_text(text)
    print(text)
    return result


if __name__ == "__main__":
    main()
