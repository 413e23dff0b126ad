"""Write the measured tables of docs/performance.md from benchmarks/results/<device>.json, one set per GPU in
DEVICES.

    python -m benchmarks.perf_docs            # rewrite the tables in place (make perf-docs)
    python -m benchmarks.perf_docs --check    # exit 1, with a diff, where a table differs from the JSON (make test)

Each table sits between `<!-- perf-docs:begin NAME TAG -->` and `<!-- perf-docs:end NAME TAG -->` in its file (TAG
names the GPU: h200, h100); only the text between the two markers is written, so the prose around a table stays
hand-written. A row of record is the last row of the JSON for its (op, case, implementation), as `make plots` reads
it; ours and each peer must come from the same run, or the pair is not shown. Ratios are the peer's time over
ours: above 1, ours is faster. A GPU whose rows are not all measured yet gets the tables it has rows for, and its
headline table names the capabilities it lacks.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


@dataclass(frozen=True)
class Rows:
    """Ours against peers at each case of one op: one table line per (case, peer)."""

    what: str  # what the user writes
    op: str
    ours: str  # the implementation of "ours" in the JSON
    peers: dict[str, str]  # implementation in the JSON -> how the docs name it
    cases: tuple[str, ...] = ()  # () = every case where `ours` was measured
    tflops: bool = False  # TFLOP/s instead of ms
    case_label: dict[str, str] = field(default_factory=dict)
    extra: tuple[str, str] | None = None  # (key in the rows' extra, its column's heading): ours / each peer

ROTARY = "B4 S4096 Hq32 Hk8 D128"
GALORE_PEER = {"peer:optax_contrib_galore": "optax.contrib.galore"}
ADAM_CASE = "105M fp32 params, 4x(4096, 6400)"
MM_SHAPES = ("4096x4096x4096", "8192x8192x8192", "16384x16384x16384", "16384x11008x4096", "16384x4096x11008",
             "16384x2048x5504", "16384x2048x2048", "16384x2048x512", "16384x512x2048", "16384x5504x2048",
             "5504x16384x2048", "2048x16384x2048", "2048x16384x5504", "2048x16384x512", "512x16384x2048")
BLOCKWISE_SHAPES = ("8192x8192x8192", "16384x2048x2048", "16384x2048x5504", "16384x2048x512", "16384x5504x2048")
GALORE_CASES = tuple(f"user path {s} r{r} {dt}" for dt in ("float32", "bfloat16") for s in ("4096x4096", "4096x11008")
                     for r in (32, 128, 512)) + ("user path llama7b layer r128 float32",
                                                 "user path llama7b layer r128 bfloat16")
GALORE_LABELS = {c: c.removeprefix("user path ") for c in GALORE_CASES}
DORA_CASES = tuple(f"{t}x4096->{n} bf16" for t in (4096, 8192) for n in ("4096 r16", "11008 r64"))
ADAPT_STEP = "one jitted Adam step of the adapters alone"
ADAPT_LABELS = {"hf_llama_1b_8x1024_r16": "HF Flax Llama 1.24B, 8 x 1024 tokens, r16 on its 7 projections",
                "hf_gemma_mqa_1b_8x1024_r16": "Gemma-shaped 1.0B, one key-value head, 8 x 1024 tokens, r16 on 7 "
                                              "projections",
                "dense_blocks_4x4096x11008_8192tok_r16": "4 blocks 4096 -> 11008 -> 4096 Dense, 8192 tokens, r16"}
FP8_BASE_CASE = "dense_blocks_4x4096x11008_8192tok_r16"
LOSS_CASES = tuple(f"N{n} d{d} V128256 bf16 fwd+bwd" for n in (8192, 16384) for d in (2048, 4096))
LOSS_PEERS = {"xla": "XLA, materialized logits", "peer:liger": "Liger (torch)", "xla:chunked": "XLA, chunked"}


@dataclass(frozen=True)
class Device:
    """A GPU with rows of record: its results file (benchmarks/results/<name>.json) and the tag of its tables'
    markers."""

    name: str
    tag: str


DEVICES = (Device("nvidia_h200", "h200"), Device("nvidia_h100_80gb_hbm3", "h100"))

# Section (its heading in docs/performance.md) -> the rows of record under it.
SECTIONS: dict[str, list[Rows]] = {
    "Adapting an existing model": [
        Rows(f"`adapt.apply(model, [adapt.DoraRule(...)])`, {ADAPT_STEP}", "adapt", "adapt:dora",
             {"dropin:dora": "DoRADense written in", "peer:qwix_lora": "qwix LoRA"}, case_label=ADAPT_LABELS,
             extra=("peak_gb", "peak GB")),
        Rows(f"`adapt.apply(model, [adapt.LoraRule(...)])`, {ADAPT_STEP}", "adapt", "adapt:lora",
             {"dropin:lora": "LoRADense written in", "peer:qwix_lora": "qwix LoRA"}, case_label=ADAPT_LABELS,
             extra=("peak_gb", "peak GB")),
        Rows(f"QDoRA: `adapt.apply(model, [adapt.DoraRule(..., quantize=\"nf4\")])`, {ADAPT_STEP}", "adapt",
             "adapt:qdora_nf4", {"peer:qwix_qlora_nf4": "qwix QLoRA (NF4, blocks of 64)"},
             case_label=ADAPT_LABELS, extra=("peak_gb", "peak GB")),
        *[Rows(f"FP8: `adapt.apply(model, [adapt.Fp8Rule(..., recipe=\"{recipe}\")])`, one Adam step of every weight",
               "adapt", f"adapt:fp8_{recipe}", {"full": "bf16 (the model as it is)"},
               cases=("dense_blocks_4x4096x11008_8192tok_r16",), case_label=ADAPT_LABELS, extra=("peak_gb", "peak GB"))
          for recipe in ("tensorwise", "rowwise")],
    ],
    "An FP8 base under the adapters": [
        *[Rows(f"`adapt.apply(model, [adapt.{rule}(..., base_fp8=\"rowwise\")])`, {ADAPT_STEP}", "adapt",
               f"adapt:{name}_fp8", {"peer:qwix_lora": "qwix LoRA", f"adapt:{name}": f"{rule} (bf16 base)"},
               cases=(FP8_BASE_CASE,), case_label=ADAPT_LABELS, extra=("peak_gb", "peak GB"))
          for rule, name in (("LoraRule", "lora"), ("DoraRule", "dora"))],
    ],
    "Fused linear cross-entropy": [
        Rows("`linear_cross_entropy(hidden, kernel, labels)`, the weight a Dense kernel (d, V), fwd+bwd", "loss",
             "user:linear_cross_entropy", LOSS_PEERS, cases=LOSS_CASES, extra=("temp_mib", "temporaries MiB")),
        Rows("the same with the weight a tied embedding (V, d)", "loss", "user:linear_cross_entropy vd", LOSS_PEERS,
             cases=LOSS_CASES, extra=("temp_mib", "temporaries MiB")),
    ],
    "Rotary embeddings": [
        Rows("`apply_rotary(q, k, positions)`", "rotary", "user:apply_rotary",
             {"xla": "XLA reference", "peer:torch_compile": "torch.compile"},
             cases=(f"{ROTARY} fwd", f"{ROTARY} fwd+bwd")),
    ],
    "GaLore Adam": [
        Rows("`galore_adamw` update, then `optax.apply_updates`, under jit (donated), one step between refreshes",
             "galore", "pallas:tx", GALORE_PEER,
             cases=GALORE_CASES, case_label=GALORE_LABELS),
        Rows("the same with `refresh=` passed from the host", "galore", "pallas:tx_host_refresh", GALORE_PEER,
             cases=GALORE_CASES, case_label=GALORE_LABELS),
        Rows('the same with `convention="optax"`', "galore", "pallas:tx_optax_convention", GALORE_PEER,
             cases=GALORE_CASES, case_label=GALORE_LABELS),
        Rows("`galore_adamw`, its refresh every 200 steps amortized", "galore", "pallas:tx", GALORE_PEER,
             cases=("llama7b layer r128 gap200",)),
        Rows("`galore_adamw_inplace`, its refresh every 200 steps amortized", "galore", "pallas:inplace", GALORE_PEER,
             cases=("llama7b layer r128 gap200",)),
    ],
    "DoRA and QDoRA": [
        Rows("`DoRADense` (linen) fwd+bwd, the output returned too", "dora_fwdbwd", "user:DoRADense",
             {"xla": "XLA reference", "lora:pallas": "lora_dense (fused the same way)"}),
        Rows("`dora_dense` fwd", "dora_fwd", "pallas",
             {"xla": "XLA reference", "lora:pallas": "lora_dense", "peer:base_matmul": "base GEMM x W"},
             cases=DORA_CASES),
        Rows("QDoRA: `dora_dense` on an `Int8Kernel`, fwd", "qdora_fwd", "pallas:int8",
             {"xla:int8": "XLA dequantize + GEMM"}, cases=DORA_CASES),
        Rows("QDoRA: `dora_dense` on an `NF4Kernel`, fwd", "qdora_fwd", "pallas:nf4",
             {"xla:nf4": "XLA dequantize + GEMM"}, cases=DORA_CASES),
        Rows("QDoRA: `dora_dense` on an `Int8Kernel`, fwd+bwd", "qdora_fwdbwd", "pallas:int8",
             {"xla:int8": "XLA dequantize + GEMM", "pallas:bf16": "bf16 DoRA"}, cases=DORA_CASES),
        Rows("QDoRA: `dora_dense` on an `NF4Kernel`, fwd+bwd", "qdora_fwdbwd", "pallas:nf4",
             {"xla:nf4": "XLA dequantize + GEMM", "pallas:bf16": "bf16 DoRA"}, cases=DORA_CASES),
    ],
    "FP8 training": [
        *[Rows(f"`nn.Dense(dot_general_cls=Float8DotGeneral)`, recipe `{recipe}`, fwd+bwd", "fp8_dense",
               f"pallas:{recipe}",
               {"peer:flax_fp8_direct": "flax Fp8DirectDotGeneralOp", "peer:bf16_dense": "bf16 nn.Dense"},
               cases=("16384x8192->8192 fwd+bwd",))
          for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp")],
        Rows("`scaled_matmul_nt(x8, w8, sx, sw)` from `quantize(..., axis=-1)` (rowwise)", "fp8_mm",
             "user:scaled_matmul_nt", {"peer:torch_scaled_mm": "torch._scaled_mm"},
             cases=tuple(f"{s} rowwise" for s in MM_SHAPES), tflops=True),
        Rows("`scaled_matmul_nt(x8, w8, sx, sw)` from `quantize(...)` (tensorwise)", "fp8_mm",
             "user:scaled_matmul_nt", {"peer:torch_scaled_mm": "torch._scaled_mm"},
             cases=tuple(f"{s} tensorwise" for s in MM_SHAPES), tflops=True),
        Rows("the blockwise GEMM (1 x 128 activation tiles, 128 x 128 weight blocks)", "fp8_mm",
             "pallas:sm90_blockwise", {"peer:torch_scaled_mm_blockwise": "torch._scaled_mm blockwise"},
             cases=tuple(f"{s} blockwise" for s in BLOCKWISE_SHAPES), tflops=True),
    ],
    "SwiGLU": [
        Rows("`swiglu(gate, up)` (forward; forward and backward)", "swiglu", "user:swiglu",
             {"xla": "XLA, `nn.silu(gate) * up`", "peer:torch_compile": "torch.compile"}),
    ],
    "Fused AdamW": [
        Rows("`adamw` update, then `optax.apply_updates`", "adam", "xla:optax",
             {"peer:optax_adamw": "optax.adamw", "peer:torch_fused_adamw": "torch fused AdamW"}, cases=(ADAM_CASE,)),
        Rows("`adamw_step`, in place", "adam", "pallas:inplace",
             {"peer:optax_adamw": "optax.adamw", "peer:torch_fused_adamw": "torch fused AdamW"}, cases=(ADAM_CASE,)),
        Rows("`adamw_step` with 8-bit states (`state_bits=8`), in place", "adam", "pallas:inplace_8bit",
             {"peer:optax_adamw": "optax.adamw", "peer:torch_fused_adamw": "torch fused AdamW"}, cases=(ADAM_CASE,)),
    ],
}


@dataclass(frozen=True)
class Headline:
    """One line of a device's headline table: a capability's main pair of record."""

    capability: str  # its section in docs/performance.md
    what: str  # what the user writes (Markdown)
    shape: str
    op: str
    case: str
    ours: str
    peer: str
    peer_label: str


# One line per capability: its main pair of record (the others are in docs/performance.md).
HEADLINE = [
    Headline("Adapting an existing model", "`adapt.apply(model, [LoraRule(...)])`, adapters-only step",
             "HF Flax Llama 1.24B, 8192 tokens, r16", "adapt", "hf_llama_1b_8x1024_r16", "adapt:lora",
             "peer:qwix_lora", "qwix `apply_lora_to_model`"),
    Headline("An FP8 base under the adapters", "`adapt.apply(model, [LoraRule(..., base_fp8=\"rowwise\")])`, "
             "adapters-only step", "4 Dense blocks 4096->11008->4096, 8192 tokens, r16", "adapt", FP8_BASE_CASE,
             "adapt:lora_fp8", "peer:qwix_lora", "qwix LoRA (bf16 base)"),
    Headline("Fused linear cross-entropy", "`linear_cross_entropy(hidden, kernel, labels)`, fwd+bwd",
             "8192 tokens, d 4096, V 128256, HF's (d, V) `lm_head`", "loss", "N8192 d4096 V128256 bf16 fwd+bwd",
             "user:linear_cross_entropy", "peer:liger", "Liger-Kernel (torch)"),
    Headline("Rotary embeddings", "`apply_rotary(q, k, positions)`, fwd+bwd", "B4 S4096 Hq32 Hk8 D128 bf16",
             "rotary", f"{ROTARY} fwd+bwd", "user:apply_rotary", "xla", "XLA reference"),
    Headline("GaLore Adam", "`galore_adamw(...)` + `optax.apply_updates`, refresh every 200 steps",
             "a Llama-7B layer, r128", "galore", "llama7b layer r128 gap200", "pallas:tx",
             "peer:optax_contrib_galore", "`optax.contrib.galore`"),
    Headline("DoRA and QDoRA", "`DoRADense(...)`, fwd+bwd", "4096 tokens, 4096->4096 r16 bf16", "dora_fwdbwd",
             "4096x4096->4096 r16 bf16", "user:DoRADense", "xla", "XLA reference"),
    Headline("FP8 training", "`nn.Dense(dot_general_cls=Float8DotGeneral)` rowwise, fwd+bwd",
             "16384 tokens, 8192->8192", "fp8_dense", "16384x8192->8192 fwd+bwd", "pallas:rowwise",
             "peer:bf16_dense", "bf16 `nn.Dense`"),
    Headline("Fused AdamW", "`adamw_step(...)`, 8-bit states, in place", "105M fp32 params", "adam", ADAM_CASE,
             "pallas:inplace_8bit", "peer:optax_adamw", "`optax.adamw`"),
]


def anchor(heading: str) -> str:
    """The id MkDocs (toc) and GitHub give a heading."""
    return re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", heading.lower())).strip("-")


def records(doc: dict) -> dict[tuple[str, str, str], dict]:
    """The row of record of each (op, case, implementation): the JSON's last."""
    return {(r["op"], r["case"], r["impl"]): r for r in doc["rows"] if r.get("ms")}


def _ratio(peer: dict, ours: dict) -> str:
    """The peer's time over ours, two decimals below 10x."""
    r = peer["ms"] / ours["ms"]
    return f"{r:.2f}x" if r < 10 else f"{r:.0f}x"


def _value(row: dict, tflops: bool) -> str:
    return f"{row['tflops']:.0f}" if tflops else f"{row['ms']:.3f}"


def section_table(doc: dict, rows: list[Rows]) -> str:
    """One table per Rows: a line per case, ours and each peer measured in the same run, then the runs' logs. Cases
    this device has no row of ours for are left out, and so is a Rows with none ("" where nothing is left);
    `unmeasured` catches a case no device has."""
    rec = records(doc)
    logs = {r["date"]: r["log"] for r in doc["runs"] if r.get("log")}
    out: list[str] = []
    for spec in rows:
        cases = spec.cases or tuple(sorted({c for (op, c, impl) in rec if op == spec.op and impl == spec.ours}))
        cases = tuple(case for case in cases if (spec.op, case, spec.ours) in rec)
        if not cases:
            continue
        unit = "TFLOP/s" if spec.tflops else "ms"
        extra_head = f" {spec.extra[1]}: ours / " + " / ".join(spec.peers.values()) + " |" if spec.extra else ""
        out += ["", f"{spec.what}, in {unit}:", "",
                "| case | ours | " + " | ".join(spec.peers.values()) + " |" + extra_head + " run |",
                "| --- | ---: | " + " | ".join("---:" for _ in spec.peers) + " |" + (" ---: |" if spec.extra else "")
                + " --- |"]
        runs = []
        for case in cases:
            ours = rec[(spec.op, case, spec.ours)]
            cells, extras = [], [ours["extra"].get(spec.extra[0])] if spec.extra else []
            for impl in spec.peers:
                peer = rec.get((spec.op, case, impl))
                same_run = peer is not None and peer["run"] == ours["run"]
                cells.append(f"{_value(peer, spec.tflops)} ({_ratio(peer, ours)})" if same_run else "")
                if spec.extra:
                    extras.append(peer["extra"].get(spec.extra[0]) if same_run else None)
            if spec.extra:
                cells.append(" / ".join("-" if v is None else f"{v:.1f}" for v in extras))
            out.append(f"| {spec.case_label.get(case, case)} | {_value(ours, spec.tflops)} | " + " | ".join(cells)
                       + f" | {ours['run'][:16]} |")
            if ours["run"] not in runs:
                runs.append(ours["run"])
        logged = [f"{run[:16]}: `benchmarks/results/{logs[run]}`" for run in runs if run in logs]
        if logged:
            out += ["", "Logs: " + "; ".join(logged) + "."]
    return "\n".join(out[1:])


def headline_table(doc: dict) -> str:
    """The headline table of one device: a line per capability whose pair of record it has (ours and the peer from
    one run), then a line naming the capabilities not measured on it yet."""
    rec = records(doc)
    out = ["| capability | what you write | shape | vs (same run) | speed vs peer | rows of record |",
           "| --- | --- | --- | --- | ---: | --- |"]
    absent = []
    for h in HEADLINE:
        ours, peer = rec.get((h.op, h.case, h.ours)), rec.get((h.op, h.case, h.peer))
        if ours is None or peer is None or ours["run"] != peer["run"]:
            absent.append(h.capability)
            continue
        out.append(f"| {h.capability} | {h.what} | {h.shape} | {h.peer_label} | {_ratio(peer, ours)} | "
                   f"[{ours['run'][:10]}](#{anchor(h.capability)}) |")
    if absent:
        out += ["", "Not measured on this GPU yet: " + ", ".join(absent) + "."]
    return "\n".join(out)


def _pairs(doc: dict):
    """(section, what, case, peer label, peer row, our row) of every pair of record in SECTIONS measured in one run."""
    rec = records(doc)
    for section, specs in SECTIONS.items():
        for spec in specs:
            cases = spec.cases or tuple(sorted({c for (op, c, impl) in rec if op == spec.op and impl == spec.ours}))
            for case in cases:
                ours = rec.get((spec.op, case, spec.ours))
                for impl, label in spec.peers.items():
                    peer = rec.get((spec.op, case, impl))
                    if ours and peer and peer["run"] == ours["run"]:
                        yield section, spec.what, spec.case_label.get(case, case), label, peer, ours


def _jax_of(doc: dict, run: str) -> str:
    return next((r.get("jax", "?") for r in doc["runs"] if r["date"] == run), "?")


def versions_table(doc: dict, other: dict, moved: float = 0.10) -> str:
    """Each pair of record that a run on another jax version (`other`, benchmarks/results/jax_<v>/) measured too:
    the peer-over-ours ratio in both, and the change; a change of more than `moved` is marked."""
    base = {tuple(key): (peer, ours) for *key, peer, ours in _pairs(doc)}
    out = ["| capability | what you write | case | vs | ratio | on | ratio | on | change |",
           "| --- | --- | --- | --- | ---: | --- | ---: | --- | ---: |"]
    for *key, opeer, oours in _pairs(other):
        if tuple(key) not in base:
            continue
        peer, ours = base[tuple(key)]
        change = (opeer["ms"] / oours["ms"]) / (peer["ms"] / ours["ms"]) - 1
        mark = "**" if abs(change) > moved else ""
        out.append(" | ".join(["", *key, _ratio(peer, ours), f"jax {_jax_of(doc, ours['run'])}", _ratio(opeer, oours),
                               f"jax {_jax_of(other, oours['run'])}", f"{mark}{round(100 * change):+d}%{mark}", ""])
                   .strip())
    return "\n".join(out)


def unmeasured(docs: list[dict]) -> list[tuple[str, str, str]]:
    """The (op, case, ours) of SECTIONS and HEADLINE that no device's JSON has a row for: a misspelt case, or one
    named before it was measured anywhere."""
    have = set().union(*(records(doc) for doc in docs))
    wanted = [(spec.op, case, spec.ours) for specs in SECTIONS.values() for spec in specs for case in spec.cases]
    wanted += [(h.op, h.case, h.ours) for h in HEADLINE]
    return [key for key in wanted if key not in have]


def tables(device: Device, doc: dict) -> dict[Path, dict[str, str]]:
    """file -> {marker name: generated text} for one device; a table with nothing in it has no markers."""
    perf = {f"rows-{anchor(name)} {device.tag}": section_table(doc, rows)
            for name, rows in SECTIONS.items()}
    for path in sorted(RESULTS.glob(f"jax_*/{device.name}.json")):
        perf[f"{path.parent.name.replace('.', '')} {device.tag}"] = versions_table(doc, json.loads(path.read_text()))
    perf[f"headline {device.tag}"] = headline_table(doc)
    return {ROOT / "docs" / "performance.md": {n: t for n, t in perf.items() if t}}


def fill(text: str, name: str, body: str, path: Path) -> str:
    begin, end = (re.escape(f"<!-- perf-docs:{mark} {name} -->") for mark in ("begin", "end"))
    pattern = re.compile(rf"({begin}\n)(.*?)({end})", re.S)
    if not pattern.search(text):
        raise SystemExit(f"perf_docs: {path.relative_to(ROOT)} has no perf-docs markers for {name!r}")
    return pattern.sub(lambda m: m.group(1) + body + "\n" + m.group(3), text, count=1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 where a table differs")
    args = p.parse_args(argv)
    docs = [json.loads((RESULTS / f"{device.name}.json").read_text()) for device in DEVICES]
    missing = unmeasured(docs)
    if missing:
        raise SystemExit(f"perf_docs: rows of record that no device has: {missing}")
    named: dict[Path, dict[str, str]] = {}
    for device, doc in zip(DEVICES, docs):
        for path, found in tables(device, doc).items():
            named.setdefault(path, {}).update(found)
    stale = []
    for path, bodies in named.items():
        old = path.read_text()
        new = old
        for name, body in bodies.items():
            new = fill(new, name, body, path)
        if new == old:
            continue
        rel = str(path.relative_to(ROOT))
        if args.check:
            stale.append(rel)
            diff = difflib.unified_diff(old.splitlines(True), new.splitlines(True), rel, f"{rel} (from the JSON)")
            sys.stdout.writelines(diff)
        else:
            path.write_text(new)
            print(f"wrote {rel}")
    if stale:
        print(f"\nperf_docs: {', '.join(stale)} differ from benchmarks/results/*.json; run `make perf-docs`",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
