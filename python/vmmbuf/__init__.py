"""vmmbuf: growable GPU memory on CUDA's virtual memory management API.

- ``vmmbuf.torch``: vmmbuf as PyTorch's CUDA allocator, for the whole
  process (``use()``) or for a scope (``MemPool()`` with
  ``torch.cuda.use_mem_pool``); PyTorch-named statistics; sleep and wake.
- ``vmmbuf.torch_memory_saver``: torch_memory_saver's interface
  (``region``, ``pause``, ``resume``), so switching is an import.
- ``vmmbuf.vllm``: vLLM's sleep-mode allocator interface (``CuMemAllocator``:
  ``use_memory_pool(tag)``, ``sleep(offload_tags)``, ``wake_up(tags)``).
- ``vmmbuf.GrowableTensor``: a tensor that grows in place at a stable
  address, handed to PyTorch, CuPy and NumPy through DLPack without a copy.
- ``vmmbuf.cupy``: vmmbuf as CuPy's allocator.

Tags (``tag(name)``) and budgets are shared by all of these: allocations a
thread makes inside ``tag("weights")`` can be put to sleep together. Every
failure raises a ``vmmbuf.errors`` exception with its cause; the library
also logs to stderr (``VMMBUF_LOG=info`` for more, ``off`` for none).
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Dict, Iterable, Iterator, Optional, Union

import warnings

try:
    from . import _native
except ImportError as _e:  # pragma: no cover - depends on how it is run
    import os as _os

    _here = _os.path.dirname(_os.path.abspath(__file__))
    if _os.path.exists(_os.path.join(_here, "..", "..", "vmmbuf-torch", "Cargo.toml")):
        raise ImportError(
            f"vmmbuf: {_here} is the source folder, which has no compiled native module. "
            "Install the package (pip install .) and run Python from outside the "
            "repository's python/ folder, or build it in place with maturin develop."
        ) from _e
    raise
from . import _check, errors
from .errors import (
    CapacityError,
    DriverError,
    InvalidArgumentError,
    NoDeviceError,
    OutOfMemoryError,
    UnsupportedError,
    VmmbufError,
)
from .tensor import GrowableTensor

__version__: str = _native.__version__

Tags = Union[None, str, Iterable[Optional[str]]]


def library_path() -> str:
    """The path of the library that holds both this package's native code
    and the C entry points PyTorch loads (``vmmbuf_malloc``/``vmmbuf_free``)."""
    path = _native.__file__
    if path is None:  # pragma: no cover - a built-in module has no file
        raise UnsupportedError("the native module has no file to hand PyTorch")
    return str(path)


def set_tag(name: Optional[str]) -> None:
    """Allocations this thread makes from now on carry ``name`` ("" or None:
    the default tag). Other threads keep theirs."""
    _native.set_tag(_check.tag("name", name))


def get_tag() -> str:
    """This thread's tag ("" for none)."""
    return _native.get_tag()


@contextlib.contextmanager
def tag(name: Optional[str]) -> Iterator[None]:
    """Allocations this thread makes inside the block carry ``name``; the
    previous tag comes back on exit. Per thread, as ``use_mem_pool``."""
    name = _check.tag("name", name)
    prev = _native.get_tag()
    _native.set_tag(name)
    try:
        yield
    finally:
        _native.set_tag(prev)


def _each(tags: Tags, what: str) -> Iterable[Optional[str]]:
    """The tags to act on; a named tag that has no memory anywhere is
    warned about (a misspelt tag would otherwise do nothing silently)."""
    each = _check.tags(tags)
    named = [t for t in each if t is not None]
    if named:
        known = set(_native.tags())
        for t in named:
            if t not in known:
                have = ", ".join(repr(k) for k in sorted(known)) or "none yet"
                which = f"{t!r}" if t else "'' (the default tag)"
                warnings.warn(
                    f"vmmbuf.{what}: no memory is tagged {which} (tags with memory: {have}); "
                    "nothing to do for it",
                    UserWarning,
                    stacklevel=3,
                )
    return each


def sleep(tags: Tags = None, *, mode: Optional[str] = None, discard: bool = False,
          reachable: bool = True) -> int:
    """Puts the allocations of ``tags`` (a tag, a list, or None for every
    tag, untagged included) to sleep and gives their device memory back;
    every tensor keeps its address. ``mode`` says what becomes of the data
    (the one spelling of the Rust ``SleepMode`` and the C functions' mode
    numbers):

    - ``"keep"`` (the default): the data moves to pinned host memory mapped
      at the tensors' addresses, so they stay valid while asleep (kernels
      and the CPU reach them over the bus);
    - ``"stash"``: the data is copied to pinned host memory kept away from
      the tensors (a stash reused from sleep to sleep) and their ranges are
      unmapped until ``wake``, as torch_memory_saver's and vLLM's backups
      leave them: one copy each way, the fastest;
    - ``"discard"``: nothing is copied and the contents are lost (KV
      caches, activations);
    - ``"pageable"``: the data is copied to pageable host memory of its own
      (no pinned memory; torch_memory_saver's ``cpu_backup_backend="mmap"``)
      and the ranges are unmapped until ``wake``, which gives that memory
      back to the system: the process's resident memory grows while asleep
      and falls at the wake. Slower copies than ``"stash"``;
    - ``"disk"``: as ``"pageable"``, in files of the directory
      ``set_spill_dir`` names (one per chunk, removed at the wake), for data
      larger than host memory allows; refused without one.

    ``discard=True`` and ``reachable=False`` are the older spellings of
    ``"discard"`` and ``"stash"``; with ``mode`` given they must agree with
    it. Touching an unmapped tensor before ``wake`` faults. Waits only for
    the streams that used the memory (once for the whole device where a
    free's deferred fence lies on a stream no live tensor uses any more).
    The pinned host memory is taken from
    what the last sleep left (see ``prepare_sleep`` and
    ``release_host_cache``). Returns the bytes put to sleep."""
    m = _mode(mode, _check.flag("discard", discard), _check.flag("reachable", reachable))
    return sum(_native.sleep(t, m)[0] for t in _each(tags, "sleep"))


def wake(tags: Tags = None, *, zero: bool = False, restore_free: bool = False) -> int:
    """Wakes the allocations of ``tags`` (None: every tag's) at the same
    addresses: kept data comes back to the GPU; discarded memory is mapped
    afresh, its contents undefined unless ``zero=True``. The pinned host
    memory a kept sleep used stays cached for the next sleep. With
    ``restore_free=True`` the free memory the sleep gave back (vmmbuf's
    cache) is mapped again too, so the footprint is the one before the
    sleep and the next allocations map nothing (best effort: what the
    device cannot hold stays unmapped). Returns the bytes woken."""
    zero = _check.flag("zero", zero)
    restore_free = _check.flag("restore_free", restore_free)
    return sum(_native.wake(t, zero, False, restore_free)[0] for t in _each(tags, "wake"))


def prepare_sleep(tags: Tags = None, *, wait: bool = False, mode: Optional[str] = None,
                  reachable: bool = True) -> int:
    """Pins, ahead of the first ``sleep`` that keeps the data (with the same
    ``mode``, ``"keep"`` or ``"stash"``; ``reachable=False`` is ``"stash"``),
    the host memory it will take (pinning costs ~0.3 s per GiB; a
    steady-state sleep pins nothing). By default on a thread of its own
    while the GPU keeps working (the next sleep waits for it) and returns 0;
    with ``wait=True`` returns the bytes pinned."""
    wait = _check.flag("wait", wait)
    m = _mode(mode, False, _check.flag("reachable", reachable))
    return sum(_native.prepare_sleep(t, wait, m) for t in _each(tags, "prepare_sleep"))


def _mode(mode: Optional[str], discard: bool, reachable: bool) -> str:
    """The sleep mode ``mode`` names, or the older keywords do; refused in
    words when they disagree or ``mode`` is not one of them."""
    implied = "discard" if discard else ("keep" if reachable else "stash")
    if mode is None:
        return implied
    modes = _native.sleep_modes()
    if mode not in modes:
        raise InvalidArgumentError(
            f"mode {mode!r}: one of " + ", ".join(repr(m) for m in modes))
    if (discard or not reachable) and implied != mode:
        raise InvalidArgumentError(
            f"mode {mode!r} and discard={discard}, reachable={reachable} disagree")
    return mode


def set_spill_dir(path: Optional[str], file_bytes: Optional[int] = None) -> None:
    """The directory (which must exist) where ``sleep(mode="disk")`` writes
    its files, for every tag and device; None: none (such a sleep is then
    refused). ``file_bytes``: the most bytes one file holds (a chunk larger
    than that is written to several files); None: a file per chunk. Files
    of a sleep already made stay where they are until its wake."""
    if path is not None and (not isinstance(path, str) or not path):
        raise InvalidArgumentError(f"set_spill_dir takes a path or None, not {path!r}")
    if path is not None and not os.path.isdir(path):
        raise InvalidArgumentError(f"set_spill_dir: {path!r} is not a directory")
    most = 0 if file_bytes is None else _check.integer("file_bytes", file_bytes, minimum=1,
                                                       maximum=(1 << 63) - 1)
    _native.set_spill_dir(path, most)


def release_host_cache() -> int:
    """Gives back the pinned host memory kept between sleeps (on every
    device; a tag asleep with ``reachable=False`` keeps its own until it
    wakes); returns the bytes."""
    return _native.release_host_cache()


def set_host_cache_limit(bytes: int) -> None:
    """Bounds the pinned host memory each device keeps between sleeps;
    what is above it goes back at once (0 keeps none)."""
    _native.set_host_cache_limit(_check.integer("bytes", bytes, maximum=_check.MAX_LIMIT))


def _device(device: Union[None, int, str]) -> int:
    """``device`` (checked: an integer naming a device this machine has; a
    string is refused with the reason), or the current CUDA
    device where PyTorch is loaded and has one (each rank of a multi-GPU job
    works on its own), else 0."""
    if device is not None:
        return _check.device(device, _native.device_count())
    import sys
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return int(torch.cuda.current_device())
    return 0


def stats(device: Union[None, int, str] = None) -> Dict[str, Any]:
    """The device's statistics (PyTorch's key names for the byte counters,
    plus ``host_bytes``, ``device_bytes``, ``sleeping_tags``,
    ``peer_access`` (whether chunks are mapped for the other GPUs: once the
    process allocates on a second GPU, or with
    ``VMMBUF_TORCH_PEER_ACCESS=1``), ...), and
    what the live GrowableTensors there hold (``growable_tensors``,
    ``growable_bytes`` in use, ``growable_mapped_bytes``); empty before
    anything was allocated there. ``device``: the current CUDA device by
    default (see :func:`empty_cache`); ``"cpu"`` for GrowableTensors in
    host memory."""
    from .tensor import figures

    if device == "cpu":
        return figures(None)
    dev = _device(device)
    text = _native.stats_json(dev)
    out: Dict[str, Any] = json.loads(text) if text else {}
    out.update(figures(dev))
    return out


def set_budget(bytes: int, device: Optional[int] = None) -> None:
    """Caps the bytes vmmbuf maps on ``device`` (the current CUDA device by
    default), all tags together; at the cap every tag's cached memory is
    given back before an allocation fails. At any time: what is mapped past
    a new, lower budget stays mapped until it goes back (as PyTorch's
    ``set_per_process_memory_fraction`` treats memory already reserved)."""
    _native.set_budget(_device(device), _check.integer("bytes", bytes, maximum=_check.MAX_LIMIT))


def empty_cache(device: Optional[int] = None) -> None:
    """Gives the device's cached (free but mapped) memory back to the
    driver. ``device``: the current CUDA device where PyTorch is loaded and
    initialised (so that each rank of a multi-GPU job reaches its own), else
    0."""
    _native.empty_cache(_device(device))


def reset_peak(device: Optional[int] = None) -> None:
    """Sets every peak statistic of the device (the current CUDA device by
    default) to its current value."""
    _native.reset_peak(_device(device))


def device_count() -> int:
    """CUDA devices this process can use (0 without a driver)."""
    return _native.device_count()


def last_error() -> Optional[str]:
    """The last failure of the C entry points on this thread (what PyTorch
    saw as a failed allocation), in words; None if none."""
    return _native.last_error()


__all__ = [
    "GrowableTensor",
    "library_path",
    "set_tag",
    "get_tag",
    "tag",
    "sleep",
    "wake",
    "prepare_sleep",
    "release_host_cache",
    "set_host_cache_limit",
    "set_spill_dir",
    "stats",
    "set_budget",
    "empty_cache",
    "reset_peak",
    "last_error",
    "device_count",
    *errors.__all__,
]
