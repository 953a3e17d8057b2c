"""vLLM's sleep-mode allocator interface on vmmbuf: switch by changing the
import::

    # from vllm.device_allocator.cumem import CuMemAllocator
    from vmmbuf.vllm import CuMemAllocator

    allocator = CuMemAllocator.get_instance()
    with allocator.use_memory_pool(tag="weights"):
        model = build().cuda()
    with allocator.use_memory_pool(tag="kv_cache"):
        kv = torch.empty(...)
    allocator.sleep(offload_tags=("weights",))   # level 1: weights to host, KV dropped
    allocator.wake_up()                          # same addresses; KV contents undefined

The same semantics as vLLM's ``CuMemAllocator``: tensors made inside
``use_memory_pool(tag)`` carry the tag (``None``: ``"default"``);
``sleep(offload_tags)`` gives back the device memory of every tag, copying
the contents of the tags in ``offload_tags`` to host memory first (``None``:
the default tag; ``()``: none, vLLM's level 2) and discarding the rest;
``wake_up(tags)`` maps the memory of ``tags`` (``None``: all) again at the
same addresses, restoring the offloaded contents; ``get_current_usage()``
is the bytes the pools hold. Each tag is a vmmbuf pool
(``vmmbuf.torch.pool``), put to sleep with ``vmmbuf.sleep(tag,
reachable=False)`` (one copy each way, through a pinned host stash kept
between sleeps) or ``discard=True``. Touching a sleeping tensor faults, as
under vLLM. A failed wake-up (out of memory) puts back to sleep what it
woke and raises ``RuntimeError`` with the cause, as vLLM does.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
from typing import Dict, Iterable, Iterator, List, Optional, Set, Tuple, Union

from . import _check
from . import sleep as _sleep
from . import wake as _wake
from . import torch as _vtorch
from .errors import InvalidArgumentError, VmmbufError


class CuMemAllocator:
    """vLLM's ``CuMemAllocator`` on vmmbuf: one per process
    (:meth:`get_instance`)."""

    instance: Optional["CuMemAllocator"] = None
    default_tag: str = "default"

    @staticmethod
    def get_instance() -> "CuMemAllocator":
        """The process's allocator (made on the first call)."""
        if CuMemAllocator.instance is None:
            CuMemAllocator.instance = CuMemAllocator()
        return CuMemAllocator.instance

    def __init__(self) -> None:
        """Use :meth:`get_instance`."""
        self.current_tag: str = CuMemAllocator.default_tag
        # Every tag used; and the tags asleep, with whether their contents
        # were kept.
        self._tags: Set[str] = set()
        self._asleep: Dict[str, bool] = {}

    @contextlib.contextmanager
    def use_memory_pool(self, tag: Optional[str] = None) -> Iterator[None]:
        """Tensors made inside come from the pool of ``tag`` (``None``: the
        default tag) and sleep with it. Cached free memory of the pools goes
        back to the driver when the block ends."""
        tag = CuMemAllocator.default_tag if tag is None else _check.tag("tag", tag)
        if not tag:
            raise InvalidArgumentError("tag must not be empty (it names a pool)")
        if tag in self._asleep:
            raise InvalidArgumentError(
                f"tag {tag!r} is asleep: wake_up() it before allocating in its pool")
        old = self.current_tag
        self.current_tag = tag
        try:
            with _vtorch.pool(tag):
                self._tags.add(tag)
                yield
        finally:
            self.current_tag = old
        _vtorch.empty_cache()

    def sleep(self, offload_tags: Union[None, str, Tuple[str, ...], List[str]] = None) -> None:
        """Gives back the device memory of every tag: the contents of the
        tags in ``offload_tags`` (``None``: the default tag; a tag; ``()``:
        none) are copied to host memory first, the rest discarded. A tag
        asleep already stays as it is."""
        if offload_tags is None:
            keep = {CuMemAllocator.default_tag}
        elif isinstance(offload_tags, str):
            keep = {offload_tags}
        else:
            keep = {_check.tag("offload_tags", t) for t in _iter(offload_tags)}
        slept = False
        for tag in self._tags:
            if tag in self._asleep:
                continue
            kept = tag in keep
            _put_to_sleep(tag, kept)
            self._asleep[tag] = kept
            slept = True
        if slept:
            gc.collect()
            _vtorch.empty_cache()

    def wake_up(self, tags: Optional[Iterable[str]] = None) -> None:
        """Maps the memory of ``tags`` (``None``: every tag asleep) again at
        the same addresses; offloaded contents come back, discarded ones are
        undefined. All or nothing: on a failure the tags woken by this call
        go back to sleep and ``RuntimeError`` says why."""
        want = None if tags is None else {_check.tag("tags", t) for t in _iter(tags)}
        which = [t for t in self._asleep if want is None or t in want]
        woken: List[str] = []
        for tag in which:
            try:
                _wake(tag)
            except VmmbufError as e:
                for back in woken:
                    _put_to_sleep(back, self._asleep[back])
                raise RuntimeError(f"CuMemAllocator.wake_up: waking {tag!r} failed: {e}") from e
            woken.append(tag)
        for tag in woken:
            del self._asleep[tag]

    def get_current_usage(self) -> int:
        """The bytes the pools hold from the driver's point of view of
        PyTorch: the segments of every tag's pool, asleep ones included."""
        total = 0
        for (tag, _device), pool in _vtorch.pools().items():
            if tag in self._tags:
                total += sum(int(s.get("total_size", 0)) for s in pool.snapshot())
        return total


def _put_to_sleep(tag: str, keep: bool) -> None:
    """``tag`` to sleep, its contents kept (stashed) or discarded. A pool
    whose tensors are all gone has nothing to sleep: vmmbuf's warning about
    a tag without memory (there for misspelt tags) is not for these."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        if keep:
            _sleep(tag, reachable=False)
        else:
            _sleep(tag, discard=True)


def _iter(value: Iterable[str]) -> List[str]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"expected a tuple or list of tags, not {type(value).__name__} ({value!r})")
    return list(value)


__all__ = ["CuMemAllocator"]
