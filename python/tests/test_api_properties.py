"""The Python API's argument space, drawn by hypothesis (issue 43): every
call either succeeds and keeps its invariants, or raises a documented
exception (``TypeError``, a ``ValueError``, or a ``vmmbuf.errors``
exception). Nothing else escapes: no ``OverflowError``, ``AttributeError``
or crash. Host memory ("cpu"), so it runs everywhere."""

from __future__ import annotations

import warnings
from typing import Any, List

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import vmmbuf  # noqa: E402
from vmmbuf import GrowableTensor  # noqa: E402

DOCUMENTED = (TypeError, ValueError, vmmbuf.VmmbufError)
DTYPES = ["float32", "float64", "int32", "int64", "uint8", "int8", "float16", "bool"]

# Anything a caller might pass where a size, a device, a tag or a flag goes.
anything = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.integers(min_value=-3, max_value=1 << 20),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.binary(max_size=4),
    st.lists(st.integers(min_value=-3, max_value=1 << 12), max_size=3),
    st.tuples(st.integers(min_value=-3, max_value=1 << 12), st.floats(0, 8)),
    st.sampled_from([np.int64(7), np.float32(2.5), "f4", "float", "int", "cuda", "cpu", "cuda:0"]),
)
dtypes = st.one_of(st.sampled_from(DTYPES), anything)

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _call(f: Any, *args: Any, **kwargs: Any) -> Any:
    """f(...), or None if it raised a documented exception; anything else
    fails the test."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        try:
            return f(*args, **kwargs)
        except DOCUMENTED:
            return None


@FAST
@given(dtype=dtypes, max_size=anything, pooled=anything)
def test_making_a_tensor_succeeds_or_raises_a_documented_error(dtype, max_size, pooled):
    g = _call(GrowableTensor, dtype, max_size, "cpu", pooled=pooled)
    if g is None:
        return
    assert len(g) == 0 and g.shape[0] == 0
    assert g.max_rows >= 1 and g.dtype_name in DTYPES + ["float16", "bfloat16", "complex64",
                                                         "complex128", "int16", "uint16",
                                                         "uint32", "uint64"]
    assert isinstance(pooled, bool), "a non-bool pooled was accepted"


op = st.one_of(
    st.tuples(st.just("resize"), anything),
    st.tuples(st.just("resize"), st.integers(min_value=0, max_value=64)),
    st.tuples(st.just("append"), st.integers(min_value=0, max_value=5), st.sampled_from(DTYPES),
              st.booleans()),
    st.tuples(st.just("shrink")),
)


@FAST
@given(dtype=st.sampled_from(DTYPES), rows=st.integers(min_value=1, max_value=48),
       width=st.integers(min_value=1, max_value=5), ops=st.lists(op, max_size=12),
       seed=st.integers(min_value=0, max_value=2**32 - 1))
def test_a_tensor_keeps_every_row_through_any_calls(dtype, rows, width, ops, seed):
    """A model of the rows (NumPy) against the tensor: appends of the right
    dtype land, the wrong dtype or shape is refused, resizes keep the rows
    below the new length, nothing moves the base address."""
    rng = np.random.default_rng(seed)
    g = GrowableTensor(dtype, (rows, width), "cpu")
    base = g.data_ptr()
    model: List[np.ndarray] = []
    for o in ops:
        if o[0] == "resize":
            n = o[1]
            before = len(g)
            if _call(g.resize, n) is None and len(g) == before and not (
                isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= rows
            ):
                continue  # refused, unchanged
            assert len(g) == n
            model = model[:n]
            if n > len(model):
                # New rows are uninitialised: the model takes what is there.
                model += list(g.numpy()[len(model):n].copy())
        elif o[0] == "append":
            _, k, kind, right_shape = o
            shape = (k, width) if right_shape else (k, width + 1)
            block = (rng.standard_normal(shape) * 50).astype(kind)
            before = len(g)
            at = _call(g.append, block)
            if at is None:
                assert len(g) == before, "a refused append changed the length"
                assert kind != dtype or not right_shape or before + k > rows
                continue
            assert kind == dtype and right_shape, f"accepted {kind} rows of {shape}"
            assert at == before
            model += list(block)
        else:
            g.shrink_to_fit()
        assert g.data_ptr() == base, "the base moved"
        assert len(g) == len(model)
        if model:
            assert np.array_equal(g.numpy(), np.stack(model), equal_nan=True)


@FAST
@given(value=anything)
def test_module_functions_succeed_or_raise_documented_errors(value):
    """Every public function of the package with one odd argument each."""
    tag_before = vmmbuf.get_tag()
    try:
        _call(vmmbuf.set_tag, value)
        assert isinstance(vmmbuf.get_tag(), str)
    finally:
        vmmbuf.set_tag(tag_before)
    for f in (vmmbuf.stats, vmmbuf.empty_cache, vmmbuf.reset_peak):
        r = _call(f, value)
        if f is vmmbuf.stats and r is not None:
            assert isinstance(r, dict)
    assert _call(vmmbuf.sleep, value) in (None, 0)
    assert _call(vmmbuf.wake, value) in (None, 0)
    assert _call(vmmbuf.sleep, None, discard=value) in (None, 0)
    assert _call(vmmbuf.prepare_sleep, value, wait=True) in (None, 0)
    _call(vmmbuf.set_host_cache_limit, value)
    vmmbuf.set_host_cache_limit(1 << 40)


def test_bad_inputs_from_the_issue_give_typed_errors_in_the_users_words():
    """The table of issue 43, each case as a user met it."""
    cases = [
        (lambda: GrowableTensor("float32", 1e6, "cpu"), TypeError, "max_size must be an int"),
        (lambda: GrowableTensor("float32", (2.5, 4), "cpu"), TypeError, "max_size[0] must be an integer"),
        (lambda: GrowableTensor("float32", True, "cpu"), TypeError, "not bool"),
        (lambda: GrowableTensor(None, 10, "cpu"), TypeError, "dtype is required"),
        (lambda: GrowableTensor("float32", 2**62, "cpu"), vmmbuf.InvalidArgumentError,
         "16 EiB: more than any address space"),
        (lambda: GrowableTensor("float32", 2**45, "cpu"), vmmbuf.CapacityError,
         "does not fit in the address space"),
        (lambda: vmmbuf.set_budget(-1), vmmbuf.InvalidArgumentError, "bytes is -1"),
        (lambda: vmmbuf.sleep(123), TypeError, "tags must be None, a string or a list"),
        (lambda: vmmbuf.empty_cache(-3), vmmbuf.InvalidArgumentError, "device is -3"),
        (lambda: vmmbuf.sleep(None, discard="yes"), TypeError, "discard must be True or False"),
    ]
    if vmmbuf.device_count() < 100:
        cases.append((lambda: vmmbuf.stats(99), vmmbuf.InvalidArgumentError, "device 99"))
    for f, kind, words in cases:
        with pytest.raises(kind) as e:
            f()
        assert words in str(e.value), str(e.value)
    assert GrowableTensor("f4", 10, "cpu").dtype_name == "float32"
    # A GrowableTensor shows in the statistics (it stayed {} before).
    t = GrowableTensor("float32", (1000, 16), "cpu")
    t.resize(100)
    st = vmmbuf.stats("cpu")
    assert st["growable_tensors"] >= 1 and st["growable_bytes"] >= 6400, st
    assert st["growable_mapped_bytes"] >= st["growable_bytes"], st
    del t
    g = GrowableTensor("int32", (10, 3), "cpu")
    for rows in (np.zeros((2, 3)), np.array([[np.nan] * 3]), np.zeros((1, 3), dtype=np.int64)):
        with pytest.raises(vmmbuf.InvalidArgumentError, match="convert them first"):
            g.append(rows)
    assert len(g) == 0
    with pytest.warns(UserWarning, match="no memory is tagged 'weightz'"):
        assert vmmbuf.sleep("weightz") == 0
    with pytest.warns(UserWarning, match="no memory is tagged 'weightz'"):
        assert vmmbuf.wake("weightz") == 0
