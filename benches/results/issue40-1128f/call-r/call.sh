#!/usr/bin/env bash
# Session 1128f call R (2x H200): main 5c1ae56 — the Rust suite and the whole pytest with peers required,
# then exp/lazy-context's wheel on the context and two-GPU tests.
set -u
mkdir -p $OUT
source scripts/gpu_env.sh
nvidia-smi topo -m | head -4
VMMBUF_REQUIRE_PEERS=1 timeout -s INT 200 bash .gpu/run.sh tests > $OUT/rust.log 2>&1
echo "rust rc $? [$SECONDS s]"; grep -E "^test result|binaries:|FAILED|panicked|!!!" $OUT/rust.log | sort | uniq -c | head -20
VMMBUF_REQUIRE_PEERS=1 timeout -s INT 270 python -m pytest -v python/tests --timeout 200 -p no:cacheprovider > $OUT/pytest-main.log 2>&1
echo "pytest main rc $? [$SECONDS s]"; grep -E "FAILED|ERROR|SKIPPED" $OUT/pytest-main.log | head -20; tail -1 $OUT/pytest-main.log
L=/tmp/pk-lazy; rm -rf $L; pip install -q --no-index --no-deps --target $L .gpu/wheels-lazy/*.whl
PYTHONPATH=$L VMMBUF_REQUIRE_PEERS=1 timeout -s INT 90 python -m pytest -v python/tests -k "context or two_gpus" --timeout 80 -p no:cacheprovider > $OUT/pytest-lazy.log 2>&1
echo "pytest lazy rc $? [$SECONDS s]"; grep -E "PASSED|FAILED|ERROR|SKIPPED" $OUT/pytest-lazy.log | sed 's/python.tests.//'; tail -1 $OUT/pytest-lazy.log
