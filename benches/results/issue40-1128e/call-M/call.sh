#!/usr/bin/env bash
# Session 1128e call M (1x H200): the queued-free change. New pytest first, then the plug-in's
# cost per pair (torch_alloc_cost) and FSDP on one GPU, queue on against =0 in the same rounds.
set -u
S=$OUT/summary.txt
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $S
source scripts/gpu_env.sh >/dev/null
git log --oneline -1 >> $S 2>/dev/null
timeout -s INT 120 python -m pytest -v python/tests -k "queued" --timeout 100 -p no:cacheprovider > $OUT/pytest-queued.log 2>&1
echo "pytest-queued rc $? [$SECONDS s]" >> $S; tail -4 $OUT/pytest-queued.log >> $S
timeout 200 python3 scripts/torch_alloc_cost.py --allocs native,expandable,vmmbuf,vmmbuf-noqueue --rounds 4 > $OUT/alloc-cost.txt 2>&1
echo "alloc-cost rc $? [$SECONDS s]" >> $S; cat $OUT/alloc-cost.txt >> $S
PYTHONFAULTHANDLER=1 timeout 330 python3 scripts/dist_train.py --all --nproc 1 --modes fsdp \
  --allocs native,expandable,vmmbuf,vmmbuf-noqueue --rounds 3 --steps 40 --out $OUT/fsdp1.json > $OUT/fsdp1.txt 2>&1
echo "fsdp1 rc $? [$SECONDS s]" >> $S; tail -40 $OUT/fsdp1.txt >> $S
cat $S
