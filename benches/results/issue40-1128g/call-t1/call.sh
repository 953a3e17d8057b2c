#!/usr/bin/env bash
# Session 1128g call T1 (2x H200): main 72fc833 — the Rust suite with peers required (first run of
# the lazy-guard two-GPU test), then torch_memory_saver 0.0.10's own suite under vmmbuf's shim
# (main with the lazy guard), compared with the real package's log of the fifth run.
set -u
mkdir -p $OUT
source scripts/gpu_env.sh
nvidia-smi topo -m | head -4; nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv
VMMBUF_REQUIRE_PEERS=1 timeout -s TERM 230 bash .gpu/run.sh tests > $OUT/rust.log 2>&1
echo "rust rc $? [$SECONDS s]"; grep -E "^test result|binaries:|FAILED|panicked|!!!" $OUT/rust.log | sort | uniq -c | head -20
grep -E "a_lazy_guard|peer::" $OUT/rust.log | head -20
mkdir -p $OUT/tms; cp benches/results/issue39-tms-suite-h200x2/fifth/native.log $OUT/tms/tms-native.log
PEER_CONFIGS=vmmbuf timeout -s TERM 260 bash scripts/peer_suites.sh tms .peer/tms $OUT/tms 240 > $OUT/tms.out 2>&1
echo "tms rc $? [$SECONDS s]"; tail -25 $OUT/tms.out
rm -rf $OUT/tms/tms-native-pkg $OUT/tms/tms-shim-pkg
