"""The end of a run: a loss plot (PNG), a markdown report and a JSON record, plus a table to paste."""

from __future__ import annotations

import json
import pathlib
import textwrap

import numpy as np

from .train import RunResult


def _smooth(values, width: int):
    values = np.asarray(values, dtype=np.float64)
    if width <= 1 or len(values) < width:
        return values
    kernel = np.ones(width) / width
    head = np.array([values[: i + 1].mean() for i in range(width - 1)])
    return np.concatenate([head, np.convolve(values, kernel, mode="valid")])


def plot(results: list[RunResult], path: pathlib.Path, title: str) -> None:
    """Train (smoothed) and validation loss per phase, every run on the same axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = list(dict.fromkeys(r.phase for r in results))
    fig, axes = plt.subplots(1, len(phases), figsize=(6.5 * len(phases), 4.5), squeeze=False)
    colors = {}
    for ax, phase in zip(axes[0], phases):
        for r in (r for r in results if r.phase == phase):
            color = colors.setdefault(r.name, f"C{len(colors)}")
            width = max(1, len(r.train_loss) // 30)
            ax.plot(r.train_steps, _smooth(r.train_loss, width), color=color, alpha=0.55, lw=1.2,
                    label=f"{r.name} train ({r.step_ms:.1f} ms/step)")
            ax.plot(r.val_steps, r.val_loss, "o-", color=color, lw=2, ms=4, label=f"{r.name} validation")
        ax.set_title(phase)
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats / byte)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(textwrap.fill(title, 130 * len(phases) // 2), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# Dense bf16 tensor-core peak (datasheet, TFLOP/s) by device name, for MFU; other devices get no MFU column value.
PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}


def model_flops_per_token(num_params: int, n_layers: int, d_model: int, seq_len: int) -> float:
    """Training FLOPs per token, forward and backward (PaLM's count: 6 N for the weights plus 12 L d S for
    attention's two sequence-long products, without a causal discount)."""
    return 6.0 * num_params + 12.0 * n_layers * d_model * seq_len


def mfu(r: RunResult, settings: dict, device: str | None) -> float | None:
    """Model FLOPs utilization per device at the median step: the step's global FLOPs (every device's tokens)
    over the peak of the devices it ran on (`r.num_devices` of them), against the device's dense bf16 peak (FP8
    runs too, so that they compare with bf16 on one scale), or None for a device without a known peak."""
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if device and k in device), None)
    if peak is None or r.median_step_ms <= 0 or not all(k in settings for k in ("n_layers", "d_model", "seq_len")):
        return None
    if not isinstance(r.num_devices, int) or r.num_devices < 1:
        raise ValueError(f"num_devices must be a positive int, got {r.num_devices!r}")
    flops = model_flops_per_token(r.num_params, settings["n_layers"], settings["d_model"], settings["seq_len"])
    return flops * r.median_tokens_per_s / (r.num_devices * peak * 1e12)


def table(results: list[RunResult], settings: dict | None = None, device: str | None = None) -> str:
    """A markdown table, one row per run, led by the typical (median) step: its ms, global tokens / s (every
    device together) and MFU per device, then the mean step (GaLore's projector refreshes included), both speed
    ratios against the phase's baseline, the optimizer state and the process' peak device memory after the run."""
    base = {r.phase: r for r in results if r.name == "baseline"}
    lines = [
        "| phase | run | val loss start -> end | final train loss | ms / step (median) | devices "
        "| tokens / s (median, all devices) | MFU (per device) | ms / step (mean) | speedup vs baseline (median) "
        "| speedup (mean) | optimizer state (MB) | peak memory (GB) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        b = base.get(r.phase)
        vs = b is not None and r is not b and r.step_ms > 0 and r.median_step_ms > 0
        med = f"{b.median_step_ms / r.median_step_ms:.2f}x" if vs else "-"
        mean = f"{b.step_ms / r.step_ms:.2f}x" if vs else "-"
        u = mfu(r, settings or {}, device)
        lines.append(
            f"| {r.phase} | {r.name} | {r.val_loss[0]:.4f} -> {r.val_loss[-1]:.4f} | {r.train_loss[-1]:.4f} | "
            f"{r.median_step_ms:.2f} | {r.num_devices} | {r.median_tokens_per_s:,.0f} | "
            f"{'-' if u is None else f'{100 * u:.1f}%'} | {r.step_ms:.2f} | "
            f"{med} | {mean} | {r.opt_state_bytes / 2**20:.1f} | "
            f"{'-' if r.peak_bytes is None else f'{r.peak_bytes / 2**30:.2f}'} |"
        )
    return "\n".join(lines)


def comparison_lines(results: list[RunResult]) -> list[str]:
    """One line per phase that has a baseline: loss difference and speed ratios (median step first)."""
    lines = []
    for phase in dict.fromkeys(r.phase for r in results):
        runs = {r.name: r for r in results if r.phase == phase}
        if "baseline" not in runs or "pallas_fused" not in runs:
            continue
        ours, base = runs["pallas_fused"], runs["baseline"]
        rel = (ours.val_loss[-1] - base.val_loss[-1]) / base.val_loss[-1]
        median = base.median_step_ms / ours.median_step_ms if ours.median_step_ms > 0 else float("nan")
        lines.append(
            f"{phase}: val loss {ours.val_loss[-1]:.4f} (pallas_fused) vs {base.val_loss[-1]:.4f} (baseline), "
            f"{100 * rel:+.2f}%; median step {ours.median_step_ms:.2f} ms vs {base.median_step_ms:.2f} ms: "
            f"speedup {median:.2f}x (mean step {ours.step_ms:.2f} vs {base.step_ms:.2f} ms: "
            f"{base.step_ms / ours.step_ms:.2f}x)"
        )
    return lines


def loss_memory_lines(memory: dict | None) -> list[str]:
    """The report's line on the memory the fused loss saves (see train.loss_memory), or none without the numbers."""
    if not memory or memory.get("fused") is None or memory.get("materialized") is None:
        return []
    fused, full = memory["fused"] / 2**20, memory["materialized"] / 2**20
    return [f"- Loss memory (LM head + cross-entropy, forward and backward, one device's batch, XLA's plan of "
            f"temporaries): {fused:.1f} MiB fused (pallas_fused.loss) against {full:.1f} MiB with the logits "
            f"materialized (the baseline's optax loss): {full - fused:.1f} MiB saved."]


def write(out: pathlib.Path, results: list[RunResult], *, command: str, settings: dict, environment: dict) -> dict:
    """Write loss.png (with matplotlib), report.md and report.json under `out`; returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"plot": out / "loss.png", "markdown": out / "report.md", "json": out / "report.json"}
    try:
        plot(results, paths["plot"], title=command)
    except ImportError as err:  # matplotlib is optional (pip install '.[bench]'); the report is written anyway
        print(f"no plot: {err}")
        del paths["plot"]
    text = [
        "# train_llama report",
        "",
        f"Command: `{command}`",
        "",
        f"Device: {environment.get('device')}; jax {environment.get('jax')}, flax {environment.get('flax')}, "
        f"optax {environment.get('optax')}.",
        "",
        f"Attention (jax.nn.dot_product_attention, both runs): {settings.get('attention') or 'xla'}"
        + (f" ({settings['attention_reason']})" if settings.get("attention_reason") else "") + ".",
        "",
        *[f"- **{name}**: {text}" for name, text in settings.get("variants", {}).items()
          if any(r.name == name for r in results)],
        "",
        table(results, settings, environment.get("device")),
        "",
        *[f"- {line}" for line in comparison_lines(results)],
        *loss_memory_lines(settings.get("loss_memory")),
        "",
        "Loss is next-byte cross-entropy in nats per byte; validation is on held-out files of the Python standard "
        "library (see examples/llama/data.py). Step time excludes the steps that compile a program and the validation "
        "passes; the mean includes GaLore projector refreshes (every update_proj_gap steps), the median over "
        "10-step windows shows the typical step. Speedups: baseline / pallas_fused, median and mean. Tokens / s: "
        "the global batch's tokens (every device's share together) at the median step. MFU, per device: "
        "6 x params + 12 x layers x d_model x seq_len FLOPs per token times those tokens / s, over the dense bf16 "
        "peak of all the devices the step ran on (devices x one device's peak). Peak memory: device 0's "
        "peak_bytes_in_use read at the end of each phase, a high-water mark of "
        "the whole process, so each phase's number includes every phase run before it in this process "
        "(pretraining, then the fine-tune; with --compare, pallas_fused's phases before the baseline's): only the "
        "first phase run shows its own peak (--steps 0 makes that the fine-tune); '-' where the backend keeps no "
        "memory statistics.",
        "",
        *(["![loss](loss.png)", ""] if "plot" in paths else []),
        "## Settings",
        "",
        "```json",
        json.dumps(settings, indent=2, default=str),
        "```",
        "",
    ]
    paths["markdown"].write_text("\n".join(text))
    runs = [dict(r.to_json(), mfu_per_device=mfu(r, settings, environment.get("device"))) for r in results]
    record = {"command": command, "settings": settings, "environment": environment, "runs": runs,
              "comparison": comparison_lines(results)}
    paths["json"].write_text(json.dumps(record, indent=2, default=str))
    return paths
