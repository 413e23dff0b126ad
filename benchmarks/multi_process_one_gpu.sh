#!/usr/bin/env bash
# The example's GPU preset twice on one GPU: the plain single process, then the multi-process code path as
# 1 process of jax.distributed (coordinator on localhost; mesh data=1, per-process batch rows, global
# arrays). The step times should match: the distributed path adds no gather or host sync to a step.
#
#     OUT=benchmarks/results/multi_process STEPS=50 bash benchmarks/multi_process_one_gpu.sh
#
# Each run compiles the GPU preset first (70-100 s on an H200) and saves a checkpoint: allow ~4-5 minutes per run.
set -u
OUT=${OUT:-benchmarks/results/multi_process}
STEPS=${STEPS:-50}
PY=${PYTHON:-python}
mkdir -p "$OUT"
common=(--preset gpu --steps "$STEPS" --finetune-steps 0 --eval-every 100000 --no-progress
        --ckpt-dir "${CKPT_DIR:-/tmp/multi_process_ckpt}")
port=$($PY -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
timeout "${RUN_TIMEOUT:-280}" $PY examples/train_llama.py "${common[@]}" --out "$OUT/plain" > "$OUT/plain.log" 2>&1
echo "plain: rc $?"
timeout "${RUN_TIMEOUT:-280}" $PY examples/train_llama.py "${common[@]}" --coordinator "127.0.0.1:$port" \
    --num-processes 1 --process-id 0 --out "$OUT/distributed" > "$OUT/distributed.log" 2>&1
echo "distributed: rc $?"
for run in plain distributed; do
    grep -E "^\| pretrain|processes|checkpoint restored" "$OUT/$run.log" | sed "s/^/$run: /"
done
