#!/usr/bin/env bash
# Issue 42 on the GPU, from the repository root after ../shared/gpu/pack, then
# the wheel copied to .gpu/wheels/ (the pack rebuilds .gpu/, so copy it after),
# with torch_memory_saver's 0.0.10 wheel in the git-ignored .peer/tms/wheels/.
#   bash scripts/issue42_gpu.sh rl          # rl_loop.py: vmmbuf, torch_memory_saver's interface on
#                                           # both packages and hook modes, pinned; first and steady
#                                           # pause/resume against the link (GPU 0)
#   bash scripts/issue42_gpu.sh footprint   # torch_allocators.py: native, expandable segments,
#                                           # cudaMallocAsync, vmmbuf and vmmbuf-move (2 MiB chunks,
#                                           # free chunks moved to where it grows), interleaved, on
#                                           # the Transformer, causal-lm, the conv net, vision-res, kv-decode
#                                           # (ALLOCS=...,vmmbuf-move4: the same moves with 4 MiB chunks;
#                                           # on long host replays they moved more than 2 MiB, 1128h)
#                                           # STEPS, and WARMUP (5): steps left out of the steady mean;
#                                           # the moves come at new peaks, so a longer run shows what
#                                           # they cost once the shapes have been seen
# Logs go to $OUT (or /tmp/issue42).
set -uo pipefail
OUT=${OUT:-/tmp/issue42}; mkdir -p "$OUT"
case "${1:-}" in
  rl)
    OUT="$OUT" ITERS="${ITERS:-5}" bash scripts/issue39_gpu.sh rl ;;
  footprint)
    source scripts/gpu_env.sh >/dev/null
    python -c "import vmmbuf" || { echo "issue42_gpu: vmmbuf does not import (no wheel in .gpu/wheels?)" >&2; exit 3; }
    CUDA_VISIBLE_DEVICES=${GPU:-0} timeout -s TERM "${SECS:-560}" python3 -u scripts/torch_allocators.py --all \
      --workloads "${WORKLOADS:-transformer,causal-lm,conv,vision-res,kv-decode}" \
      --allocs "${ALLOCS:-native,expandable,async,vmmbuf,vmmbuf-move}" --repeats "${REPEATS:-2}" \
      --steps "${STEPS:-40}" --warmup "${WARMUP:-5}" --json "$OUT/allocators.json" > "$OUT/allocators.txt" 2>&1
    echo "footprint: exit $?"; grep -v '^{' "$OUT/allocators.txt" | tail -n 40 ;;
  *) echo "usage: $0 rl | footprint" >&2; exit 2 ;;
esac
