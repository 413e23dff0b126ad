"""Multi-GPU checks of the example (examples/train_llama.py's pretraining step), two ways:

    python -m benchmarks.multi_gpu --out benchmarks/results/multi_gpu        # one process, >= 2 GPUs, ~3-4 min
    python -m benchmarks.multi_gpu --launch --gpus 1,2,4 --out benchmarks/results/multi_gpu   # one process per GPU

`--launch`: the scaling table, with one process per GPU as docs/multi_process.md's recipe starts them: for each
row, N processes of examples/train_llama.py with `--coordinator 127.0.0.1:PORT --num-processes N --process-id I`
and CUDA_VISIBLE_DEVICES=I, the GPU preset (`--preset`), `--steps` pretraining steps, no fine-tune. Rows: for
every N of --gpus, data parallel (`--mesh data=N`) at --batch-per-gpu rows per GPU (global batch N x that), and
for every N > 1 FSDP (`--mesh fsdp=N`) at a fixed global batch (--fsdp-global-batch, default --batch-per-gpu).
Writes scaling.json under --out: a list of rows {gpus, processes, mesh, global_batch, per_gpu_batch, median_ms,
tokens_per_s, weak_scaling, mfu_per_device, peak_gb, final_train_loss, val_loss, attention, report, error}, read
off each run's report.json (process 0's): median_ms is the median step, tokens_per_s the global tokens / s at it,
peak_gb process 0's device peak. weak_scaling is tokens_per_s over the 1-GPU data-parallel row's at the same
per-GPU batch (null without that row, and for FSDP rows, whose global batch is fixed). A row whose processes fail
or time out keeps its keys, null numbers and the error; every process' log is under --out/logs.
`--platform cpu` runs the same launch on CPU processes (one CPU device each; the tests use it).

One process (without --launch):

(a) Weak scaling, data parallel: the pretraining step (forward, backward, galore_adamw in place with the
    randomized projector, everything on the pallas_fused kernels) on 1 GPU with batch B, then with
    `--mesh data=2` and batch 2B (the same B per device). Throughput = tokens / s over timed windows that
    exclude the first step (compilation) and every projector-refresh step (each refresh step runs
    untimed, synchronised before and after; the steps between refreshes are dispatched back to back).
    Reported: the ratio tokens/s(2 GPUs) / tokens/s(1 GPU); target >= 1.8.
(b) FSDP: the same run (same initial params, same batches of global size B, refreshes included) on 1 GPU
    and with `--mesh fsdp=2` (params, gradients and optimizer states split along one axis of each weight)
    for `--fsdp-steps` steps: the loss curves should agree to bf16 reduction-order noise.

The 1-GPU run of (b) is the 1-GPU run of (a) (same batch B): three compiled runs in all. Writes
multi_gpu.json and multi_gpu.md to --out. Every part's failure is recorded, not raised.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _example():
    spec = importlib.util.spec_from_file_location("train_llama", ROOT / "examples" / "train_llama.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # puts examples/ on sys.path (the `llama` package)
    return module


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=pathlib.Path, required=True)
    p.add_argument("--launch", action="store_true",
                   help="one process per GPU (docs/multi_process.md's recipe); writes scaling.json under --out")
    p.add_argument("--gpus", default=None,
                   help="--launch: GPU counts, comma-separated (default: 1 and every power of two up to the GPUs "
                        "nvidia-smi lists)")
    p.add_argument("--meshes", default="data,fsdp", help="--launch: which row kinds, of data and fsdp")
    p.add_argument("--steps", type=int, default=50, help="--launch: pretraining steps of each run")
    p.add_argument("--batch-per-gpu", type=int, default=None,
                   help="--launch: rows per GPU of the data-parallel rows (default: the preset's batch size)")
    p.add_argument("--fsdp-global-batch", type=int, default=None,
                   help="--launch: global batch of the FSDP rows (default: --batch-per-gpu)")
    p.add_argument("--platform", choices=["gpu", "cpu"], default="gpu",
                   help="--launch: cpu runs the processes on CPU devices (JAX_PLATFORMS=cpu): a simulation")
    p.add_argument("--timeout", type=float, default=900.0, help="--launch: seconds for each row's processes")
    p.add_argument("--example-args", default="",
                   help="--launch: more arguments for examples/train_llama.py, as one string (e.g. '--fp8 tensorwise')")
    p.add_argument("--preset", default="gpu", help="model preset of examples/train_llama.py (default gpu, ~300M)")
    for key, kind in (("d_model", int), ("n_layers", int), ("seq_len", int), ("galore_rank", int)):
        p.add_argument("--" + key.replace("_", "-"), type=kind, default=None, help="override the preset")
    p.add_argument("--batch-per-device", type=int, default=None, help="B (default: the preset's batch size)")
    p.add_argument("--fsdp-steps", type=int, default=50, help="steps of the 1-GPU and FSDP runs (b)")
    p.add_argument("--dp-steps", type=int, default=30, help="steps of the data-parallel run (a)")
    p.add_argument("--update-proj-gap", type=int, default=25, help="projector refresh every N steps")
    p.add_argument("--implementation", default=None, help="pallas_fused implementation (default: auto)")
    p.add_argument("--max-bytes", type=int, default=20_000_000, help="corpus bytes to load")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.launch:
        try:
            args.gpu_counts = parse_counts(args.gpus) if args.gpus is not None else default_counts()
            args.mesh_kinds = parse_meshes(args.meshes)
        except ValueError as err:
            p.error(str(err))
        for name in ("steps", "batch_per_gpu", "fsdp_global_batch"):
            value = getattr(args, name)
            if value is not None and value < 1:
                p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if args.timeout <= 0:
            p.error(f"--timeout must be > 0, got {args.timeout}")
    return args


# ------------------------------------------------------------------------------------------ one process per GPU

ROW_KEYS = ("gpus", "processes", "mesh", "global_batch", "per_gpu_batch", "median_ms", "tokens_per_s",
            "weak_scaling", "mfu_per_device", "peak_gb", "final_train_loss", "val_loss", "attention", "report",
            "error")


def parse_counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--gpus must be comma-separated GPU counts, got {text!r}") from None
    if not counts or any(n < 1 for n in counts):
        raise ValueError(f"--gpus must be comma-separated GPU counts >= 1, got {text!r}")
    return sorted(set(counts))


def parse_meshes(text: str) -> list[str]:
    kinds = [x.strip() for x in text.split(",") if x.strip()]
    if not kinds or any(k not in ("data", "fsdp") for k in kinds):
        raise ValueError(f"--meshes must name data and/or fsdp, comma-separated, got {text!r}")
    return kinds


def default_counts() -> list[int]:
    """1 and every power of two up to the GPUs nvidia-smi lists."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        raise ValueError("--gpus not given and nvidia-smi is not here to count the GPUs: pass --gpus 1,2,...")
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False).stdout
    n = sum(line.startswith("GPU ") for line in listed.splitlines())
    if n < 1:
        raise ValueError("--gpus not given and nvidia-smi lists no GPU: pass --gpus 1,2,...")
    return [c for c in (1, 2, 4, 8, 16, 32) if c <= n]


def plan_rows(counts: list[int], kinds: list[str], batch_per_gpu: int, fsdp_global_batch: int) -> list[dict]:
    """The runs of the table: data parallel at a fixed per-GPU batch for every count, FSDP at a fixed global
    batch for every count > 1."""
    rows = []
    for n in counts:
        if "data" in kinds:
            rows.append({"gpus": n, "processes": n, "mesh": f"data={n}", "global_batch": n * batch_per_gpu,
                         "per_gpu_batch": batch_per_gpu})
        if "fsdp" in kinds and n > 1:
            if fsdp_global_batch % n:
                raise ValueError(f"--fsdp-global-batch {fsdp_global_batch} must be a multiple of every GPU count "
                                 f"of its rows, not of {n}")
            rows.append({"gpus": n, "processes": n, "mesh": f"fsdp={n}", "global_batch": fsdp_global_batch,
                         "per_gpu_batch": fsdp_global_batch // n})
    return rows


def add_weak_scaling(rows: list[dict]) -> list[dict]:
    """weak_scaling of each row: its tokens/s over the 1-GPU data-parallel row's at the same per-GPU batch; None
    for FSDP rows (a fixed global batch), and where either number is missing."""
    base = {r["per_gpu_batch"]: r.get("tokens_per_s") for r in rows
            if r["gpus"] == 1 and r["mesh"].startswith("data=")}
    for r in rows:
        ref = base.get(r["per_gpu_batch"])
        ok = r["mesh"].startswith("data=") and ref and r.get("tokens_per_s") is not None
        r["weak_scaling"] = r["tokens_per_s"] / ref if ok else None
    return rows


def row_from_report(row: dict, report: dict) -> dict:
    """A row's numbers from its run's report.json (the pretraining run of pallas_fused)."""
    run = next(r for r in report["runs"] if r["phase"] == "pretrain" and r["name"] == "pallas_fused")
    if report["settings"]["batch_size"] != row["global_batch"]:
        raise ValueError(f"the run's batch {report['settings']['batch_size']} is not the row's {row['global_batch']}")
    peak = run.get("peak_bytes")
    return dict(row, median_ms=run["median_step_ms"], tokens_per_s=run["median_tokens_per_s"],
                mfu_per_device=run.get("mfu_per_device"), peak_gb=None if peak is None else peak / 2**30,
                final_train_loss=run["final_train_loss"], val_loss=run["final_val_loss"],
                attention=report["settings"].get("attention"))


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_row(row: dict, args, out: pathlib.Path) -> dict:
    """Start the row's processes (one per GPU), wait for all, and read the report process 0 wrote."""
    import os
    import shlex
    import shutil
    import subprocess
    import tempfile

    name = row["mesh"].replace("=", "")
    run_dir, logs = out / "runs" / name, out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    ckpt = pathlib.Path(tempfile.mkdtemp(prefix=f"multi_gpu_{name}_"))  # every process' shards; removed after
    port = _free_port()
    command = [sys.executable, str(ROOT / "examples" / "train_llama.py"), "--preset", args.preset,
               "--steps", str(args.steps), "--finetune-steps", "0", "--eval-every", str(10**9), "--no-progress",
               "--batch-size", str(row["global_batch"]), "--mesh", row["mesh"], "--seed", str(args.seed),
               "--out", str(run_dir), "--ckpt-dir", str(ckpt), *shlex.split(args.example_args),
               "--coordinator", f"127.0.0.1:{port}", "--num-processes", str(row["processes"])]
    if args.implementation:
        command += ["--implementation", args.implementation]
    for key in ("d_model", "n_layers", "seq_len", "galore_rank"):  # the model overrides, as in the one-process mode
        if getattr(args, key) is not None:
            command += ["--" + key.replace("_", "-"), str(getattr(args, key))]
    procs, files = [], []
    try:
        for i in range(row["processes"]):
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(i), PYTHONPATH=os.pathsep.join(
                [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
            if args.platform == "cpu":
                env["JAX_PLATFORMS"] = "cpu"
            log = open(logs / f"{name}_p{i}.log", "w")  # noqa: SIM115 (closed below, after the process ends)
            files.append(log)
            procs.append(subprocess.Popen(command + ["--process-id", str(i)], cwd=ROOT, env=env, stdout=log,
                                          stderr=subprocess.STDOUT))
        deadline = time.monotonic() + args.timeout
        codes = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=max(deadline - time.monotonic(), 1.0)))
            except subprocess.TimeoutExpired:
                codes.append(None)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in files:
            log.close()
        shutil.rmtree(ckpt, ignore_errors=True)
    empty = {k: None for k in ROW_KEYS}
    if any(c != 0 for c in codes):
        status = ", ".join(f"process {i}: {'timed out' if c is None else f'exit {c}'}" for i, c in enumerate(codes))
        return dict(empty, **row, error=f"{status} (logs: {logs}/{name}_p*.log)")
    try:
        report = json.loads((run_dir / "report.json").read_text())
        return dict(empty, **row_from_report(row, report), report=str(run_dir / "report.json"))
    except Exception as err:  # a run that ended but left no usable report: recorded, the other rows still run
        return dict(empty, **row, error=f"{type(err).__name__}: {err}")


def launch(args) -> list[dict]:
    ex_presets = _example().PRESETS
    if args.preset not in ex_presets:
        raise ValueError(f"--preset must be one of {sorted(ex_presets)}, got {args.preset!r}")
    b = args.batch_per_gpu or ex_presets[args.preset]["batch_size"]
    rows = plan_rows(args.gpu_counts, args.mesh_kinds, b, args.fsdp_global_batch or b)
    args.out.mkdir(parents=True, exist_ok=True)
    done = []
    for row in rows:
        start = time.perf_counter()
        print(f"{row['mesh']}: {row['processes']} process(es), global batch {row['global_batch']}", flush=True)
        done.append(run_row(row, args, args.out))
        r = done[-1]
        what = r["error"] or f"{r['median_ms']:.1f} ms median step, {r['tokens_per_s']:,.0f} tok/s"
        print(f"  {what} ({time.perf_counter() - start:.0f} s)", flush=True)
    add_weak_scaling(done)
    (args.out / "scaling.json").write_text(json.dumps(done, indent=1) + "\n")
    print(json.dumps(done, indent=1))
    return done


def run(ex, name, s, layout, init_params, batches, steps, gap, implementation):
    """`steps` training steps; returns a record (losses, timing). batches: (steps, B, S + 1) numpy."""
    from llama.model import Llama
    from llama.train import TrainState, place

    cfg = ex.model_config(s, implementation=implementation)
    model = Llama(cfg)
    tx = ex.pretrain_optimizer(dict(s, update_proj_gap=gap), init_params, baseline=False,
                               implementation=implementation, projector="randomized", inplace=True)
    trainable = jax.tree.map(jnp.copy, init_params)
    state = TrainState(step=jnp.zeros((), jnp.int32), trainable=trainable, frozen={}, opt_state=tx.init(trainable))
    state, step_fn, put = place(state, model, tx, layout, batches.shape[1])
    on_device = [put(b) for b in batches[:steps]]  # no host->device copy inside the timing
    jax.block_until_ready(on_device)
    losses, timed_s, timed_steps, refresh_s, compile_s = [], 0.0, 0, [], 0.0
    window_start, window_steps = None, 0

    def close_window():
        nonlocal timed_s, timed_steps, window_steps
        if window_steps:
            jax.block_until_ready(losses[-1])
            timed_s += time.perf_counter() - window_start
            timed_steps += window_steps
        window_steps = 0

    for i in range(steps):
        if i % gap == 0:  # compile (i = 0) or projector refresh: synchronised and untimed
            close_window()
            t = time.perf_counter()
            state, loss = step_fn(state, on_device[i])
            jax.block_until_ready(loss)
            if i == 0:
                compile_s = time.perf_counter() - t
            else:
                refresh_s.append(time.perf_counter() - t)
            losses.append(loss)
            window_start = time.perf_counter()
            continue
        state, loss = step_fn(state, on_device[i])
        losses.append(loss)
        window_steps += 1
    close_window()
    cache_size = getattr(step_fn, "_cache_size", lambda: None)()  # 1 = no recompilation after the first step
    tokens_per_step = int(batches.shape[1] * (batches.shape[2] - 1))
    return {
        "name": name, "mesh": None if layout is None else dict(layout.mesh.shape), "steps": steps,
        "global_batch": int(batches.shape[1]), "tokens_per_step": tokens_per_step,
        "loss": [float(x) for x in losses], "compile_s": compile_s, "refresh_step_s": refresh_s,
        "timed_steps": timed_steps, "timed_s": timed_s, "compiled_programs": cache_size,
        "step_ms": 1000 * timed_s / max(timed_steps, 1),
        "tokens_per_s": tokens_per_step * timed_steps / max(timed_s, 1e-9),
    }


def main(argv=None):
    args = parse_args(argv)
    if args.launch:
        return launch(args)
    args.out.mkdir(parents=True, exist_ok=True)
    ex = _example()
    from llama import data
    from llama.mesh import Layout
    from llama.model import Llama, count_params

    from pallas_fused import _backend

    s = dict(ex.PRESETS[args.preset])
    s.update({k: getattr(args, k) for k in ("d_model", "n_layers", "seq_len", "galore_rank")
              if getattr(args, k) is not None})
    b = args.batch_per_device or s["batch_size"]
    steps = max(args.fsdp_steps, args.dp_steps)
    s.update(steps=steps, batch_size=b)
    record = {"command": "python -m benchmarks.multi_gpu " + " ".join(sys.argv[1:] if argv is None else argv),
              "device": _backend.device_name(), "devices": jax.device_count(), "jax": jax.__version__,
              "settings": {k: s[k] for k in ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "seq_len",
                                             "dtype", "galore_rank", "lr", "warmup")},
              "batch_per_device": b, "update_proj_gap": args.update_proj_gap, "runs": {}, "errors": {}}
    start = time.perf_counter()

    stream = data.load_split("pretrain", max_bytes=args.max_bytes)
    gen = data.Batches(stream, 2 * b, s["seq_len"], args.seed)
    big = np.stack([next(gen) for _ in range(steps)])  # (steps, 2B, S + 1): the data-parallel run's batches
    small = big[:, :b]  # the 1-GPU / FSDP runs' batches: the first B rows of each
    cfg = ex.model_config(s, implementation="xla")
    init_params = jax.jit(lambda key, tokens: Llama(cfg).init(key, tokens)["params"])(
        jax.random.PRNGKey(args.seed), jnp.asarray(small[0][:1, :-1]))
    record["num_params"] = count_params(init_params)
    print(f"{record['num_params'] / 1e6:.1f}M params on {record['devices']} x {record['device']}", flush=True)

    def attempt(key, fn):
        try:
            record["runs"][key] = fn()
            r = record["runs"][key]
            print(f"{key}: {r['tokens_per_s']:,.0f} tok/s ({r['step_ms']:.1f} ms/step over {r['timed_steps']} steps), "
                  f"compile {r['compile_s']:.1f} s, final loss {r['loss'][-1]:.4f}", flush=True)
        except Exception:  # record and go on: the other parts still run
            record["errors"][key] = traceback.format_exc()
            print(f"{key} failed:\n{record['errors'][key]}", flush=True)

    gap, impl = args.update_proj_gap, args.implementation
    attempt("1gpu", lambda: run(ex, "1 GPU", s, None, init_params, small, steps, gap, impl))
    if jax.device_count() >= 2:
        attempt("data2", lambda: run(ex, "data=2", s, Layout.from_axes({"data": 2}), init_params, big,
                                     args.dp_steps, gap, impl))
        attempt("fsdp2", lambda: run(ex, "fsdp=2", s, Layout.from_axes({"fsdp": 2}), init_params, small,
                                     args.fsdp_steps, gap, impl))
    else:
        record["errors"]["multi"] = f"only {jax.device_count()} device(s): the 2-GPU runs were skipped"

    runs = record["runs"]
    summary = {}
    if "1gpu" in runs and "data2" in runs:
        ratio = runs["data2"]["tokens_per_s"] / runs["1gpu"]["tokens_per_s"]
        summary["weak_scaling_ratio"] = ratio
        summary["weak_scaling_target_met"] = ratio >= 1.8
    if "1gpu" in runs and "fsdp2" in runs:
        n = min(len(runs["1gpu"]["loss"]), len(runs["fsdp2"]["loss"]))
        a, c = np.asarray(runs["1gpu"]["loss"][:n]), np.asarray(runs["fsdp2"]["loss"][:n])
        rel = np.abs(a - c) / np.abs(a)
        summary.update(fsdp_steps_compared=n, fsdp_max_rel_loss_diff=float(rel.max()),
                       fsdp_final_loss=(float(a[-1]), float(c[-1])),
                       fsdp_mean_last10_rel_diff=float(abs(a[-10:].mean() - c[-10:].mean()) / a[-10:].mean()),
                       fsdp_same_loss=bool(rel.max() < 0.02))  # bf16 compute: reduction order noise only
    record["summary"] = summary
    record["wall_s"] = time.perf_counter() - start
    (args.out / "multi_gpu.json").write_text(json.dumps(record, indent=1))
    (args.out / "multi_gpu.md").write_text(markdown(record))
    print(markdown(record))
    return record


def markdown(record) -> str:
    lines = [f"# Multi-GPU: examples/train_llama.py pretraining step ({record['num_params'] / 1e6:.0f}M params, "
             f"{record['devices']} x {record['device']}, jax {record['jax']})", "",
             f"`{record['command']}`; batch per device {record['batch_per_device']}, seq "
             f"{record['settings']['seq_len']}, {record['settings']['dtype']}, galore_adamw in place (randomized "
             f"projector, refresh every {record['update_proj_gap']} steps). Throughput excludes the first "
             "(compile) step and every projector-refresh step.", "",
             "| run | global batch | timed steps | ms / step | tokens / s | compile s | refresh step s | final loss |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in record["runs"].values():
        refresh = ", ".join(f"{x:.2f}" for x in r["refresh_step_s"]) or "-"
        lines.append(f"| {r['name']} | {r['global_batch']} | {r['timed_steps']} | {r['step_ms']:.1f} | "
                     f"{r['tokens_per_s']:,.0f} | {r['compile_s']:.1f} | {refresh} | {r['loss'][-1]:.4f} |")
    sm = record.get("summary", {})
    lines.append("")
    if "weak_scaling_ratio" in sm:
        lines.append(f"- data parallel weak scaling (2 GPUs / 1 GPU, same batch per device): "
                     f"**{sm['weak_scaling_ratio']:.2f}x** (target >= 1.8: "
                     f"{'met' if sm['weak_scaling_target_met'] else 'NOT met'})")
    if "fsdp_max_rel_loss_diff" in sm:
        lines.append(f"- FSDP galore_adamw, 2 GPUs vs 1 GPU over {sm['fsdp_steps_compared']} steps: max relative "
                     f"loss difference {sm['fsdp_max_rel_loss_diff']:.2e}, final loss {sm['fsdp_final_loss'][0]:.4f} "
                     f"vs {sm['fsdp_final_loss'][1]:.4f} ({'same' if sm['fsdp_same_loss'] else 'DIFFERENT'})")
    for key, err in record["errors"].items():
        lines.append(f"- {key} failed: `{err.strip().splitlines()[-1]}`")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
