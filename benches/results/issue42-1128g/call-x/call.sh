#!/usr/bin/env bash
# Session 1128g call X (1 of 2x H200): allocation traces of issue 42's kv-decode and causal-LM
# workloads for host replays (scripts/torch_trace.py, 40 steps, PyTorch's own allocator recording).
set -u
mkdir -p $OUT
for w in kv-decode causal-lm; do
  timeout -s TERM 100 python3 scripts/torch_trace.py $OUT/torch-$w-h200.csv.gz --workload $w --steps 40 > $OUT/trace-$w.txt 2>&1
  echo "$w rc $? [$SECONDS s]"; tail -3 $OUT/trace-$w.txt
done
ls -la $OUT
