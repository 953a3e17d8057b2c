#!/usr/bin/env bash
# Session 1128e call N (1x H200): full pytest with the queued frees and the lighter malloc guard,
# then the cost per pair against fa64703's wheel (vmmbuf-alt) in the same rounds.
set -u
S=$OUT/summary.txt
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $S
source scripts/gpu_env.sh >/dev/null
pip install -q --no-index --no-deps --target /tmp/alt .gpu/wheels-alt/*.whl 2>/dev/null; export DIST_ALT_PATH=/tmp/alt
timeout -s INT 300 python -m pytest -v python/tests --timeout 200 -p no:cacheprovider --durations=8 > $OUT/pytest.log 2>&1
echo "pytest rc $? [$SECONDS s]" >> $S; tail -3 $OUT/pytest.log >> $S; grep -E "FAILED|ERROR" $OUT/pytest.log | head >> $S
timeout 240 python3 scripts/torch_alloc_cost.py --allocs native,expandable,vmmbuf,vmmbuf-noqueue,vmmbuf-alt --rounds 4 > $OUT/alloc-cost.txt 2>&1
echo "alloc-cost rc $? [$SECONDS s]" >> $S; cat $OUT/alloc-cost.txt >> $S
cat $S
