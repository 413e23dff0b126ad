#!/usr/bin/env bash
# The tuner on one GPU, in two stages that each fit one device call:
#
#     STAGE=tune    OUT=$OUT bash benchmarks/tune_check.sh   # tune this GPU from scratch for the example's FP8 GEMMs
#     STAGE=compare OUT=$OUT bash benchmarks/tune_check.sh   # the FP8 GEMM rows at the example's shapes, --quick
#
# tune: `python -m pallas_fused.tune --ops $OPS` (default fp8: the FP8 GEMMs; fp8,dora adds the DoRA layers) with
# an empty cache directory ($OUT/cache), the example's GPU preset shapes, rowwise and tensorwise, bounded by BUDGET
# seconds (default 360) inside an outer `timeout` of BUDGET + 120; the cache file it wrote is copied to $OUT/$NAME.json
# (default nvidia_h100.json). Shipped as this GPU kind's table it goes to pallas_fused/tuning/<device>.json (the file
# name it had in $OUT/cache, e.g. nvidia_h100_80gb_hbm3.json).
# compare (inside COMPARE_TIMEOUT s, default 560): `python -m benchmarks.run fp8 --quick` at the example's 9 GEMM
# shapes (FP8_SECTIONS=matmul), every candidate in turn with torch._scaled_mm; rows under $OUT. With the tuned file
# in pallas_fused/tuning/ (or in $PALLAS_FUSED_TUNING_CACHE), the row of record `user:scaled_matmul_nt` runs its
# choice ("choice" in the row).
# Each prints a short table last.
set -u
OUT=${OUT:-runs/tune_check}
PY=${PYTHON:-python}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false}
SHAPES=16384x2048x5504,16384x2048x2048,16384x2048x512,16384x5504x2048,16384x512x2048,2048x16384x2048,2048x16384x512,2048x16384x5504,5504x16384x2048
case "${STAGE:?set STAGE to tune or compare}" in
    tune)
        BUDGET=${BUDGET:-360}
        start=$(date +%s)
        rm -rf "$OUT/cache"
        timeout $((BUDGET + 120)) $PY -m pallas_fused.tune --budget "$BUDGET" --ops "${OPS:-fp8}" \
            --cache-dir "$OUT/cache" --no-progress \
            > "$OUT/tune.log" 2>&1
        echo "tune exited $? after $(($(date +%s) - start)) s (log: $OUT/tune.log)"
        for f in "$OUT"/cache/*.json; do
            [ -e "$f" ] && cp "$f" "$OUT/${NAME:-nvidia_h100}.json" && echo "table: $OUT/${NAME:-nvidia_h100}.json (as $(basename "$f"))"
        done
        # the candidates that failed, then the table (the log's last lines)
        grep "failed:" "$OUT/tune.log" | head -20
        sed -n '/^elapsed/,$p' "$OUT/tune.log" ;;
    compare)
        FP8_SECTIONS=matmul FP8_SHAPES=${FP8_SHAPES:-$SHAPES} PF_RESULTS_DIR="$OUT" timeout "${COMPARE_TIMEOUT:-560}" \
            $PY -m benchmarks.run fp8 --quick > "$OUT/compare.log" 2>&1
        echo "benchmarks.run exited $? (log: $OUT/compare.log)"
        $PY - "$OUT" <<'EOF'
import json, pathlib, sys

docs = [json.loads(p.read_text()) for p in pathlib.Path(sys.argv[1]).glob("*.json")]
rows = [r for d in docs if isinstance(d, dict) for r in d.get("rows", []) if r.get("op") == "fp8_mm"]  # results files
by = {}
for r in rows:
    by.setdefault(r["case"], {})[r["impl"]] = r
print(f"{'case':<28} {'user ms':>8} {'choice':<22} {'best of ours':<34} {'torch ms':>8} {'vs torch':>8}")
for case, impls in by.items():
    user, torch = impls.get("user:scaled_matmul_nt", {}), impls.get("peer:torch_scaled_mm", {})
    ours = sorted((r["ms"], name) for name, r in impls.items() if r.get("ms") and not name.startswith("peer:"))
    best = f"{ours[0][1]} {ours[0][0]:.4f}" if ours else "-"
    ratio = f"{torch['ms'] / user['ms']:.2f}x" if user.get("ms") and torch.get("ms") else "-"  # above 1: ours faster
    choice = user.get("extra", {}).get("choice", "-")
    print(f"{case:<28} {user.get('ms') or 0:8.4f} {choice:<22} {best:<34} {torch.get('ms') or 0:8.4f} {ratio:>8}")
EOF
        ;;
    *) echo "unknown STAGE $STAGE"; exit 2 ;;
esac
