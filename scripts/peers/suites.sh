#!/usr/bin/env bash
# Runs other projects' own test suites against vmmbuf and against the peer's
# own allocator, on the same machine, one after the other, and writes each
# run's pytest -v log plus the per-test differences (scripts/peers/pytest/compare.py).
#
# Usage: scripts/peers/suites.sh SUITE PEER_DIR OUT_DIR [SECONDS]
#   SUITE     cupy   CuPy's tests/ (PEER_DIR/tests), under CuPy's default pool
#                    and under vmmbuf.cupy.use()
#             tms    torch_memory_saver's own test/ (PEER_DIR/test, and its wheel in
#                    PEER_DIR/wheels): the real package, and vmmbuf's through a
#                    shim package of the same name (scripts/peers/pytest/tms_shim.py)
#             torch  PyTorch's test/test_cuda.py (PEER_DIR/test_cuda.py): without
#                    vmmbuf, vmmbuf process-wide, every test in a vmmbuf MemPool,
#                    and every test in a MemPool of PyTorch's own (the control
#                    for the vmmbuf MemPool: its differences are compared too);
#                    torch-expandable (PyTorch alone with expandable segments,
#                    not run unless named in PEER_CONFIGS) tells which of
#                    vmmbuf's differences expandable segments share
#   PEER_DIR  the suite's files, fetched from its public repository into a
#             git-ignored folder (never committed)
#   OUT_DIR   where the logs and the differences go
#   SECONDS   the most each run may take (default 600)
# Environment: PEER_FILES (the test files or node ids to run, relative to
# PEER_DIR; a fixed sample where time forces it), PEER_K (a -k expression),
# PEER_M (a -m marker expression, e.g. multi_gpu for CuPy's tests of several GPUs),
# PEER_GPUS (one CUDA_VISIBLE_DEVICES value per configuration, space-separated,
# e.g. "0,1 2,3": the configurations then run at once, each on its own GPUs,
# the same count for each; unset: one after the other on every GPU),
# PEER_TIMEOUT (seconds one test may take, default 120), PEER_XDIST (a worker
# count: each run spread over that many processes by
# pytest-xdist, for a larger sample in the same time).
# PEER_CONFIGS (the configurations to run, space-separated, a subset of the
# suite's; the differences are then taken against OUT_DIR's native log of an
# earlier run where native is not among them).
# Each run gets PYTHONFAULTHANDLER=1, so a crash leaves its stack in the log.
set -uo pipefail
suite=$1 dir=$(cd "$2" && pwd) out=$3 secs=${4:-600}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
export PYTHONPATH="$here/pytest${PYTHONPATH:+:$PYTHONPATH}" PYTHONFAULTHANDLER=1 PEER_SUITE=$suite
case "$suite" in
  cupy) configs="native vmmbuf" ;;
  torch) configs="native vmmbuf vmmbuf-mempool torch-mempool" ;;
  tms) configs="native vmmbuf"
    whl=$(ls "$dir"/wheels/torch_memory_saver-*.whl 2>/dev/null | head -n 1)
    [ -n "$whl" ] || { echo "peer_suites: no torch_memory_saver wheel in $dir/wheels" >&2; exit 2; }
    python3 "$here/pytest/tms_shim.py" "$whl" "$out/tms-native-pkg" "$out/tms-shim-pkg" || exit 2 ;;
  *) echo "peer_suites: unknown suite $suite" >&2; exit 2 ;;
esac
configs=${PEER_CONFIGS:-$configs}
files=${PEER_FILES:-}
if [ -z "$files" ]; then
  case "$suite" in cupy) files=tests/cupy_tests/cuda_tests ;; torch) files=test_cuda.py ;; tms) files=test ;; esac
fi
run_one() { # CONFIG [CUDA_VISIBLE_DEVICES]
  local cfg=$1 log="$out/$suite-$1.log" start rc pp= conf=
  [ "$cfg" = torch-expandable ] && conf=PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  # torch_memory_saver's suite imports the package by name: the real one
  # or vmmbuf's shim comes first on the path.
  [ "$suite" = tms ] && { [ "$cfg" = native ] && pp=$out/tms-native-pkg || pp=$out/tms-shim-pkg; }
  echo "== $suite under $cfg${2:+ on GPUs $2}: $files" | tee "$log"
  start=$(date +%s)
  (cd "$dir" && env ${2:+CUDA_VISIBLE_DEVICES=$2} $conf ${pp:+PYTHONPATH=$pp:$PYTHONPATH} PEER_ALLOCATOR=$cfg timeout -k 10 "$secs" \
      python -m pytest -v -p peer_allocator \
      -p no:cacheprovider -o console_output_style=classic --timeout "${PEER_TIMEOUT:-120}" \
      --continue-on-collection-errors ${PEER_XDIST:+-n "$PEER_XDIST"} \
      ${PEER_K:+-k "$PEER_K"} ${PEER_M:+-m "$PEER_M"} $files) >> "$log" 2>&1
  rc=$?
  echo "== exit $rc after $(( $(date +%s) - start )) s" | tee -a "$log"
  tail -n 1 "$log"
}
read -r -a gpus <<< "${PEER_GPUS:-}"
i=0
for cfg in $configs; do
  if [ ${#gpus[@]} -gt 0 ]; then
    [ $i -lt ${#gpus[@]} ] || { echo "peer_suites: PEER_GPUS names fewer groups than configurations" >&2; exit 2; }
    run_one "$cfg" "${gpus[$i]}" &
  else
    run_one "$cfg"
  fi
  i=$((i + 1))
done
wait
base="$out/$suite-native.log"
if [ "$suite" = torch ]; then
  # The control is PyTorch's own MemPool: against it, the vmmbuf MemPool
  # and vmmbuf process-wide (PyTorch's default mode under vmmbuf).
  for cfg in vmmbuf-mempool vmmbuf torch-expandable; do
    [ -f "$out/torch-torch-mempool.log" ] && [ -f "$out/torch-$cfg.log" ] || continue
    python3 "$here/pytest/compare.py" "$out/torch-torch-mempool.log" "$out/torch-$cfg.log" \
      --names torch-mempool "$cfg" > "$out/torch-$cfg-vs-torch-mempool-diff.md"
    head -n 8 "$out/torch-$cfg-vs-torch-mempool-diff.md"
  done
fi
[ -f "$base" ] || exit 0
for cfg in $configs; do
  [ "$cfg" = native ] && continue
  python3 "$here/pytest/compare.py" "$base" "$out/$suite-$cfg.log" --names native "$cfg" \
    > "$out/$suite-$cfg-diff.md"
  head -n 8 "$out/$suite-$cfg-diff.md"
done
