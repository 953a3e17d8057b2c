"""torch_memory_saver's backups on vmmbuf: which kind of memory a region
makes for its backup choice, the sleep each kind's pause takes, and the
checks torch_memory_saver makes of the backup settings."""

from __future__ import annotations

import os
from typing import Dict, Mapping, Optional

from .. import _native
from ..errors import InvalidArgumentError

# Region memory is a vmmbuf tag per kind: the region's tag followed by the
# kind's suffix ("pinned" backups none, "mmap" backups and memory without a
# backup a mark no user's tag has, starting with a control character), as
# torch_memory_saver keeps a pool per tag and backup. The table is the
# native module's, which the C tms_pause reads too, with the sleep each
# kind's pause takes ("pinned" memory "stash", or "keep" when the saver keeps
# paused memory reachable; "mmap" "pageable"; "disk" "disk"; the rest
# "discard").
_KINDS: Dict[str, str] = {k: suffix for k, suffix, _ in _native.tms_kinds()}
_PAUSE_MODES: Dict[str, str] = {k: mode for k, _, mode in _native.tms_kinds()}
# The backends torch_memory_saver's cpu_backup_backend names.
_BACKENDS = ("pinned", "mmap")


def _backup_backend(enable_cpu_backup: bool, backend: Optional[str],
                    env: Optional[Dict[str, str]] = None) -> str:
    """torch_memory_saver's checks of ``cpu_backup_backend``; the kind of
    memory a region makes (see ``_KINDS``): ``"discard"`` without a CPU
    backup, else the backend named, or the process default
    (``TMS_INIT_CPU_BACKUP_BACKEND`` in ``env``, the environment if None,
    else ``"pinned"``)."""
    if backend is not None:
        if not enable_cpu_backup:
            raise InvalidArgumentError("cpu_backup_backend requires enable_cpu_backup=True")
        if backend not in _BACKENDS:
            raise InvalidArgumentError(f"cpu_backup_backend {backend!r}: 'pinned' or 'mmap'")
    if not enable_cpu_backup:
        return "discard"
    if backend:
        return backend
    # torch_memory_saver's process default.
    default = (os.environ if env is None else env).get("TMS_INIT_CPU_BACKUP_BACKEND", "")
    if default and default not in _BACKENDS:
        raise InvalidArgumentError(
            f"TMS_INIT_CPU_BACKUP_BACKEND={default!r}: 'pinned' or 'mmap'")
    return default or "pinned"


def _disk_file_bytes(env: Mapping[str, str]) -> int:
    """The most bytes one disk backup file holds: torch_memory_saver's
    ``TMS_DISK_BACKUP_CHUNK_MB`` (whole MiB, at least 1), 0 (a file per
    chunk) where it is not set."""
    text = env.get("TMS_DISK_BACKUP_CHUNK_MB", "")
    if not text:
        return 0
    try:
        mib = int(text)
    except ValueError:
        mib = 0
    if mib < 1:
        raise InvalidArgumentError(
            f"TMS_DISK_BACKUP_CHUNK_MB={text!r}: a whole number of MiB, at least 1")
    return mib << 20
