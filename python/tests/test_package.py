"""The package without a GPU: the library, its entry points, errors, tags."""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import types
from typing import Any, List, Tuple
from pathlib import Path

import pytest

import vmmbuf
from conftest import run_script
from vmmbuf import _native, errors

ENTRY_POINTS = ("vmmbuf_malloc", "vmmbuf_torch_malloc", "vmmbuf_free", "vmmbuf_stats_json", "vmmbuf_set_budget",
                "vmmbuf_set_tag", "vmmbuf_sleep", "vmmbuf_wake", "vmmbuf_empty_cache",
                "vmmbuf_prepare_sleep", "vmmbuf_release_host_cache",
                "vmmbuf_set_host_cache_limit",
                "vmmbuf_reset_peak", "vmmbuf_last_error", "vmmbuf_announce_captures",
                "vmmbuf_capture_begins", "vmmbuf_capture_ends")


def test_the_package_finds_its_library_by_its_own_path():
    path = Path(vmmbuf.library_path())
    assert path.is_file()
    assert path.parent == Path(vmmbuf.__file__).parent
    lib = ctypes.CDLL(str(path))
    for sym in ENTRY_POINTS:
        assert hasattr(lib, sym), sym
    assert vmmbuf.__version__ == _native.__version__


def test_a_failed_c_call_is_kept_as_the_threads_last_error():
    lib = ctypes.CDLL(vmmbuf.library_path())
    lib.vmmbuf_malloc.restype = ctypes.c_void_p
    lib.vmmbuf_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    assert lib.vmmbuf_malloc(-5, 0, None) is None
    assert "negative size -5" in (vmmbuf.last_error() or "")
    assert lib.vmmbuf_malloc(0, 0, None) is None, "0 bytes: null, as PyTorch expects"
    assert "negative size -5" in (vmmbuf.last_error() or ""), "and not a failure"
    seen = []
    t = threading.Thread(target=lambda: seen.append(vmmbuf.last_error()))
    t.start()
    t.join()
    assert seen == [None], "another thread's last error is its own"


def test_errors_map_by_kind_and_keep_the_message():
    for kind, cls, base in [("out_of_memory", errors.OutOfMemoryError, MemoryError),
                            ("capacity", errors.CapacityError, ValueError),
                            ("invalid_argument", errors.InvalidArgumentError, ValueError),
                            ("unsupported", errors.UnsupportedError, NotImplementedError),
                            ("no_device", errors.NoDeviceError, RuntimeError),
                            ("driver", errors.DriverError, RuntimeError),
                            ("something new", errors.VmmbufError, Exception)]:
        e = errors._from_native(kind, f"why: {kind}")
        assert isinstance(e, cls) and isinstance(e, base) and isinstance(e, vmmbuf.VmmbufError)
        assert str(e) == f"why: {kind}"


def test_out_of_memory_is_torchs_when_torch_is_loaded(monkeypatch):
    fake = types.ModuleType("torch")
    fake.OutOfMemoryError = type("OutOfMemoryError", (RuntimeError,), {})
    monkeypatch.setitem(sys.modules, "torch", fake)
    e = errors._from_native("out_of_memory", "device full")
    assert isinstance(e, fake.OutOfMemoryError)
    assert isinstance(e, vmmbuf.OutOfMemoryError) and isinstance(e, MemoryError)
    with pytest.raises(fake.OutOfMemoryError, match="device full"):
        raise e


def test_native_errors_are_typed_exceptions_with_the_cause():
    with pytest.raises(vmmbuf.InvalidArgumentError, match="device is -1"):
        vmmbuf.set_budget(1 << 30, device=-1)
    with pytest.raises(vmmbuf.InvalidArgumentError, match="not a live allocation"):
        _native.free(0x1234, 0, 0)
    with pytest.raises(vmmbuf.InvalidArgumentError, match="0 bytes"):
        _native.malloc(0, 0, 0)


def test_without_a_gpu_the_driver_error_says_why():
    try:
        import torch  # noqa: F401

        pytest.skip("PyTorch is installed: this checks the no-driver path")
    except ImportError:
        pass
    try:
        ctypes.CDLL("libcuda.so.1")
        pytest.skip("a CUDA driver is installed")
    except OSError:
        pass
    with pytest.raises(vmmbuf.NoDeviceError, match="CUDA driver"):
        _native.malloc(1 << 20, 0, 0)
    with pytest.raises(vmmbuf.NoDeviceError, match="CUDA driver"):
        vmmbuf.GrowableTensor("float32", 1024, device="cuda")


def test_tags_nest_and_are_per_thread():
    assert vmmbuf.get_tag() == ""
    with vmmbuf.tag("weights"):
        assert vmmbuf.get_tag() == "weights"
        other = []
        t = threading.Thread(target=lambda: other.append(vmmbuf.get_tag()))
        t.start()
        t.join()
        assert other == [""], "a new thread starts untagged"
        with vmmbuf.tag("kv"):
            assert vmmbuf.get_tag() == "kv"
        assert vmmbuf.get_tag() == "weights"
        with pytest.raises(KeyError):
            with vmmbuf.tag("inner"):
                raise KeyError("the tag comes back on an exception too")
        assert vmmbuf.get_tag() == "weights"
    assert vmmbuf.get_tag() == ""


def test_sleep_and_stats_without_memory():
    """Before any memory: every call answers 0 or {}; a named tag with no
    memory is warned about (a misspelt tag would otherwise do nothing). In a
    fresh interpreter: tests before it in this one may have used device 0."""
    out = run_script("""
        import warnings, vmmbuf

        def warns(words, call):
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                got = call()
            said = [str(x.message) for x in w if issubclass(x.category, UserWarning)]
            assert said and all(any(x in m for m in said) for x in words), (words, said)
            return got

        assert vmmbuf.stats(0) == {}
        assert vmmbuf.sleep() == 0
        assert vmmbuf.wake(zero=True) == 0
        assert vmmbuf.wake(restore_free=True) == 0
        try:
            vmmbuf.wake(restore_free="yes")
            raise AssertionError("a non-bool restore_free was taken")
        except TypeError as e:
            assert "restore_free must be True or False" in str(e), e
        assert vmmbuf.prepare_sleep(wait=True) == 0
        assert warns(["'weights'", "(the default tag)"], lambda: vmmbuf.wake(["weights", None])) == 0
        assert warns(["'kv'"], lambda: vmmbuf.sleep("kv")) == 0
        assert warns(["'kv'"], lambda: vmmbuf.sleep("kv", discard=True)) == 0
        assert warns(["'w'"], lambda: vmmbuf.sleep("w", reachable=False)) == 0
        assert warns(["'w'"], lambda: vmmbuf.prepare_sleep("w", wait=True, reachable=False)) == 0
        assert warns(["'weights'"], lambda: vmmbuf.prepare_sleep(["weights"])) == 0
        # One mode spelling, Rust's list: mode= names it; the older
        # keywords must agree.
        assert vmmbuf._native.sleep_modes() == ["keep", "discard", "stash", "pageable", "disk"]
        for m in vmmbuf._native.sleep_modes():
            assert warns(["'kv'"], lambda: vmmbuf.sleep("kv", mode=m)) == 0
        assert warns(["'kv'"], lambda: vmmbuf.sleep("kv", mode="discard", discard=True)) == 0
        assert warns(["'w'"], lambda: vmmbuf.prepare_sleep("w", wait=True, mode="stash")) == 0
        for bad in (dict(mode="fast"), dict(mode="Keep"), dict(mode="keep", discard=True),
                    dict(mode="stash", discard=True), dict(mode="keep", reachable=False)):
            try:
                vmmbuf.sleep("kv", **bad)
            except vmmbuf.InvalidArgumentError as e:
                assert "mode" in str(e), e
                if bad.get("mode") == "fast":
                    assert "one of 'keep', 'discard', 'stash', 'pageable', 'disk'" in str(e), e
            else:
                raise SystemExit(f"sleep({bad}) was not refused")
        try:
            vmmbuf._native.sleep("kv", "fast")
        except vmmbuf.InvalidArgumentError as e:
            assert '"keep", "stash", "discard", "pageable" or "disk"' in str(e), e
        else:
            raise SystemExit("the native sleep took mode 'fast'")
        assert vmmbuf.release_host_cache() == 0
        vmmbuf.set_host_cache_limit(1 << 30)
        vmmbuf.set_host_cache_limit(2**64 - 1)
        vmmbuf.reset_peak(0)
        vmmbuf.empty_cache(0)
        # A device the machine does not have is named in the error.
        n = vmmbuf.device_count()
        for call in (vmmbuf.stats, vmmbuf.empty_cache):
            try:
                call(n + 5)
            except vmmbuf.InvalidArgumentError as e:
                assert f"device {n + 5}" in str(e), e
            else:
                raise SystemExit(f"{call.__name__}({n + 5}) was not refused")
        print("OK")
    """)
    assert out.strip().endswith("OK"), out


def test_a_budget_is_set_before_the_device_is_used(monkeypatch: pytest.MonkeyPatch):
    # Device 6 of a machine that has 8 (the budget is kept before its first
    # allocation, with or without a driver here).
    monkeypatch.setattr(vmmbuf._native, "device_count", lambda: 8)
    vmmbuf.set_budget(1 << 30, device=6)
    vmmbuf.set_budget(2 << 30, device=6)  # still unused: may change


def test_device_defaults_to_the_current_cuda_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """stats(), empty_cache(), reset_peak() and set_budget() reach the
    current CUDA device when PyTorch has one (each rank of a multi-GPU job
    its own), device 0 without PyTorch, and an explicit device as given."""
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.setattr(vmmbuf._native, "device_count", lambda: 4)
    assert vmmbuf._device(None) == 0
    assert vmmbuf._device(3) == 3
    cuda = types.SimpleNamespace(is_initialized=lambda: True, current_device=lambda: 1)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    assert vmmbuf._device(None) == 1
    assert vmmbuf._device(0) == 0
    cuda.is_initialized = lambda: False
    assert vmmbuf._device(None) == 0


def _on_a_stand_in_torch(monkeypatch: pytest.MonkeyPatch) -> Tuple[Any, Any, Any]:
    """vmmbuf.torch, vmmbuf.torch_memory_saver and vmmbuf.vllm imported
    afresh over a stand-in for torch with two devices (no GPU needed); the
    modules as they were come back after the test."""
    import importlib

    class Device:
        def __init__(self, spec: Any) -> None:
            if not isinstance(spec, str) or spec.split(":")[0] not in ("cuda", "cpu"):
                raise RuntimeError(f"Invalid device string: '{spec}'")
            kind, _, index = spec.partition(":")
            self.type, self.index = kind, (int(index) if index else None)

    cuda = types.SimpleNamespace(device_count=lambda: 2, current_device=lambda: 0)
    fake = types.SimpleNamespace(cuda=cuda, device=Device)
    monkeypatch.setitem(sys.modules, "torch", fake)
    tms_parts = ("_backups", "_hooks", "_saver")
    for name in ("vmmbuf.torch", "vmmbuf.torch_memory_saver", "vmmbuf.vllm",
                 *(f"vmmbuf.torch_memory_saver.{p}" for p in tms_parts)):
        # setitem, then delitem: afterwards the entry is put back as it was,
        # or removed if there was none (delitem alone of a missing entry
        # would leave the modules made here over the stand-in to later tests).
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name))
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delattr(vmmbuf, "torch", raising=False)
    monkeypatch.delattr(vmmbuf, "torch_memory_saver", raising=False)
    monkeypatch.delattr(vmmbuf, "vllm", raising=False)
    return (importlib.import_module("vmmbuf.torch"),
            importlib.import_module("vmmbuf.torch_memory_saver"),
            importlib.import_module("vmmbuf.vllm"))


def test_torch_and_torch_memory_saver_arguments_are_checked(monkeypatch: pytest.MonkeyPatch,
                                                            tmp_path: Any) -> None:
    """vmmbuf.torch and vmmbuf.torch_memory_saver refuse bad devices, budgets,
    tags and flags in words, before any CUDA call: checked against a stand-in
    for torch with two devices, so it runs without a GPU."""
    vt, tms, vllm = _on_a_stand_in_torch(monkeypatch)
    assert vt._dev(None) == 0 and vt._dev(1) == 1 and vt._dev("cuda:1") == 1 and vt._dev("cuda") == 0
    for bad, kind, words in [
        (5, vmmbuf.InvalidArgumentError, "device 5: this machine has 2 CUDA devices"),
        (-1, vmmbuf.InvalidArgumentError, "device is -1"),
        (True, TypeError, "not a bool"),
        ("cuda:7", vmmbuf.InvalidArgumentError, "device 7"),
        ("cpu", vmmbuf.InvalidArgumentError, "is not a CUDA device"),
        ("gpu", vmmbuf.InvalidArgumentError, "'cuda', 'cuda:N'"),
    ]:
        with pytest.raises(kind, match=words):
            vt._dev(bad)
    with pytest.raises(TypeError, match="budget_bytes must be an integer"):
        vt.use(budget_bytes=1.5)
    with pytest.raises(vmmbuf.InvalidArgumentError, match="device 3"):
        vt.use(device=3)
    with pytest.raises(TypeError, match="tag must be a string"):
        with vt.pool(tag=7):
            pass
    saver = tms.TorchMemorySaver()
    with pytest.raises(TypeError, match="enable_cpu_backup must be True or False"):
        with saver.region("w", enable_cpu_backup="yes"):
            pass
    with pytest.raises(TypeError, match="tag must be a string"):
        saver.pause(3)
    assert saver.retain_cpu_backup is False, "False by default, as in torch_memory_saver"
    saver.retain_cpu_backup = True
    assert saver.retain_cpu_backup is True
    with pytest.raises(TypeError, match="retain_cpu_backup must be True or False"):
        saver.retain_cpu_backup = 1
    saver.hook_mode = "torch"
    assert saver.hook_mode == "torch"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with pytest.raises(vmmbuf.UnsupportedError, match="configure_subprocess"):
        saver.hook_mode = "preload"     # this process was not started with the library
    with pytest.raises(vmmbuf.InvalidArgumentError, match="'torch' or 'preload'"):
        saver.hook_mode = "cuda"
    assert saver.hook_mode == "torch", "a refused mode changes nothing"
    # configure_subprocess(): the preload library first in LD_PRELOAD, what
    # was there kept, all put back after (torch_memory_saver's own tests
    # of it check the same).
    lib = tms.preload_library_path()
    assert lib.startswith(str(tmp_path / "cache" / "vmmbuf")) and tms.preload_library_path() == lib
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    with tms.configure_subprocess():
        assert os.environ["LD_PRELOAD"] == lib
    assert "LD_PRELOAD" not in os.environ
    monkeypatch.setenv("LD_PRELOAD", "/other/lib.so")
    with tms.configure_subprocess():
        assert os.environ["LD_PRELOAD"].split(":") == [lib, "/other/lib.so"]
    assert os.environ["LD_PRELOAD"] == "/other/lib.so"
    # Never set, the hook mode follows the process: preload mode where the
    # library was preloaded (here it is only named, so attaching is refused
    # in words), torch mode elsewhere.
    fresh = tms.TorchMemorySaver()
    assert fresh._preload() is False and fresh.hook_mode == "torch"
    named = tms.TorchMemorySaver()
    monkeypatch.setenv("LD_PRELOAD", lib)
    with pytest.raises(vmmbuf.UnsupportedError, match="configure_subprocess"):
        named._preload()
    chosen = tms.TorchMemorySaver()
    chosen.hook_mode = "torch"
    assert chosen._preload() is False, "a mode set is kept"
    monkeypatch.setenv("LD_PRELOAD", "/other/lib.so")
    # Backup backends and disk backup: "pinned" (a stash) and "mmap" (a
    # pageable sleep) are vmmbuf's, the process default from
    # TMS_INIT_CPU_BACKUP_BACKEND; files are refused in words; the checks
    # torch_memory_saver makes come first.
    with pytest.raises(vmmbuf.InvalidArgumentError, match="requires enable_cpu_backup=True"):
        with saver.region("w", cpu_backup_backend="pinned"):
            pass
    assert tms._backup_backend(True, "mmap") == "mmap"
    assert tms._backup_backend(True, "pinned") == "pinned"
    assert tms._backup_backend(False, None) == "discard"
    monkeypatch.delenv("TMS_INIT_CPU_BACKUP_BACKEND", raising=False)
    assert tms._backup_backend(True, None) == "pinned"
    monkeypatch.setenv("TMS_INIT_CPU_BACKUP_BACKEND", "mmap")
    assert tms._backup_backend(True, None) == "mmap"
    assert tms._backup_backend(True, "pinned") == "pinned", "an argument overrides it"
    monkeypatch.setenv("TMS_INIT_CPU_BACKUP_BACKEND", "disk")
    with pytest.raises(vmmbuf.InvalidArgumentError, match="TMS_INIT_CPU_BACKUP_BACKEND"):
        tms._backup_backend(True, None)
    monkeypatch.delenv("TMS_INIT_CPU_BACKUP_BACKEND")
    assert tms._KINDS == {"pinned": "", "mmap": "\x1fmmap", "disk": "\x1fdisk", "discard": "\x1fdiscard"}
    assert tms._PAUSE_MODES == {"pinned": "stash", "mmap": "pageable", "disk": "disk",
                                "discard": "discard"}
    with pytest.raises(vmmbuf.InvalidArgumentError, match="'pinned' or 'mmap'"):
        with saver.region("w", enable_cpu_backup=True, cpu_backup_backend="disk"):
            pass
    with pytest.raises(vmmbuf.InvalidArgumentError, match="mutually exclusive"):
        with saver.region("w", enable_cpu_backup=True, enable_disk_backup=True):
            pass
    with pytest.raises(vmmbuf.UnsupportedError, match="process's allocator"):
        with saver.cuda_graph(object(), tag="g", enable_cpu_backup=True, cpu_backup_backend="mmap"):
            pass
    assert "w" not in saver._used, "a refused region records nothing"
    spill: List[Any] = []
    monkeypatch.setattr(tms._native, "set_spill_dir", lambda p, n=0: spill.append((p, n)))
    disk = tmp_path / "tms-disk"
    monkeypatch.delenv("TMS_DISK_BACKUP_CHUNK_MB", raising=False)
    saver.set_disk_backup_dir(str(disk))
    assert disk.is_dir() and spill == [(str(disk), 0)], "made, and every arena's"
    monkeypatch.setenv("TMS_DISK_BACKUP_DIR", str(tmp_path / "from-env"))
    monkeypatch.setenv("TMS_DISK_BACKUP_CHUNK_MB", "3")
    fresh = tms.TorchMemorySaver()
    fresh._disk_dir_for_pause()
    assert spill[-1] == (str(tmp_path / "from-env"), 3 << 20), "files of at most 3 MiB"
    assert (tmp_path / "from-env").is_dir()
    for bad in ("0", "-1", "1.5", "one"):
        monkeypatch.setenv("TMS_DISK_BACKUP_CHUNK_MB", bad)
        with pytest.raises(vmmbuf.InvalidArgumentError, match="TMS_DISK_BACKUP_CHUNK_MB"):
            saver.set_disk_backup_dir(str(disk))
    monkeypatch.delenv("TMS_DISK_BACKUP_CHUNK_MB")
    monkeypatch.setattr(vmmbuf._native, "set_spill_dir", lambda p, n=0: spill.append((p, n)))
    vmmbuf.set_spill_dir(str(disk), file_bytes=12345)
    assert spill[-1] == (str(disk), 12345)
    vmmbuf.set_spill_dir(None)
    assert spill[-1] == (None, 0), "None: a file per chunk"
    for bad in (0, -5):
        with pytest.raises(vmmbuf.InvalidArgumentError, match="file_bytes"):
            vmmbuf.set_spill_dir(str(disk), file_bytes=bad)
    with pytest.raises(TypeError, match="file_bytes"):
        vmmbuf.set_spill_dir(str(disk), file_bytes=1.5)  # type: ignore[arg-type]
    with pytest.raises(vmmbuf.InvalidArgumentError, match="not a directory"):
        vmmbuf.set_spill_dir(str(tmp_path / "missing"))
    with pytest.raises(vmmbuf.InvalidArgumentError, match="takes a path"):
        vmmbuf.set_spill_dir("")
    with pytest.raises(vmmbuf.InvalidArgumentError, match="takes a path"):
        saver.set_disk_backup_dir("")
    with pytest.raises(vmmbuf.InvalidArgumentError, match="CUDA tensor"):
        saver.get_cpu_backup(object())
    # cuda_graph() needs vmmbuf process-wide (the stand-in is not): refused.
    with pytest.raises(vmmbuf.UnsupportedError, match="process's allocator"):
        with saver.cuda_graph(object(), tag="g"):
            pass
    with pytest.raises(TypeError, match="tag must be a string"):
        with saver.cuda_graph(object(), tag=5):
            pass
    margins: List[int] = []
    monkeypatch.setattr(tms._native, "set_memory_margin", margins.append)
    saver.memory_margin_bytes = 1 << 30
    assert margins == [1 << 30]
    with pytest.raises(NotImplementedError, match="Only setter"):
        saver.memory_margin_bytes
    with pytest.raises(vmmbuf.InvalidArgumentError, match="memory_margin_bytes is -1"):
        saver.memory_margin_bytes = -1
    with pytest.raises(TypeError, match="memory_margin_bytes must be an integer"):
        saver.memory_margin_bytes = 1.5
    assert margins == [1 << 30], "refused values set nothing"
    # TMS_INIT_ENABLE: vmmbuf process-wide, the default tag for every thread.
    calls: List[Any] = []
    monkeypatch.setattr(tms._vtorch, "use", lambda: calls.append("use"))
    monkeypatch.setattr(tms._native, "set_default_tag", lambda t: calls.append(t))
    # The C tms_resume is told to map free memory back (resume's default
    # where vmmbuf is the process's allocator), and told again on a change.
    restores: List[bool] = []
    monkeypatch.setattr(tms._native, "set_tms_restore_free", restores.append)
    monkeypatch.setattr(tms._vtorch, "is_process_wide", lambda: "use" in calls)
    assert not tms._init_enable(tms.TorchMemorySaver(), {}) and calls == []
    assert not tms._init_enable(tms.TorchMemorySaver(), {"TMS_INIT_ENABLE": "0"}) and calls == []
    s1 = tms.TorchMemorySaver()
    assert tms._init_enable(s1, {"TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "1"})
    assert calls == ["use", "default"] and s1._used == {"default": ["pinned"]}
    assert restores == [True] and s1.restore_free and s1._restores()
    s1.restore_free = False
    assert restores == [True, False] and not s1._restores()
    with pytest.raises(TypeError, match="restore_free must be True or False"):
        s1.restore_free = 1
    assert restores == [True, False] and not s1.restore_free
    calls.clear()
    s2 = tms.TorchMemorySaver()
    assert tms._init_enable(s2, {"TMS_INIT_ENABLE": "1"})
    assert calls == ["use", "default\x1fdiscard"] and s2._used == {"default": ["discard"]}
    calls.clear()
    s3 = tms.TorchMemorySaver()
    assert tms._init_enable(s3, {"TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "1",
                                 "TMS_INIT_CPU_BACKUP_BACKEND": "mmap"})
    assert calls == ["use", "default\x1fmmap"] and s3._used == {"default": ["mmap"]}
    # vLLM's interface: one allocator; bad tags refused before any CUDA call.
    a = vllm.CuMemAllocator.get_instance()
    assert a is vllm.CuMemAllocator.get_instance() and a.current_tag == "default"
    with pytest.raises(TypeError, match="tag must be a string"):
        with a.use_memory_pool(tag=7):
            pass
    with pytest.raises(vmmbuf.InvalidArgumentError, match="must not be empty"):
        with a.use_memory_pool(tag=""):
            pass
    assert a.current_tag == "default", "a refused pool leaves the current tag"
    with pytest.raises(TypeError, match="a tuple or list of tags"):
        a.sleep(offload_tags=5)
    with pytest.raises(TypeError, match="a tuple or list of tags"):
        a.wake_up(tags="weights")
    a.sleep(offload_tags=())  # no tag used yet: nothing to do
    a.wake_up()
    assert a.get_current_usage() == 0
    vllm.CuMemAllocator.instance = None


def test_the_preload_library_answers_through_vmmbuf_and_passes_on_otherwise(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The preload library (torch_memory_saver's preload mode): it exports
    cudaMalloc and cudaFree; unattached, or attached with preload mode off
    or no tag on the thread, a call goes on to the CUDA runtime (none in
    this process: cudaErrorInitializationError, 3); attaching finds the
    package's native module; a pointer vmmbuf never made is passed on."""
    import ctypes

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    data = vmmbuf._native.preload_library()
    assert data is not None and data[:4] == b"\x7fELF"
    path = os.path.join(str(tmp_path), "vmmbuf", "x.so")
    os.makedirs(os.path.dirname(path))
    with open(path, "wb") as f:
        f.write(data)
    lib = ctypes.CDLL(path)              # loaded locally: it interposes nothing here
    lib.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
    lib.cudaFree.argtypes = [ctypes.c_void_p]
    lib.vmmbuf_preload_attach.argtypes = [ctypes.c_char_p]
    p = ctypes.c_void_p()
    assert lib.vmmbuf_preload_attached() == 0
    assert lib.cudaMalloc(ctypes.byref(p), 1 << 20) == 3, "no runtime after it"
    assert lib.vmmbuf_preload_attach(b"/no/such/module.so") == -1
    assert lib.vmmbuf_preload_attach(vmmbuf.library_path().encode()) == 0
    assert lib.vmmbuf_preload_attached() == 1
    assert lib.cudaMalloc(ctypes.byref(p), 1 << 20) == 3, "preload mode off: passed on"
    vmmbuf._native.set_preload(True)
    try:
        assert lib.cudaMalloc(ctypes.byref(p), 1 << 20) == 3, "no tag: passed on"

        def tagged_without_a_context() -> int:
            # A tag, but no CUDA context current (a new thread has none, even
            # where an earlier test made one current on this thread): passed
            # on as well.
            with vmmbuf.tag("weights"):
                return int(lib.cudaMalloc(ctypes.byref(ctypes.c_void_p()), 1 << 20))

        answers: List[int] = []
        t = threading.Thread(target=lambda: answers.append(tagged_without_a_context()))
        t.start()
        t.join()
        assert answers == [3], answers
        assert lib.cudaFree(ctypes.c_void_p(0x1234)) == 3, "not vmmbuf's: passed on"
    finally:
        vmmbuf._native.set_preload(False)


def test_a_pinned_backup_is_prepared_in_the_background_as_its_region_ends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """torch_memory_saver's interface pins a region's CPU backup on a
    thread of its own as the region ends (the first pause then copies
    without pinning): the region's thread does not wait for it, a pause
    waits for it first, regions without a pinned backup prepare nothing,
    ``prepare_backup = False`` turns it off, and a preparation that fails
    is told as a warning while the pause goes on. With stand-ins for the
    native calls, so it runs without a GPU."""
    import contextlib
    import time

    _, tms, _ = _on_a_stand_in_torch(monkeypatch)
    monkeypatch.setattr(tms._saver, "_allocating_as",
                        lambda *a, **k: contextlib.nullcontext())
    calls: List[Any] = []
    release = threading.Event()

    def prepare(tag: str, wait: bool, mode: str) -> int:
        release.wait(5)
        if tag.startswith("bad"):
            raise RuntimeError("no pinned memory left")
        calls.append(("prepare", tag, wait, mode))
        return 1 << 20

    def sleep(tag: str, mode: str) -> Tuple[int, int]:
        calls.append(("sleep", tag, mode))
        return (1 << 20, 1 << 20)

    monkeypatch.setattr(tms._native, "prepare_sleep", prepare)
    monkeypatch.setattr(tms._native, "sleep", sleep)
    saver = tms.TorchMemorySaver()
    assert saver.prepare_backup
    start = time.monotonic()
    with saver.region("w", enable_cpu_backup=True):
        pass
    with saver.region("kv"):
        pass
    with saver.region("m", enable_cpu_backup=True, cpu_backup_backend="mmap"):
        pass
    assert time.monotonic() - start < 1.0 and calls == [], "the region's thread did not wait"
    release.set()
    saver.pause("w")
    assert calls == [("prepare", "w", True, "stash"), ("sleep", "w", "stash")], calls
    calls.clear()
    kept = tms.TorchMemorySaver(reachable=True)
    with kept.region("r", enable_cpu_backup=True):
        pass
    kept.pause("r")
    assert calls == [("prepare", "r", True, "keep"), ("sleep", "r", "keep")], calls
    calls.clear()
    saver.prepare_backup = False
    with saver.region("w2", enable_cpu_backup=True):
        pass
    saver.pause("w2")
    assert calls == [("sleep", "w2", "stash")], calls
    with pytest.raises(TypeError, match="prepare_backup must be True or False"):
        saver.prepare_backup = 1
    calls.clear()
    saver.prepare_backup = True
    with saver.region("bad", enable_cpu_backup=True):
        pass
    with pytest.warns(RuntimeWarning, match="no pinned memory left"):
        saver.pause("bad")
    assert calls == [("sleep", "bad", "stash")], calls
    monkeypatch.setenv("VMMBUF_TMS_PREPARE", "0")
    assert not tms.TorchMemorySaver().prepare_backup


def test_a_resume_keeps_the_pinned_memory_for_the_next_pause_while_prepare_backup(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 42: a resume without ``retain_cpu_backup`` gave the pinned
    host memory back every time, so every later pause pinned it anew (about
    0.25 s per GiB; 262 ms/GiB steady through this interface on an H200
    against 24 through vmmbuf's own). With ``prepare_backup`` (the default)
    the memory stays for the next pause and the contents still go (the wake
    keeps no backup); with it off, or ``retain_cpu_backup``, as before.
    With stand-ins for the native calls, so it runs without a GPU."""
    import contextlib

    _, tms, _ = _on_a_stand_in_torch(monkeypatch)
    monkeypatch.setattr(tms._saver, "_allocating_as",
                        lambda *a, **k: contextlib.nullcontext())
    calls: List[Any] = []
    monkeypatch.setattr(tms._native, "prepare_sleep", lambda tag, wait, mode: 1 << 20)
    monkeypatch.setattr(tms._native, "sleep", lambda tag, mode: (1 << 20, 1 << 20))

    def wake(tag: str, zeroed: bool, keep: bool, restore: bool) -> Tuple[int, int]:
        calls.append(("wake", tag, keep))
        return (1 << 20, 0)

    def release_host_cache() -> int:
        calls.append(("release",))
        return 1 << 20

    monkeypatch.setattr(tms._native, "wake", wake)
    monkeypatch.setattr(tms._native, "release_host_cache", release_host_cache)
    saver = tms.TorchMemorySaver()
    with saver.region("w", enable_cpu_backup=True):
        pass
    for prepare, retain, want in ((True, False, [("wake", "w", False)]),
                                  (False, False, [("wake", "w", False), ("release",)]),
                                  (False, True, [("wake", "w", True)]),
                                  (True, True, [("wake", "w", True)])):
        saver.prepare_backup, saver.retain_cpu_backup = prepare, retain
        calls.clear()
        saver.pause("w")
        saver.resume("w")
        assert calls == want, (prepare, retain, calls)
