#!/usr/bin/env bash
# Session 1128f call S (2x H200): exp/lazy-context (625e897) as vmmbuf against main 5c1ae56 as vmmbuf-alt,
# FSDP on 2 GPUs with native and expandable in the same rounds, then the cost per pair on GPU 0.
set -u
mkdir -p $OUT
rm -rf .gpu/wheels-alt; mv .gpu/wheels .gpu/wheels-alt; mv .gpu/wheels-lazy .gpu/wheels
ROUNDS=5 DIST_SECS=420 COST_SECS=110 bash scripts/issue40_gpu.sh before 2
echo "[$SECONDS s]"
