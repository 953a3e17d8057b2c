"""A pytest plug-in for running another project's own tests on vmmbuf.

``PEER_ALLOCATOR=vmmbuf`` makes vmmbuf the allocator before every test's
set-up: CuPy's (``vmmbuf.cupy.use()``) for CuPy's suite. Tests that install
an allocator of their own and put CuPy's default pool back afterwards would
otherwise leave the rest of the session on CuPy's pool; a test whose fixture
installs its own pool keeps it. Anything else (``native``, unset)
leaves the peer's own allocator alone: the same tests, the baseline.

PyTorch's process-wide allocator must be chosen before CUDA starts, so for
PyTorch's suite the choice is made at import time here (``vmmbuf`` process
wide) or by ``PEER_ALLOCATOR=vmmbuf-mempool`` (every test inside a vmmbuf
``MemPool``)."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import pytest

_WHICH = os.environ.get("PEER_ALLOCATOR", "native")
_SUITE = os.environ.get("PEER_SUITE", "cupy")

if _SUITE == "torch" and _WHICH == "vmmbuf":
    import vmmbuf.torch

    vmmbuf.torch.use()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: Any) -> None:
    # Before the test's fixtures: a fixture that installs a pool of its own
    # (and inspects it) keeps it for the test.
    if _SUITE == "cupy" and _WHICH == "vmmbuf":
        import vmmbuf.cupy

        vmmbuf.cupy.use()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: Any) -> Iterator[None]:
    with _scope():
        yield


@contextlib.contextmanager
def _scope() -> Iterator[None]:
    if _SUITE == "torch" and _WHICH == "vmmbuf-mempool":
        import torch
        import vmmbuf.torch

        pool = _mempool()
        with torch.cuda.use_mem_pool(pool):
            yield
    else:
        yield


_POOL: Any = None


def _mempool() -> Any:
    global _POOL
    if _POOL is None:
        import vmmbuf.torch

        _POOL = vmmbuf.torch.MemPool()
    return _POOL


def pytest_report_header(config: Any) -> str:
    return f"peer suite {_SUITE}, allocator {_WHICH}"
