#!/usr/bin/env bash
# Runs other projects' own test suites against vmmbuf and against the peer's
# own allocator, on the same machine, one after the other, and writes each
# run's pytest -v log plus the per-test differences (scripts/peer/compare.py).
#
# Usage: scripts/peer_suites.sh SUITE PEER_DIR OUT_DIR [SECONDS]
#   SUITE     cupy   CuPy's tests/ (PEER_DIR/tests), under CuPy's default pool
#                    and under vmmbuf.cupy.use()
#             torch  PyTorch's test/test_cuda.py (PEER_DIR/test_cuda.py): without
#                    vmmbuf, vmmbuf process-wide, every test in a vmmbuf MemPool
#   PEER_DIR  the suite's files, fetched from its public repository into a
#             git-ignored folder (never committed)
#   OUT_DIR   where the logs and the differences go
#   SECONDS   the most each run may take (default 600)
# Environment: PEER_FILES (the test files or node ids to run, relative to
# PEER_DIR; a fixed sample where time forces it), PEER_K (a -k expression).
# Each run gets PYTHONFAULTHANDLER=1, so a crash leaves its stack in the log.
set -uo pipefail
suite=$1 dir=$(cd "$2" && pwd) out=$3 secs=${4:-600}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
export PYTHONPATH="$here/peer${PYTHONPATH:+:$PYTHONPATH}" PYTHONFAULTHANDLER=1 PEER_SUITE=$suite
case "$suite" in
  cupy) configs="native vmmbuf" ;;
  torch) configs="native vmmbuf vmmbuf-mempool" ;;
  *) echo "peer_suites: unknown suite $suite" >&2; exit 2 ;;
esac
files=${PEER_FILES:-}
[ -n "$files" ] || { [ "$suite" = cupy ] && files=tests/cupy_tests/cuda_tests || files=test_cuda.py; }
for cfg in $configs; do
  log="$out/$suite-$cfg.log"
  echo "== $suite under $cfg: $files" | tee "$log"
  start=$(date +%s)
  (cd "$dir" && PEER_ALLOCATOR=$cfg timeout -k 10 "$secs" python -m pytest -v -p peer_allocator \
      -p no:cacheprovider -o console_output_style=classic --timeout 120 \
      --continue-on-collection-errors \
      ${PEER_K:+-k "$PEER_K"} $files) >> "$log" 2>&1
  rc=$?
  echo "== exit $rc after $(( $(date +%s) - start )) s" | tee -a "$log"
  tail -n 1 "$log"
done
base="$out/$suite-native.log"
for cfg in $configs; do
  [ "$cfg" = native ] && continue
  python3 "$here/peer/compare.py" "$base" "$out/$suite-$cfg.log" --names native "$cfg" \
    > "$out/$suite-$cfg-diff.md"
  head -n 8 "$out/$suite-$cfg-diff.md"
done
