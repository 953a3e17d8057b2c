"""CuPy on vmmbuf: the allocator, a workload checked against NumPy, and
GrowableTensor through cupy.from_dlpack. Skipped without CuPy and a GPU
(failed under VMMBUF_REQUIRE_GPU=1)."""

from __future__ import annotations

import gc

import numpy as np


def test_cupy_allocator_workload(cupy_gpu):
    cp = cupy_gpu
    import vmmbuf
    import vmmbuf.cupy

    dev = cp.cuda.Device().id
    rng = np.random.default_rng(3)
    vmmbuf.cupy.use()
    try:
        before = vmmbuf.stats(dev).get("num_allocs", 0)
        a_h = rng.standard_normal((1024, 768)).astype(np.float32)
        b_h = rng.standard_normal((768, 512)).astype(np.float32)
        s = cp.cuda.Stream(non_blocking=True)
        with s:
            a, b = cp.asarray(a_h), cp.asarray(b_h)
            c = a @ b
            f = cp.fft.rfft(a, axis=1)
            sizes = [cp.arange(n, dtype=cp.int64) for n in (1, 17, 4096, 1 << 20)]
        s.synchronize()
        np.testing.assert_allclose(cp.asnumpy(c), a_h @ b_h, rtol=2e-3, atol=2e-3)
        np.testing.assert_allclose(cp.asnumpy(f), np.fft.rfft(a_h, axis=1), rtol=2e-3, atol=2e-2)
        for x in sizes:
            np.testing.assert_array_equal(cp.asnumpy(x), np.arange(x.size))
            # Whole 512-byte units, as CuPy's pool gives (code reads it so).
            assert x.data.mem.size % 512 == 0 and x.data.mem.size >= x.nbytes, x.data.mem.size
        st = vmmbuf.stats(dev)
        assert st["num_allocs"] - before >= 7, st
        assert st["allocated_bytes.all.current"] >= a.nbytes + b.nbytes + c.nbytes
        live = st["live_allocations"]
        del a, b, c, f, sizes
        gc.collect()
        s.synchronize()
        assert vmmbuf.stats(dev)["live_allocations"] <= live - 7, "frees reached vmmbuf"
        # Memory allocated on a stream whose Python object is dropped: the
        # allocation keeps the stream alive, so its free is ordered after it.
        tmp = cp.cuda.Stream(non_blocking=True)
        with tmp:
            late = cp.full(1 << 20, 3, dtype=cp.int32)
        del tmp
        gc.collect()
        assert int(late.sum()) == 3 << 20
        del late
        gc.collect()
    finally:
        vmmbuf.cupy.restore()


def test_growable_tensor_with_cupy(cupy_gpu):
    cp = cupy_gpu
    from vmmbuf import GrowableTensor

    rng = np.random.default_rng(9)
    t = GrowableTensor(np.float32, (50_000, 32), device=cp.cuda.Device().id)
    base = t.data_ptr()
    host = []
    for _ in range(300):
        r = rng.standard_normal((int(rng.integers(1, 6)), 32)).astype(np.float32)
        t.append(cp.asarray(r))
        host.append(r)
        v = t.cupy()
        assert v.data.ptr == base
    np.testing.assert_array_equal(cp.asnumpy(t.cupy()), np.concatenate(host))


def test_two_gpus_copies_between_devices_and_frees_keep_the_current_device(cupy_gpu):
    """CuPy's own multi-device tests failed on vmmbuf (issue 38): a copy
    from GPU 0's memory to GPU 1 raised ``cudaErrorInvalidValue`` (the
    chunks were mapped for GPU 0 only), and a free of GPU 1's memory from
    GPU 0 left GPU 1's context current, so CuPy's next allocation landed on
    GPU 1. Here: copies both ways, a kernel on GPU 1 reading GPU 0's array
    through peer access, and frees of the other GPU's arrays, after each of
    which the current device is still the caller's. Needs two GPUs (skips
    with one, fails under VMMBUF_REQUIRE_PEERS=1)."""
    cp = cupy_gpu
    import os

    import pytest
    import vmmbuf.cupy

    if cp.cuda.runtime.getDeviceCount() < 2:
        if os.environ.get("VMMBUF_REQUIRE_PEERS") == "1":
            pytest.fail("VMMBUF_REQUIRE_PEERS=1 but one GPU")
        pytest.skip("needs two GPUs")
    rng = np.random.default_rng(8)
    vmmbuf.cupy.use()
    try:
        with cp.cuda.Device(0):
            h = rng.standard_normal(1 << 20).astype(np.float32)
            a = cp.asarray(h)
            strided = a[::3]
        with cp.cuda.Device(1):
            b = a.copy()                         # a peer copy from GPU 0
            c = strided.copy()                   # non-contiguous: made contiguous on GPU 0 first
            assert b.device.id == 1 and c.device.id == 1
            np.testing.assert_array_equal(cp.asnumpy(b), h)
            np.testing.assert_array_equal(cp.asnumpy(c), h[::3])
            if cp.cuda.runtime.deviceCanAccessPeer(1, 0):
                _enable_peer_access_to_0(cp)
                d = cp.ElementwiseKernel("T x", "T y", "y = x * 2", "vmmbuf_twice")(a)
                np.testing.assert_array_equal(cp.asnumpy(d), h * 2)
                del d
        # GPU 0 current: freeing GPU 1's arrays must leave it current.
        with cp.cuda.Device(0):
            del b, c
            gc.collect()
            assert cp.cuda.runtime.getDevice() == 0, "a free of GPU 1's memory left GPU 1 current"
            e = cp.zeros(16, dtype=cp.float32)
            assert e.device.id == 0
        with cp.cuda.Device(1):
            del a, strided, e
            gc.collect()
            assert cp.cuda.runtime.getDevice() == 1, "a free of GPU 0's memory left GPU 0 current"
    finally:
        vmmbuf.cupy.restore()


def _enable_peer_access_to_0(cp) -> None:
    """Gives the current GPU peer access to GPU 0 (already given is fine)."""
    try:
        cp.cuda.runtime.deviceEnablePeerAccess(0)
    except cp.cuda.runtime.CUDARuntimeError as e:
        if "PeerAccessAlreadyEnabled" not in str(e):
            raise
