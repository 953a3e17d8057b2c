#!/usr/bin/env bash
# vmmbuf's own tests on the GPU machine, from the repository root after
# ../shared/gpu/pack --libs and the wheel in .gpu/wheels/:
#   bash scripts/gpu/tests.sh          # the Rust binaries (.gpu/run.sh tests), then the whole pytest
#   PEERS=1 bash scripts/gpu/tests.sh  # on two or more GPUs: the peer tests must run too
# A GPU test that cannot run fails (VMMBUF_REQUIRE_GPU=1). Logs go to $OUT (default /tmp/tests).
set -uo pipefail
OUT=${OUT:-/tmp/tests}; mkdir -p "$OUT"
source scripts/gpu/env.sh >/dev/null
export PYTHONFAULTHANDLER=1
[ "${PEERS:-0}" = 1 ] && export VMMBUF_REQUIRE_PEERS=1
OUT=$OUT timeout -s TERM "${RUST_SECS:-400}" bash .gpu/run.sh tests > "$OUT/rust.log" 2>&1
echo "rust: exit $? $(tail -n 1 "$OUT/rust.log")"
timeout -s TERM "${PYTEST_SECS:-500}" python -m pytest -q python/tests --timeout 200 -p no:cacheprovider \
  > "$OUT/pytest.log" 2>&1
echo "pytest: exit $? $(tail -n 1 "$OUT/pytest.log")"
