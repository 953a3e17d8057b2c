#!/usr/bin/env bash
# Issue 39 on a machine of two (or more) GPUs, from the repository root after
# ../shared/gpu/pack, then the wheel copied to .gpu/wheels/ (the pack rebuilds
# .gpu/, so copy it after), with torch_memory_saver's test/ and its 0.0.10
# wheel fetched into the git-ignored .peer/tms/ (test/, wheels/).
#   bash scripts/issue39_gpu.sh suite   # its own suite: the real package, then vmmbuf (peer_suites.sh)
#   bash scripts/issue39_gpu.sh own     # vmmbuf's torch_memory_saver and vLLM tests (2 GPUs)
#   bash scripts/issue39_gpu.sh rl      # rl_loop.py: both packages, both hook modes, pinned (GPU $GPU, 0)
# Logs go to $OUT (or /tmp/issue39). Each part checks that vmmbuf imports
# first: a run without the wheel says so instead of failing test by test.
set -uo pipefail
OUT=${OUT:-/tmp/issue39}; mkdir -p "$OUT"
source scripts/gpu_env.sh >/dev/null
python -c "import vmmbuf" || { echo "issue39_gpu: vmmbuf does not import (no wheel in .gpu/wheels?)" >&2; exit 3; }
export PYTHONFAULTHANDLER=1
REAL=/tmp/tms-real-$$; rm -rf "$REAL"
pip install -q --no-index --no-deps --target "$REAL" .peer/tms/wheels/*.whl || exit 3
case "${1:-}" in
  suite)
    PEER_TIMEOUT=${PEER_TIMEOUT:-90} bash scripts/peer_suites.sh tms .peer/tms "$OUT/tms" "${SECS:-240}" ;;
  own)
    VMMBUF_REQUIRE_PEERS=1 timeout -s TERM "${SECS:-300}" python -m pytest -v -p no:cacheprovider \
      python/tests/test_torch_gpu.py python/tests/test_vllm_gpu.py -k "memory_saver or vllm" \
      --timeout 150 > "$OUT/own.log" 2>&1
    echo "own: exit $? $(tail -n 1 "$OUT/own.log")" ;;
  rl)
    CUDA_VISIBLE_DEVICES=${GPU:-0} PYTHONPATH="$PYTHONPATH:$REAL" timeout -s TERM "${SECS:-500}" \
      python3 -u scripts/rl_loop.py --all --iters "${ITERS:-5}" \
      --variants "${VARIANTS:-vmmbuf,vtms,vtms-preload,tms,tms-preload,pinned}" \
      --json "$OUT/rl_loop.json" > "$OUT/rl_loop.txt" 2>&1
    echo "rl: exit $?"; tail -n 24 "$OUT/rl_loop.txt" ;;
  *) echo "usage: $0 suite | own | rl" >&2; exit 2 ;;
esac
