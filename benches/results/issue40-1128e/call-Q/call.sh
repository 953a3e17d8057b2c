#!/usr/bin/env bash
# Session 1128e call Q (1x H200): main's lighter context guard (malloc and free read the context once
# when it is the device's own): the plug-in's GPU tests.
set -u
source scripts/gpu_env.sh >/dev/null
timeout -s INT 170 python -m pytest -v python/tests/test_torch_gpu.py -k "process_wide or callers_context or mempool or record_stream or our_out_of_memory" \
  --timeout 120 -p no:cacheprovider > $OUT/pytest.log 2>&1
echo "pytest rc $? [$SECONDS s]"; grep -E "PASSED|FAILED|ERROR|SKIPPED" $OUT/pytest.log | sed 's/python.tests.test_torch_gpu.py:://' ; tail -1 $OUT/pytest.log
