"""PyTorch's private memory pools answered by vmmbuf, for the process-wide
mode: what ``torch.compile(mode="reduce-overhead")``'s CUDA graph trees ask
of the allocator.

Graph trees record and replay CUDA graphs in one private pool and ask the
allocator three things PyTorch routes to no pluggable allocator (each
raises "does not yet support" under one):

- ``torch._C._cuda_checkPoolLiveAllocations(device, pool, ptrs)``: are the
  pool's live allocations exactly these?
- ``torch._C._cuda_getCheckpointState(device, pool)``: a checkpoint of the
  pool, taken after each graph is recorded;
- ``torch._C._cuda_setCheckpointPoolState(device, state, stale, live)``:
  the checkpoint made true again before the tree records on a path it had
  been replaying. The outputs of the graphs replayed since (tensors made
  over the graphs' addresses, owning nothing) live again at those
  addresses, and the live ones own their memory again (their storages get
  the allocator's deleter).

:func:`install` answers them from vmmbuf's plug-in, which notes which
allocations are made into which pool: a capture's (its pool named by the
capture hook of :mod:`vmmbuf._captures`), and a thread's between
``_cuda_beginAllocateCurrentThreadToPool`` (or the two other begin calls,
taken here as the calling thread's) and ``_cuda_endAllocateToPool``. A
checkpoint lists the pool's live allocations; restoring it takes each
block freed since again at its address (``vmmbuf::Arena::retake``: graphs
hold a freed output until CUDA destroys them, so it is still there, and
its next free waits for its earlier uses too), through PyTorch's own
``raw_alloc`` so that PyTorch's record of the allocation is whole.

Where memory comes from and when it is reused follow vmmbuf's rule for
graphs, stricter than a private pool's: a graph's blocks stay its own
until CUDA destroys it, so a later graph of the tree does not reuse the
blocks of an earlier one's dead outputs (more memory than PyTorch's
pool, never an overwrite).

A storage's deleter is set through :class:`StorageDeleters`, which finds
where a ``c10::StorageImpl`` keeps its data pointer by probing storages it
made itself (one owning, one not) and refuses to work, with the cause, if
what it finds is not the layout it knows. The logic here is pure (the
plug-in and PyTorch come in as :class:`Source`) and tested without a GPU.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

Pool = Tuple[int, int]


@dataclass(frozen=True)
class PoolCheckpoint:
    """A pool's live allocations at a checkpoint: (address, bytes asked)."""

    device: int
    pool: Pool
    blocks: Tuple[Tuple[int, int], ...]


@dataclass
class Source:
    """What :func:`install` answers from: the plug-in's pool bookkeeping,
    PyTorch's raw allocation calls, and storage deleters."""

    #: (device, pool) -> the pool's live allocations, (address, bytes).
    live: Callable[[int, Pool], List[Tuple[int, int]]]
    #: (device, pool): the calling thread allocates into the pool.
    pool_begin: Callable[[int, Pool], None]
    #: (device, pool): it no longer does.
    pool_end: Callable[[int, Pool], None]
    #: (address or None, pool): the thread's next allocation retakes it.
    retake_next: Callable[[Optional[int], Pool], None]
    #: (device, bytes) -> address, through PyTorch's allocator on the
    #: device's current stream.
    raw_alloc: Callable[[int, int], int]
    #: address -> None, through PyTorch's allocator.
    raw_delete: Callable[[int], None]
    #: storage impl -> frees its memory and makes it own nothing (PyTorch's
    #: ``_free_And_Remove_DeleterFn``).
    free_and_disown: Callable[[int], None]
    #: The deleters of storages (made at the first checkpoint restore).
    deleters: Callable[[], "Deleters"]


class Deleters:
    """Reads and sets the data pointer's deleter of a storage (a
    ``c10::StorageImpl`` address)."""

    def data_of(self, impl: int) -> int:  # pragma: no cover - interface
        raise NotImplementedError

    def own(self, impl: int) -> None:  # pragma: no cover - interface
        """The storage (owning nothing) owns its memory: freed through the
        allocator when it dies."""
        raise NotImplementedError

    def disown(self, impl: int) -> None:  # pragma: no cover - interface
        """The storage owns its memory no longer (nothing is freed)."""
        raise NotImplementedError


class StorageDeleters(Deleters):
    """:class:`Deleters` on real ``c10::StorageImpl`` objects.

    A ``c10::DataPtr`` is three words in the storage (the data address,
    the deleter function, the deleter's context, as libstdc++ lays out its
    ``unique_ptr``), at an offset that depends on the PyTorch build. The
    probe finds it: ``owning`` is a storage the allocator made (data ==
    context, a deleter that PyTorch calls standard), ``borrowed`` one made
    over the same address owning nothing (context 0, PyTorch's
    ``deleteNothing``). ``is_standard(impl)`` is PyTorch's
    ``_has_Standard_Deleter``; every change is checked with it.
    """

    WORDS = 12

    def __init__(self, owning: int, owning_data: int, borrowed: int,
                 is_standard: Callable[[int], bool],
                 peek: Optional[Callable[[int], Any]] = None) -> None:
        self._peek = peek or (lambda impl: (ctypes.c_uint64 * self.WORDS).from_address(impl))
        self._is_standard = is_standard
        w, b = self._peek(owning), self._peek(borrowed)
        found = [i for i in range(1, self.WORDS - 2)
                 if w[i] == owning_data and w[i + 2] == owning_data and w[i + 1]
                 and b[i] == owning_data and b[i + 2] == 0 and b[i + 1] and b[i + 1] != w[i + 1]]
        if len(found) != 1 or not is_standard(owning) or is_standard(borrowed):
            raise RuntimeError(
                "vmmbuf cannot restore CUDA graph trees' pool checkpoints with this PyTorch: a "
                "storage's data pointer is not laid out as vmmbuf knows it (data, deleter, "
                "context). Use torch.compile with "
                "torch._inductor.config.triton.cudagraph_trees = False, or vmmbuf.torch.pool()")
        self._at = found[0]
        self._deleter = int(w[self._at + 1])
        self._nothing = int(b[self._at + 1])

    def data_of(self, impl: int) -> int:
        return int(self._peek(impl)[self._at])

    def own(self, impl: int) -> None:
        w = self._peek(impl)
        i = self._at
        if w[i + 1] != self._nothing or w[i + 2] != 0:
            raise RuntimeError(" Not expecting deleter function")
        w[i + 2] = w[i]
        w[i + 1] = self._deleter
        if not self._is_standard(impl):
            w[i + 1], w[i + 2] = self._nothing, 0
            raise RuntimeError("vmmbuf: a storage's deleter did not take")

    def disown(self, impl: int) -> None:
        w = self._peek(impl)
        i = self._at
        if w[i + 1] == self._deleter:
            w[i + 1] = self._nothing
            w[i + 2] = 0


def _pool(pool: Any) -> Pool:
    return (int(pool[0]), int(pool[1]))


def check_live(src: Source, device: int, pool: Any, ptrs: Iterable[int]) -> bool:
    """PyTorch's ``checkPoolLiveAllocations``: the pool's live allocations
    are exactly ``ptrs``."""
    return {a for a, _ in src.live(int(device), _pool(pool))} == {int(p) for p in ptrs}


def checkpoint(src: Source, device: int, pool: Any) -> PoolCheckpoint:
    """PyTorch's ``getCheckpointState``."""
    d, p = int(device), _pool(pool)
    return PoolCheckpoint(d, p, tuple(src.live(d, p)))


def restore(src: Source, state: PoolCheckpoint, stale: Sequence[int],
            to_own: Sequence[int]) -> None:
    """PyTorch's ``setCheckpointPoolState``: the pool's live allocations
    become the checkpoint's. Those made since must belong to ``stale``
    storages (freed now, owning nothing after); those freed since are
    taken again at their addresses; each storage of ``to_own`` over one of
    the checkpoint's blocks owns it again. A failure to retake a block
    frees the ones retaken before it and changes nothing else."""
    d, p = state.device, state.pool
    now = dict(src.live(d, p))
    kept: Dict[int, int] = dict(state.blocks)
    deleters = src.deleters()
    stale_at: Dict[int, int] = {}
    for impl in stale:
        stale_at.setdefault(deleters.data_of(int(impl)), int(impl))
    made_since: Set[int] = set(now) - set(kept)
    if made_since - set(stale_at):
        # PyTorch's own words for this.
        raise RuntimeError(
            "Any stale tensors which are being manually freed must be passed to set checkpoint")
    retaken: List[int] = []
    try:
        for a in sorted(set(kept) - set(now)):
            src.retake_next(a, p)
            try:
                got = src.raw_alloc(d, kept[a])
            finally:
                src.retake_next(None, p)
            if got != a:
                src.raw_delete(got)
                raise RuntimeError(f"vmmbuf: retook {got:#x} for {a:#x}")
            retaken.append(a)
    except BaseException:
        for a in retaken:
            src.raw_delete(a)
        raise
    for a in sorted(made_since):
        src.free_and_disown(stale_at[a])
    for a, old in stale_at.items():
        if a in kept:
            deleters.disown(old)
    owners = {deleters.data_of(int(impl)): int(impl) for impl in to_own}
    for a in kept:
        owner = owners.get(a)
        if owner is not None:
            deleters.own(owner)


def install(torch_c: Any, src: Source) -> None:
    """Puts vmmbuf's answers in place of PyTorch's pool calls on
    ``torch_c`` (``torch._C``). Installing twice changes nothing more."""
    if getattr(torch_c, "_vmmbuf_pools_installed", False):
        return

    def noting(pytorchs: Optional[Callable[..., Any]], then: Callable[[int, Pool], None]
               ) -> Callable[..., None]:
        def call(device: Any, pool: Any, *args: Any) -> None:
            if pytorchs is not None:
                pytorchs(device, pool, *args)
            then(int(device), _pool(pool))
        return call

    for name in ("_cuda_beginAllocateCurrentThreadToPool", "_cuda_beginAllocateToPool",
                 "_cuda_beginAllocateCurrentStreamToPool"):
        if hasattr(torch_c, name):
            setattr(torch_c, name, noting(getattr(torch_c, name), src.pool_begin))
    torch_c._cuda_endAllocateToPool = noting(
        getattr(torch_c, "_cuda_endAllocateToPool", None), src.pool_end)
    pytorchs_restore = getattr(torch_c, "_cuda_setCheckpointPoolState", None)

    def set_checkpoint_pool_state(device: Any, state: Any, stale: Sequence[int],
                                  to_own: Sequence[int] = ()) -> None:
        if not isinstance(state, PoolCheckpoint) and pytorchs_restore is not None:
            pytorchs_restore(device, state, stale, to_own)
            return
        if not isinstance(state, PoolCheckpoint) or state.device != int(device):
            raise RuntimeError("vmmbuf: a checkpoint of another device or allocator")
        restore(src, state, stale, to_own)

    torch_c._cuda_checkPoolLiveAllocations = (
        lambda device, pool, ptrs: check_live(src, device, pool, ptrs))
    torch_c._cuda_getCheckpointState = lambda device, pool: checkpoint(src, device, pool)
    torch_c._cuda_setCheckpointPoolState = set_checkpoint_pool_state
    torch_c._vmmbuf_pools_installed = True


_HOOKED = "_vmmbuf_notes_capture_pools"


def hook_captures(cls: Any, stream_now: Callable[[], Any], new_pool: Callable[[], Any],
                  note: Callable[[Any, Any], None]) -> bool:
    """Wraps ``cls.capture_begin`` (PyTorch's ``torch._C._CUDAGraph``,
    called as ``capture_begin(pool=None, capture_error_mode=...)``) so that
    once a capture has begun, ``note(stream, pool)`` tells the plug-in which
    pool it allocates into. A capture given no pool gets a new one from
    ``new_pool()`` (PyTorch's ``graph_pool_handle``), as PyTorch would make
    one, so that its id is known during the capture (``graph.pool()`` is not
    until its end). False, changing nothing, if the class cannot be
    wrapped; True once it is."""
    begin = getattr(cls, "capture_begin", None)
    if begin is None:
        return False
    if getattr(begin, _HOOKED, False):
        return True

    def capture_begin(self: Any, *args: Any, **kwargs: Any) -> Any:
        stream = stream_now()
        if args:
            pool, args = args[0], args[1:]
        else:
            pool = kwargs.pop("pool", None)
        if pool is None or tuple(pool) == (0, 0):
            pool = new_pool()
        result = begin(self, pool, *args, **kwargs)
        note(stream, pool)
        return result

    capture_begin.__doc__ = begin.__doc__
    setattr(capture_begin, _HOOKED, True)
    try:
        setattr(cls, "capture_begin", capture_begin)
    except (AttributeError, TypeError):
        return False
    return True
