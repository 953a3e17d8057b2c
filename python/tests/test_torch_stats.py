"""PyTorch's statistics answered from vmmbuf's (the process-wide mode's
bridge), without a GPU or PyTorch: the nested dictionary has every key
PyTorch's ``memory_summary`` reads, carries vmmbuf's numbers where PyTorch's
flattening (``memory_stats``) looks for them, and ``install`` replaces the
calls once, ``empty_cache`` reaching vmmbuf on every device."""

from __future__ import annotations

from typing import Any, Dict

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

    class FakeC:
        _cuda_memoryStats = None

        @staticmethod
        def _cuda_emptyCache() -> None:
            emptied.append("pytorch")

    asked = []
    reset = []

    def stats(dev: int) -> Dict[str, Any]:
        asked.append(dev)
        return RAW

    c = FakeC()
    _torch_stats.install(c, stats, reset.append, emptied.append, lambda: 2, lambda: 3)
    first = c._cuda_memoryStats
    _torch_stats.install(c, stats, reset.append, emptied.append, lambda: 5, lambda: 9)
    assert c._cuda_memoryStats is first, "installed once"
    assert c._cuda_memoryStats(None)["allocated_bytes"]["all"]["current"] == 3 << 20

    class Dev:
        index = 1

    c._cuda_memoryStats(Dev())
    c._cuda_memoryStats(0)
    c._cuda_resetPeakMemoryStats(None)
    c._cuda_resetAccumulatedMemoryStats(None)
    assert asked == [2, 1, 0] and reset == [2]
    c._cuda_emptyCache()
    assert emptied == ["pytorch", 0, 1, 2], "PyTorch's, then vmmbuf's on every device"
