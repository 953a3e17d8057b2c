"""torch_memory_saver's interface on vmmbuf: switch by changing the import::

    # from torch_memory_saver import torch_memory_saver
    from vmmbuf.torch_memory_saver import torch_memory_saver

    with torch_memory_saver.region(tag="weights", enable_cpu_backup=True):
        model = build().cuda()
    torch_memory_saver.pause("weights")     # device memory given back
    torch_memory_saver.resume("weights")    # same addresses

``region`` allocates from a vmmbuf ``MemPool`` per tag (or, after
``vmmbuf.torch.use()``, from vmmbuf process-wide) and tags what it
allocates. ``pause`` gives the tag's device memory back, every tensor
keeping its address: with ``enable_cpu_backup=True`` the contents are copied
to a pinned host stash and the tensors' ranges are unmapped until
``resume`` copies them back (torch_memory_saver's behaviour, at copy speed:
``vmmbuf.sleep(tag, reachable=False)``); without it they are discarded, as
torch_memory_saver discards them, and ``resume`` maps fresh memory
(contents undefined). Touching a paused tensor faults, as it does under
torch_memory_saver; ``TorchMemorySaver(reachable=True)`` instead moves the
contents to pinned host memory at the same addresses, where kernels and the
CPU can still read them (a little slower). The pinned host memory stays
cached from one pause to the next (torch_memory_saver's
``retain_cpu_backup``, always on; see ``vmmbuf.release_host_cache``).
``sleep``/``wake`` are the same as
``pause``/``resume``.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Optional

from . import _check, _native
from . import torch as _vtorch

_TAG_DEFAULT = "default"


class TorchMemorySaver:
    """torch_memory_saver's ``TorchMemorySaver`` on vmmbuf."""

    def __init__(self, reachable: bool = False) -> None:
        """``reachable=True``: regions with a CPU backup stay readable while
        paused (moved to host memory at their addresses) instead of being
        stashed and unmapped."""
        self._cpu_backup: Dict[str, bool] = {}
        self._reachable = reachable

    @contextlib.contextmanager
    def region(self, tag: str = _TAG_DEFAULT, enable_cpu_backup: bool = False) -> Iterator[None]:
        """Tensors made inside can be paused with ``pause(tag)``."""
        tag = _check.tag("tag", tag)
        enable_cpu_backup = _check.flag("enable_cpu_backup", enable_cpu_backup)
        self._cpu_backup[tag] = self._cpu_backup.get(tag, False) or enable_cpu_backup
        if _vtorch.is_process_wide():
            prev = _native.get_tag()
            _native.set_tag(tag)
            try:
                yield
            finally:
                _native.set_tag(prev)
        else:
            with _vtorch.pool(tag):
                yield

    def _tags(self, tag: Optional[str]) -> List[str]:
        return sorted(self._cpu_backup) if tag is None else [_check.tag("tag", tag)]

    def pause(self, tag: Optional[str] = None) -> int:
        """Gives back the device memory of ``tag`` (None: every region's
        tag), keeping the contents in pinned host memory where the region
        asked for a CPU backup and discarding them otherwise; returns the
        bytes paused."""
        total = 0
        for t in self._tags(tag):
            backup = self._cpu_backup.get(t, False)
            total += _native.sleep(t, not backup, self._reachable if backup else True)[0]
        return total

    def resume(self, tag: Optional[str] = None) -> int:
        """Maps ``tag``'s memory (None: every region's) back at the same
        addresses; returns the bytes resumed."""
        return sum(_native.wake(t)[0] for t in self._tags(tag))

    @property
    def retain_cpu_backup(self) -> bool:
        """Always True: the pinned host memory stays cached between pauses
        (``vmmbuf.release_host_cache`` gives it back)."""
        return True

    sleep = pause
    wake = resume

    @property
    def enabled(self) -> bool:
        """Always True: vmmbuf needs no preload or hook mode."""
        return True


torch_memory_saver = TorchMemorySaver()
memory_saver = torch_memory_saver


def region(tag: str = _TAG_DEFAULT, enable_cpu_backup: bool = False) -> "contextlib.AbstractContextManager[None]":
    """``torch_memory_saver.region``."""
    return torch_memory_saver.region(tag, enable_cpu_backup)


def pause(tag: Optional[str] = None) -> int:
    """``torch_memory_saver.pause``."""
    return torch_memory_saver.pause(tag)


def resume(tag: Optional[str] = None) -> int:
    """``torch_memory_saver.resume``."""
    return torch_memory_saver.resume(tag)


sleep = pause
wake = resume

__all__ = ["TorchMemorySaver", "torch_memory_saver", "memory_saver", "region", "pause",
           "resume", "sleep", "wake"]
