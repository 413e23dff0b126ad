"""Regenerate the README's pictures from the committed results (no GPU needed): `make plots`.

- docs/img/ratios_<device>.png: ours vs peers as ratios, from benchmarks/results/<device>.json;
- benchmarks/results/<device>.png: every implementation's time per case (benchmarks.common.plot_results);
- docs/img/loss_<run>.png: the example's loss curves, from benchmarks/results/example/<run>/report.json.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from benchmarks.common import RESULTS_DIR, plot_ratios, plot_results

IMG_DIR = Path(__file__).resolve().parent.parent / "docs" / "img"


def example_runs(report: dict):
    """The RunResults of an example report.json (what examples/llama/report.plot draws)."""
    from examples.llama.train import RunResult

    out = []
    for r in report["runs"]:
        timed = max(int(r.get("steps", 1)) - 1, 1)
        out.append(RunResult(name=r["name"], phase=r["phase"], train_steps=r["train_steps"],
                             train_loss=r["train_loss"], val_steps=r["val_steps"], val_loss=r["val_loss"],
                             train_s=r["step_ms"] * timed / 1000.0, timed_steps=timed))
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="nvidia_h200", help="results/<device>.json to plot")
    args = p.parse_args(argv)
    from examples.llama import report as example_report

    IMG_DIR.mkdir(parents=True, exist_ok=True)
    doc = json.loads((RESULTS_DIR / f"{args.device}.json").read_text())
    plot_ratios(doc, IMG_DIR / f"ratios_{args.device}.png")
    plot_results(doc, RESULTS_DIR / f"{args.device}.png")
    for path in sorted((RESULTS_DIR / "example").glob("*/report.json")):
        report = json.loads(path.read_text())
        out = IMG_DIR / f"loss_{path.parent.name}.png"
        # The title is the command without where that run wrote its files.
        title = re.sub(r" --(out|ckpt-dir) \S+| --no-progress", "", report["command"])
        example_report.plot(example_runs(report), out, title=title)
        print(out)
    print(IMG_DIR / f"ratios_{args.device}.png")


if __name__ == "__main__":
    main()
