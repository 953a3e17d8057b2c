"""vmmbuf as PyTorch's CUDA allocator.

Process-wide (every CUDA tensor from vmmbuf; call before the first one)::

    import vmmbuf.torch
    vmmbuf.torch.use()

Scoped, as vLLM's ``CuMemAllocator`` does (inside: vmmbuf; outside:
PyTorch's own allocator)::

    pool = vmmbuf.torch.MemPool()
    with torch.cuda.use_mem_pool(pool):
        weights = torch.empty(..., device="cuda")

or ``with vmmbuf.torch.pool("weights"): ...``, which also tags what it
allocates so ``vmmbuf.sleep("weights")`` moves exactly that.

In a ``MemPool`` scope PyTorch's caching allocator sits on top: it asks
vmmbuf for segments and caches blocks in them, and ``torch.cuda.memory_stats``
works as usual. Process-wide, PyTorch's own calls would raise under a
pluggable allocator; ``use()`` answers them with vmmbuf's numbers
(``torch.cuda.memory_stats``, ``max_memory_allocated``, the snapshot, the
memory fraction, out-of-memory observers: :mod:`vmmbuf._torch_stats`),
makes ``torch.cuda.MemPool`` a vmmbuf tag (:mod:`vmmbuf._torch_mempool`)
and answers CUDA graph trees' pool calls (:mod:`vmmbuf._torch_graphs`).
``vmmbuf.torch.memory_stats`` and friends give the same key names from
vmmbuf's arenas in either mode.

CUDA graphs (``torch.cuda.graph``): in either mode, what a capture
allocates, and what is freed while a stream is captured, stays the graph's
(the replays use those addresses) until CUDA destroys the graph and every
executable made from it and their launches finish (a user object on the
graph tells vmmbuf); then it is free memory again. ``stats()`` counts it
as ``graph_bytes``, the graphs alive as ``graph_pools``. With
``torch.cuda.graph(g, pool=vmmbuf.torch.MemPool().id)`` PyTorch's private
pool takes its segments from vmmbuf. ``torch.compile(mode="reduce-overhead")``
works in a ``MemPool`` scope (its graphs use PyTorch's own graph pool).
Captures are announced, as PyTorch announces them to its own cache: once
this module makes its allocator, it counts the captures begun and ended
through ``torch.cuda.CUDAGraph`` (which all of the above use), and the
plug-in asks the driver whether a stream is captured only while one is
under way, instead of at every malloc and free. A capture begun some other
way (``cudaStreamBeginCapture`` from another library on a stream where
vmmbuf allocates) is then not seen, as PyTorch's own cache does not see it;
``VMMBUF_TORCH_ANNOUNCE_CAPTURES=0`` makes every call ask.
Process-wide, ``torch.compile(mode="reduce-overhead")``'s CUDA graph trees
work too: vmmbuf answers the pool calls PyTorch routes to no pluggable
allocator (the live-allocation check, the pool checkpoint and its restore;
see :mod:`vmmbuf._torch_graphs`). A later graph of a tree does not reuse
the memory of an earlier one's dead outputs while the earlier graph lives,
as PyTorch's private pool would (vmmbuf's graph rule): more memory, never
an overwrite.

NCCL: with ``VMMBUF_TORCH_NCCL_READY=1`` (set before the first CUDA
allocation) vmmbuf makes its chunks as ``ncclMemAlloc`` does, and
``register_nccl(group)`` keeps all of vmmbuf's device memory registered
with the group's communicator as it grows and shrinks (PyTorch's
``register_mem_pool`` registers only the segments that exist at its call);
close the registration before ``destroy_process_group``.

Out of memory: in a ``MemPool`` scope PyTorch raises ``torch.OutOfMemoryError``
as usual. Process-wide, PyTorch's pluggable interface has no way to report a
failed allocation (it would make a tensor at address 0 of a null), so vmmbuf
throws PyTorch's own C++ ``c10::OutOfMemoryError`` (found in the loaded
libc10, see ``vmmbuf-torch/src/throw.cpp``), which PyTorch raises as
``torch.OutOfMemoryError`` in its words ("CUDA out of memory. Tried to
allocate ...") with vmmbuf's cause after them (also in
``vmmbuf.last_error()``); a failure that is not out of memory is a
``RuntimeError``. ``torch.cuda.set_per_process_memory_fraction`` sets
vmmbuf's device budget.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections import OrderedDict
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from . import (_captures, _check, _native, _torch_graphs, _torch_mempool, _torch_stats,
               library_path, stats)
from .errors import InvalidArgumentError, NoDeviceError, UnsupportedError, VmmbufError

_ALLOCATORS: Dict[str, Any] = {}
_POOLS: Dict[Tuple[str, int], Any] = {}
_PROCESS_WIDE = False


def _allocator(malloc: str = "vmmbuf_torch_malloc") -> Any:
    """A ``CUDAPluggableAllocator`` over this package's own library (PyTorch
    loads the file the package imported), one per allocation function:

    - ``vmmbuf_torch_malloc``, process-wide: it throws a failure to PyTorch
      as an exception, since PyTorch's pluggable allocator would wrap a null
      as a tensor at address 0;
    - ``vmmbuf_malloc``, for MemPools: it answers a failure with null, which
      PyTorch's caching allocator above it handles (it frees its cache,
      retries, then raises ``torch.OutOfMemoryError``).
    """
    if malloc not in _ALLOCATORS:
        # A MemPool's segments go back as cudaFree's would (PyTorch's cache
        # above is the cache); process-wide, a free keeps them for reuse.
        free = "vmmbuf_free" if malloc == "vmmbuf_torch_malloc" else "vmmbuf_segment_free"
        a = torch.cuda.memory.CUDAPluggableAllocator(library_path(), malloc, free)
        if malloc == "vmmbuf_torch_malloc":
            # Process-wide, ``Tensor.record_stream`` reaches the plug-in only
            # through this hook: PyTorch skips the call when none is set,
            # and the block would go back to its own stream while another
            # still uses it. (Under a MemPool, PyTorch's caching allocator
            # keeps the record itself.)
            setter = getattr(a.allocator(), "set_record_stream_fn", None)
            if setter is None:
                warnings.warn(
                    "this PyTorch cannot pass Tensor.record_stream to a pluggable allocator: "
                    "free a tensor used on another stream only after synchronising with that "
                    "stream", RuntimeWarning, stacklevel=3)
            else:
                setter(_native.record_stream_fn())
        _ALLOCATORS[malloc] = a
        _announce_captures()
    return _ALLOCATORS[malloc]


def _capturing(stream: Any) -> bool:
    with torch.cuda.stream(stream):
        return bool(torch.cuda.is_current_stream_capturing())


def _announce_captures() -> bool:
    """Counts PyTorch's CUDA graph captures for the plug-in, which then asks
    the driver about a stream's capture only while one is under way (see
    :mod:`vmmbuf._captures`). Not when ``VMMBUF_TORCH_ANNOUNCE_CAPTURES=0``,
    nor if this thread's stream is being captured now (a capture begun
    before the hook would go uncounted). True if captures are announced."""
    if os.environ.get("VMMBUF_TORCH_ANNOUNCE_CAPTURES", "1") == "0":
        return False
    if torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
        return False
    return _captures.hook(torch._C._CUDAGraph, torch.cuda.current_stream, _capturing)


def require_device(what: str) -> None:
    """Raises ``NoDeviceError`` naming the cause (no driver, no device) when
    vmmbuf cannot allocate on a GPU here; ``what`` names the call refused.
    Every entry point that needs a GPU asks this first, before PyTorch
    would raise its own ``RuntimeError``, and before anything is changed."""
    why = _native.cuda_unavailable()
    if why is not None:
        raise NoDeviceError(f"{what}: no CUDA device to allocate on: {why}")


def _dev(device: Any) -> int:
    """A CUDA device PyTorch has: None (the current one), an int, "cuda",
    "cuda:N" or a ``torch.device``; anything else is refused in words."""
    if device is None:
        return int(torch.cuda.current_device())
    if isinstance(device, (int, bool)) or hasattr(device, "__index__"):
        return _check.device(device, torch.cuda.device_count())
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise InvalidArgumentError(
            f"device {device!r}: 'cuda', 'cuda:N', an int or a torch.device") from e
    if d.type != "cuda":
        raise InvalidArgumentError(f"device {device!r} is not a CUDA device")
    if d.index is None:
        return int(torch.cuda.current_device())
    return _check.device(d.index, torch.cuda.device_count())


def use(budget_bytes: Optional[int] = None, device: int = 0) -> None:
    """Makes vmmbuf the CUDA allocator of the whole process. Call it before
    the first CUDA tensor (PyTorch cannot swap an allocator in use).
    ``budget_bytes`` caps what vmmbuf maps on ``device``, all tags together.
    PyTorch's statistics calls (``torch.cuda.memory_allocated``,
    ``max_memory_allocated``, ``memory_reserved``, ``memory_stats``,
    ``memory_summary``, ``reset_peak_memory_stats``) then answer with
    vmmbuf's numbers, ``torch.cuda.memory_snapshot`` and
    ``torch.cuda.memory._dump_snapshot`` show vmmbuf's segments and blocks,
    and ``torch.cuda.empty_cache`` gives vmmbuf's cached memory back (see
    :mod:`vmmbuf._torch_stats`)."""
    global _PROCESS_WIDE
    # Every check first (the arguments, then the machine): a refused call
    # installs nothing.
    device = _check.device(device, torch.cuda.device_count())
    budget = None if budget_bytes is None else _check.integer(
        "budget_bytes", budget_bytes, maximum=_check.MAX_LIMIT)
    require_device("vmmbuf.torch.use()")
    if not _PROCESS_WIDE:
        try:
            torch.cuda.memory.change_current_allocator(_allocator())
        except RuntimeError as e:
            raise VmmbufError(
                "vmmbuf.torch.use() must come before the first CUDA tensor (PyTorch cannot "
                "change an allocator in use): call it at the start of the program, or use "
                "vmmbuf.torch.pool() for a scope") from e
    if budget is not None:
        _native.set_budget(device, budget)
    if _PROCESS_WIDE:
        return
    _torch_mempool.install(torch, _torch_mempool.Natives(
        new_id=torch.cuda.graph_pool_handle, get_tag=_native.get_tag, set_tag=_native.set_tag,
        pool_begin=_native.torch_pool_begin, pool_end=_native.torch_pool_end,
        empty_tags=lambda d, tags: _native.empty_cache(d, only=tags),
        current_device=torch.cuda.current_device))
    _torch_stats.install(torch._C, _torch_stats.Source(
        stats=stats, reset_peak=_native.reset_peak,
        # A live MemPool keeps its cache, as PyTorch's does, until its end.
        empty_cache=lambda d: _native.empty_cache(d, skip=_torch_mempool.live_tags()),
        snapshot_json=_native.snapshot_json, set_budget=_native.set_budget,
        budget=_native.budget, current_device=torch.cuda.current_device,
        device_count=torch.cuda.device_count,
        total_memory=lambda d: int(torch.cuda.mem_get_info(d)[1]),
        attach_oom_observer=_native.attach_oom_observer,
        label_segments=_torch_mempool.label_segments))
    _torch_graphs.install(torch._C, _graph_source())
    _torch_graphs.hook_captures(torch._C._CUDAGraph, torch.cuda.current_stream,
                                torch.cuda.graph_pool_handle, _note_capture)
    _PROCESS_WIDE = True


def _note_capture(stream: Any, pool: Any) -> None:
    """Tells the plug-in which PyTorch pool the capture just begun on
    ``stream`` allocates into (see :mod:`vmmbuf._torch_graphs`)."""
    _native.torch_capture_pool(int(stream.device.index), int(stream.cuda_stream),
                               (int(pool[0]), int(pool[1])))


def _storage_deleters() -> _torch_graphs.StorageDeleters:
    """Finds where this PyTorch keeps a storage's deleter, from a storage
    vmmbuf allocates and one made over the same address owning nothing."""
    t = torch.empty(1, dtype=torch.uint8, device=torch.device("cuda", torch.cuda.current_device()))
    owning = t.untyped_storage()
    borrowed = torch._C._construct_storage_from_data_pointer(owning.data_ptr(), t.device, 1)
    return _torch_graphs.StorageDeleters(owning._cdata, owning.data_ptr(), borrowed._cdata,
                                         torch._C._has_Standard_Deleter)


def _graph_source() -> _torch_graphs.Source:
    """The plug-in and PyTorch, as :mod:`vmmbuf._torch_graphs` asks them."""
    found: List[_torch_graphs.StorageDeleters] = []

    def deleters() -> _torch_graphs.StorageDeleters:
        if not found:
            found.append(_storage_deleters())
        return found[0]

    def raw_alloc(device: int, nbytes: int) -> int:
        with torch.cuda.device(device):
            stream = torch.cuda.current_stream(device).cuda_stream
            return int(torch._C._cuda_cudaCachingAllocator_raw_alloc(nbytes, stream))

    return _torch_graphs.Source(
        live=_native.torch_pool_live, pool_begin=_native.torch_pool_begin,
        pool_end=_native.torch_pool_end,
        retake_next=lambda a, p: _native.torch_retake_next(a, p), raw_alloc=raw_alloc,
        raw_delete=torch._C._cuda_cudaCachingAllocator_raw_delete,
        free_and_disown=torch._C._free_And_Remove_DeleterFn, deleters=deleters)


def is_process_wide() -> bool:
    """True once ``use()`` made vmmbuf the process's allocator."""
    return _PROCESS_WIDE


def MemPool(**kwargs: Any) -> Any:
    """A ``torch.cuda.MemPool`` whose segments come from vmmbuf: use it with
    ``torch.cuda.use_mem_pool(pool)``. Keyword arguments go to
    ``torch.cuda.MemPool``. Allocations made in it carry the allocating
    thread's tag (``vmmbuf.tag``)."""
    require_device("vmmbuf.torch.MemPool()")
    if _PROCESS_WIDE:
        # PyTorch makes no MemPool under a process-wide pluggable allocator:
        # vmmbuf's own, a tag of its own (see vmmbuf._torch_mempool).
        return _torch_mempool.WidePool(**kwargs)
    # vmmbuf's state on the device (driver handles, a stream, the tag's
    # arena) is made now, outside any CUDA graph capture: PyTorch asks a
    # pool for its first segment inside a capture when the pool is a
    # graph's, where CUDA forbids creating them.
    d = torch.cuda.current_device()
    s = torch.cuda.current_stream(d).cuda_stream
    _native.free(_native.malloc(256, d, s), d, s)
    return torch.cuda.MemPool(_allocator("vmmbuf_malloc").allocator(), **kwargs)


@contextlib.contextmanager
def pool(tag: str = "", device: Any = None) -> Iterator[Any]:
    """Allocations made inside come from vmmbuf and carry ``tag``: one
    ``MemPool`` per tag and device, kept for the process (PyTorch caches
    blocks in it, so a tag's memory is never handed to another tag). Yields
    the pool. Process-wide (``use()``), every allocation comes from vmmbuf
    already: the scope only tags them, and yields None."""
    # The tag first, then the machine, then the device (which PyTorch can
    # name only with a driver).
    name = _check.tag("tag", tag)
    require_device("vmmbuf.torch.pool()")
    d = _dev(device)
    if _PROCESS_WIDE:
        prev = _native.get_tag()
        _native.set_tag(name)
        try:
            yield None
        finally:
            _native.set_tag(prev)
        return
    key = (name, d)
    p = _POOLS.get(key)
    if p is None:
        with torch.cuda.device(d):
            p = _POOLS[key] = MemPool()
    prev = _native.get_tag()
    _native.set_tag(key[0])
    try:
        with torch.cuda.use_mem_pool(p, device=d):
            yield p
    finally:
        _native.set_tag(prev)


def pools() -> Dict[Tuple[str, int], Any]:
    """The pools ``pool()`` made, by (tag, device)."""
    return dict(_POOLS)


_STATS = ("allocated_bytes", "reserved_bytes", "active_bytes", "inactive_split_bytes",
          "requested_bytes")


def memory_stats(device: Any = None) -> "OrderedDict[str, Any]":
    """vmmbuf's statistics for ``device`` with PyTorch's key names
    (``allocated_bytes.all.current``, ``.peak``, ``allocation.all.*``,
    ``num_alloc_retries``, ``num_ooms``), sorted as PyTorch sorts them. Only
    what vmmbuf counts: there is no small/large pool split, and no
    cumulative byte totals. Empty before vmmbuf's first allocation there."""
    raw = stats(_dev(device))
    out: Dict[str, Any] = {}
    if not raw:
        return OrderedDict()
    for name in _STATS:
        for which in ("current", "peak"):
            out[f"{name}.all.{which}"] = raw[f"{name}.all.{which}"]
    out["allocation.all.current"] = raw["live_allocations"]
    out["allocation.all.allocated"] = raw["num_allocs"]
    out["allocation.all.freed"] = raw["num_frees"]
    out["num_alloc_retries"] = raw["num_alloc_retries"]
    out["num_ooms"] = raw["num_ooms"]
    out["num_device_syncs"] = raw["num_device_syncs"]
    out["num_device_alloc"] = raw["num_device_alloc"]
    out["num_device_free"] = raw["num_device_free"]
    return OrderedDict(sorted(out.items()))


def memory_allocated(device: Any = None) -> int:
    """Bytes in live vmmbuf allocations on ``device``."""
    return int(memory_stats(device).get("allocated_bytes.all.current", 0))


def max_memory_allocated(device: Any = None) -> int:
    """The peak of ``memory_allocated`` since the start or the last reset."""
    return int(memory_stats(device).get("allocated_bytes.all.peak", 0))


def memory_reserved(device: Any = None) -> int:
    """Bytes vmmbuf has mapped on ``device`` (allocated plus cached)."""
    return int(memory_stats(device).get("reserved_bytes.all.current", 0))


def max_memory_reserved(device: Any = None) -> int:
    """The peak of ``memory_reserved``."""
    return int(memory_stats(device).get("reserved_bytes.all.peak", 0))


def reset_peak_memory_stats(device: Any = None) -> None:
    """Sets the peaks to the current values."""
    _native.reset_peak(_dev(device))


def empty_cache(device: Any = None) -> None:
    """Gives cached memory back to the driver: PyTorch's caches in vmmbuf
    pools first (``torch.cuda.empty_cache``), then vmmbuf's own."""
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    _native.empty_cache(_dev(device))


class NcclRegistration:
    """Every device range vmmbuf maps on ``device`` stays registered with one
    NCCL communicator (``ncclCommRegister``) while this lives: the ranges
    mapped when it was made at once, later ones as they are mapped, and each
    one deregistered before vmmbuf unmaps it (``empty_cache``, a budget, a
    sleep). ``close()`` (or leaving its ``with`` block) undoes every
    registration; call it before the communicator is destroyed
    (``torch.distributed.destroy_process_group``). Made by
    :func:`register_nccl`."""

    def __init__(self, device: int, comm: int, ident: int, group: Any = None) -> None:
        self._device = device
        self._comm = comm
        self._id: Optional[int] = ident
        self._group = group

    @property
    def device(self) -> int:
        """The CUDA device whose memory is registered."""
        return self._device

    @property
    def comm(self) -> int:
        """The communicator (an ``ncclComm_t``, as an integer)."""
        return self._comm

    @property
    def closed(self) -> bool:
        """True once ``close()`` undid the registrations."""
        return self._id is None

    def close(self) -> None:
        """Deregisters every range from the communicator and stops
        registering new ones. A second call does nothing."""
        if self._id is None:
            return
        ident, self._id = self._id, None
        if self in _REGISTRATIONS:
            _REGISTRATIONS.remove(self)
        _native.nccl_deregister(self._device, ident)

    def __enter__(self) -> "NcclRegistration":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._id is None else f"id {self._id}"
        return f"NcclRegistration(device={self._device}, comm={self._comm:#x}, {state})"


# Registrations made from a process group, closed by
# ``torch.distributed.destroy_process_group`` before the group's
# communicator goes (see ``_guard_destroy``).
_REGISTRATIONS: List["NcclRegistration"] = []


def _guard_destroy() -> None:
    """Wraps ``torch.distributed.destroy_process_group`` (once) so that it
    first closes the registrations made from the groups it destroys (all of
    them for ``None``): a registration left open would later be undone
    through a destroyed communicator."""
    import torch.distributed as dist

    if getattr(dist.destroy_process_group, "_vmmbuf_guard", False):
        return
    inner = dist.destroy_process_group

    def destroy_process_group(group: Any = None, *args: Any, **kwargs: Any) -> Any:
        for r in list(_REGISTRATIONS):
            if group is None or r._group is group:
                r.close()
        return inner(group, *args, **kwargs)

    destroy_process_group._vmmbuf_guard = True  # type: ignore[attr-defined]
    destroy_process_group.__doc__ = inner.__doc__
    dist.destroy_process_group = destroy_process_group
    dist.distributed_c10d.destroy_process_group = destroy_process_group


def _group_of(group: Any) -> Any:
    """``group``, or the default process group for ``None``."""
    import torch.distributed as dist

    if group is None:
        if not dist.is_available() or not dist.is_initialized():
            raise InvalidArgumentError(
                "no default process group: call torch.distributed.init_process_group "
                "first, or pass an ncclComm_t as an int")
        return dist.distributed_c10d._get_default_group()
    return group


def _nccl_comm(group: Any, device: int) -> int:
    """The ``ncclComm_t`` of ``group`` (a ``ProcessGroup``) on ``device``."""
    try:
        backend = group._get_backend(torch.device("cuda", device))
    except (RuntimeError, AttributeError) as e:
        raise InvalidArgumentError(
            f"{group!r} has no NCCL backend on cuda:{device}") from e
    comm_ptr = getattr(backend, "_comm_ptr", None)
    if comm_ptr is None:
        raise UnsupportedError(
            f"{type(backend).__name__} does not expose its NCCL communicator "
            "(_comm_ptr); pass an ncclComm_t as an int")
    comm = int(comm_ptr())
    if comm == 0:
        raise InvalidArgumentError(
            "the process group's NCCL communicator does not exist yet: run a collective "
            "first, or pass device_id to init_process_group")
    return comm


def register_nccl(group: Any = None, device: Any = None,
                  library: Optional[str] = None) -> NcclRegistration:
    """Keeps vmmbuf's memory on ``device`` registered with the NCCL
    communicator of ``group`` as it grows, shrinks and sleeps: what PyTorch's
    ``register_mem_pool`` does once, for segments that exist at the call.

    ``group``: a NCCL ``ProcessGroup`` (``None``: the default group), or an
    ``ncclComm_t`` as an integer (vLLM's ``PyNcclCommunicator.comm.value``).
    ``library``: the path of the NCCL library the communicator belongs to;
    by default the one PyTorch loaded. vmmbuf's chunks must be made as
    ``ncclMemAlloc`` makes them: set ``VMMBUF_TORCH_NCCL_READY=1`` before
    the first CUDA allocation. Returns a :class:`NcclRegistration`; close it
    before the communicator is destroyed (``destroy_process_group`` closes
    the registrations made from the groups it destroys first; one made
    from an integer is its caller's to close). Its counters are in
    ``vmmbuf.stats()``: ``nccl_comms``, ``nccl_registrations``,
    ``nccl_deregistrations``, ``nccl_failures`` (calls NCCL refused, also
    logged), ``nccl_registered_bytes`` and ``nccl_mapped_bytes``.

    The registrations are local (``ncclCommRegister``): each rank makes its
    own when its memory grows, with no collective call, so ranks that grow
    at different times cannot deadlock. NCCL's symmetric windows
    (``ncclCommWindowRegister``) are collective, every rank at once, and
    cannot follow one rank's growth this way.

    Each chunk vmmbuf maps is one registration (NCCL 2.28 maps at a peer
    only the one allocation holding a buffer, and reuses that mapping for
    every buffer of the registration). With a registration, each growth
    maps one chunk of its own, whatever its size, and no tensor straddles
    two chunks: every tensor lies in one registration, on every rank alike.
    NCCL decides per rank whether a buffer is registered, and a collective
    in which one rank's buffer is and another's is not is undefined (ranks
    stopped in FSDP's all-gather when tensors could straddle chunks).
    :func:`nccl_registered` says whether a tensor is. Free chunks go back
    whole only; a chunk's free bytes serve only requests that fit in it, so
    where a new chunk would take memory past 1.1x the peak allocated, whole
    free chunks go back first (deregistered, then unmapped)."""
    require_device("vmmbuf.torch.register_nccl()")
    d = _dev(device)
    if isinstance(group, int) and not isinstance(group, bool):
        return NcclRegistration(d, group, _native.nccl_register(d, group, library))
    group = _group_of(group)
    comm = _nccl_comm(group, d)
    _guard_destroy()
    reg = NcclRegistration(d, comm, _native.nccl_register(d, comm, library), group)
    _REGISTRATIONS.append(reg)
    return reg


def nccl_registered(tensor: Any) -> bool:
    """Whether ``tensor``'s bytes lie in one range that :func:`register_nccl`
    keeps registered with every communicator added on its device (NCCL can
    then use it zero-copy). False for a tensor not on a CUDA device, or with
    no registration there."""
    if not getattr(tensor, "is_cuda", False):
        return False
    nbytes = int(tensor.numel()) * int(tensor.element_size())
    return bool(_native.nccl_covers(int(tensor.device.index), int(tensor.data_ptr()), max(nbytes, 1)))


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n}"  # pragma: no cover


def memory_summary(device: Any = None) -> str:
    """A table of ``memory_stats`` and vmmbuf's own counters (host bytes of
    sleeping tags, fragmentation), as ``torch.cuda.memory_summary`` prints."""
    d = _dev(device)
    raw = stats(d)
    lines = [f"vmmbuf memory summary, device {d}"
             + (" (process-wide)" if _PROCESS_WIDE else " (pools)")]
    if not raw:
        return lines[0] + "\n  no allocation yet\n"
    lines.append(f"  {'metric':<24}{'current':>14}{'peak':>14}")
    for name, label in (("allocated_bytes", "allocated memory"), ("active_bytes", "active memory"),
                        ("requested_bytes", "requested memory"), ("reserved_bytes", "reserved memory"),
                        ("inactive_split_bytes", "inactive split memory")):
        lines.append(f"  {label:<24}{_fmt(raw[f'{name}.all.current']):>14}"
                     f"{_fmt(raw[f'{name}.all.peak']):>14}")
    lines.append(f"  {'allocations':<24}{raw['live_allocations']:>14}"
                 f"   ({raw['num_allocs']} made, {raw['num_frees']} freed)")
    lines.append(f"  {'on the device':<24}{_fmt(raw['device_bytes']):>14}")
    lines.append(f"  {'in host memory':<24}{_fmt(raw['host_bytes']):>14}"
                 f"   (sleeping tags: {', '.join(map(repr, raw['sleeping_tags'])) or 'none'})")
    budget = raw.get("budget_bytes")
    lines.append(f"  {'budget':<24}{(_fmt(budget) if budget is not None else 'none'):>14}")
    lines.append(f"  {'fragmentation':<24}{raw['fragmentation']:>14.3f}")
    lines.append(f"  {'retries / OOMs':<24}{raw['num_alloc_retries']:>7} / {raw['num_ooms']}")
    return "\n".join(lines) + "\n"


__all__ = [
    "use",
    "is_process_wide",
    "MemPool",
    "pool",
    "pools",
    "memory_stats",
    "memory_allocated",
    "max_memory_allocated",
    "memory_reserved",
    "max_memory_reserved",
    "reset_peak_memory_stats",
    "empty_cache",
    "memory_summary",
    "register_nccl",
    "nccl_registered",
    "NcclRegistration",
]
