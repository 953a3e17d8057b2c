#!/usr/bin/env bash
# Session 1128e call O (1x H200): the queued frees' tests, the cost per pair, and FSDP on one GPU
# against fa64703's wheel (vmmbuf-alt) in the same interleaved rounds.
set -u
S=$OUT/summary.txt
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $S
source scripts/gpu_env.sh >/dev/null
pip install -q --no-index --no-deps --target /tmp/alt .gpu/wheels-alt/*.whl 2>/dev/null; export DIST_ALT_PATH=/tmp/alt
timeout -s INT 100 python -m pytest -v python/tests -k "queued or callers_context or record_stream" --timeout 90 -p no:cacheprovider > $OUT/pytest.log 2>&1
echo "pytest rc $? [$SECONDS s]" >> $S; tail -2 $OUT/pytest.log >> $S
timeout 150 python3 scripts/torch_alloc_cost.py --allocs expandable,vmmbuf,vmmbuf-noqueue,vmmbuf-alt --rounds 4 > $OUT/alloc-cost.txt 2>&1
echo "alloc-cost rc $? [$SECONDS s]" >> $S; cat $OUT/alloc-cost.txt >> $S
PYTHONFAULTHANDLER=1 timeout 330 python3 scripts/dist_train.py --all --nproc 1 --modes fsdp \
  --allocs native,expandable,vmmbuf,vmmbuf-alt --rounds 4 --steps 40 --out $OUT/fsdp1.json > $OUT/fsdp1.txt 2>&1
echo "fsdp1 rc $? [$SECONDS s]" >> $S; grep -v "^{" $OUT/fsdp1.txt | tail -24 >> $S
cat $S
