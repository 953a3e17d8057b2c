"""vmmbuf as CuPy's allocator::

    import vmmbuf.cupy
    vmmbuf.cupy.use()          # cupy.cuda.set_allocator(vmmbuf.cupy.malloc)

Every CuPy array's memory then comes from vmmbuf's arena on the current
device, under the thread's tag. Frees are stream-ordered: an array's memory
is reused only after the work queued on the stream it was allocated on, and
on the stream current when it is freed, has finished (each allocation keeps
its stream object alive until then).
"""

from __future__ import annotations

import gc
import logging
from typing import Any, Optional

import cupy

from . import _native
from .errors import VmmbufError

_log = logging.getLogger(__name__)


class _Owner:
    """Frees its allocation when CuPy lets the memory go. It keeps the
    stream the memory was allocated on alive until then: vmmbuf orders the
    free after that stream's work, which needs the stream to exist.

    Keeping it alive is not always enough: when the stream and the memory
    are garbage in one reference cycle, the garbage collector runs their
    finalizers in any order, and CuPy's ``Stream.__del__`` destroys the
    CUDA stream (it leaves ``ptr`` set). A finalized stream is never
    touched: the free then waits for a device synchronisation instead
    (``free_stream_destroyed``)."""

    __slots__ = ("ptr", "size", "device", "stream")

    def __init__(self, ptr: int, size: int, device: int, stream: Any) -> None:
        self.ptr, self.size, self.device, self.stream = ptr, size, device, stream

    def __del__(self) -> None:
        try:
            if _gone(self.stream):
                _native.free_stream_destroyed(self.ptr, self.device)
                return
            with cupy.cuda.Device(self.device):
                current = cupy.cuda.get_current_stream()
            # The stream current at the free is ordered too, unless it is
            # being destroyed itself.
            stream = self.stream if _gone(current) else current
            _native.free(self.ptr, self.device, int(stream.ptr))
        except VmmbufError as e:  # logged by the library too; never raised from __del__
            _log.warning("vmmbuf: free of %#x failed: %s", self.ptr, e)
        except Exception as e:  # noqa: BLE001 - nothing may escape a finalizer
            _log.warning("vmmbuf: free of %#x failed: %r", self.ptr, e)


def _gone(stream: Any) -> bool:
    """Whether CuPy's finalizer has run on ``stream`` (its CUDA stream is
    destroyed then, unless it is one CuPy never destroys)."""
    return gc.is_finalized(stream)


def malloc(size: int) -> Any:
    """A ``cupy.cuda.MemoryPointer`` to ``size`` bytes from vmmbuf on the
    current device, for work on the current stream."""
    device = cupy.cuda.Device().id
    if size == 0:
        return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(0, 0, None, device), 0)
    # CuPy's pool hands out multiples of 512 bytes and code written for it
    # reads ``memptr.mem.size`` as such (CuPy's own test of percentile's
    # memory access asserts it); the same rounding costs at most 511 bytes.
    size = (size + 511) // 512 * 512
    stream = cupy.cuda.get_current_stream()
    ptr = _native.malloc(size, device, int(stream.ptr))
    mem = cupy.cuda.UnownedMemory(ptr, size, _Owner(ptr, size, device, stream), device)
    return cupy.cuda.MemoryPointer(mem, 0)


_PREVIOUS: Optional[Any] = None


def use() -> None:
    """Makes vmmbuf CuPy's allocator (``cupy.cuda.set_allocator``)."""
    global _PREVIOUS
    if _PREVIOUS is None:
        _PREVIOUS = cupy.cuda.get_allocator()
    cupy.cuda.set_allocator(malloc)


def restore() -> None:
    """Puts back the allocator CuPy had before ``use()``."""
    global _PREVIOUS
    if _PREVIOUS is not None:
        cupy.cuda.set_allocator(_PREVIOUS)
        _PREVIOUS = None


__all__ = ["malloc", "use", "restore"]
