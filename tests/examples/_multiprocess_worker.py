"""One process of a multi-process run of the example on CPU (test_multi_process.py starts N of them):

    python -m tests.examples._multiprocess_worker OUT_DIR COORDINATOR NUM_PROCESSES PROCESS_ID CONFIG...

NUM_PROCESSES 0: the single-process reference (no jax.distributed, one device, no mesh). Each CONFIG (a key
of CONFIGS) is a run of examples/train_llama.py in this process, on the mesh MESHES gives it. Prints one
JSON line: {"choices": {...}, CONFIG: {phase: {"train", "val"}, "checks", "fingerprint", "wrote_report"}}.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = ["--preset", "cpu", "--d-model", "64", "--n-layers", "1", "--seq-len", "32", "--batch-size", "8",
        "--galore-rank", "8", "--update-proj-gap", "3", "--lr", "1e-2", "--no-progress", "--steps", "4",
        "--finetune-steps", "0", "--eval-every", "4", "--max-bytes", "300000"]
# The mesh of each config by process count (the reference, 0 processes, runs without one).
MESHES = {"fsdp_galore_fp8_dora": {2: "fsdp=2", 4: "data=2,fsdp=2"}, "data_adamw8": {2: "data=2", 4: "data=4"}}
CONFIGS = {
    # FSDP: galore_adamw (in place, randomized projector) with FP8 tensorwise block projections, then a DoRA
    # fine-tune with the fused AdamW.
    # fine-tune with the fused AdamW (4 processes: data=2,fsdp=2).
    "fsdp_galore_fp8_dora": ["--fp8", "tensorwise", "--finetune-steps", "2"],
    # Data parallel: the fused AdamW with 8-bit moments on every param (embedding, kernels, head quantized).
    "data_adamw8": ["--optimizer", "adamw", "--state-bits", "8"],
}


def arguments(config: str, num_processes: int) -> list[str]:
    mesh = ["--mesh", MESHES[config][num_processes]] if num_processes else []
    return TINY + CONFIGS[config] + mesh


def main(out_dir: str, coordinator: str, num_processes: int, process_id: int, configs: list[str]) -> None:
    sys.path.insert(0, str(ROOT))
    from tests.examples._program_choices import program_choices

    spec = importlib.util.spec_from_file_location("train_llama", ROOT / "examples" / "train_llama.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    launch = [] if num_processes == 0 else ["--coordinator", coordinator, "--num-processes", str(num_processes),
                                            "--process-id", str(process_id)]
    record: dict = {}
    for config in configs:
        out = module.main(arguments(config, num_processes) + launch + ["--out", str(pathlib.Path(out_dir) / config)])
        checks = out["checks"]["pallas_fused"]
        record[config] = {r.phase: {"train": r.train_loss, "val": r.val_loss} for r in out["results"]}
        record[config]["checks"] = {k: v for k, v in checks.items() if isinstance(v, bool)}
        record[config]["fingerprint"] = checks["checkpoint_fingerprint"]
        record[config]["wrote_report"] = out["paths"] is not None
    record["choices"] = program_choices()
    print("RESULT " + json.dumps(record), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:])
