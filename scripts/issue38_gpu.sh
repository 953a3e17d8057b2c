#!/usr/bin/env bash
# Issue 38 on a machine of four GPUs, from the repository root after
# ../shared/gpu/pack and the wheel in .gpu/wheels/ (see scripts/gpu_env.sh),
# with the peers' test files fetched into the git-ignored .peer/ folder
# (.peer/torch/test_cuda.py: the sample of PyTorch's test/test_cuda.py, with
# the wheels its harness needs and the machine lacks in .peer/torch/wheels:
# expecttest, ninja; .peer/cupy/tests: CuPy's tests at the tag of the
# installed CuPy).
#   bash scripts/issue38_gpu.sh torch   # PyTorch's tests: without vmmbuf, vmmbuf process-wide, in a
#                                      # vmmbuf MemPool and in PyTorch's own MemPool, at once on
#                                      # GPUs 0-3 (one each); then vmmbuf's own tests (OWN=0: not)
#   bash scripts/issue38_gpu.sh cupy    # CuPy's tests ($CUPY_FILES): CuPy's pool on GPUs 0,1 and
#                                      # vmmbuf on GPUs 2,3, at once ($PEER_XDIST: spread over
#                                      # that many processes each)
# Logs go to $OUT (or /tmp/issue38).
set -uo pipefail
OUT=${OUT:-/tmp/issue38}; mkdir -p "$OUT"
source scripts/gpu_env.sh >/dev/null
export PYTHONFAULTHANDLER=1
case "${1:-}" in
  torch)
    if ls .peer/torch/wheels/*.whl >/dev/null 2>&1; then
      D=/tmp/peerdeps; rm -rf "$D"; pip install -q --no-index --no-deps --target "$D" .peer/torch/wheels/*.whl
      export PYTHONPATH="$D:$PYTHONPATH" PATH="$D/bin:$PATH"
    fi
    PEER_GPUS="0 1 2 3" bash scripts/peer_suites.sh torch .peer/torch "$OUT/torch" "${SECS:-420}"
    [ "${OWN:-1}" = 0 ] || ( export CUDA_VISIBLE_DEVICES=3
      OUT=$OUT timeout -s TERM 400 bash .gpu/run.sh tests > "$OUT/own-rust.log" 2>&1
      echo "own rust: exit $? $(tail -n 1 "$OUT/own-rust.log")"
      timeout -s TERM 300 python -m pytest -q python/tests --timeout 120 -p no:cacheprovider \
        > "$OUT/own-pytest.log" 2>&1
      echo "own pytest: exit $? $(tail -n 1 "$OUT/own-pytest.log")" ) ;;
  cupy)
    PEER_GPUS="0,1 2,3" PEER_FILES="${CUPY_FILES:?name the CuPy test files}" \
      bash scripts/peer_suites.sh cupy .peer/cupy "$OUT/cupy" "${SECS:-480}" ;;
  *) echo "usage: $0 torch | cupy" >&2; exit 2 ;;
esac
