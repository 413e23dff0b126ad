"""One process of a multi-process run of the example on CPU (test_multi_process.py starts N of them):

    python -m tests.examples._multiprocess_worker OUT_DIR COORDINATOR NUM_PROCESSES PROCESS_ID CONFIG...

NUM_PROCESSES 0: the single-process reference (no jax.distributed, one device, no mesh). Each CONFIG (a key
of CONFIGS) is a run of examples/train_llama.py in this process; `{n}` in its arguments is the process
count. Prints one JSON line: {"choices": {...}, CONFIG: {phase: {"train", "val"}, "checks", "fingerprint"}}.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = ["--preset", "cpu", "--d-model", "64", "--n-layers", "1", "--seq-len", "32", "--batch-size", "8",
        "--galore-rank", "8", "--update-proj-gap", "3", "--lr", "1e-2", "--no-progress", "--steps", "4",
        "--finetune-steps", "0", "--eval-every", "4"]
CONFIGS = {
    # FSDP: galore_adamw (in place, randomized projector) with FP8 tensorwise block projections, then a DoRA
    # fine-tune with the fused AdamW.
    "fsdp_galore_fp8_dora": ["--mesh", "fsdp={n}", "--fp8", "tensorwise", "--finetune-steps", "2"],
    # Data parallel: the fused AdamW with 8-bit moments on every param (embedding, kernels, head quantized).
    "data_adamw8": ["--mesh", "data={n}", "--optimizer", "adamw", "--state-bits", "8"],
    # Both axes (4 processes): galore_adamw, 8-bit fine-tune.
    "data_fsdp_galore_dora8": ["--mesh", "data=2,fsdp={half}", "--finetune-steps", "2", "--state-bits", "8"],
}


def arguments(config: str, num_processes: int) -> list[str]:
    args = [a.format(n=num_processes, half=max(num_processes // 2, 1)) for a in TINY + CONFIGS[config]]
    if num_processes == 0:  # the reference: one device, no mesh
        i = args.index("--mesh")
        del args[i:i + 2]
    return args


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
