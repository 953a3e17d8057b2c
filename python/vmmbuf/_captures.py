"""Announcing CUDA graph captures to the plug-in.

Unless told of captures, vmmbuf's malloc and free ask the driver at every
call whether the stream is being captured (``cuStreamIsCapturing``: twice
per malloc/free pair, 0.4-0.7 us each with a training step's cold caches).
PyTorch's own cache asks only while a capture it was told of is under way.
:func:`hook` gives vmmbuf the same: it wraps a graph class's
``capture_begin`` and ``capture_end`` (PyTorch's ``torch._C._CUDAGraph``,
which ``torch.cuda.CUDAGraph``, ``torch.cuda.graph``, ``make_graphed_callables``
and ``torch.compile``'s CUDA graphs all go through) so that each capture is
counted, and then tells the plug-in that captures are announced.

Every doubt keeps the plug-in asking, which is correct and only slower: a
``capture_begin`` that raises leaves its count up, and so does a
``capture_end`` that raises while its stream is still captured.

This module does not import torch: :mod:`vmmbuf.torch` passes in the class
and how to ask a stream (tests pass stand-ins).
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Dict, Tuple

from . import _native

_HOOKED = "_vmmbuf_announces_captures"


def hook(cls: Any, stream_now: Callable[[], Any], capturing: Callable[[Any], bool]) -> bool:
    """Wraps ``cls.capture_begin`` and ``cls.capture_end`` to announce each
    capture to the plug-in, then announces captures. ``stream_now()`` names
    the stream a capture begins on (the current one, for PyTorch);
    ``capturing(stream)`` says whether it is still captured. Returns False,
    changing nothing, if the class cannot be wrapped; True once it is
    (again: a second call changes nothing)."""
    begin = getattr(cls, "capture_begin", None)
    end = getattr(cls, "capture_end", None)
    if begin is None or end is None:
        return False
    if getattr(begin, _HOOKED, False):
        return True
    lock = threading.Lock()
    # Captures begun through the wrapper and not yet ended: graph id ->
    # (graph, its stream). A capture_end of any other graph changes no count.
    begun: Dict[int, Tuple[Any, Any]] = {}

    @functools.wraps(begin)
    def capture_begin(self: Any, *args: Any, **kwargs: Any) -> Any:
        stream = stream_now()
        # Counted before the capture begins: no allocation in it can miss it.
        _native.capture_begins()
        # If this raises, the count stays up (the capture may have begun).
        result = begin(self, *args, **kwargs)
        with lock:
            begun[id(self)] = (self, stream)
        return result

    @functools.wraps(end)
    def capture_end(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            result = end(self, *args, **kwargs)
        except BaseException:
            with lock:
                entry = begun.get(id(self))
            # Ended anyway (an invalidated capture ends with an error), or
            # refused before ending (another stream): ask its stream.
            if entry is not None and not capturing(entry[1]):
                _ended(begun, lock, self)
            raise
        _ended(begun, lock, self)
        return result

    setattr(capture_begin, _HOOKED, True)
    setattr(capture_end, _HOOKED, True)
    try:
        setattr(cls, "capture_begin", capture_begin)
        setattr(cls, "capture_end", capture_end)
    except (AttributeError, TypeError):
        # A class that refuses new attributes: put back what was changed.
        try:
            setattr(cls, "capture_begin", begin)
        except (AttributeError, TypeError):
            pass
        return False
    _native.announce_captures()
    return True


def _ended(begun: Dict[int, Tuple[Any, Any]], lock: threading.Lock, graph: Any) -> None:
    with lock:
        entry = begun.pop(id(graph), None)
    if entry is not None:
        _native.capture_ends()


def state() -> Tuple[bool, int]:
    """``(announced, captures under way)`` as the plug-in counts them."""
    return _native.captures()
