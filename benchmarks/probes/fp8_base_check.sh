#!/usr/bin/env bash
# LoRA / DoRA over an FP8 base on one GPU, one command: the GPU tests of frozen_fp8_matmul, then bench_adapt's
# adapters-only Adam step with the FP8-base rules beside bf16 LoRA / DoRA and qwix's LoRA in the same process.
#   bash benchmarks/probes/fp8_base_check.sh [blocks|adapters|adapters-pairs]
# blocks (default): 4 x 4096 -> 11008 -> 4096 Dense blocks at 8192 tokens, r16, every candidate in one process.
# adapters: HF's Flax Llama at 1B, 8 x 1024 tokens, r16, qwix's QLoRA NF4 beside, every candidate in one process
# (the interleaved timing holds every candidate's state at once: an H200's memory).
# adapters-pairs: the same model, one process per rule, each beside qwix's LoRA (what fits an H100 80GB).
# SKIP_TESTS=1 leaves out the GPU tests. Logs and the results JSON go under $OUT; a table of the step times and peak
# memory, each ratio against the qwix LoRA of its own run, is printed last.
set -u
GROUP=${1:-blocks}
OUT=${OUT:-/tmp/fp8_base_check}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
START=$(date "+%Y-%m-%d %H:%M:%S")  # the rows of this check: runs dated from here on (local time, as the results file)
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 170 $PY -m pytest -q -p no:cacheprovider -n 0 -m gpu tests/fp8/test_frozen.py > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests (tests/fp8/test_frozen.py -m gpu): rc=$? $(tail -1 "$OUT/gpu_tests.log")"
fi
bench() {  # bench GROUPS IMPLS LOG TIMEOUT
  ADAPT_GROUPS=$1 ADAPT_IMPLS=$2 ADAPT_TRACE=0 timeout "$4" $PY -m benchmarks.run adapt --quick --out "$OUT" \
    > "$OUT/$3" 2>&1
  echo "bench_adapt $2: rc=$?"
}
case "$GROUP" in
  blocks)
    IMPLS=blocks:adapt:lora,blocks:adapt:dora,blocks:peer:qwix_lora,blocks:adapt:lora_fp8,blocks:adapt:dora_fp8
    bench blocks "$IMPLS,blocks:adapt:lora_fp8_tensorwise,blocks:adapt:dora_fp8_tensorwise" bench_blocks.log 400 ;;
  adapters)
    bench adapters,quantized adapt:lora,adapt:dora,peer:qwix_lora,peer:qwix_qlora_nf4,adapt:lora_fp8,adapt:dora_fp8 \
      bench_adapters.log 400 ;;
  adapters-pairs)
    for rule in lora_fp8 dora_fp8; do
      bench adapters "peer:qwix_lora,adapt:$rule" "bench_adapters_$rule.log" "${PAIR_TIMEOUT:-200}"
    done ;;
  *) echo "unknown group $GROUP" >&2; exit 2 ;;
esac
$PY - "$OUT" "$START" <<'PY'
import glob, json, sys
docs = [json.load(open(p)) for p in glob.glob(f"{sys.argv[1]}/*.json")]
rows = [r for d in docs for r in d["rows"] if r["op"] == "adapt" and r.get("run", "") >= sys.argv[2]]
base = {(r["case"], r["run"]): r["ms"] for r in rows if r["impl"] == "peer:qwix_lora" and r["ms"]}
print(f"{'case':40s} {'run':20s} {'impl':24s} {'ms':>9s} {'x qwix':>7s} {'peak GB':>8s}")
for r in sorted(rows, key=lambda r: (r["case"], r["run"], r["ms"] or 1e9)):
    q = base.get((r["case"], r["run"]))
    ms = r["ms"]
    print(f"{r['case'][:40]:40s} {r['run'][:20]:20s} {r['impl'][:24]:24s} {ms if ms else float('nan'):9.3f} "
          f"{ms / q if ms and q else float('nan'):7.3f} {r['extra'].get('peak_gb') or float('nan'):8.3f}"
          + ("" if ms else f"  {str(r['extra'].get('error', ''))[:60]}"))
PY
