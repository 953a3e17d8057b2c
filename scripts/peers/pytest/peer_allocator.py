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
``MemPool`` of its own); ``torch-mempool`` runs every test inside a MemPool
of PyTorch's own, the control for ``vmmbuf-mempool``: what differs between
those two is vmmbuf's doing, what they share is the pool's."""

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


# PyTorch's tests of MemPool itself make pools and destroy them; PyTorch
# aborts the process when a MemPool is destroyed while another is in use
# (c10's synchronize_and_free_events asserts that no pool is), so inside
# the vmmbuf MemPool they would test that nesting rather than vmmbuf. They
# run outside it, as under native.
_UNWRAPPED = ("TestMemPool",)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: Any) -> Iterator[None]:
    cls = getattr(item, "cls", None)
    with _scope(wrap=getattr(cls, "__name__", "") not in _UNWRAPPED):
        yield


@contextlib.contextmanager
def _scope(wrap: bool = True) -> Iterator[None]:
    if _SUITE == "torch" and _WHICH in ("vmmbuf-mempool", "torch-mempool") and wrap:
        import gc

        import torch

        # A pool per test, given back after it, as the test's memory would
        # be under native: one pool for the session kept every test's
        # cache (PyTorch's empty_cache leaves a pool in use alone), and
        # later tests ran out of memory or read its peak.
        pool = _mempool()
        try:
            with torch.cuda.use_mem_pool(pool):
                yield
        finally:
            del pool
            gc.collect()
            torch.cuda.empty_cache()
    else:
        yield


def _mempool() -> Any:
    """A vmmbuf MemPool, or (``torch-mempool``, the control) PyTorch's own."""
    if _WHICH == "torch-mempool":
        import torch

        return torch.cuda.MemPool()
    import vmmbuf.torch

    return vmmbuf.torch.MemPool()


def pytest_report_header(config: Any) -> str:
    return f"peer suite {_SUITE}, allocator {_WHICH}"
