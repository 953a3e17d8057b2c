#!/usr/bin/env python3
"""vmmbuf's first minutes from Python: a tensor that grows in place.

    pip install ".[numpy]"        # in a clone of the repository
    python3 python/examples/quickstart.py

Runs on the GPU through PyTorch if PyTorch sees one, else in host memory
with NumPy, and says which. Either way: room for a million rows is reserved
(no memory yet), rows are appended, the memory grows underneath without a
copy, and the address never changes.
"""

from __future__ import annotations

import numpy as np

import vmmbuf


def on_the_host() -> None:
    kv = vmmbuf.GrowableTensor("float32", (1_000_000, 64), device="cpu")
    base = kv.data_ptr()
    rng = np.random.default_rng(0)
    rows = []
    for step in range(1, 6):
        block = rng.standard_normal((step * 1000, 64)).astype(np.float32)
        kv.append(block)
        rows.append(block)
        print(f"  {len(kv):>6} rows, {kv.mapped_bytes / 2**20:5.1f} MiB mapped, "
              f"address {kv.data_ptr():#x}")
    assert kv.data_ptr() == base, "the address moved"
    assert np.array_equal(kv.numpy(), np.concatenate(rows)), "a row changed"
    kv.resize(100)
    kv.shrink_to_fit()
    print(f"  resized to {len(kv)} rows and shrunk: {kv.mapped_bytes / 2**20:.1f} MiB mapped")


def on_the_gpu(torch) -> None:  # noqa: ANN001 - torch is optional
    vmmbuf.torch.use()  # every CUDA tensor from vmmbuf, before the first one
    kv = vmmbuf.GrowableTensor(torch.float16, (1_000_000, 128), device="cuda")
    base = kv.data_ptr()
    for _ in range(5):
        kv.append(torch.randn(4096, 128, device="cuda", dtype=torch.float16))
    assert kv.data_ptr() == base
    total = kv.tensor.float().sum().item()
    print(f"  {len(kv)} rows on the GPU, {kv.mapped_bytes / 2**20:.1f} MiB mapped, sum {total:.1f}")
    with vmmbuf.tag("weights"):
        w = torch.randn(4096, 4096, device="cuda")
    before = w.sum().item()
    vmmbuf.sleep("weights")  # its device memory goes back; the data waits in pinned host memory
    vmmbuf.wake("weights")   # back on the GPU, at the same address
    assert w.sum().item() == before
    print(f"  slept and woke 64 MiB of weights at the same address {w.data_ptr():#x}")


def main() -> None:
    try:
        import torch
        import vmmbuf.torch  # noqa: F401 - registers the allocator module

        gpu = torch.cuda.is_available()
    except ImportError:
        torch, gpu = None, False
    if gpu:
        print("vmmbuf quickstart on the GPU (PyTorch):")
        on_the_gpu(torch)
    else:
        print("vmmbuf quickstart in host memory (no GPU that PyTorch sees; NumPy):")
        on_the_host()


if __name__ == "__main__":
    main()
