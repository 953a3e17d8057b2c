#!/usr/bin/env bash
# Session 1128g call U (2x H200): main 72fc833 (lazy context guard), FSDP on 2 GPUs against native
# and expandable segments, interleaved rounds, to see whether 1128f's one run at parity repeats.
set -u
mkdir -p $OUT
source scripts/gpu_env.sh >/dev/null
export NCCL_NVLS_ENABLE=0 PYTHONFAULTHANDLER=1
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
timeout -s TERM 530 python3 -u scripts/dist_train.py --all --nproc 2 --budget 505 --modes fsdp \
  --allocs native,expandable,vmmbuf --rounds 7 --steps 40 --out $OUT/dist-2gpu.json > $OUT/dist-2gpu.txt 2>&1
echo "dist_train exit $? [$SECONDS s]"; grep -v '^{' $OUT/dist-2gpu.txt | tail -n 30
