#!/usr/bin/env bash
# Session 1128g call V (2x H200): CuPy 14.2's own tests marked multi_gpu (the 17 files that have them),
# under CuPy's pool and under vmmbuf.cupy.use(), one after the other on both GPUs: main 72fc833 with the
# context guards (the fix for test_copy_multi_device_non_contiguous_K, not rerun in CuPy's suite since).
set -u
mkdir -p $OUT
source scripts/gpu_env.sh >/dev/null
PEER_M=multi_gpu PEER_TIMEOUT=60 PEER_FILES="tests/cupy_tests/core_tests/fusion_tests/test_misc.py tests/cupy_tests/core_tests/test_elementwise.py tests/cupy_tests/core_tests/test_ndarray.py tests/cupy_tests/core_tests/test_ndarray_get.py tests/cupy_tests/core_tests/test_raw.py tests/cupy_tests/core_tests/test_scan.py tests/cupy_tests/creation_tests/test_from_data.py tests/cupy_tests/cuda_tests/test_cufft.py tests/cupy_tests/cuda_tests/test_device.py tests/cupy_tests/cuda_tests/test_driver.py tests/cupy_tests/cuda_tests/test_memory.py tests/cupy_tests/cuda_tests/test_nccl.py tests/cupy_tests/cuda_tests/test_stream.py tests/cupy_tests/fft_tests/test_cache.py tests/cupy_tests/fft_tests/test_fft.py tests/cupy_tests/manipulation_tests/test_basic.py tests/cupy_tests/manipulation_tests/test_join.py " timeout -s TERM 470 bash scripts/peer_suites.sh cupy .peer/cupy $OUT/cupy 220 > $OUT/cupy.out 2>&1
echo "cupy rc $? [$SECONDS s]"; tail -30 $OUT/cupy.out
