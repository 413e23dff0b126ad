#!/usr/bin/env bash
# LoRA / DoRA over an FP8 base on one GPU, one command: the GPU tests of frozen_fp8_matmul, then bench_adapt's
# adapters-only Adam step with the FP8-base rules beside bf16 LoRA / DoRA and qwix's LoRA in the same process.
#   bash benchmarks/probes/fp8_base_check.sh [blocks|adapters]   (default blocks: 4 x 4096 -> 11008 -> 4096 Dense
#   blocks at 8192 tokens, r16; adapters: HF's Flax Llama at 1B, 8 x 1024 tokens, r16, qwix's QLoRA NF4 beside)
# Logs and the results JSON go under $OUT; a table of the step times and peak memory is printed last.
set -u
GROUP=${1:-blocks}
OUT=${OUT:-/tmp/fp8_base_check}
mkdir -p "$OUT"
if [ "$GROUP" = blocks ]; then
  IMPLS=blocks:adapt:lora,blocks:adapt:dora,blocks:peer:qwix_lora,blocks:adapt:lora_fp8,blocks:adapt:dora_fp8
  IMPLS=$IMPLS,blocks:adapt:lora_fp8_tensorwise,blocks:adapt:dora_fp8_tensorwise
  GROUPS_=blocks
else
  IMPLS=adapt:lora,adapt:dora,peer:qwix_lora,peer:qwix_qlora_nf4,adapt:lora_fp8,adapt:dora_fp8
  GROUPS_=adapters,quantized
fi
timeout 170 ${PYTHON:-python3} -m pytest -q -p no:cacheprovider -n 0 -m gpu tests/fp8/test_frozen.py > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests (tests/fp8/test_frozen.py -m gpu): rc=$? $(tail -1 "$OUT/gpu_tests.log")"
ADAPT_GROUPS=$GROUPS_ ADAPT_IMPLS=$IMPLS ADAPT_TRACE=0 timeout 400 ${PYTHON:-python3} -m benchmarks.run adapt --quick \
  --out "$OUT" > "$OUT/bench_$GROUP.log" 2>&1
echo "bench_adapt $GROUP: rc=$?"
${PYTHON:-python3} - "$OUT" <<'PY'
import glob, json, sys
docs = [json.load(open(p)) for p in glob.glob(f"{sys.argv[1]}/*.json")]
rows = [r for d in docs for r in d["rows"] if r["op"] == "adapt" and r.get("run") == d["runs"][-1]["date"]]
base = {r["case"]: r["ms"] for r in rows if r["impl"] == "peer:qwix_lora" and r["ms"]}
print(f"{'case':44s} {'impl':28s} {'ms':>9s} {'x qwix':>7s} {'peak GB':>8s}")
for r in sorted(rows, key=lambda r: (r["case"], r["ms"] or 1e9)):
    q = base.get(r["case"])
    ms = r["ms"]
    print(f"{r['case'][:44]:44s} {r['impl'][:28]:28s} {ms if ms else float('nan'):9.3f} "
          f"{ms / q if ms and q else float('nan'):7.3f} {r['extra'].get('peak_gb') or float('nan'):8.3f}"
          + ("" if ms else f"  {str(r['extra'].get('error', ''))[:60]}"))
PY
