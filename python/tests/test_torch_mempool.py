"""``torch.cuda.MemPool`` in the process-wide mode, without a GPU or
PyTorch: a pool is a vmmbuf tag of its own, ``use_mem_pool`` allocates
under it on the calling thread, snapshots name the pool's segments, a live
pool keeps its cache, and its end gives it back."""

from __future__ import annotations

import contextlib
import gc
import itertools
import threading
import types
from typing import Any, Iterator, List, Tuple

import pytest

from vmmbuf import _torch_mempool
from vmmbuf._torch_mempool import Natives, WidePool
from vmmbuf.errors import UnsupportedError


class Plugin:
    def __init__(self) -> None:
        self.ids = itertools.count(1)
        self.tag = threading.local()
        self.calls: List[Tuple[Any, ...]] = []

    def natives(self) -> Natives:
        return Natives(
            new_id=lambda: (0, next(self.ids)),
            get_tag=lambda: getattr(self.tag, "v", ""),
            set_tag=lambda t: setattr(self.tag, "v", t),
            pool_begin=lambda d, p: self.calls.append(("begin", d, p)),
            pool_end=lambda d, p: self.calls.append(("end", d, p)),
            empty_tags=lambda d, tags: self.calls.append(("empty", d, tuple(tags))),
            current_device=lambda: 0)


def _torch() -> Any:
    used: List[Any] = []

    @contextlib.contextmanager
    def use_mem_pool(pool: Any, device: Any = None) -> Iterator[None]:
        used.append(pool)
        yield

    memory = types.SimpleNamespace(MemPool=object, use_mem_pool=use_mem_pool)
    cuda = types.SimpleNamespace(MemPool=object, use_mem_pool=use_mem_pool, memory=memory)
    return types.SimpleNamespace(cuda=cuda, used=used)


def test_a_pool_is_a_tag_of_its_own_in_use_mem_pool_scopes() -> None:
    pl = Plugin()
    torch = _torch()
    _torch_mempool.install(torch, pl.natives())
    assert torch.cuda.MemPool is WidePool and torch.cuda.memory.MemPool is WidePool
    a, b = WidePool(), WidePool()
    assert a.id != b.id and a.id[0] == 0 and a.allocator is None, "PyTorch's user pool ids"
    assert (a.tag, a.use_count()) == (f"torch.MemPool{a.id[1]}", 1)
    seen: List[Tuple[str, int]] = []
    with torch.cuda.use_mem_pool(a):
        seen.append((pl.natives().get_tag(), a.use_count()))
        with torch.cuda.memory.use_mem_pool(b, device=0):
            seen.append((pl.natives().get_tag(), b.use_count()))
        seen.append((pl.natives().get_tag(), a.use_count()))
    seen.append((pl.natives().get_tag(), a.use_count()))
    assert seen == [(a.tag, 2), (b.tag, 2), (a.tag, 2), ("", 1)], "nested scopes put tags back"
    assert pl.calls == [("begin", 0, a.id), ("begin", 0, b.id), ("end", 0, b.id),
                        ("end", 0, a.id)]
    other = object()
    with torch.cuda.use_mem_pool(other):
        pass
    assert torch.used == [other], "a pool PyTorch made goes to PyTorch's scope"
    # Per thread: another thread's tag is its own.
    got: List[str] = []
    with torch.cuda.use_mem_pool(a):
        t = threading.Thread(target=lambda: got.append(pl.natives().get_tag()))
        t.start()
        t.join()
    assert got == [""]


def test_live_pools_keep_their_cache_and_name_their_segments_until_their_end() -> None:
    pl = Plugin()
    _torch_mempool.install(_torch(), pl.natives())
    a = WidePool()
    kept = WidePool(tag="kv")
    tags = set(_torch_mempool.live_tags())
    assert {a.tag, "kv"} <= tags
    segs = [{"tag": a.tag, "segment_pool_id": (0, 0)}, {"tag": "", "segment_pool_id": (0, 0)},
            {"tag": "kv", "segment_pool_id": (0, 0)}]
    out = _torch_mempool.label_segments(segs)
    assert [s["segment_pool_id"] for s in out] == [a.id, (0, 0), kept.id]
    assert _torch_mempool.label_segments(segs, a.id) == [dict(segs[0], segment_pool_id=a.id)]
    assert _torch_mempool.label_segments(segs, (0, 0)) == [segs[1]]
    tag, dev = a.tag, a._device
    del a
    gc.collect()
    assert ("empty", dev, (tag,)) in pl.calls, "its end gives its cache back"
    assert tag not in _torch_mempool.live_tags()
    assert _torch_mempool.pool_of_tag("kv") == kept.id


def test_a_pool_over_another_allocator_is_refused_with_the_cause() -> None:
    _torch_mempool.install(_torch(), Plugin().natives())
    with pytest.raises(UnsupportedError, match="no allocation can go to another allocator"):
        WidePool(allocator=object())
