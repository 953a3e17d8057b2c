"""torch_memory_saver's ``TorchMemorySaver`` on vmmbuf: regions, pause and
resume, backups read back, and the settings (see the package)."""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from .. import _check, _native
from .. import tag as _tagged
from .. import torch as _vtorch
from ..errors import InvalidArgumentError, UnsupportedError
from ._backups import _KINDS, _PAUSE_MODES, _backup_backend, _disk_file_bytes
from ._hooks import _PRELOAD_NAME, _allocating_as, _attach_preload

_TAG_DEFAULT = "default"


class TorchMemorySaver:
    """torch_memory_saver's ``TorchMemorySaver`` on vmmbuf."""

    def __init__(self, reachable: bool = False) -> None:
        """``reachable=True``: regions with a CPU backup stay readable while
        paused (moved to host memory at their addresses) instead of being
        stashed and unmapped."""
        # Every region tag used, with the kinds of its memory ("pinned",
        # "mmap", "discard"; see _KINDS), each a vmmbuf tag of its own.
        self._used: Dict[str, List[str]] = {}
        self._reachable = reachable
        # Where disk backups go (set_disk_backup_dir), once known.
        self._disk_dir: Optional[str] = None
        # torch_memory_saver reads TMS_RETAIN_CPU_BACKUP=1 for the default.
        self._retain = os.environ.get("TMS_RETAIN_CPU_BACKUP", "0") == "1"
        self._hook_mode = "torch"
        # Until hook_mode is set, a process started with vmmbuf's preload
        # library (configure_subprocess) takes preload mode at its first
        # region, as torch_memory_saver defaults to its preload mode.
        self._hook_chosen = False
        # MemPool mode: how deep this thread is in regions, and the pools
        # disable() used inside them, given back once the outermost region
        # ends (PyTorch aborts on a MemPool destroyed while another pool is
        # in use: c10's synchronize_and_free_events asserts that no pool is).
        self._local = threading.local()
        # Preload mode: PyTorch's pool per vmmbuf tag and device (see
        # _allocating_as), kept for the process, as torch_memory_saver keeps
        # its MemPools.
        self._pools: Dict[Tuple[str, int], Any] = {}
        # resume maps back the free memory pause gave back (restore_free).
        self._restore_free = True
        # A pinned backup made in the background as its region ends
        # (prepare_backup): the thread doing it, and what it failed with.
        self._prepare = os.environ.get("VMMBUF_TMS_PREPARE", "1") != "0"
        self._prep_lock = threading.Lock()
        self._prep_thread: Optional[threading.Thread] = None
        self._prep_error: Optional[BaseException] = None

    def _depth(self) -> int:
        return getattr(self._local, "depth", 0)

    def _spent(self) -> List[Any]:
        spent = getattr(self._local, "spent", None)
        if spent is None:
            spent = self._local.spent = []
        return spent

    @contextlib.contextmanager
    def region(self, tag: str = _TAG_DEFAULT, enable_cpu_backup: bool = False,
               enable_disk_backup: bool = False,
               cpu_backup_backend: Optional[str] = None) -> Iterator[None]:
        """Tensors made inside can be paused with ``pause(tag)``, their
        contents kept in host memory (``enable_cpu_backup=True``) or dropped.
        Regions nest: the innermost one's tag and backup apply.
        ``cpu_backup_backend`` (with a CPU backup only, as in
        torch_memory_saver): ``"pinned"`` (a stash of pinned host memory,
        the default), ``"mmap"`` (pageable host memory given back to the
        system at the resume: vmmbuf's ``"pageable"`` sleep), or None (the
        process default, ``TMS_INIT_CPU_BACKUP_BACKEND``, else pinned).
        ``enable_disk_backup=True`` (without a CPU backup) keeps the contents
        in files of the disk backup directory instead, one per chunk (or
        per ``TMS_DISK_BACKUP_CHUNK_MB`` MiB of it, read when the directory
        is set), removed at the resume (vmmbuf's ``"disk"`` sleep): see
        ``set_disk_backup_dir`` (default ``TMS_DISK_BACKUP_DIR``, else
        ``/tmp``)."""
        tag = _check.tag("tag", tag)
        enable_cpu_backup = _check.flag("enable_cpu_backup", enable_cpu_backup)
        disk = _check.flag("enable_disk_backup", enable_disk_backup)
        if disk and enable_cpu_backup:
            raise InvalidArgumentError(
                "enable_cpu_backup and enable_disk_backup are mutually exclusive")
        kind = _backup_backend(enable_cpu_backup, cpu_backup_backend)
        if disk:
            self._disk_dir_for_pause()
            kind = "disk"
        self._local.depth = self._depth() + 1
        vtag = self._note(tag, kind)
        try:
            with _allocating_as(vtag, self._preload(), self._pools):
                yield
        finally:
            self._local.depth -= 1
            if self._local.depth == 0:
                self._spent().clear()
        if kind == "pinned" and self._prepare:
            self._prepare_later(vtag, "keep" if self._reachable else "stash")

    @contextlib.contextmanager
    def cuda_graph(self, cuda_graph: Any, pool: Any = None, stream: Any = None,
                   capture_error_mode: str = "global", tag: str = _TAG_DEFAULT,
                   enable_cpu_backup: bool = False,
                   cpu_backup_backend: Optional[str] = None) -> Iterator[None]:
        """``torch.cuda.graph(cuda_graph, pool, stream, capture_error_mode)``
        whose memory (the graph's pool) pauses and resumes with ``tag``, as
        torch_memory_saver's does. It needs vmmbuf under PyTorch's own
        allocator: process-wide (``vmmbuf.torch.use()``, or
        ``TMS_INIT_ENABLE=1``), which then serves graph pools too, or preload
        mode (``hook_mode = "preload"``), where the pool's ``cudaMalloc``
        comes to vmmbuf; torch_memory_saver's needs its preload mode
        likewise. A paused graph must not be replayed before its resume."""
        tag = _check.tag("tag", tag)
        enable_cpu_backup = _check.flag("enable_cpu_backup", enable_cpu_backup)
        kind = _backup_backend(enable_cpu_backup, cpu_backup_backend)
        if not (_vtorch.is_process_wide() or self._preload()):
            raise UnsupportedError(
                "cuda_graph() needs vmmbuf as the process's allocator (vmmbuf.torch.use() before "
                "the first CUDA tensor, or TMS_INIT_ENABLE=1) or preload mode (hook_mode = "
                "'preload'): PyTorch serves a graph's pool from its own allocator otherwise")
        as_tag = self._note(tag, kind)
        with torch.cuda.graph(cuda_graph, pool=pool, stream=stream,
                              capture_error_mode=capture_error_mode):
            # The graph's own pool keeps its memory apart already.
            with _allocating_as(as_tag, preload=self._preload()):
                yield

    @contextlib.contextmanager
    def disable(self) -> Iterator[None]:
        """Inside a region, tensors made in this block are not pausable:
        PyTorch's own allocator (or, after ``vmmbuf.torch.use()``, vmmbuf's
        untagged memory, which ``pause()`` leaves alone, given back to the
        driver as the block ends, as torch_memory_saver disposes of its
        pool)."""
        if _vtorch.is_process_wide():
            # vmmbuf's untagged memory (in preload mode too: PyTorch's
            # tensors come to vmmbuf directly), given back as the block ends.
            with _tagged(""):
                yield
            _vtorch.empty_cache()
        elif self._preload():
            # The CUDA runtime's own memory (the preload library passes on
            # what is allocated under no tag), in a PyTorch pool of its own
            # that is disposed of as the block ends, as torch_memory_saver
            # does: its memory goes back to the driver rather than staying
            # in PyTorch's cache beside the paused memory.
            with _tagged(""):
                pool = torch.cuda.MemPool()
                with torch.cuda.use_mem_pool(pool):
                    yield
                del pool
        else:
            pool = torch.cuda.MemPool()
            try:
                with torch.cuda.use_mem_pool(pool):
                    yield
            finally:
                if self._depth() > 0:
                    # Given back when the outermost region ends.
                    self._spent().append(pool)
                del pool

    def _preload(self) -> bool:
        """Whether allocations are caught in preload mode: as set, or (never
        set) when this process was started with vmmbuf's preload library."""
        if not self._hook_chosen:
            self._hook_chosen = True
            if _PRELOAD_NAME in os.environ.get("LD_PRELOAD", ""):
                self.hook_mode = "preload"
        return self._hook_mode == "preload"

    def _note(self, tag: str, kind: str) -> str:
        """Records that ``tag`` has memory of ``kind`` (see ``_KINDS``), and
        returns the vmmbuf tag that memory is made under."""
        kinds = self._used.setdefault(tag, [])
        if kind not in kinds:
            kinds.append(kind)
        return tag + _KINDS[kind]

    def _tags(self, tag: Optional[str]) -> List[Tuple[str, str]]:
        """The vmmbuf tags of ``tag`` (None: every region's), each with the
        kind of its memory."""
        names = sorted(self._used) if tag is None else [_check.tag("tag", tag)]
        return [(name + _KINDS[k], k) for name in names for k in self._used.get(name, [])]

    def _prepare_later(self, vtag: str, mode: str) -> None:
        """Pins, on a thread of its own, the host memory a pause of the
        vmmbuf tag ``vtag`` in ``mode`` will take (``prepare_backup``); after
        any preparation still under way, so the region's thread never
        waits."""
        with self._prep_lock:
            before = self._prep_thread

            def work() -> None:
                if before is not None:
                    before.join()
                try:
                    _native.prepare_sleep(vtag, True, mode)
                except Exception as e:  # told at the next pause
                    self._prep_error = e

            t = threading.Thread(target=work, name="vmmbuf-tms-prepare", daemon=True)
            self._prep_thread = t
            t.start()

    def _prepared(self) -> None:
        """Waits for the background preparation (``prepare_backup``); one
        that failed is told as a warning (the pause pins what it needs)."""
        with self._prep_lock:
            t, self._prep_thread = self._prep_thread, None
        if t is not None:
            t.join()
        e, self._prep_error = self._prep_error, None
        if e is not None:
            warnings.warn(f"vmmbuf: preparing a pinned backup in the background failed ({e}); "
                          "the pause pins it now", RuntimeWarning, stacklevel=3)

    @property
    def prepare_backup(self) -> bool:
        """Whether a region with a pinned CPU backup gets that backup's host
        memory pinned in the background as the region ends (True by
        default; ``VMMBUF_TMS_PREPARE=0`` in the environment, or False here,
        turns it off), so that the first pause copies at the link's speed
        instead of pinning first (about 0.25 s per GiB). It costs the
        backup's host memory from the region's end rather than from the
        first pause (counted in ``vmmbuf.stats()["stash_bytes"]``, mapped
        into the tag's stash so that the first pause maps nothing either, or
        in ``pooled_host_bytes`` for a backup that stays reachable; not
        shed by ``vmmbuf.set_host_cache_limit``, given back by
        ``vmmbuf.release_host_cache()``) and one background
        thread's CPU while it pins; a pause waits for a preparation under
        way. A resume then keeps the pinned memory (as the tag's stash,
        counted in ``stash_bytes``; not the backup's contents:
        ``get_cpu_backup`` answers None unless ``retain_cpu_backup``) for
        the next pause, which copies at the
        link's speed too; with False, unless ``retain_cpu_backup``, it goes
        back to the system at each resume (``vmmbuf.release_host_cache()``
        gives it back at any time)."""
        return self._prepare

    @prepare_backup.setter
    def prepare_backup(self, value: bool) -> None:
        self._prepare = _check.flag("prepare_backup", value)

    def pause(self, tag: Optional[str] = None) -> int:
        """Gives back the device memory of ``tag`` (None: every region's
        tag), keeping the contents in pinned host memory where the region
        asked for a CPU backup and discarding them otherwise; returns the
        bytes paused. A tag with no region is nothing to pause."""
        self._prepared()
        total = 0
        for t, kind in self._tags(tag):
            mode = "keep" if kind == "pinned" and self._reachable else _PAUSE_MODES[kind]
            total += _native.sleep(t, mode)[0]
        return total

    def resume(self, tag: Optional[str] = None) -> int:
        """Maps ``tag``'s memory (None: every region's) back at the same
        addresses; returns the bytes resumed. With ``retain_cpu_backup``
        the backups stay readable (``get_cpu_backup``, at the same host
        address) until the next pause, which copies into them again.
        Without it their contents go; their pinned host memory stays for
        the next pause while ``prepare_backup`` is on (the default), and
        goes back to the system otherwise."""
        keep = self._retain
        restore = self._restores()
        total = sum(_native.wake(t, False, keep, restore)[0] for t, _ in self._tags(tag))
        if not self._retain and not self._prepare:
            _native.release_host_cache()
        return total

    def get_cpu_backup(self, x: Any, zero_copy: bool = False) -> Any:
        """A CPU tensor of what a pause kept for ``x`` (a contiguous CUDA
        tensor made in a region with a CPU backup), while its tag is paused
        or after a resume with ``retain_cpu_backup``; None when no backup
        holds it (not paused, paused without a backup, or made outside
        every region), as torch_memory_saver answers. ``zero_copy=True``
        gives a view of the backup itself (pinned, ``"mmap"`` or disk; the
        same host address from pause to pause while retained), valid until
        the backup goes: a resume without ``retain_cpu_backup``. (The
        ``reachable`` mode keeps the contents at ``x``'s own address
        instead, where ``x.cpu()`` reads them, and has no separate
        backup.)"""
        zero_copy = _check.flag("zero_copy", zero_copy)
        if not getattr(x, "is_cuda", False):
            raise InvalidArgumentError(f"get_cpu_backup takes a CUDA tensor, not {type(x).__name__}")
        if not x.is_contiguous():
            raise InvalidArgumentError(
                f"get_cpu_backup takes a contiguous tensor (shape {tuple(x.shape)}, "
                f"strides {x.stride()})")
        # The backup's host address (Arena::backup_address), or None where
        # no backup holds every byte of x.
        at = _native.backup_address(x.data_ptr(), x.nbytes) if zero_copy else None
        if at is not None:
            import ctypes

            view = (ctypes.c_uint8 * x.nbytes).from_address(at)
            flat = torch.frombuffer(view, dtype=torch.uint8)
        else:
            got = _native.read_backup(x.data_ptr(), x.nbytes)
            if got is None:
                return None
            flat = torch.frombuffer(bytearray(got), dtype=torch.uint8)
        return flat.view(x.dtype).view(x.shape)

    def set_disk_backup_dir(self, path: str) -> None:
        """The directory (made if needed) where the pauses of regions with
        ``enable_disk_backup=True`` write their files, for the whole process
        (as torch_memory_saver's). It should be a real disk: on a memory
        file system the files take host memory."""
        if not isinstance(path, str) or not path:
            raise InvalidArgumentError(f"set_disk_backup_dir takes a path, not {path!r}")
        os.makedirs(path, exist_ok=True)
        _native.set_spill_dir(path, _disk_file_bytes(os.environ))
        self._disk_dir = path

    def _disk_dir_for_pause(self) -> None:
        """Makes sure disk pauses have a directory: the one set, else
        torch_memory_saver's default (``TMS_DISK_BACKUP_DIR``, else
        ``/tmp``)."""
        if self._disk_dir is None:
            self.set_disk_backup_dir(os.environ.get("TMS_DISK_BACKUP_DIR") or "/tmp")

    @property
    def retain_cpu_backup(self) -> bool:
        """Whether the host memory of the backups stays after a resume,
        readable and for the next pause (False by default, as in
        torch_memory_saver, or ``TMS_RETAIN_CPU_BACKUP=1``; True saves
        re-pinning it, about 0.25 s per GiB, at every pause). Read at each
        resume."""
        return self._retain

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value: bool) -> None:
        self._retain = _check.flag("retain_cpu_backup", value)

    @property
    def restore_free(self) -> bool:
        """Whether ``resume`` maps back, besides the tensors' memory, the
        free memory ``pause`` gave back, where vmmbuf is the process's
        allocator (``TMS_INIT_ENABLE=1`` or ``vmmbuf.torch.use()``): its free
        blocks are then the cache PyTorch's allocator would keep, and
        torch_memory_saver's resume maps back everything its pause unmapped,
        that cache included. True by default, as torch_memory_saver: the
        device footprint after ``resume`` is the one before ``pause``, and the
        next step allocates without mapping. False maps back only what
        tensors hold (less memory taken at the resume; free memory is mapped
        again when an allocation needs it). In a region's ``MemPool``
        PyTorch's allocator keeps the cache itself and resume maps it back
        either way. Best effort: what the device cannot hold stays unmapped.
        Also what the C ``tms_resume`` does."""
        return self._restore_free

    @restore_free.setter
    def restore_free(self, value: bool) -> None:
        self._restore_free = _check.flag("restore_free", value)
        _native.set_tms_restore_free(self._restores())

    def _restores(self) -> bool:
        """Whether a resume maps back free memory (see ``restore_free``)."""
        return self._restore_free and _vtorch.is_process_wide()

    @property
    def hook_mode(self) -> str:
        """How allocations are caught: ``"torch"`` (PyTorch's pluggable
        allocator, per region) or ``"preload"`` (torch_memory_saver's
        LD_PRELOAD mode: vmmbuf's preload library answers the CUDA
        runtime's ``cudaMalloc``/``cudaFree`` of the whole process, so what
        any library allocates inside a region pauses too). ``"preload"``
        needs a process started with the library preloaded (spawn it
        inside :func:`configure_subprocess`); elsewhere it is refused in
        words. Never set, it becomes ``"preload"`` at the first region in
        such a process (torch_memory_saver's default mode) and stays
        ``"torch"`` elsewhere."""
        return self._hook_mode

    @hook_mode.setter
    def hook_mode(self, mode: str) -> None:
        self._hook_chosen = True
        if mode == "torch":
            if self._hook_mode == "preload":
                _native.set_preload(False)
            self._hook_mode = mode
        elif mode == "preload":
            _attach_preload()
            _native.set_preload(True)
            self._hook_mode = mode
        else:
            raise InvalidArgumentError(f"hook_mode must be 'torch' or 'preload', not {mode!r}")

    @property
    def memory_margin_bytes(self) -> int:
        """Only set, as in torch_memory_saver."""
        raise NotImplementedError("Only setter is supported")

    @memory_margin_bytes.setter
    def memory_margin_bytes(self, value: int) -> None:
        """Device bytes to leave free: an allocation that would make vmmbuf
        map memory past the device's free bytes less this fails as out of
        memory (every vmmbuf pool on every device: the regions', and after
        ``vmmbuf.torch.use()`` every allocation; 0 turns it off)."""
        _native.set_memory_margin(_check.integer("memory_margin_bytes", value, maximum=_check.MAX_LIMIT))

    sleep = pause
    wake = resume

    @property
    def enabled(self) -> bool:
        """Always True: vmmbuf needs no preload."""
        return True
