#!/usr/bin/env python3
"""NCCL registration that follows vmmbuf's memory (vmmbuf.torch.register_nccl).

PyTorch's ProcessGroupNCCL.register_mem_pool registers a pool's segments once:
memory mapped later is not registered. Here every device range vmmbuf maps is
registered with the group's communicator when it is mapped and deregistered
before it is unmapped, so a training or serving process whose memory grows,
shrinks and sleeps stays registered. The script grows a set of tensors,
all-reduces each (checked), gives memory back, sleeps and wakes, and prints
what was registered at each step.

    python3 python/examples/nccl_register.py                           # one rank
    torchrun --nproc_per_node 2 python/examples/nccl_register.py       # one per GPU

Needs PyTorch with CUDA and NCCL; exits with a message where there is none.
"""

from __future__ import annotations

import os
import sys
import tempfile

# vmmbuf makes its chunks as ncclMemAlloc does (exportable, RDMA capable):
# it must be set before the first CUDA allocation.
os.environ.setdefault("VMMBUF_TORCH_NCCL_READY", "1")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def main() -> int:
    try:
        import torch
    except ImportError:
        print("PyTorch is not installed: this example needs it, with CUDA and NCCL")
        return 0
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to register (this example needs a GPU)")
        return 0
    import torch.distributed as dist

    import vmmbuf
    import vmmbuf.torch as vt

    vt.use()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(dev)
    if "MASTER_ADDR" in os.environ:
        dist.init_process_group("nccl", device_id=dev)
    else:
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=dev)

    def show(what: str) -> None:
        s = vmmbuf.stats(dev.index)
        if rank == 0:
            print(f"{what:<28} mapped {s['nccl_mapped_bytes'] / 2**20:8.1f} MiB, "
                  f"registered {s['nccl_registered_bytes'] / 2**20:8.1f} MiB, "
                  f"{s['nccl_registrations']:3d} registrations, "
                  f"{s['nccl_deregistrations']:3d} undone, {s['nccl_failures']} refused")

    with vt.register_nccl() as reg:
        show("registered")
        g = torch.Generator(device=dev).manual_seed(rank)
        kept = []
        for n in (1 << 20, 6 << 20, 20 << 20, 48 << 20):
            x = torch.randint(-100, 100, (n,), device=dev, generator=g, dtype=torch.int32)
            parts = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(parts, x)
            dist.all_reduce(x)
            assert torch.equal(x, sum(parts)), "all-reduce over registered memory"
            kept.append(x)
            show(f"grown by {n * 4 >> 20} MiB")
        del kept[2:], parts
        torch.cuda.synchronize()
        vt.empty_cache()
        show("after empty_cache")
        vmmbuf.sleep(reachable=False)
        show("asleep")
        vmmbuf.wake()
        for x in kept:
            dist.all_reduce(x)
        show("awake, all-reduced again")
    show(f"closed ({reg!r})")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
