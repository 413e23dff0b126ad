#!/usr/bin/env bash
# The training-step check on one GPU, in stages that each fit one device call (each run compiles the GPU
# preset first: ~70-100 s per model on an H200):
#
#     STAGE=profile OUT=$OUT bash benchmarks/step_check.sh   # per-family GPU kernel ms per step, ours and baseline
#     STAGE=bf16    OUT=$OUT bash benchmarks/step_check.sh   # 300 steps, --compare, bf16
#     STAGE=fp8     OUT=$OUT bash benchmarks/step_check.sh   # 300 steps, --compare, FP8 tensorwise
#     STAGE=qdora   OUT=$OUT bash benchmarks/step_check.sh   # the DoRA fine-tune alone, --compare: bf16, int8, nf4
#     STAGE=recipes OUT=$OUT bash benchmarks/step_check.sh   # 300 steps, ours alone: FP8 rowwise, then blockwise
#
# The qdora stage skips pretraining (--steps 0), so each process' first phase is the fine-tune and the report's
# peak device memory (a process-wide high-water mark) is the pallas_fused fine-tune's own.
# Both sides of every run use cuDNN attention (ATTENTION=xla to change it), so the difference between them is the
# library's: its kernels, drop-ins and optimizers against plain flax / optax.
set -u
OUT=${OUT:-runs/step_check}
PY=${PYTHON:-python}
ATTENTION=${ATTENTION:-cudnn}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false}
case "${STAGE:?set STAGE to profile, bf16, fp8, recipes or qdora}" in
    profile)
        $PY benchmarks/profile_step.py --preset gpu --steps 10 --attention "$ATTENTION" --out "$OUT/profile" \
            2>&1 | tee "$OUT/profile.log" ;;
    bf16)
        $PY examples/train_llama.py --preset gpu --compare --attention "$ATTENTION" --finetune-steps 0 \
            --no-progress --out "$OUT/bf16" 2>&1 | tee "$OUT/bf16.log" ;;
    fp8)
        $PY examples/train_llama.py --preset gpu --compare --attention "$ATTENTION" --fp8 tensorwise \
            --finetune-steps 0 --no-progress --out "$OUT/fp8" 2>&1 | tee "$OUT/fp8.log" ;;
    recipes)
        for recipe in rowwise blockwise; do
            $PY examples/train_llama.py --preset gpu --attention "$ATTENTION" --fp8 $recipe --finetune-steps 0 \
                --no-progress --out "$OUT/fp8_$recipe" 2>&1 | tee "$OUT/fp8_$recipe.log"
        done ;;
    qdora)
        for base in bf16 int8 nf4; do
            quantize=""
            [ "$base" = bf16 ] || quantize="--quantize $base"
            $PY examples/train_llama.py --preset gpu --steps 0 --compare --attention "$ATTENTION" $quantize \
                --no-progress --out "$OUT/qdora_$base" 2>&1 | tee "$OUT/qdora_$base.log"
        done ;;
    *)
        echo "STAGE must be profile, bf16, fp8, recipes or qdora, got $STAGE" >&2; exit 2 ;;
esac
