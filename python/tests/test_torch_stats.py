"""PyTorch's statistics answered from vmmbuf's (the process-wide mode's
bridge), without a GPU or PyTorch: the nested dictionary has every key
PyTorch's ``memory_summary`` reads, carries vmmbuf's numbers where PyTorch's
flattening (``memory_stats``) looks for them, and ``install`` replaces the
calls once, ``empty_cache`` reaching vmmbuf on every device."""

from __future__ import annotations

import json
from typing import Any, Dict

import pytest

from vmmbuf import _torch_stats

RAW = {
    "allocated_bytes.all.current": 3 << 20, "allocated_bytes.all.peak": 7 << 20,
    "reserved_bytes.all.current": 4 << 20, "reserved_bytes.all.peak": 8 << 20,
    "active_bytes.all.current": 3 << 20, "active_bytes.all.peak": 7 << 20,
    "inactive_split_bytes.all.current": 1 << 20, "inactive_split_bytes.all.peak": 2 << 20,
    "requested_bytes.all.current": 3000000, "requested_bytes.all.peak": 7000000,
    "live_allocations": 5, "num_allocs": 11, "num_frees": 6, "num_alloc_retries": 1,
    "num_ooms": 2, "num_device_syncs": 3, "num_device_alloc": 4, "num_device_free": 1,
}


def _flatten(d: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """What torch.cuda.memory_stats does with the nested dictionary."""
    out: Dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict):
            out.update(_flatten(v, key))
        else:
            out[key] = v
    return out


def _source(raw: Dict[str, Any], **changes: Any) -> _torch_stats.Source:
    """A stand-in for vmmbuf's side: device 0 of one, 1 GiB, statistics
    ``raw``, every other call doing nothing; ``changes`` replaces some."""
    calls: Dict[str, Any] = dict(
        stats=lambda d: raw, reset_peak=lambda d: None, empty_cache=lambda d: None,
        snapshot_json=lambda d: None, set_budget=lambda d, b: None, budget=lambda d: None,
        current_device=lambda: 0, device_count=lambda: 1, total_memory=lambda d: 1 << 30)
    calls.update(changes)
    return _torch_stats.Source(**calls)


def test_the_nested_statistics_carry_vmmbufs_numbers_under_pytorchs_keys() -> None:
    flat = _flatten(_torch_stats.nested_stats(RAW))
    assert flat["allocated_bytes.all.current"] == 3 << 20
    assert flat["allocated_bytes.all.peak"] == 7 << 20
    assert flat["reserved_bytes.all.current"] == 4 << 20
    assert flat["reserved_bytes.all.peak"] == 8 << 20
    assert flat["requested_bytes.all.current"] == 3000000
    assert flat["allocation.all.current"] == 5
    assert flat["allocation.all.allocated"] == 11 and flat["allocation.all.freed"] == 6
    assert flat["segment.all.allocated"] == 4 and flat["segment.all.freed"] == 1
    assert flat["num_ooms"] == 2 and flat["num_alloc_retries"] == 1
    assert flat["num_sync_all_streams"] == 3
    # Every key memory_summary formats is there.
    for metric in ("allocated_bytes", "active_bytes", "requested_bytes", "reserved_bytes",
                   "inactive_split_bytes", "allocation", "active", "segment", "inactive_split"):
        for pool in ("all", "large_pool", "small_pool"):
            for stat in ("current", "peak", "allocated", "freed"):
                assert isinstance(flat[f"{metric}.{pool}.{stat}"], int), (metric, pool, stat)
    for key in ("oversize_allocations.current", "oversize_allocations.peak",
                "oversize_segments.current", "oversize_segments.peak",
                "num_device_alloc", "num_device_free", "max_split_size"):
        assert key in flat, key
    # No pool split in vmmbuf: all of it under large_pool, none under small.
    assert flat["allocated_bytes.large_pool.current"] == 3 << 20
    assert flat["allocated_bytes.small_pool.current"] == 0


def test_no_statistics_yet_read_as_zeros() -> None:
    flat = _flatten(_torch_stats.nested_stats({}))
    assert flat["allocated_bytes.all.current"] == 0 and flat["reserved_bytes.all.peak"] == 0
    assert flat["num_ooms"] == 0


def test_install_replaces_the_three_calls_once_and_resolves_the_device() -> None:
    emptied = []
    history = []

    class FakeC:
        _cuda_memoryStats = None

        @staticmethod
        def _cuda_emptyCache() -> None:
            emptied.append("pytorch")

        @staticmethod
        def _cuda_record_memory_history(*args: Any) -> None:
            history.append(args)
            if args[0] == "refused":
                raise RuntimeError("CUDAPluggableAllocator does not yet support recordHistory")
            if args[0] == "broken":
                raise RuntimeError("something else")

    asked = []
    reset = []

    def stats(dev: int) -> Dict[str, Any]:
        asked.append(dev)
        return RAW

    c = FakeC()
    arenas = json.dumps([{"tag": "kv", "base": 1 << 40, "segments": [[0, 4 << 20]],
                          "blocks": [[0, 1 << 20, True, 1000, False, False],
                                     [1 << 20, 3 << 20, False, 0, False, False]]}])
    snaps = {0: arenas, 1: None, 2: None}
    budgets: Dict[int, int] = {}

    def source(current: int, count: int) -> _torch_stats.Source:
        return _torch_stats.Source(
            stats=stats, reset_peak=reset.append, empty_cache=emptied.append,
            snapshot_json=snaps.get, set_budget=budgets.__setitem__, budget=budgets.get,
            current_device=lambda: current, device_count=lambda: count,
            total_memory=lambda d: (d + 1) * 1000)

    _torch_stats.install(c, source(2, 3))
    first = c._cuda_memoryStats
    _torch_stats.install(c, source(5, 9))
    assert c._cuda_memoryStats is first, "installed once"
    # PyTorch's memory fraction is vmmbuf's budget: the fraction of the
    # device's total, read back as a fraction (1.0 while none is set).
    assert c._cuda_getMemoryFraction(1) == 1.0
    c._cuda_setMemoryFraction(0.25, 1)
    c._cuda_setMemoryFraction(0.5, None)
    assert budgets == {1: 500, 2: 1500}
    assert c._cuda_getMemoryFraction(1) == 0.25 and c._cuda_getMemoryFraction(None) == 0.5
    assert c._cuda_memoryStats(None)["allocated_bytes"]["all"]["current"] == 3 << 20

    class Dev:
        index = 1

    c._cuda_memoryStats(Dev())
    c._cuda_memoryStats(0)
    c._cuda_resetPeakMemoryStats(None)
    c._cuda_resetAccumulatedMemoryStats(None)
    # The accumulated reset reads device 2's counters (its new start).
    assert asked == [2, 1, 0, 2] and reset == [2]
    c._cuda_emptyCache()
    assert emptied == ["pytorch", 0, 1, 2], "PyTorch's, then vmmbuf's on every device"
    snap = c._cuda_memorySnapshot(None)
    assert snap["device_traces"] == [[], [], []]
    (seg,) = snap["segments"]
    assert (seg["device"], seg["address"], seg["total_size"]) == (0, 1 << 40, 4 << 20)
    assert seg["allocated_size"] == 1 << 20 and seg["requested_size"] == 1000
    assert [b["state"] for b in seg["blocks"]] == ["active_allocated", "inactive"]
    # PyTorch's history call: its own where it works, accepted where a
    # pluggable allocator refuses it, and any other failure still raised.
    c._cuda_record_memory_history("all")
    c._cuda_record_memory_history("refused")
    try:
        c._cuda_record_memory_history("broken")
        raise AssertionError("another failure was swallowed")
    except RuntimeError as e:
        assert "something else" in str(e)
    assert [h[0] for h in history] == ["all", "refused", "broken"]


def test_segments_carry_every_block_in_its_state() -> None:
    g = 2 << 20
    arenas = [{"tag": "", "base": 1 << 40, "segments": [[0, g], [4 * g, 2 * g]],
               "blocks": [[0, 512, True, 500, False, False],
                          [512, g - 512, False, 0, True, False],
                          [4 * g, g, False, 0, False, True],
                          [5 * g, g, False, 0, False, False]]}]
    segs = _torch_stats.pytorch_segments(arenas, 3)
    assert [(s["address"] - (1 << 40), s["total_size"]) for s in segs] == [(0, g), (4 * g, 2 * g)]
    assert [b["state"] for b in segs[0]["blocks"]] == ["active_allocated", "active_awaiting_free"]
    assert [b["state"] for b in segs[1]["blocks"]] == ["inactive", "inactive"], (
        "a free block graphs hold is a private pool's free block")
    assert segs[0]["active_size"] == g and segs[0]["allocated_size"] == 512
    assert segs[1]["allocated_size"] == 0 and segs[1]["active_size"] == 0
    for s in segs:
        assert sum(b["size"] for b in s["blocks"]) == s["total_size"], "the blocks tile it"
        assert s["device"] == 3 and s["is_expandable"]


def test_allocated_and_freed_totals_count_from_the_last_accumulated_reset() -> None:
    """The allocated and freed totals are vmmbuf's, under PyTorch's keys
    (current = allocated - freed, as PyTorch keeps them), and
    ``reset_accumulated_memory_stats`` starts them again from 0, the event
    counts with them, while current values and peaks stay."""
    raw = dict(RAW)
    raw.update({"allocated_bytes.all.allocated": 10 << 20, "allocated_bytes.all.freed": 7 << 20,
                "requested_bytes.all.allocated": 9000000, "requested_bytes.all.freed": 6000000})

    class FakeC:
        pass

    c = FakeC()
    _torch_stats.install(c, _source(raw))
    flat = _flatten(c._cuda_memoryStats(0))
    assert flat["allocated_bytes.all.allocated"] - flat["allocated_bytes.all.freed"] \
        == flat["allocated_bytes.all.current"] == 3 << 20
    assert (flat["requested_bytes.all.allocated"], flat["requested_bytes.all.freed"]) == (9000000, 6000000)
    assert (flat["allocation.all.allocated"], flat["allocation.all.freed"]) == (11, 6)
    c._cuda_resetAccumulatedMemoryStats(0)
    raw["allocated_bytes.all.allocated"] += 1 << 20   # one more MiB allocated
    raw["allocated_bytes.all.current"] += 1 << 20
    raw["num_allocs"] += 1
    flat = _flatten(c._cuda_memoryStats(None))
    assert (flat["allocated_bytes.all.allocated"], flat["allocated_bytes.all.freed"]) == (1 << 20, 0)
    assert (flat["allocation.all.allocated"], flat["num_ooms"], flat["num_alloc_retries"]) == (1, 0, 0)
    assert flat["allocated_bytes.all.current"] == 4 << 20, "current values stay"
    assert flat["allocated_bytes.all.peak"] == 7 << 20, "peaks stay"


def test_active_totals_follow_the_allocations_and_torch_accelerator_is_answered() -> None:
    """The active bytes' totals: allocated bytes became active; the bytes
    no longer active are those less the active bytes' growth since the
    last reset (PyTorch's test_memory_stats: +1024 active, 0 freed; after
    the free, 1024 freed). ``torch.accelerator``'s calls are answered too."""
    raw = dict(RAW)
    raw.update({"allocated_bytes.all.allocated": 10 << 20, "allocated_bytes.all.freed": 7 << 20,
                "active_bytes.all.current": 3 << 20})
    emptied: list = []

    class FakeC:
        _accelerator_getDeviceStats = None
        _accelerator_resetPeakStats = None
        _accelerator_resetAccumulatedStats = None
        _accelerator_emptyCache = None

    c = FakeC()
    _torch_stats.install(c, _source(raw, empty_cache=emptied.append))
    flat = _flatten(c._accelerator_getDeviceStats(None))
    assert (flat["active_bytes.all.allocated"], flat["active_bytes.all.freed"]) \
        == (10 << 20, 7 << 20), "since the start: everything allocated less what is active"
    c._accelerator_resetAccumulatedStats(0)
    raw["allocated_bytes.all.allocated"] += 1024
    raw["active_bytes.all.current"] += 1024
    flat = _flatten(c._accelerator_getDeviceStats(0))
    assert (flat["active_bytes.all.allocated"], flat["active_bytes.all.freed"]) == (1024, 0)
    assert flat["active_bytes.all.current"] == (3 << 20) + 1024, "current values stay"
    raw["active_bytes.all.current"] -= 1024     # freed, and its streams passed it
    flat = _flatten(c._accelerator_getDeviceStats(0))
    assert (flat["active_bytes.all.allocated"], flat["active_bytes.all.freed"]) == (1024, 1024)
    c._accelerator_emptyCache()
    assert emptied == [0]


def test_out_of_memory_observers_go_to_vmmbuf_when_given_somewhere_to_go() -> None:
    attached: list = []

    class FakeC:
        @staticmethod
        def _cuda_attach_out_of_memory_observer(cb: Any) -> None:
            raise RuntimeError("CUDAPluggableAllocator does not yet support attachOutOfMemoryObserver")

    def source(attach: Any) -> _torch_stats.Source:
        return _source(RAW, attach_oom_observer=attach)

    kept = FakeC()
    _torch_stats.install(kept, source(None))
    with pytest.raises(RuntimeError, match="does not yet support"):
        kept._cuda_attach_out_of_memory_observer(print)
    c = FakeC()
    _torch_stats.install(c, source(attached.append))
    c._cuda_attach_out_of_memory_observer(print)
    assert attached == [print]


def test_a_snapshot_of_one_pool_asks_for_that_pools_segments() -> None:
    """PyTorch asks ``_cuda_memorySnapshot((id, id, include_traces))``, the
    pool (0, 0) or None for every segment."""
    asked: list = []

    class FakeC:
        pass

    c = FakeC()
    _torch_stats.install(c, _source(
        RAW, label_segments=lambda segs, pool: asked.append(pool) or segs))
    c._cuda_memorySnapshot((0, 0, True))
    c._cuda_memorySnapshot(None)
    c._cuda_memorySnapshot((0, 5, False))
    c._cuda_memorySnapshot(mempool_id=(3, 0))
    assert asked == [None, None, (0, 5), (3, 0)]
