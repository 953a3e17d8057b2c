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
CPU can still read them (a little slower). A region with a pinned backup
has that host memory pinned on a thread of its own as it ends
(``prepare_backup``), so the first pause copies without pinning first, and
a resume keeps the pinned memory (not the contents) for the next pause; with
``prepare_backup = False`` it goes back after each resume, unless
``retain_cpu_backup = True`` (as in torch_memory_saver, where keeping the
backup saves re-pinning at every pause).
``disable()`` inside a region makes tensors that are not pausable; regions
nest; a tag may have regions with and without a backup; ``cuda_graph()``
(after ``vmmbuf.torch.use()``) makes a graph whose memory pauses. With
``TMS_INIT_ENABLE=1`` in the environment at import (and
``TMS_INIT_ENABLE_CPU_BACKUP=1`` to keep the contents), every allocation of
the process is pausable under the tag ``"default"``, as in
torch_memory_saver's preload mode (vmmbuf becomes the process's allocator:
import it before the first CUDA tensor); its ``resume`` then maps back
the free memory the pause gave back too, as torch_memory_saver's does
(``restore_free``).
``hook_mode = "preload"`` is torch_memory_saver's LD_PRELOAD mode: in a
process started inside ``configure_subprocess()``, vmmbuf's preload library
answers the CUDA runtime's ``cudaMalloc``/``cudaFree`` for the whole
process, so what any library allocates inside a region pauses too.
``get_cpu_backup(tensor)`` reads a paused tensor's backup.
``sleep``/``wake`` are the same as
``pause``/``resume``.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Dict, Optional

from .. import _native
from .. import torch as _vtorch
from ..errors import UnsupportedError
from ._backups import _BACKENDS, _KINDS, _PAUSE_MODES, _backup_backend, _disk_file_bytes
from ._hooks import _PRELOAD_NAME, configure_subprocess, preload_library_path
from ._saver import _TAG_DEFAULT, TorchMemorySaver

torch_memory_saver = TorchMemorySaver()
memory_saver = torch_memory_saver


def _init_enable(saver: TorchMemorySaver, env: Dict[str, str]) -> bool:
    """torch_memory_saver's ``TMS_INIT_ENABLE=1``: every allocation of the
    process is pausable from the start, under the tag ``"default"`` (its
    contents kept at a pause with ``TMS_INIT_ENABLE_CPU_BACKUP=1``, dropped
    otherwise): vmmbuf becomes the process's allocator (before the first
    CUDA tensor, else an error says so) and every thread that sets no tag
    allocates under it; ``region`` and ``disable`` scope others. Returns
    whether it applied."""
    if env.get("TMS_INIT_ENABLE", "0") != "1":
        return False
    backup = env.get("TMS_INIT_ENABLE_CPU_BACKUP", "0") == "1"
    _vtorch.use()
    _native.set_tms_restore_free(saver._restores())
    _native.set_default_tag(saver._note(_TAG_DEFAULT, _backup_backend(backup, None, env)))
    if _PRELOAD_NAME in env.get("LD_PRELOAD", ""):
        # Started with vmmbuf's preload library (torch_memory_saver's
        # preload mode): what other libraries cudaMalloc is pausable too.
        try:
            saver.hook_mode = "preload"
        except UnsupportedError as e:
            # Another build's library (its name has another hash): PyTorch's
            # allocations are vmmbuf's still; other libraries' are not.
            warnings.warn(f"TMS_INIT_ENABLE: preload mode is off: {e}", RuntimeWarning,
                          stacklevel=2)
    return True


_init_enable(torch_memory_saver, dict(os.environ))


def region(tag: str = _TAG_DEFAULT, enable_cpu_backup: bool = False,
           enable_disk_backup: bool = False,
           cpu_backup_backend: Optional[str] = None) -> "contextlib.AbstractContextManager[None]":
    """``torch_memory_saver.region``."""
    return torch_memory_saver.region(tag, enable_cpu_backup, enable_disk_backup,
                                     cpu_backup_backend)


def pause(tag: Optional[str] = None) -> int:
    """``torch_memory_saver.pause``."""
    return torch_memory_saver.pause(tag)


def resume(tag: Optional[str] = None) -> int:
    """``torch_memory_saver.resume``."""
    return torch_memory_saver.resume(tag)


sleep = pause
wake = resume

__all__ = ["TorchMemorySaver", "torch_memory_saver", "memory_saver", "region", "pause",
           "configure_subprocess", "preload_library_path",
           "resume", "sleep", "wake"]
