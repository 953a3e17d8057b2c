#!/usr/bin/env bash
# Other projects' own test suites against vmmbuf and against the peer, on the
# GPU machine, from the repository root after ../shared/gpu/pack and the
# wheel in .gpu/wheels/ (scripts/gpu/env.sh installs it). The peers' files are
# fetched into the git-ignored .peer/ folder, never committed:
#   .peer/torch/test_cuda.py   the sample of PyTorch's test/test_cuda.py (and in
#                              .peer/torch/wheels the wheels its harness needs: expecttest, ninja)
#   .peer/cupy/tests           CuPy's tests at the tag of the installed CuPy
#   .peer/tms/test, wheels/    torch_memory_saver's test/ and its 0.0.10 wheel
#
#   bash scripts/gpu/peers.sh torch   # without vmmbuf, vmmbuf process-wide, every test in a vmmbuf
#                                     # MemPool and in PyTorch's own MemPool (GPUS: one group each)
#   bash scripts/gpu/peers.sh cupy    # CuPy's pool, then vmmbuf ($PEER_FILES, $PEER_M)
#   bash scripts/gpu/peers.sh tms     # the real torch_memory_saver, then vmmbuf's interface
# Logs and the per-test differences go to $OUT (default /tmp/peers).
set -uo pipefail
OUT=${OUT:-/tmp/peers}; mkdir -p "$OUT"
source scripts/gpu/env.sh >/dev/null
python -c "import vmmbuf" || { echo "peers.sh: vmmbuf does not import (no wheel in .gpu/wheels?)" >&2; exit 3; }
export PYTHONFAULTHANDLER=1
case "${1:-}" in
  torch)
    if ls .peer/torch/wheels/*.whl >/dev/null 2>&1; then
      D=/tmp/peerdeps; rm -rf "$D"; pip install -q --no-index --no-deps --target "$D" .peer/torch/wheels/*.whl
      export PYTHONPATH="$D:$PYTHONPATH" PATH="$D/bin:$PATH"
    fi
    PEER_GPUS=${GPUS:-} bash scripts/peers/suites.sh torch .peer/torch "$OUT/torch" "${SECS:-420}" ;;
  cupy)
    PEER_GPUS=${GPUS:-} bash scripts/peers/suites.sh cupy .peer/cupy "$OUT/cupy" "${SECS:-480}" ;;
  tms)
    PEER_TIMEOUT=${PEER_TIMEOUT:-90} bash scripts/peers/suites.sh tms .peer/tms "$OUT/tms" "${SECS:-240}" ;;
  *) echo "usage: $0 torch | cupy | tms" >&2; exit 2 ;;
esac
