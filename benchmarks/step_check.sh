#!/usr/bin/env bash
# The training-step check on one GPU, in stages that each fit one device call (each run compiles the GPU
# preset first: ~70-100 s per model on an H200):
#
#     STAGE=profile OUT=$OUT bash benchmarks/step_check.sh   # per-family GPU kernel ms per step, ours and baseline
#     STAGE=bf16    OUT=$OUT bash benchmarks/step_check.sh   # 300 steps, --compare, bf16
#     STAGE=fp8     OUT=$OUT bash benchmarks/step_check.sh   # 300 steps, --compare, FP8 tensorwise
#
# Both sides of every run use cuDNN attention (ATTENTION=xla to change it), so the difference between them is the
# library's: its kernels, drop-ins and optimizers against plain flax / optax.
set -u
OUT=${OUT:-runs/step_check}
PY=${PYTHON:-python}
ATTENTION=${ATTENTION:-cudnn}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false}
case "${STAGE:?set STAGE to profile, bf16 or fp8}" in
    profile)
        $PY benchmarks/profile_step.py --preset gpu --steps 10 --attention "$ATTENTION" --out "$OUT/profile" \
            2>&1 | tee "$OUT/profile.log" ;;
    bf16)
        $PY examples/train_llama.py --preset gpu --compare --attention "$ATTENTION" --finetune-steps 0 \
            --no-progress --out "$OUT/bf16" 2>&1 | tee "$OUT/bf16.log" ;;
    fp8)
        $PY examples/train_llama.py --preset gpu --compare --attention "$ATTENTION" --fp8 tensorwise \
            --finetune-steps 0 --no-progress --out "$OUT/fp8" 2>&1 | tee "$OUT/fp8.log" ;;
    *)
        echo "STAGE must be profile, bf16 or fp8, got $STAGE" >&2; exit 2 ;;
esac
