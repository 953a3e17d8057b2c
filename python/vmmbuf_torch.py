"""PyTorch on vmmbuf: load the vmmbuf-torch library and make it PyTorch's
CUDA allocator. ctypes only, no build step.

    import vmmbuf_torch
    vmmbuf_torch.use()                 # before the first CUDA allocation
    ... train ...
    print(vmmbuf_torch.stats())        # PyTorch's key names

The library is found at $VMMBUF_TORCH_LIB, else next to this file's repo in
target/release or target/debug (cargo build --release -p vmmbuf-torch).
"""
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
    for sub in ("target/release", "target/debug", ".gpu/lib"):
        p = root / sub / NAME
        if p.is_file():
            return str(p)
    return None


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
