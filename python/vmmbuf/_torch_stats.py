"""PyTorch's memory statistics answered with vmmbuf's numbers, for the
process-wide mode.

Under a pluggable allocator made process-wide, PyTorch's own statistics
calls (``torch._C._cuda_memoryStats`` and the peak and accumulated resets,
under ``torch.cuda.memory_stats``, ``memory_allocated``,
``max_memory_allocated``, ``memory_reserved``, ``max_memory_reserved``,
``reset_peak_memory_stats`` and ``memory_summary``) raise "does not yet
support getDeviceStats", and ``torch.cuda.empty_cache`` leaves vmmbuf's
cache as it is. :func:`install` puts functions of the same shape in their
place, answered from :func:`vmmbuf.stats` (and ``empty_cache`` gives
vmmbuf's cached memory back on every device): the same nested
dictionary PyTorch's caching allocator gives (every key
``memory_summary`` reads), with vmmbuf's counts under ``all`` and
``large_pool`` (vmmbuf keeps no small pool apart in this sense) and zeros
under ``small_pool``. The allocated and freed totals of the allocated and
requested bytes and of the allocation and segment counts are vmmbuf's,
counted from the last ``reset_accumulated_memory_stats``; those of the
active, inactive-split and reserved bytes are not counted and read 0.

PyTorch's memory fraction (``torch._C._cuda_setMemoryFraction`` and
``_cuda_getMemoryFraction``, under ``torch.cuda.set_per_process_memory_fraction``
and ``get_per_process_memory_fraction``) is vmmbuf's device budget: the
fraction times the device's total memory caps what vmmbuf maps, all tags
together, and an allocation past it raises ``torch.OutOfMemoryError``.
Out-of-memory observers (``torch._C._cuda_attach_out_of_memory_observer``)
are told of each allocation vmmbuf refuses for want of memory, before
PyTorch raises it, with PyTorch's arguments.

The memory snapshot (``torch._C._cuda_memorySnapshot``, under
``torch.cuda.memory_snapshot``, ``torch.cuda.memory._snapshot`` and
``_dump_snapshot``) is answered the same way: vmmbuf's mapped segments and
their blocks (allocated, awaiting another stream, held by a CUDA graph, or
free) in PyTorch's format, which its memory visualizer reads. vmmbuf keeps
no history of single calls: ``torch.cuda.memory._record_memory_history``
is accepted, and the snapshot's ``device_traces`` are empty.

:func:`nested_stats` and :func:`pytorch_snapshot` are pure (vmmbuf's
numbers in, PyTorch's shape out) and tested without a GPU.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

# A StatArray's four fields, each answered by a vmmbuf counter or 0.
_Names = Tuple[Optional[str], Optional[str], Optional[str], Optional[str]]

# The statistics PyTorch keeps as a StatArray (all, small_pool, large_pool),
# and the vmmbuf counters each is answered from: (current, peak, allocated,
# freed), a name or None for 0.
_ARRAYS: Dict[str, _Names] = {
    "allocation": ("live_allocations", None, "num_allocs", "num_frees"),
    "segment": (None, None, "num_device_alloc", "num_device_free"),
    "active": ("live_allocations", None, "num_allocs", "num_frees"),
    "inactive_split": (None, None, None, None),
    "allocated_bytes": ("allocated_bytes.all.current", "allocated_bytes.all.peak",
                        "allocated_bytes.all.allocated", "allocated_bytes.all.freed"),
    "reserved_bytes": ("reserved_bytes.all.current", "reserved_bytes.all.peak", None, None),
    "active_bytes": ("active_bytes.all.current", "active_bytes.all.peak",
                     "active_bytes.all.allocated", "active_bytes.all.freed"),
    "inactive_split_bytes": (
        "inactive_split_bytes.all.current", "inactive_split_bytes.all.peak", None, None),
    "requested_bytes": ("requested_bytes.all.current", "requested_bytes.all.peak",
                        "requested_bytes.all.allocated", "requested_bytes.all.freed"),
}

# vmmbuf's counters that only grow, which PyTorch's
# ``reset_accumulated_memory_stats`` sets back to 0: every StatArray's
# allocated and freed (but the active bytes', which :func:`since` derives),
# and the event counts.
_DERIVED = ("active_bytes.all.allocated", "active_bytes.all.freed")
ACCUMULATED = tuple(sorted({n for names in _ARRAYS.values() for n in names[2:]
                            if n and n not in _DERIVED}
                           | {"num_alloc_retries", "num_ooms", "num_device_syncs"}))


def since(raw: Mapping[str, Any], base: Mapping[str, int]) -> Dict[str, Any]:
    """``raw`` with each accumulated counter counted from ``base`` (its
    values when PyTorch's accumulated statistics were last reset), and the
    active bytes' totals: a block is active from its allocation until its
    free has passed every stream that used it, so the bytes that became
    active are the allocated ones, and those that stopped being active are
    those less the growth of the active bytes since the reset (``base``'s
    ``active_bytes.all.current``, 0 before any reset)."""
    out = dict(raw)
    for k, v in base.items():
        if k in out and k in ACCUMULATED:
            out[k] = max(0, int(out[k] or 0) - v)
    became = int(out.get("allocated_bytes.all.allocated", 0) or 0)
    grew = int(out.get("active_bytes.all.current", 0) or 0) - int(
        base.get("active_bytes.all.current", 0))
    out["active_bytes.all.allocated"] = became
    out["active_bytes.all.freed"] = max(0, became - grew)
    return out

_FIELDS = ("current", "peak", "allocated", "freed")


def _stat(raw: Mapping[str, Any], names: _Names) -> Dict[str, int]:
    out = {f: int(raw.get(n, 0) or 0) if n else 0 for f, n in zip(_FIELDS, names)}
    # A count with no peak of its own never reads below its current value.
    out["peak"] = max(out["peak"], out["current"])
    return out


def nested_stats(raw: Mapping[str, Any]) -> Dict[str, Any]:
    """The dictionary ``torch._C._cuda_memoryStats`` returns, from vmmbuf's
    statistics of one device (``vmmbuf.stats(device)``; empty before its
    first allocation, which gives zeros throughout, as PyTorch does)."""
    zero = {f: 0 for f in _FIELDS}
    out: Dict[str, Any] = {}
    for key, names in _ARRAYS.items():
        s = _stat(raw, names)
        out[key] = {"all": s, "large_pool": dict(s), "small_pool": dict(zero)}
    out["oversize_allocations"] = dict(zero)
    out["oversize_segments"] = dict(zero)
    out["num_alloc_retries"] = int(raw.get("num_alloc_retries", 0) or 0)
    out["num_ooms"] = int(raw.get("num_ooms", 0) or 0)
    out["num_sync_all_streams"] = int(raw.get("num_device_syncs", 0) or 0)
    out["num_device_alloc"] = int(raw.get("num_device_alloc", 0) or 0)
    out["num_device_free"] = int(raw.get("num_device_free", 0) or 0)
    out["max_split_size"] = -1
    return out


def pytorch_segments(arenas: Any, device: int) -> List[Dict[str, Any]]:
    """PyTorch's snapshot segments from vmmbuf's arenas of one device (the
    parsed ``_native.snapshot_json(device)``): a segment per mapped run,
    with the blocks that start in it, in address order. A free block that
    CUDA graphs hold is inactive, as a free block of PyTorch's private pool
    is (no other allocation takes it until the graphs are gone)."""
    out: List[Dict[str, Any]] = []
    for arena in arenas or []:
        base = int(arena["base"])
        segs = sorted((int(o), int(n)) for o, n in arena["segments"])
        blocks = sorted(arena["blocks"])
        for off, size in segs:
            inside = [b for b in blocks if off <= int(b[0]) < off + size]
            bl: List[Dict[str, Any]] = []
            for o, n, allocated, requested, pending, _graph in inside:
                state = ("active_allocated" if allocated
                         else "active_awaiting_free" if pending else "inactive")
                bl.append({"address": base + int(o), "size": int(n),
                           "requested_size": int(requested) if allocated else 0,
                           "state": state, "frames": []})
            allocated_size = sum(b["size"] for b in bl if b["state"] == "active_allocated")
            out.append({
                "device": device,
                "address": base + off,
                "total_size": size,
                "allocated_size": allocated_size,
                "active_size": sum(b["size"] for b in bl if b["state"] != "inactive"),
                "requested_size": sum(b["requested_size"] for b in bl),
                "stream": 0,
                "segment_type": "large",
                "segment_pool_id": (0, 0),
                "is_expandable": True,
                "frames": [],
                "tag": str(arena.get("tag", "")),
                "blocks": bl,
            })
    return out


def pytorch_snapshot(segments: List[Dict[str, Any]], devices: int) -> Dict[str, Any]:
    """The dictionary ``torch._C._cuda_memorySnapshot`` returns: the
    segments, an empty trace per device (vmmbuf keeps no call history) and
    no allocator settings."""
    return {"segments": segments, "device_traces": [[] for _ in range(devices)],
            "allocator_settings": {}, "external_annotations": []}


@dataclass(frozen=True)
class Source:
    """vmmbuf's side of the answers, one function each, by device index:
    its statistics, peak reset, cache release, snapshot (JSON) and budget
    (set, and read: None while none is set); the device PyTorch means by
    None, how many devices the device-wide calls go over, a device's
    total memory (what PyTorch's memory fraction is a fraction of), and
    where out-of-memory observers go (None: PyTorch's own call stays)."""

    stats: Callable[[int], Mapping[str, Any]]
    reset_peak: Callable[[int], None]
    empty_cache: Callable[[int], None]
    snapshot_json: Callable[[int], Optional[str]]
    set_budget: Callable[[int, int], None]
    budget: Callable[[int], Optional[int]]
    current_device: Callable[[], int]
    device_count: Callable[[], int]
    total_memory: Callable[[int], int]
    attach_oom_observer: Optional[Callable[[Callable[..., Any]], None]] = None
    #: (segments, the pool asked for or None) -> the segments with their
    #: pools' ids, only the pool's if one is asked for (None: all as they are).
    label_segments: Optional[Callable[[List[Dict[str, Any]], Any], List[Dict[str, Any]]]] = None


class _Answers:
    """vmmbuf's answer to each of PyTorch's memory calls, from ``src``;
    ``pytorchs_empty_cache``: PyTorch's own ``empty_cache``, called first."""

    def __init__(self, src: Source, pytorchs_empty_cache: Optional[Callable[[], None]]) -> None:
        self.src = src
        self.pytorchs_empty_cache = pytorchs_empty_cache
        # Per device, the accumulated counters at PyTorch's last reset of them.
        self.bases: Dict[int, Dict[str, int]] = {}

    def device_of(self, device: Any) -> int:
        """The index ``device`` names (None or a device without an index:
        the current one)."""
        if device is None:
            return int(self.src.current_device())
        index = getattr(device, "index", device)
        return int(self.src.current_device()) if index is None else int(index)

    def memory_stats(self, device: Any) -> Dict[str, Any]:
        d = self.device_of(device)
        return nested_stats(since(self.src.stats(d), self.bases.get(d, {})))

    def reset_peak_memory_stats(self, device: Any) -> None:
        self.src.reset_peak(self.device_of(device))

    def reset_accumulated_memory_stats(self, device: Any) -> None:
        # vmmbuf's counters only grow: the reset is a new starting point.
        d = self.device_of(device)
        raw = self.src.stats(d)
        self.bases[d] = {k: int(raw.get(k, 0) or 0)
                         for k in ACCUMULATED + ("active_bytes.all.current",)}

    def empty_cache_everywhere(self) -> None:
        # PyTorch's own first (what its allocator object keeps), then
        # vmmbuf's on every device.
        if self.pytorchs_empty_cache is not None:
            self.pytorchs_empty_cache()
        for d in range(int(self.src.device_count())):
            self.src.empty_cache(d)

    def memory_snapshot(self, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        # PyTorch passes the pool asked for first, as (id, id, include
        # traces); None or the pool (0, 0): every segment.
        asked = args[0] if args else kwargs.get("mempool_id")
        mempool_id = None if asked is None else (int(asked[0]), int(asked[1]))
        if mempool_id == (0, 0):
            mempool_id = None
        n = int(self.src.device_count())
        segments: List[Dict[str, Any]] = []
        for d in range(n):
            raw = self.src.snapshot_json(d)
            segments += pytorch_segments(json.loads(raw) if raw else [], d)
        if self.src.label_segments is not None:
            segments = self.src.label_segments(segments, mempool_id)
        return pytorch_snapshot(segments, n)

    def set_memory_fraction(self, fraction: float, device: Any) -> None:
        # PyTorch checks the fraction (0 to 1) before this call, and caps
        # what its allocator reserves at fraction x the device's total.
        d = self.device_of(device)
        self.src.set_budget(d, int(float(fraction) * self.src.total_memory(d)))

    def get_memory_fraction(self, device: Any) -> float:
        d = self.device_of(device)
        budget = self.src.budget(d)
        return 1.0 if budget is None else min(1.0, budget / self.src.total_memory(d))


def _accepting(pytorchs: Callable[..., Any]) -> Callable[..., None]:
    """PyTorch's memory-history call, kept where it works (its settings are
    kept); under a pluggable allocator it refuses, and vmmbuf keeps no call
    history to record into: that refusal is swallowed, any other raised."""
    def record_memory_history(*args: Any, **kwargs: Any) -> None:
        try:
            pytorchs(*args, **kwargs)
        except RuntimeError as e:
            if "does not yet support" not in str(e):
                raise
    return record_memory_history


def install(torch_c: Any, src: Source) -> None:
    """Puts vmmbuf's answers (``src``) in place of PyTorch's statistics,
    snapshot, history and memory-fraction calls and its ``empty_cache`` on
    ``torch_c`` (``torch._C``), and torch.accelerator's memory calls, which
    reach the same allocator through calls of their own (a pluggable
    allocator refuses them as well). Installing twice changes nothing
    more."""
    if getattr(torch_c, "_vmmbuf_stats_installed", False):
        return
    a = _Answers(src, getattr(torch_c, "_cuda_emptyCache", None))
    for name in ("_cuda_record_memory_history", "_cuda_record_memory_history_legacy"):
        pytorchs = getattr(torch_c, name, None)
        if pytorchs is not None:
            setattr(torch_c, name, _accepting(pytorchs))
    answers: Dict[str, Callable[..., Any]] = {
        "_cuda_setMemoryFraction": a.set_memory_fraction,
        "_cuda_getMemoryFraction": a.get_memory_fraction,
        "_cuda_emptyCache": a.empty_cache_everywhere,
        "_cuda_memorySnapshot": a.memory_snapshot,
        "_cuda_memoryStats": a.memory_stats,
        "_cuda_resetPeakMemoryStats": a.reset_peak_memory_stats,
        "_cuda_resetAccumulatedMemoryStats": a.reset_accumulated_memory_stats,
    }
    for name, answer in answers.items():
        setattr(torch_c, name, answer)
    if src.attach_oom_observer is not None:
        # Called as PyTorch calls its observers: (device, bytes asked, the
        # most the process may have, the device's free bytes).
        torch_c._cuda_attach_out_of_memory_observer = src.attach_oom_observer
    for name, answer in (("_accelerator_getDeviceStats", a.memory_stats),
                         ("_accelerator_resetPeakStats", a.reset_peak_memory_stats),
                         ("_accelerator_resetAccumulatedStats", a.reset_accumulated_memory_stats),
                         ("_accelerator_emptyCache", a.empty_cache_everywhere)):
        if hasattr(torch_c, name):
            setattr(torch_c, name, answer)
    torch_c._vmmbuf_stats_installed = True
