"""Shared fixtures: GPU tests skip with a printed reason where there is no
GPU (or no PyTorch/CuPy), and fail instead under VMMBUF_REQUIRE_GPU=1, so a
broken GPU path never passes silently."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import Optional

import pytest

REQUIRE_GPU = os.environ.get("VMMBUF_REQUIRE_GPU") == "1"


def _torch_gpu_reason() -> Optional[str]:
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed"
    if not torch.cuda.is_available():
        return "PyTorch sees no CUDA device"
    return None


def _cupy_reason() -> Optional[str]:
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed"
    try:
        cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - any CUDA failure means no GPU here
        return f"CuPy sees no CUDA device: {e}"
    return None


def _need(reason: Optional[str]) -> None:
    if reason is None:
        return
    if REQUIRE_GPU:
        pytest.fail(f"VMMBUF_REQUIRE_GPU=1 but {reason}")
    print(f"skipped (needs a GPU): {reason}")
    pytest.skip(reason)


@pytest.fixture
def torch_gpu():
    """PyTorch with a GPU, or skip (fail under VMMBUF_REQUIRE_GPU=1)."""
    _need(_torch_gpu_reason())
    import torch

    return torch


@pytest.fixture
def cupy_gpu():
    """CuPy with a GPU, or skip (fail under VMMBUF_REQUIRE_GPU=1)."""
    _need(_cupy_reason())
    import cupy

    return cupy


def run_script(code: str, timeout: float = 300.0, env: Optional[dict] = None) -> str:
    """Runs ``code`` in a fresh interpreter (a process-wide allocator must be
    installed before CUDA starts); fails with its output unless it exits 0.
    Returns its stdout."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                       text=True, timeout=timeout, env=full_env)
    assert p.returncode == 0, f"exit {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    return p.stdout
