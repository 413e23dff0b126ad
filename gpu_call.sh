#!/bin/bash
# device call 6 (session 4): the README example on GPU with this session's defaults.
# GPU0: pallas_fused only, with the DoRA fine-tune (gemm auto -> sm90 where the shapes fit); GPU1: --compare pretrain.
pip install --no-deps -e . >/dev/null 2>&1
cp -r . /tmp/t1
( cd /tmp/t1 && CUDA_VISIBLE_DEVICES=1 timeout 430 python examples/train_llama.py --preset gpu --compare --finetune-steps 0 --no-progress --out $OUT/demo_compare --ckpt-dir /tmp/ckpt1 > $OUT/example_compare.log 2>&1; echo "rc=$?" >> $OUT/example_compare.log ) &
CUDA_VISIBLE_DEVICES=0 timeout 430 python examples/train_llama.py --preset gpu --finetune-steps 100 --no-progress --out $OUT/demo_dora --ckpt-dir /tmp/ckpt0 > $OUT/example_dora.log 2>&1; echo "rc=$?" >> $OUT/example_dora.log
wait
grep -v "^[EW]11" $OUT/example_dora.log | tail -n 12; grep -v "^[EW]11" $OUT/example_compare.log | tail -n 8
