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
