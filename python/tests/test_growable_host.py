"""GrowableTensor in host memory (the host backend: no GPU needed), through
numpy.from_dlpack: growth in place, every element checked, memory given
back, views kept alive, DLPack's rules."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import vmmbuf
from vmmbuf import GrowableTensor

np_from_dlpack = getattr(np, "from_dlpack", None)
pytestmark = pytest.mark.skipif(np_from_dlpack is None, reason="numpy without from_dlpack")


def test_a_thousand_growths_keep_the_address_and_every_element():
    rng = np.random.default_rng(21)
    row = (3, 5)
    g = GrowableTensor(np.float32, (4000,) + row, device="cpu")
    base = g.data_ptr()
    expect = []
    for i in range(1000):
        k = int(rng.integers(1, 4))
        rows = rng.standard_normal((k,) + row).astype(np.float32)
        at = g.append(rows if k > 1 or i % 2 else rows[0])
        assert at == sum(len(e) for e in expect)
        expect.append(rows)
        assert g.data_ptr() == base
        view = np.from_dlpack(g)
        assert view.ctypes.data == base, "the view starts at the same address"
        assert view.shape == (at + k,) + row
        # The rows just written, and the first ones (never moved).
        np.testing.assert_array_equal(view[at:at + k], rows)
        np.testing.assert_array_equal(view[:len(expect[0])], expect[0])
    whole = np.concatenate(expect)
    np.testing.assert_array_equal(np.from_dlpack(g), whole)
    assert len(g) == len(whole) and g.shape == whole.shape
    assert g.capacity >= len(g)


def test_resize_shrink_and_memory_goes_back():
    g = GrowableTensor("int64", 1 << 20, device="cpu")
    for n in range(1000, 300_001, 1000):  # many growths: many chunks
        g.resize(n)
    assert g._buf.chunk_count > 1
    a = np.from_dlpack(g)
    a[:] = np.arange(300_000, dtype=np.int64) * 7
    mapped = g.mapped_bytes
    assert mapped >= 300_000 * 8
    del a
    gc.collect()
    g.resize(1000)
    assert g.mapped_bytes == mapped, "truncating keeps the memory"
    g.shrink_to_fit()
    assert g.mapped_bytes < mapped, "shrink_to_fit gives the memory back"
    assert g.mapped_bytes >= 1000 * 8
    np.testing.assert_array_equal(np.from_dlpack(g), np.arange(1000, dtype=np.int64) * 7)
    g.resize(300_000)  # regrows at the same address; the first 1000 kept
    np.testing.assert_array_equal(np.from_dlpack(g)[:1000], np.arange(1000, dtype=np.int64) * 7)


def test_a_live_view_keeps_its_bytes_and_the_buffer():
    g = GrowableTensor("uint8", 1 << 22, device="cpu")
    g.resize(2 << 20)
    v = np.from_dlpack(g)
    v[:] = 0xA5
    g.resize(0)
    g.shrink_to_fit()
    assert g.mapped_bytes >= 2 << 20, "a live view's bytes are not given back"
    assert (v == 0xA5).all()
    del g
    gc.collect()
    assert (v == 0xA5).all(), "the view keeps the buffer alive"
    v[-1] = 1
    assert v[-1] == 1


def test_failures_change_nothing():
    g = GrowableTensor("float64", (10, 2), device="cpu")
    g.append(np.ones((10, 2)))
    with pytest.raises(vmmbuf.CapacityError):
        g.append(np.zeros((1, 2)))
    with pytest.raises(vmmbuf.CapacityError):
        g.resize(11)
    with pytest.raises(vmmbuf.InvalidArgumentError):
        g.append(np.zeros((1, 3)))
    assert len(g) == 10
    np.testing.assert_array_equal(np.from_dlpack(g), np.ones((10, 2)))
    h = GrowableTensor("float32", (10, 2), device="cpu")
    with pytest.raises(ValueError):
        h.append(np.array([["a", "b"], ["c", "d"]]))  # numpy refuses the copy
    assert len(h) == 0, "a failed copy leaves the length as it was"
    with pytest.raises(vmmbuf.UnsupportedError):
        h.append([[1.0, 2.0]])
    with pytest.raises(vmmbuf.InvalidArgumentError):
        GrowableTensor("float32", (0, 4), device="cpu")
    with pytest.raises(vmmbuf.InvalidArgumentError):
        GrowableTensor("string", 4, device="cpu")
    with pytest.raises(vmmbuf.InvalidArgumentError):
        GrowableTensor("float32", 4, device="tpu")


def test_dlpack_protocol():
    g = GrowableTensor("int32", (100, 4), device="cpu")
    g.append(np.arange(8, dtype=np.int32).reshape(2, 4))
    # append's own view of the mapped rows (cached) is live:
    wide = g._buf.views_end
    assert wide == g.capacity * 16
    assert g.__dlpack_device__() == (1, 0)
    cap_legacy = g.__dlpack__()
    assert "dltensor" in repr(cap_legacy) and "versioned" not in repr(cap_legacy)
    cap_v1 = g.__dlpack__(max_version=(1, 0))
    assert "dltensor_versioned" in repr(cap_v1)
    del cap_legacy, cap_v1  # never consumed: their destructors free them
    gc.collect()
    assert g._buf.views_end == wide, "unconsumed capsules released their views"
    with pytest.raises(BufferError):
        g.__dlpack__(copy=True)
    with pytest.raises(BufferError):
        g.__dlpack__(stream=5)
    with pytest.raises(BufferError):
        g.__dlpack__(dl_device=(2, 0))
    g.shrink_to_fit()  # drops the cached view
    assert g._buf.views_end == 0
    v = np.from_dlpack(g)
    assert g._buf.views_end == 2 * 16
    np.testing.assert_array_equal(v, np.arange(8, dtype=np.int32).reshape(2, 4))
    del v
    gc.collect()
    assert g._buf.views_end == 0


@pytest.mark.parametrize("dtype", ["bool", "int8", "uint16", "int32", "uint64", "float16",
                                   "float32", "float64", "complex64", "complex128"])
def test_dtypes_round_trip(dtype):
    rng = np.random.default_rng(abs(hash(dtype)) % 1000)
    g = GrowableTensor(np.dtype(dtype), (64, 3), device="cpu")
    data = (rng.standard_normal((50, 3)) * 100).astype(dtype)
    for r in data:
        g.append(r)
    out = np.from_dlpack(g)
    assert out.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(out, data)


def test_dtype_names():
    from vmmbuf.tensor import dtype_name

    assert dtype_name("half") == "float16"
    assert dtype_name(np.float64) == "float64"
    assert dtype_name("bfloat16") == "bfloat16"
    g = GrowableTensor("bfloat16", 8, device="cpu")
    assert g.itemsize == 2 and g.row_bytes == 2


def test_numpys_array_protocol_gives_the_rows_without_a_copy() -> None:
    """``np.asarray`` of a host GrowableTensor is its rows (not an empty
    object array), at its own address; ``dtype`` converts, ``copy`` copies."""
    t = vmmbuf.GrowableTensor("float32", (1000, 4), device="cpu")
    rows = np.arange(40, dtype=np.float32).reshape(10, 4)
    t.append(rows)
    a = np.asarray(t)
    assert a.dtype == np.float32 and a.shape == (10, 4)
    assert np.array_equal(a, rows)
    assert a.__array_interface__["data"][0] == t.data_ptr(), "no copy"
    assert np.asarray(t, dtype=np.float64).dtype == np.float64
    c = np.array(t, copy=True)
    assert np.array_equal(c, rows) and c.__array_interface__["data"][0] != t.data_ptr()
