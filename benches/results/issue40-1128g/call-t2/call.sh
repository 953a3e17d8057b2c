#!/usr/bin/env bash
# Session 1128g call T2 (2x H200): main 72fc833's whole pytest with peers required (main with the
# lazy guard: its first whole run).
set -u
mkdir -p $OUT
source scripts/gpu_env.sh
VMMBUF_REQUIRE_PEERS=1 timeout -s TERM 540 python -m pytest -v python/tests --timeout 200 -p no:cacheprovider > $OUT/pytest-main.log 2>&1
echo "pytest main rc $? [$SECONDS s]"; grep -E "FAILED|ERROR|SKIPPED" $OUT/pytest-main.log | head -20; tail -1 $OUT/pytest-main.log
