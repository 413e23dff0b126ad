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


def table(results: list[RunResult]) -> str:
    """A markdown table: one row per run, with the speed ratio against the baseline of the same phase."""
    base = {r.phase: r for r in results if r.name == "baseline"}
    lines = [
        "| phase | run | val loss start -> end | final train loss | ms / step (mean) | ms / step (median) "
        "| tokens / s | optimizer state (MB) | speedup vs baseline |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        b = base.get(r.phase)
        speedup = f"{b.step_ms / r.step_ms:.2f}x" if b is not None and r is not b and r.step_ms > 0 else "-"
        lines.append(
            f"| {r.phase} | {r.name} | {r.val_loss[0]:.4f} -> {r.val_loss[-1]:.4f} | {r.train_loss[-1]:.4f} | "
            f"{r.step_ms:.2f} | {r.median_step_ms:.2f} | {r.tokens_per_s:,.0f} | {r.opt_state_bytes / 2**20:.1f} | "
            f"{speedup} |"
        )
    return "\n".join(lines)


def comparison_lines(results: list[RunResult]) -> list[str]:
    """One line per phase that has a baseline: loss difference and speed ratio."""
    lines = []
    for phase in dict.fromkeys(r.phase for r in results):
        runs = {r.name: r for r in results if r.phase == phase}
        if "baseline" not in runs or "pallas_fused" not in runs:
            continue
        ours, base = runs["pallas_fused"], runs["baseline"]
        rel = (ours.val_loss[-1] - base.val_loss[-1]) / base.val_loss[-1]
        lines.append(
            f"{phase}: val loss {ours.val_loss[-1]:.4f} (pallas_fused) vs {base.val_loss[-1]:.4f} (baseline), "
            f"{100 * rel:+.2f}%; step {ours.step_ms:.2f} ms vs {base.step_ms:.2f} ms: "
            f"speedup {base.step_ms / ours.step_ms:.2f}x"
        )
    return lines


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
        *[f"- **{name}**: {text}" for name, text in settings.get("variants", {}).items()
          if any(r.name == name for r in results)],
        "",
        table(results),
        "",
        *[f"- {line}" for line in comparison_lines(results)],
        "",
        "Loss is next-byte cross-entropy in nats per byte; validation is on held-out files of the Python standard "
        "library (see examples/llama/data.py). Step time excludes the first (compiling) step and the validation "
        "passes; the mean includes GaLore projector refreshes (every update_proj_gap steps), the median over "
        "10-step windows shows the typical step. Speedup = baseline mean / pallas_fused mean.",
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
    record = {"command": command, "settings": settings, "environment": environment,
              "runs": [r.to_json() for r in results], "comparison": comparison_lines(results)}
    paths["json"].write_text(json.dumps(record, indent=2, default=str))
    return paths
