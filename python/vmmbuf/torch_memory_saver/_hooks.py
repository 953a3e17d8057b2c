"""torch_memory_saver's hook modes on vmmbuf: how a region's allocations
are made (the thread's tag process-wide, a vmmbuf pool, or, in preload
mode, the CUDA runtime's allocations answered by vmmbuf's preload
library), and that library's file and attachment."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Dict, Iterator, Optional, Tuple

import torch

from .. import _native
from .. import tag as _tagged
from .. import torch as _vtorch
from ..errors import UnsupportedError


@contextlib.contextmanager
def _allocating_as(tag: str, preload: bool = False,
                   pools: Optional[Dict[Tuple[str, int], Any]] = None) -> Iterator[None]:
    """Allocations of this block carry the vmmbuf tag ``tag``: through the
    thread's tag where vmmbuf is the process's allocator; where it answers
    the CUDA runtime's allocations (``preload``), through the thread's tag
    and, given ``pools``, a PyTorch pool of the tag's own (made once per
    tag and device, kept in ``pools``), as torch_memory_saver's preload mode
    does: PyTorch's allocator then never carves a tensor made outside the
    region from a segment the region's ``cudaMalloc`` made (which a pause
    takes away); else a vmmbuf pool."""
    if _vtorch.is_process_wide():
        with _tagged(tag):
            yield
    elif preload:
        if pools is None:
            with _tagged(tag):
                yield
            return
        key = (tag, torch.cuda.current_device())
        pool = pools.get(key)
        if pool is None:
            pool = pools[key] = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(pool), _tagged(tag):
            yield
    else:
        with _vtorch.pool(tag):
            yield


# The preload library's file name starts with this (preload_library_path).
_PRELOAD_NAME = "libvmmbuf_preload-"


def preload_library_path() -> str:
    """Where vmmbuf's preload library is: written once from the package into
    a per-user cache folder (``$XDG_CACHE_HOME/vmmbuf``, else
    ``~/.cache/vmmbuf``), under a name that changes with its contents."""
    data = _native.preload_library()
    if data is None:
        raise UnsupportedError("hook_mode='preload' is built on Linux only")
    import hashlib
    import tempfile

    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    folder = os.path.join(base, "vmmbuf")
    path = os.path.join(folder, f"{_PRELOAD_NAME}{hashlib.sha256(data).hexdigest()[:16]}.so")
    if not os.path.exists(path):
        os.makedirs(folder, exist_ok=True)
        # Written whole under another name, then renamed: a process that
        # starts meanwhile never loads half a file.
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".so.part")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, 0o755)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
    return path


@contextlib.contextmanager
def configure_subprocess() -> Iterator[None]:
    """torch_memory_saver's ``configure_subprocess()``: processes started
    inside the block load vmmbuf's preload library (``LD_PRELOAD``, put
    first, the entries already there kept), for ``hook_mode='preload'``
    in them."""
    path = preload_library_path()
    before = os.environ.get("LD_PRELOAD")
    os.environ["LD_PRELOAD"] = path if not before else f"{path}:{before}"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("LD_PRELOAD", None)
        else:
            os.environ["LD_PRELOAD"] = before


def _attach_preload() -> None:
    """Points the preload library of this process at vmmbuf's native
    module; refused in words unless this process was started with it."""
    import ctypes

    from .. import library_path

    path = preload_library_path()
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_NOW)
    except OSError as e:
        raise UnsupportedError(
            "hook_mode='preload' needs this process started with vmmbuf's preload library "
            "(LD_PRELOAD): start it inside vmmbuf.torch_memory_saver.configure_subprocess()") from e
    lib.vmmbuf_preload_attach.argtypes = [ctypes.c_char_p]
    lib.vmmbuf_preload_attach.restype = ctypes.c_int
    if lib.vmmbuf_preload_attach(library_path().encode()) != 0:
        raise UnsupportedError("the preload library found no vmmbuf native module to answer it")
