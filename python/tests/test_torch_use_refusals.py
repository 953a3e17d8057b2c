"""``vmmbuf.torch.use()`` refuses in words and installs nothing when it
cannot work: here, on a machine without a CUDA driver (CI), with a stand-in
``torch`` module whose allocator switch records whether it was called (the
refusal must come before it). Skipped where a CUDA device is usable."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import vmmbuf
from vmmbuf import _native

_FAKE_TORCH = """
import sys, types
calls = []
torch = types.ModuleType("torch")
torch.cuda = types.SimpleNamespace(
    device_count=lambda: 0,
    is_initialized=lambda: False,
    memory=types.SimpleNamespace(change_current_allocator=lambda a: calls.append(a)),
)
torch._C = types.SimpleNamespace()
sys.modules["torch"] = torch
"""


@pytest.mark.skipif(_native.cuda_unavailable() is None, reason="a CUDA device is usable here")
def test_use_without_a_driver_raises_no_device_error_naming_the_cause() -> None:
    code = _FAKE_TORCH + textwrap.dedent("""
        import vmmbuf, vmmbuf.torch as vt
        from vmmbuf.errors import NoDeviceError
        try:
            vt.use(budget_bytes=1 << 30)
            print("installed")
        except NoDeviceError as e:
            print("refused:", e)
        print("switched:", len(calls), "process-wide:", vt.is_process_wide(),
              "stats:", vmmbuf.stats(0))
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    print(p.stdout, p.stderr)
    assert p.returncode == 0, p.stderr
    refused = [line for line in p.stdout.splitlines() if line.startswith("refused:")]
    assert refused and "no CUDA device" in refused[0], p.stdout
    # The cause, in the driver's or vmmbuf's words.
    assert len(refused[0]) > len("refused: vmmbuf.torch.use(): no CUDA device to allocate on: ")
    assert "switched: 0 process-wide: False stats: {}" in p.stdout, "nothing installed"


def test_the_cause_is_stated_in_words() -> None:
    why = _native.cuda_unavailable()
    assert why is None or (isinstance(why, str) and why.strip()), why
    if why is not None:
        assert vmmbuf.device_count() == 0


@pytest.mark.skipif(_native.cuda_unavailable() is None, reason="a CUDA device is usable here")
def test_every_pytorch_entry_point_that_needs_a_gpu_raises_no_device_error() -> None:
    """``MemPool()``, ``pool()`` (vLLM's ``use_memory_pool`` goes through it)
    and ``register_nccl()`` refuse as ``use()`` does, naming the call and
    the cause, before PyTorch is asked anything (the stand-in ``torch`` has
    no CUDA to ask: a call that reached it would fail with AttributeError).
    torch_memory_saver's ``region()`` only names a tag: it makes nothing
    until a tensor is made."""
    code = _FAKE_TORCH + textwrap.dedent("""
        import vmmbuf, vmmbuf.torch as vt
        from vmmbuf.errors import NoDeviceError
        def pool():
            with vt.pool("kv"):
                pass
        for name, call in [("MemPool", vt.MemPool), ("pool", pool),
                           ("register_nccl", lambda: vt.register_nccl(12345))]:
            try:
                call()
                print(name, "ran")
            except NoDeviceError as e:
                print(name, "refused:", e)
            except Exception as e:
                print(name, "failed otherwise:", type(e).__name__, e)
        print("stats:", vmmbuf.stats(0))
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    print(p.stdout, p.stderr)
    assert p.returncode == 0, p.stderr
    for name, said in [("MemPool", "vmmbuf.torch.MemPool()"), ("pool", "vmmbuf.torch.pool()"),
                       ("register_nccl", "vmmbuf.torch.register_nccl()")]:
        line = next(x for x in p.stdout.splitlines() if x.startswith(name + " "))
        assert line.startswith(f"{name} refused: {said}: no CUDA device to allocate on: "), line
    assert "stats: {}" in p.stdout, "nothing was made"
