#!/usr/bin/env bash
# The benchmarks behind BENCHMARKS.md that run in Python, on the GPU machine,
# from the repository root after ../shared/gpu/pack --libs and the wheel in
# .gpu/wheels/ (torch_memory_saver's 0.0.10 wheel in .peer/tms/wheels/ for
# the RL runs). Each writes its result under $OUT (default /tmp/bench) with
# the name benches/results/ gives it; copy it there, update index.json and
# run python3 scripts/report.py --plots.
#   bash scripts/gpu/bench.sh training     # torch_allocators.py: PyTorch alone, expandable segments,
#                                          # vmmbuf; WORKLOADS, ALLOCS, REPEATS (3), STEPS (40)
#   bash scripts/gpu/bench.sh rl           # rl_loop.py: vmmbuf's torch_memory_saver interface, the real
#                                          # package, both hook modes, pinned tensors (GPU $GPU, 0)
#   bash scripts/gpu/bench.sh dist N       # dist_train.py: MODES (fsdp) on N GPUs, ROUNDS (7) rounds
#   bash scripts/gpu/bench.sh rl-ranks N   # rl_ranks.py: the RL step across N ranks
#   bash scripts/gpu/bench.sh nccl N       # nccl_stress.py: registration under growth on N GPUs
#   bash scripts/gpu/bench.sh cost         # torch_alloc_cost.py: the plug-in's cost per alloc/free pair
set -uo pipefail
OUT=${OUT:-/tmp/bench}; mkdir -p "$OUT"
source scripts/gpu/env.sh >/dev/null
python -c "import vmmbuf" || { echo "bench.sh: vmmbuf does not import (no wheel in .gpu/wheels?)" >&2; exit 3; }
export PYTHONFAULTHANDLER=1 NCCL_NVLS_ENABLE=0
tms() { # the real torch_memory_saver beside vmmbuf's, on the path
  REAL=/tmp/tms-real; rm -rf "$REAL"
  pip install -q --no-index --no-deps --target "$REAL" .peer/tms/wheels/*.whl || exit 3
  export PYTHONPATH="$PYTHONPATH:$REAL"
}
case "${1:-}" in
  training)
    CUDA_VISIBLE_DEVICES=${GPU:-0} timeout -s TERM "${SECS:-560}" python3 -u scripts/bench/torch_allocators.py --all \
      --workloads "${WORKLOADS:-transformer,conv,causal-lm}" --allocs "${ALLOCS:-native,expandable,vmmbuf}" \
      --repeats "${REPEATS:-3}" --steps "${STEPS:-40}" --json "$OUT/torch_allocators.json" \
      > "$OUT/torch_allocators.txt" 2>&1
    echo "training: exit $?"; grep -v '^{\|^losses' "$OUT/torch_allocators.txt" | tail -n 40 ;;
  compile)
    CUDA_VISIBLE_DEVICES=${GPU:-0} timeout -s TERM "${SECS:-560}" python3 -u scripts/bench/compile_graphs.py \
      --rounds "${REPEATS:-2}" --steps "${STEPS:-30}" > "$OUT/compile_graphs-h200.txt"
    echo "compile: exit $?"; grep '^|' "$OUT/compile_graphs-h200.txt" ;;
  rl)
    tms
    CUDA_VISIBLE_DEVICES=${GPU:-0} timeout -s TERM "${SECS:-500}" python3 -u scripts/bench/rl_loop.py --all \
      --iters "${ITERS:-4}" --variants "${VARIANTS:-vtms,vtms-preload,tms,tms-preload,pinned}" \
      --json "$OUT/rl_loop.json" > "$OUT/rl_loop.txt" 2>&1
    echo "rl: exit $?"; tail -n 24 "$OUT/rl_loop.txt" ;;
  dist)
    n=${2:-2}; secs=${SECS:-540}
    timeout -s TERM "$secs" python3 -u scripts/bench/dist_train.py --all --nproc "$n" --budget $(( secs - 20 )) \
      --modes "${MODES:-fsdp}" --allocs "${ALLOCS:-native,expandable,vmmbuf}" --rounds "${ROUNDS:-7}" \
      --steps "${STEPS:-40}" --out "$OUT/dist_train-${n}gpu.json" > "$OUT/dist_train-${n}gpu.txt" 2>&1
    echo "dist_train: exit $?"; grep -v '^{' "$OUT/dist_train-${n}gpu.txt" | tail -n 30 ;;
  rl-ranks)
    tms
    n=${2:-2}
    timeout -s TERM "${SECS:-300}" python3 -u scripts/bench/rl_ranks.py --all --nproc "$n" \
      --iters "${ITERS:-6}" --timeout 140 > "$OUT/rl_ranks-${n}gpu.txt" 2>&1
    echo "rl_ranks: exit $?"; grep -v '^{' "$OUT/rl_ranks-${n}gpu.txt" | grep -v '^\[rank' | tail -n 16 ;;
  nccl)
    timeout -s TERM "${SECS:-560}" python scripts/bench/nccl_stress.py --nproc "${2:-2}" --steps "${STEPS:-220}" \
      --stall 90 2>&1 | tee "$OUT/nccl_stress-${2:-2}gpu.txt" | grep -vE "^\s*$" | tail -40 ;;
  cost)
    CUDA_VISIBLE_DEVICES=${GPU:-0} timeout -s TERM "${SECS:-240}" python3 scripts/bench/torch_alloc_cost.py \
      --allocs "${ALLOCS:-native,expandable,vmmbuf}" --rounds "${ROUNDS:-6}" > "$OUT/torch_alloc_cost.txt" 2>&1
    echo "cost: exit $?"; cat "$OUT/torch_alloc_cost.txt" ;;
  *) echo "usage: $0 training | compile | rl | dist N | rl-ranks N | nccl N | cost" >&2; exit 2 ;;
esac
