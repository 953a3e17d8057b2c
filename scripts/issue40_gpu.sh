#!/usr/bin/env bash
# Issue 40 on a machine of several GPUs, from the repository root after
# ../shared/gpu/pack and the wheel in .gpu/wheels/ (see scripts/gpu_env.sh);
# .gpu/wheels-old/ may hold a wheel built before the fix, for the
# before/after runs of scripts/nccl_straddle.py.
#   bash scripts/issue40_gpu.sh straddle   # the two layouts, before and after, on every GPU
#   bash scripts/issue40_gpu.sh stress N   # scripts/nccl_stress.py on N GPUs
#   bash scripts/issue40_gpu.sh tables N   # FSDP and DDP, ROUNDS (4) interleaved rounds on N GPUs,
#                                          # then the RL step across N ranks against torch_memory_saver
#                                          # (its 0.0.10 wheel in .peer/tms/wheels/)
#   bash scripts/issue40_gpu.sh diagnose N # what registered FSDP's 14% and the slower pause on 4 ranks are:
#                                          # FSDP with vmmbuf-ready and vmmbuf-hooked beside vmmbuf-nccl (ROUNDS, 2),
#                                          # then the RL step with vmmbuf-nopeer and the sleeps' debug lines
#   bash scripts/issue40_gpu.sh parity N   # FSDP on N GPUs, vmmbuf against native and expandable segments,
#                                          # ROUNDS (7) interleaved rounds, step by step (session 1128g's call U)
#   bash scripts/issue40_gpu.sh before N   # this wheel against the one in .gpu/wheels-alt/ (vmmbuf-alt) in the
#                                          # same rounds: FSDP on N GPUs (ROUNDS, 6), step by step, then
#                                          # torch_alloc_cost.py on GPU 0 (the plug-in's cost per pair)
# Logs go to $OUT (or /tmp/issue40).
set -uo pipefail
OUT=${OUT:-/tmp/issue40}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONFAULTHANDLER=1
NG=$(nvidia-smi -L 2>/dev/null | wc -l)
# The wheel in .gpu/wheels/ is installed and imports (else exit 3).
imports() {
  python -c "import vmmbuf" || { echo "issue40_gpu: vmmbuf does not import (no wheel in .gpu/wheels?)" >&2; exit 3; }
}
# dist_train.py --all as NAME on N GPUs within SECS (no round started that
# would end past SECS less 20), ROUNDS rounds of MODES and ALLOCS; its
# output in $OUT/NAME.txt (last TAIL lines shown) and per-step JSON in
# $OUT/NAME.json.
dist() { # NAME N SECS ROUNDS TAIL MODES ALLOCS
  timeout -s TERM "$3" python3 -u scripts/dist_train.py --all --nproc "$2" --budget $(( $3 - 20 )) \
    --modes "$6" --allocs "$7" --rounds "$4" --steps "${DIST_STEPS:-40}" \
    --out "$OUT/$1.json" > "$OUT/$1.txt" 2>&1
  echo "dist_train exit $?"; grep -v '^{' "$OUT/$1.txt" | tail -n "$5"
}
straddle() { # $1 = dir of a wheel, $2 = label
  local P=/tmp/pk-$2; rm -rf "$P"; pip install -q --no-index --no-deps --target "$P" "$1"/*.whl
  for c in join reuse; do
    echo "== $2 $c on $NG GPUs"
    L=/tmp/issue40-nccl; rm -rf "$L"; mkdir -p "$L"
    PYTHONPATH=$P VMMBUF_TORCH_MAX_CHUNK_BYTES=$((128 << 20)) NCCL_PROTO=Simple NCCL_ALGO=Ring \
      NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=REG NCCL_DEBUG_FILE="$L/n.%p.log" \
      timeout -s TERM 150 python -m torch.distributed.run --nproc_per_node "$NG" \
      scripts/nccl_straddle.py --case "$c" --stall 45 > "$OUT/straddle-$2-$c.log" 2>&1
    echo "exit $?"
    grep -E "RANK [0-9]" "$OUT/straddle-$2-$c.log" | cut -c1-160 | head -20
    grep -hoE "Timeout \(0:[0-9:]+\)|illegal memory access|unhandled cuda error|File \"[^\"]*nccl_straddle.py\", line [0-9]+" \
      "$OUT/straddle-$2-$c.log" | sort | uniq -c | head -8
    echo "NCCL IPC lines by rank:"; cat "$L"/n.*.log 2>/dev/null \
      | grep -oE "rank [0-9]+ - IPC (register|registering|reuse)|rank [0-9]+ failed to IPC register" | sort | uniq -c
  done
}
case "${1:-}" in
  straddle)
    [ -d .gpu/wheels-old ] && straddle .gpu/wheels-old before
    straddle .gpu/wheels after ;;
  stress)
    source scripts/gpu_env.sh >/dev/null
    timeout -s TERM 560 python scripts/nccl_stress.py --nproc "${2:-2}" --steps "${STEPS:-220}" \
      --stall 90 2>&1 | tee "$OUT/stress-${2:-2}gpu.log" | grep -vE "^\s*$" | tail -40 ;;
  tables)
    source scripts/gpu_env.sh >/dev/null
    imports
    n=${2:-2}
    dist "dist-${n}gpu" "$n" "${DIST_SECS:-540}" "${ROUNDS:-4}" 30 "${MODES:-fsdp,ddp}" \
      "${ALLOCS:-native,expandable,vmmbuf,vmmbuf-nodefer,vmmbuf-nccl}"
    REAL=/tmp/tms-real; rm -rf "$REAL"
    pip install -q --no-index --no-deps --target "$REAL" .peer/tms/wheels/*.whl || exit 3
    PYTHONPATH="$PYTHONPATH:$REAL" timeout -s TERM "${RL_SECS:-300}" python3 -u scripts/rl_ranks.py --all \
      --nproc "$n" --iters "${ITERS:-6}" --timeout 140 > "$OUT/rl_ranks-${n}gpu.txt" 2>&1
    echo "rl_ranks exit $?"; grep -v '^{' "$OUT/rl_ranks-${n}gpu.txt" | grep -v '^\[rank' | tail -n 16 ;;
  diagnose)
    source scripts/gpu_env.sh >/dev/null
    n=${2:-4}
    dist "diag-fsdp-${n}gpu" "$n" "${DIST_SECS:-330}" "${ROUNDS:-2}" 24 fsdp \
      native,expandable,vmmbuf,vmmbuf-nccl,vmmbuf-ready,vmmbuf-hooked
    RL_LOG_DIR="$OUT/diag-rl-logs" VMMBUF_LOG=debug timeout -s TERM "${RL_SECS:-200}" python3 -u scripts/rl_ranks.py --all --nproc "$n" \
      --variants none,vmmbuf,vmmbuf-nopeer --iters "${ITERS:-4}" --timeout 90 > "$OUT/diag-rl-${n}gpu.txt" 2>&1
    echo "rl_ranks exit $?"; grep -v '^{' "$OUT/diag-rl-${n}gpu.txt" | grep '^|' | tail -n 14
    for v in vmmbuf vmmbuf-nopeer; do echo "== $v"; grep -hE "arena (asleep|awake)" "$OUT/diag-rl-logs/$v.log" \
      | grep -oE "(mode|bytes|total_us|wait_us|acquire_us|copy_us|swap_us|dispose_us)=[^ ]+" | paste -sd' ' | cut -c1-900; done ;;
  parity)
    source scripts/gpu_env.sh >/dev/null
    imports
    n=${2:-2}
    nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
    # A 505 s budget, as session 1128g's call U had.
    dist "parity-${n}gpu" "$n" "${DIST_SECS:-525}" "${ROUNDS:-7}" 30 fsdp native,expandable,vmmbuf ;;
  before)
    source scripts/gpu_env.sh >/dev/null
    n=${2:-2}; ALT=/tmp/alt; rm -rf "$ALT"
    pip install -q --no-index --no-deps --target "$ALT" .gpu/wheels-alt/*.whl || exit 3
    export DIST_ALT_PATH=$ALT
    dist "before-fsdp-${n}gpu" "$n" "${DIST_SECS:-540}" "${ROUNDS:-6}" 24 fsdp native,expandable,vmmbuf,vmmbuf-alt
    CUDA_VISIBLE_DEVICES=0 timeout -s TERM "${COST_SECS:-240}" python3 scripts/torch_alloc_cost.py \
      --allocs native,expandable,vmmbuf,vmmbuf-alt --rounds "${ROUNDS:-6}" > "$OUT/before-cost.txt" 2>&1
    echo "torch_alloc_cost exit $?"; cat "$OUT/before-cost.txt" ;;
  *) echo "usage: $0 straddle | stress N | tables N | diagnose N | parity N | before N" >&2; exit 2 ;;
esac
