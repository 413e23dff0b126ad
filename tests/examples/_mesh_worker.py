"""Run the example on simulated CPU devices: `python -m tests.examples._mesh_worker OUT_DIR MESH...`.

XLA_FLAGS (the device count) must be set before jax starts, so test_train_llama_mesh.py runs this in a
subprocess. Prints one JSON line: {mesh: {phase: {"train": [...], "val": [...]}, "checks": {...}}}.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = ["--preset", "cpu", "--d-model", "64", "--n-layers", "1", "--seq-len", "32", "--batch-size", "8",
        "--galore-rank", "8", "--update-proj-gap", "3", "--lr", "1e-2", "--no-progress", "--steps", "5",
        "--finetune-steps", "0", "--eval-every", "5"]


def main(out_dir: str, meshes: list[str]) -> None:
    spec = importlib.util.spec_from_file_location("train_llama", ROOT / "examples" / "train_llama.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    record = {}
    for mesh in meshes:
        args = TINY + (["--mesh", mesh] if mesh != "none" else []) + ["--out", str(pathlib.Path(out_dir) / mesh)]
        out = module.main(args)
        record[mesh] = {r.phase: {"train": r.train_loss, "val": r.val_loss} for r in out["results"]}
        record[mesh]["checks"] = {k: v for k, v in out["checks"]["pallas_fused"].items() if isinstance(v, bool)}
    print("RESULT " + json.dumps(record), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
