#!/bin/bash
# device call 5 (session 4): DoRA main cases alone (no parallel stream: single-call rows need an idle host)
pip install --no-deps -e . >/dev/null 2>&1
DORA_SECTIONS=main_cases DORA_IMPLS=pallas,pallas:sm90,pallas:merged,pallas:epilogue,pallas:xla_epilogue,pallas:sm90_remerge CUDA_VISIBLE_DEVICES=0 timeout 420 python -m benchmarks.run dora --out $OUT/dora > $OUT/bench_dora.log 2>&1
echo "bench rc=$?"
grep -E "dora_(fwd|fwdbwd|colnorm) |took|HBM [0-9]" $OUT/bench_dora.log | grep -v "pallas:single\|xla:single"
