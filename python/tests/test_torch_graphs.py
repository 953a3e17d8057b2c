"""CUDA graph trees' pool calls answered from vmmbuf (the process-wide
mode's bridge), without a GPU or PyTorch: a model of the plug-in (pool
membership, blocks graphs hold after a free) and storages laid out in real
memory as ``c10::StorageImpl`` keeps them. A checkpoint's restore makes the
pool's live allocations the checkpoint's, owning storages own their memory
again, and a failure changes nothing."""

from __future__ import annotations

import ctypes
import random
import types
from typing import Any, Dict, List, Optional, Set, Tuple

import pytest

from vmmbuf import _torch_graphs
from vmmbuf._torch_graphs import PoolCheckpoint, StorageDeleters

STANDARD, NOTHING, OTHER = 0xA11C, 0x0DE1, 0xBEEF
AT = 2  # words before the data pointer (vtable, reference counts)


class Storages:
    """Storages in real memory: word AT the data address, AT+1 the deleter,
    AT+2 its context; ``impl`` is the address of the words."""

    def __init__(self, at: int = AT) -> None:
        self.at = at
        self.mem: Dict[int, Any] = {}

    def make(self, data: int, owning: bool, ctx: Optional[int] = None) -> int:
        w = (ctypes.c_uint64 * StorageDeleters.WORDS)()
        w[0], w[1] = 0x7777, 1
        w[self.at] = data
        w[self.at + 1] = STANDARD if owning else NOTHING
        w[self.at + 2] = (data if ctx is None else ctx) if owning else 0
        impl = ctypes.addressof(w)
        self.mem[impl] = w
        return impl

    def standard(self, impl: int) -> bool:
        return bool(self.mem[impl][self.at + 1] == STANDARD)

    def deleters(self) -> StorageDeleters:
        own = self.make(0x5000, True)
        return StorageDeleters(own, 0x5000, self.make(0x5000, False), self.standard)


def test_the_probe_finds_the_data_pointer_and_sets_its_deleter() -> None:
    for at in (1, 2, 3, 6):
        st = Storages(at)
        d = st.deleters()
        s = st.make(0x9000, owning=False)
        assert d.data_of(s) == 0x9000 and not st.standard(s)
        d.own(s)
        assert st.standard(s) and st.mem[s][at + 2] == 0x9000, "context = data, as PyTorch's"
        with pytest.raises(RuntimeError, match="Not expecting deleter function"):
            d.own(s)
        d.disown(s)
        assert not st.standard(s) and st.mem[s][at + 2] == 0
        assert [st.mem[s][i] for i in range(at)] == [0x7777, 1][:at] + [0] * max(0, at - 2), \
            "nothing before the data pointer changed"


def test_the_probe_refuses_a_layout_it_does_not_know() -> None:
    st = Storages()
    own = st.make(0x5000, True, ctx=0x1234)  # context is not the data address
    with pytest.raises(RuntimeError, match="cudagraph_trees = False"):
        StorageDeleters(own, 0x5000, st.make(0x5000, False), st.standard)
    own = st.make(0x5000, True)
    with pytest.raises(RuntimeError, match="not laid out"):
        # PyTorch calls the borrowed one standard: not what vmmbuf knows.
        StorageDeleters(own, 0x5000, st.make(0x5000, False), lambda impl: True)


class Plugin:
    """The plug-in as the bridge sees it: live allocations by pool, blocks
    graphs hold after a free (retakable), PyTorch's raw calls."""

    def __init__(self, storages: Storages) -> None:
        self.storages = storages
        self.live: Dict[int, Tuple[Tuple[int, int], int]] = {}
        self.held: Set[int] = set()
        self.request: Optional[Tuple[int, Tuple[int, int]]] = None
        self.next = 0x10_0000
        self.calls: List[str] = []

    def alloc(self, pool: Tuple[int, int], n: int) -> int:
        a, self.next = self.next, self.next + 0x1000
        self.live[a] = (pool, n)
        return a

    def free(self, a: int) -> None:
        del self.live[a]
        self.held.add(a)

    def source(self) -> _torch_graphs.Source:
        def live(d: int, pool: Tuple[int, int]) -> List[Tuple[int, int]]:
            return sorted((a, n) for a, (p, n) in self.live.items() if p == pool)

        def retake_next(a: Optional[int], pool: Tuple[int, int]) -> None:
            self.request = None if a is None else (a, pool)

        def raw_alloc(d: int, n: int) -> int:
            assert self.request is not None, "a retake without a request"
            a, pool = self.request
            self.request = None
            if a not in self.held:
                raise RuntimeError(f"no block held at {a:#x}")
            self.held.remove(a)
            self.live[a] = (pool, n)
            self.calls.append(f"retake {a:#x}")
            return a

        def raw_delete(a: int) -> None:
            self.calls.append(f"delete {a:#x}")
            self.free(a)

        def free_and_disown(impl: int) -> None:
            self.calls.append(f"free {self.storages.mem[impl][AT]:#x}")
            self.free(self.storages.mem[impl][AT])
            self.storages.mem[impl][AT + 1] = NOTHING
            self.storages.mem[impl][AT + 2] = 0

        deleters = self.storages.deleters()
        return _torch_graphs.Source(
            live=live, pool_begin=lambda d, p: None, pool_end=lambda d, p: None,
            retake_next=retake_next, raw_alloc=raw_alloc, raw_delete=raw_delete,
            free_and_disown=free_and_disown, deleters=lambda: deleters)


POOL = (0, 5)


def test_a_restore_makes_the_pools_live_allocations_the_checkpoints() -> None:
    rng = random.Random(7)
    for _ in range(40):
        st = Storages()
        pl = Plugin(st)
        src = pl.source()
        blocks = [pl.alloc(POOL, rng.randrange(1, 1 << 20)) for _ in range(rng.randrange(1, 9))]
        other = pl.alloc((0, 9), 4096)  # another pool's: untouched
        cp = _torch_graphs.checkpoint(src, 0, POOL)
        assert [a for a, _ in cp.blocks] == sorted(blocks)
        assert _torch_graphs.check_live(src, 0, POOL, blocks)
        # Replays went on: some outputs died (freed, held by their graphs),
        # live ones are tensors owning nothing; later allocations of the
        # pool belong to stale storages.
        freed = [a for a in blocks if rng.random() < 0.6]
        for a in freed:
            pl.free(a)
        assert not _torch_graphs.check_live(src, 0, POOL, blocks) or not freed
        later = [pl.alloc(POOL, 512) for _ in range(rng.randrange(0, 3))]
        stale = [st.make(a, owning=True) for a in later]
        alive = [a for a in blocks if rng.random() < 0.7]
        owners = [st.make(a, owning=False) for a in alive]
        _torch_graphs.restore(src, cp, stale, owners)
        assert _torch_graphs.check_live(src, 0, POOL, blocks), "the checkpoint's allocations"
        assert dict(_torch_graphs.checkpoint(src, 0, POOL).blocks) == dict(cp.blocks), \
            "each with its size"
        assert all(st.standard(s) for s in owners), "live storages own their memory"
        assert not any(st.standard(s) for s in stale), "stale ones own nothing"
        assert other in pl.live and pl.live[other][0] == (0, 9)
        assert pl.request is None, "no retake request left behind"


def test_a_restore_refuses_later_allocations_without_their_stale_storages() -> None:
    st = Storages()
    pl = Plugin(st)
    src = pl.source()
    a = pl.alloc(POOL, 100)
    cp = _torch_graphs.checkpoint(src, 0, POOL)
    pl.free(a)
    b = pl.alloc(POOL, 100)
    before = (dict(pl.live), set(pl.held))
    with pytest.raises(RuntimeError, match="stale tensors"):
        _torch_graphs.restore(src, cp, [], [])
    assert (dict(pl.live), set(pl.held)) == before, "nothing changed"
    assert b in pl.live


def test_a_failed_retake_gives_back_what_it_retook() -> None:
    st = Storages()
    pl = Plugin(st)
    src = pl.source()
    a, b = pl.alloc(POOL, 100), pl.alloc(POOL, 200)
    cp = _torch_graphs.checkpoint(src, 0, POOL)
    pl.free(a)
    pl.free(b)
    pl.held.discard(b)  # its graph was destroyed: the block went back
    owner = st.make(a, owning=False)
    with pytest.raises(RuntimeError, match="no block held"):
        _torch_graphs.restore(src, cp, [], [owner])
    assert not _torch_graphs.check_live(src, 0, POOL, [a]) and a in pl.held
    assert pl.calls == [f"retake {a:#x}", f"delete {a:#x}"]
    assert not st.standard(owner) and pl.request is None


def test_install_replaces_pytorchs_pool_calls_once() -> None:
    st = Storages()
    pl = Plugin(st)
    seen: List[Tuple[str, Any]] = []
    noted: List[Tuple[str, int, Tuple[int, int]]] = []
    src = pl.source()
    src.pool_begin = lambda d, p: noted.append(("begin", d, p))
    src.pool_end = lambda d, p: noted.append(("end", d, p))
    torch_c = types.SimpleNamespace(
        _cuda_beginAllocateCurrentThreadToPool=lambda d, p: seen.append(("begin", p)),
        _cuda_endAllocateToPool=lambda d, p: seen.append(("end", p)),
        _cuda_setCheckpointPoolState=lambda *a: seen.append(("pytorch restore", a[1])),
        _cuda_checkPoolLiveAllocations=lambda *a: pytest.fail("PyTorch's own was called"),
    )
    _torch_graphs.install(torch_c, src)
    replaced = torch_c._cuda_checkPoolLiveAllocations
    _torch_graphs.install(torch_c, src)
    assert torch_c._cuda_checkPoolLiveAllocations is replaced, "installed once"
    torch_c._cuda_beginAllocateCurrentThreadToPool(0, [0, 5])
    a = pl.alloc(POOL, 64)
    torch_c._cuda_endAllocateToPool(0, (0, 5))
    assert seen == [("begin", [0, 5]), ("end", (0, 5))], "PyTorch's own still called"
    assert noted == [("begin", 0, POOL), ("end", 0, POOL)]
    assert torch_c._cuda_checkPoolLiveAllocations(0, POOL, {a})
    assert not torch_c._cuda_checkPoolLiveAllocations(0, POOL, set())
    cp = torch_c._cuda_getCheckpointState(0, POOL)
    assert isinstance(cp, PoolCheckpoint) and cp.blocks == ((a, 64),)
    pl.free(a)
    owner = st.make(a, owning=False)
    torch_c._cuda_setCheckpointPoolState(0, cp, [], [owner])
    assert st.standard(owner) and torch_c._cuda_checkPoolLiveAllocations(0, POOL, [a])
    torch_c._cuda_setCheckpointPoolState(0, "native state", [], [])
    assert seen[-1] == ("pytorch restore", "native state"), "a state PyTorch made goes to it"
    with pytest.raises(RuntimeError, match="another device"):
        torch_c._cuda_setCheckpointPoolState(1, cp, [], [])


def test_the_capture_hook_names_the_pool_after_the_capture_began() -> None:
    order: List[str] = []

    class Graph:
        def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
            order.append(f"begin {pool} {capture_error_mode}")

    fresh = iter([(0, 41), (0, 42)])

    def note(s: Any, pool: Any) -> None:
        order.append(f"note {tuple(pool)} on {s}")

    assert _torch_graphs.hook_captures(Graph, lambda: "stream 7", lambda: next(fresh), note)
    assert _torch_graphs.hook_captures(Graph, lambda: "other", lambda: (9, 9), note), \
        "hooked once"
    Graph().capture_begin()
    Graph().capture_begin(pool=(0, 3), capture_error_mode="thread_local")
    Graph().capture_begin((0, 0))
    Graph().capture_begin((1, 0), "relaxed")
    assert order == [
        "begin (0, 41) global", "note (0, 41) on stream 7",
        "begin (0, 3) thread_local", "note (0, 3) on stream 7",
        "begin (0, 42) global", "note (0, 42) on stream 7",
        "begin (1, 0) relaxed", "note (1, 0) on stream 7",
    ], "a capture without a pool gets a new one, known before its end"
    assert not _torch_graphs.hook_captures(types.SimpleNamespace(), lambda: 0, lambda: 0, note)
