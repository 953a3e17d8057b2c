"""PyTorch on vmmbuf: load the vmmbuf-torch library and make it PyTorch's
CUDA allocator. ctypes only, no build step.

    import vmmbuf_torch
    vmmbuf_torch.use()                 # before the first CUDA allocation
    ... train ...
    print(vmmbuf_torch.stats())        # PyTorch's key names

    with vmmbuf_torch.tag("weights"):  # allocations made here carry a tag
        model = make_model().cuda()
    vmmbuf_torch.sleep(["weights"])    # to host memory, same addresses
    vmmbuf_torch.wake(["weights"])     # back to the GPU

The library is found at $VMMBUF_TORCH_LIB, else next to this file's repo in
target/release, target/debug or .gpu/lib, the newest of them
(cargo build --release -p vmmbuf-torch).
"""
import contextlib
import ctypes
import json
import os
from pathlib import Path

_LIB = None
_PATH = None
NAME = "libvmmbuf_torch.so"


def find_library():
    """The path of the vmmbuf-torch shared library, or None."""
    env = os.environ.get("VMMBUF_TORCH_LIB")
    if env:
        return env if Path(env).is_file() else None
    root = Path(__file__).resolve().parent.parent
    found = [root / sub / NAME for sub in ("target/release", "target/debug", ".gpu/lib")]
    found = [p for p in found if p.is_file()]
    # The newest build: a stale release build must not shadow a fresh one.
    return str(max(found, key=lambda p: p.stat().st_mtime)) if found else None


def _lib():
    global _LIB, _PATH
    if _LIB is None:
        _PATH = find_library()
        if _PATH is None:
            raise FileNotFoundError(
                f"{NAME} not found: cargo build --release -p vmmbuf-torch, or set VMMBUF_TORCH_LIB")
        _LIB = ctypes.CDLL(_PATH)
        _LIB.vmmbuf_stats_json.restype = ctypes.c_char_p
        _LIB.vmmbuf_stats_json.argtypes = [ctypes.c_int]
        _LIB.vmmbuf_set_budget.argtypes = [ctypes.c_int, ctypes.c_uint64]
        _LIB.vmmbuf_set_budget.restype = ctypes.c_int
        _LIB.vmmbuf_reset_peak.argtypes = [ctypes.c_int]
        _LIB.vmmbuf_empty_cache.argtypes = [ctypes.c_int]
        _LIB.vmmbuf_empty_cache.restype = ctypes.c_int
        _LIB.vmmbuf_set_tag.argtypes = [ctypes.c_char_p]
        _LIB.vmmbuf_set_tag.restype = ctypes.c_int
        for f in (_LIB.vmmbuf_sleep, _LIB.vmmbuf_wake):
            f.argtypes = [ctypes.c_char_p]
            f.restype = ctypes.c_int64
    return _LIB


def use(budget_bytes=None, device=0):
    """Makes vmmbuf PyTorch's CUDA allocator (call before any CUDA tensor)."""
    lib = _lib()
    if budget_bytes is not None and lib.vmmbuf_set_budget(device, int(budget_bytes)) != 0:
        raise RuntimeError("the budget must be set before the first allocation")
    import torch
    alloc = torch.cuda.memory.CUDAPluggableAllocator(_PATH, "vmmbuf_malloc", "vmmbuf_free")
    torch.cuda.memory.change_current_allocator(alloc)


def parse_stats(text):
    """The stats JSON as a dict (empty for none)."""
    return json.loads(text) if text else {}


def stats(device=0):
    """The arena's statistics with PyTorch's key names."""
    raw = _lib().vmmbuf_stats_json(device)
    return parse_stats(raw.decode() if raw else "")


def reset_peak(device=0):
    _lib().vmmbuf_reset_peak(device)


def empty_cache(device=0):
    if _lib().vmmbuf_empty_cache(device) != 0:
        raise RuntimeError("vmmbuf_empty_cache failed (see the log)")


_TAG = ""


def set_tag(name):
    """Allocations from now on carry `name` ("" or None: no tag)."""
    global _TAG
    name = name or ""
    if _lib().vmmbuf_set_tag(name.encode()) != 0:
        raise ValueError(f"bad tag {name!r}")
    _TAG = name


@contextlib.contextmanager
def tag(name):
    """Allocations made inside the block carry `name`."""
    prev = _TAG
    set_tag(name)
    try:
        yield
    finally:
        set_tag(prev)


def _move(fn, tags):
    if tags is None:
        n = fn(None)
        if n < 0:
            raise RuntimeError(f"{fn.__name__} failed (see the log)")
        return n
    total = 0
    for t in tags:
        n = fn((t or "").encode())
        if n < 0:
            raise RuntimeError(f"{fn.__name__}({t!r}) failed (see the log)")
        total += n
    return total


def sleep(tags=None):
    """Moves the allocations of `tags` (None: all, untagged included) to pinned
    host memory at the same addresses; their device memory goes back to the
    driver. Tensors stay valid (kernels read them over the bus). Returns the
    bytes moved."""
    return _move(_lib().vmmbuf_sleep, tags)


def wake(tags=None):
    """Brings the allocations of `tags` (None: all) back to the GPU. Returns
    the bytes moved."""
    return _move(_lib().vmmbuf_wake, tags)
