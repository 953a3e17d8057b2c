"""``torch.cuda.MemPool`` in the process-wide mode.

PyTorch makes every ``MemPool`` through its process allocator
(``createOrIncrefPool``), which a pluggable allocator refuses ("pluggable
does not yet support createOrIncrefPool"): once vmmbuf is the process's
allocator, no ``MemPool`` could be made, not even for a CUDA graph's pool
or a library's private scope. :func:`install` puts :class:`WidePool` in
its place: a private pool is a vmmbuf tag of its own (its memory is never
handed to another tag, as a pool's is never handed to another pool).

- ``torch.cuda.use_mem_pool(pool)`` allocates under the pool's tag on the
  calling thread, and tells the plug-in the thread allocates into the
  pool's id (what ``torch.cuda.memory_snapshot(pool.id)`` and CUDA graph
  trees read);
- ``pool.snapshot()`` and ``torch.cuda.memory_snapshot(pool.id)`` show the
  segments of the pool's tag, each with ``segment_pool_id`` = the pool's id;
- ``torch.cuda.empty_cache()`` leaves a live pool's cache alone, as
  PyTorch does; the pool's end gives it back;
- a pool over another allocator (``MemPool(allocator)``) is refused with
  the cause: every allocation of the process goes to vmmbuf, none could go
  to that allocator.

The class and the scope take their plug-in calls from :class:`Natives`, so
they are tested without a GPU.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from .errors import UnsupportedError

Pool = Tuple[int, int]


@dataclass
class Natives:
    """The calls a :class:`WidePool` makes."""

    #: A new pool id, as PyTorch numbers user pools (``graph_pool_handle``).
    new_id: Callable[[], Any]
    #: The calling thread's tag, and setting it.
    get_tag: Callable[[], str]
    set_tag: Callable[[str], None]
    #: (device, pool): the thread allocates into the pool, and stops.
    pool_begin: Callable[[int, Pool], None]
    pool_end: Callable[[int, Pool], None]
    #: (device, only these tags): their cached memory back to the driver.
    empty_tags: Callable[[int, List[str]], None]
    #: The device a pool is made on (PyTorch's current device).
    current_device: Callable[[], int]


_LOCK = threading.Lock()
# Live pools by tag: what empty_cache leaves alone, and what snapshots name.
_LIVE: "weakref.WeakValueDictionary[str, WidePool]" = weakref.WeakValueDictionary()


class WidePool:
    """``torch.cuda.MemPool`` while vmmbuf is the process's allocator (see
    the module). ``tag`` names the vmmbuf tag (default ``torch.MemPool<n>``
    for the pool numbered n)."""

    natives: Optional[Natives] = None

    def __init__(self, allocator: Any = None, use_on_oom: bool = False,
                 no_split: bool = False, tag: Optional[str] = None) -> None:
        if allocator is not None:
            raise UnsupportedError(
                "torch.cuda.MemPool(allocator): vmmbuf is this process's CUDA allocator "
                "(vmmbuf.torch.use()), so no allocation can go to another allocator. Make the "
                "pool without one (a vmmbuf tag of its own), or leave vmmbuf.torch.use() out "
                "and use vmmbuf.torch.pool() for vmmbuf's scopes")
        n = self._natives()
        pid = n.new_id()
        self._id: Pool = (int(pid[0]), int(pid[1]))
        self._tag = tag if tag is not None else f"torch.MemPool{self._id[1]}"
        self._device = int(n.current_device())
        self._scopes = 0
        self.use_on_oom, self.no_split = use_on_oom, no_split
        with _LOCK:
            _LIVE[self._tag] = self
        weakref.finalize(self, _end, n, self._device, self._tag)

    @classmethod
    def _natives(cls) -> Natives:
        if cls.natives is None:
            raise RuntimeError("vmmbuf's MemPool is made only once vmmbuf.torch.use() ran")
        return cls.natives

    @property
    def id(self) -> Pool:
        """The pool's id (PyTorch's ``MempoolId_t``)."""
        return self._id

    @property
    def allocator(self) -> None:
        """None: the process's allocator (vmmbuf) serves it."""
        return None

    @property
    def tag(self) -> str:
        """The vmmbuf tag its memory carries."""
        return self._tag

    def use_count(self) -> int:
        """1 for the pool, plus one per ``use_mem_pool`` scope open on it."""
        return 1 + self._scopes

    def snapshot(self, include_traces: bool = True) -> List[Dict[str, Any]]:
        """The pool's segments, as ``torch.cuda.memory_snapshot(pool.id)``."""
        import torch

        return list(torch.cuda.memory_snapshot(self._id))

    def __repr__(self) -> str:
        return f"vmmbuf MemPool(id={self._id}, tag={self._tag!r})"


def _end(n: Natives, device: int, tag: str) -> None:
    """A pool's end: its cache back to the driver, as PyTorch's pool's
    destructor empties it (memory still allocated stays allocated)."""
    try:
        n.empty_tags(device, [tag])
    except Exception:  # noqa: BLE001 - a finalizer must not raise
        pass


def pool_of_tag(tag: str) -> Optional[Pool]:
    """The id of the live pool whose tag this is, if any."""
    with _LOCK:
        p = _LIVE.get(tag)
    return None if p is None else p.id


def live_tags() -> List[str]:
    """The tags of the live pools."""
    with _LOCK:
        return list(_LIVE.keys())


@contextlib.contextmanager
def use(pool: WidePool, device: Optional[int] = None) -> Iterator[None]:
    """``torch.cuda.use_mem_pool(pool)``: the calling thread allocates under
    the pool's tag, and into its id, until the scope ends."""
    n = pool._natives()
    d = pool._device if device is None else int(device)
    prev = n.get_tag()
    n.set_tag(pool.tag)
    n.pool_begin(d, pool.id)
    pool._scopes += 1
    try:
        yield
    finally:
        pool._scopes -= 1
        n.pool_end(d, pool.id)
        n.set_tag(prev)


def label_segments(segments: List[Dict[str, Any]], mempool_id: Any = None
                   ) -> List[Dict[str, Any]]:
    """Segments of live pools' tags carry their pool's id; with
    ``mempool_id``, only the segments of that pool."""
    out = []
    for s in segments:
        pid = pool_of_tag(str(s.get("tag", "")))
        if pid is not None:
            s = dict(s, segment_pool_id=pid)
        if mempool_id is None or tuple(s.get("segment_pool_id", (0, 0))) == tuple(mempool_id):
            out.append(s)
    return out


def install(torch_mod: Any, natives: Natives) -> None:
    """``torch.cuda.MemPool`` and ``use_mem_pool`` become vmmbuf's (on
    ``torch.cuda`` and ``torch.cuda.memory``); a scope over a pool PyTorch
    made (before) still goes to PyTorch. Installing twice changes nothing."""
    WidePool.natives = natives
    cuda = torch_mod.cuda
    if getattr(cuda, "_vmmbuf_mempool_installed", False):
        return
    pytorchs_use = cuda.use_mem_pool

    @contextlib.contextmanager
    def use_mem_pool(pool: Any, device: Any = None) -> Iterator[None]:
        if isinstance(pool, WidePool):
            index = None if device is None else getattr(device, "index", device)
            with use(pool, None if index is None else int(index)):
                yield
        else:
            with pytorchs_use(pool, device):
                yield

    for mod in (cuda, getattr(cuda, "memory", None)):
        if mod is not None:
            mod.MemPool = WidePool
            mod.use_mem_pool = use_mem_pool
    cuda._vmmbuf_mempool_installed = True
