#!/usr/bin/env python3
"""Tensors placed across vmmbuf's chunks, gathered by NCCL with the memory
registered: the two layouts that stopped FSDP with
``register_nccl``, run as a torchrun worker on every rank.

  torchrun --nproc_per_node 2 scripts/bench/nccl_straddle.py --case join
  torchrun --nproc_per_node 2 scripts/bench/nccl_straddle.py --case reuse

``join``: rank 1 frees two chunks' worth of tensors, so that (before the
fix) the free block joined across the chunks and the next all-gather output
straddled two registrations on rank 1 only; on rank 0 it lay in one. NCCL
decides per rank whether a buffer is registered, and a collective in which
one rank's is and another's is not is undefined.

``reuse``: one large free block over several chunks; two outputs in
different chunks of it. Before the fix the chunks made one registration;
NCCL 2.28's source maps at a peer only the allocation holding the first
buffer it registers there and reuses that mapping for the registration's
later buffers, which suggested wrong peer addresses for the second. On 4x
H200 that layout gave correct data before the fix too (not confirmed);
it stays as a check that both outputs are registered and correct.

Each all-gather's result is checked element by element against every rank's
input; a collective that does not finish within ``--stall`` seconds dumps
every thread's stack and exits 3. Prints one line per collective
(``registered`` where vmmbuf says the output lies in one registration) and
``RANK r OK`` at the end. NCCL_PROTO=Simple NCCL_ALGO=Ring make NCCL take
its registered path for every size.
"""
import argparse
import faulthandler
import os
import sys

MIB = 1 << 20


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", choices=("join", "reuse"), required=True)
    ap.add_argument("--stall", type=float, default=60.0)
    a = ap.parse_args()
    os.environ.setdefault("VMMBUF_TORCH_NCCL_READY", "1")
    import torch
    import torch.distributed as dist
    import vmmbuf
    import vmmbuf.torch as vt

    vt.use()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    dist.barrier()
    reg = vt.register_nccl()
    registered = getattr(vt, "nccl_registered", None)  # absent before the fix
    gen = torch.Generator(device=dev).manual_seed(7 + rank)

    def gather(name: str, out: "torch.Tensor") -> None:
        n = out.numel() // world
        x = torch.randint(-(1 << 30), 1 << 30, (n,), device=dev, generator=gen, dtype=torch.int32)
        mine = x.clone()
        faulthandler.dump_traceback_later(a.stall, exit=True)
        dist.all_gather_into_tensor(out, x)
        torch.cuda.synchronize()
        faulthandler.cancel_dump_traceback_later()
        parts = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(parts, mine)  # the reference, into fresh tensors
        want = torch.cat(parts)
        bad = int((out != want).sum())
        reg_word = "?" if registered is None else ("registered" if registered(out) else "unregistered")
        print(f"RANK {rank} {name}: {out.numel() * 4 // MIB} MiB at {out.data_ptr():#x} {reg_word}, "
              f"{bad} of {out.numel()} elements wrong", flush=True)
        if bad:
            raise SystemExit(f"RANK {rank} {name}: {bad} elements wrong")
        if registered is not None and not registered(out):
            raise SystemExit(f"RANK {rank} {name}: the output lies in no one registration")

    # The warm-up: NCCL's own buffers and the first collective.
    gather("warm-up", torch.empty(world * MIB // 4, device=dev, dtype=torch.int32))
    if a.case == "join":
        if rank == 1:
            a_, b_ = (torch.empty(60 * MIB, device=dev, dtype=torch.uint8) for _ in range(2))
            torch.cuda.synchronize()
            del a_, b_
        out = torch.empty(100 * MIB // 4, device=dev, dtype=torch.int32)
        gather("after rank 1 freed two chunks", out)
    else:
        big = torch.empty(320 * MIB, device=dev, dtype=torch.uint8)
        torch.cuda.synchronize()
        del big
        first = torch.empty(32 * MIB // 4, device=dev, dtype=torch.int32)
        filler = torch.empty(100 * MIB, device=dev, dtype=torch.uint8)
        second = torch.empty(32 * MIB // 4, device=dev, dtype=torch.int32)
        gather("first output", first)
        gather("second output, further in the same free block", second)
        del filler
    s = vmmbuf.stats(dev.index)
    ok = s["nccl_registered_bytes"] == s["nccl_mapped_bytes"] and s["nccl_failures"] == 0
    print(f"RANK {rank} registrations={s['nccl_registrations']} registered={s['nccl_registered_bytes']} "
          f"mapped={s['nccl_mapped_bytes']} failures={s['nccl_failures']}", flush=True)
    reg.close()
    dist.destroy_process_group()
    if not ok:
        return 1
    print(f"RANK {rank} OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
