#!/usr/bin/env python3
"""Record the allocations of a real PyTorch training run and write them as a
vmmbuf trace (CSV: op,id,bytes,stream,time_us), for replay through an Arena.

    python3 scripts/bench/torch_trace.py OUT.csv.gz [--steps N]

The workloads are those of torch_allocators.py (--workload transformer: an
nn.TransformerEncoder on random sequence lengths, where PyTorch's native
caching allocator fragments; --workload conv: a conv net on random batch
sizes; vision-res, causal-lm, kv-decode and transformer-xl as there), each
step as torch_allocators.py takes it (trained with AdamW; kv-decode decoded
without gradients), fixed seed. The recorded transformer trace in the
repository predates the shared workload code: the same model, written out
here before. torch.cuda.memory._record_memory_history records every
alloc and free; _snapshot() hands them over. Frees are taken when requested
(free_requested), falling back to free_completed; the arena keeps stream
order itself. PyTorch's own peaks are printed for reference.
"""
import argparse
import gzip
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_allocators  # noqa: E402  (the workloads)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--workload", default="transformer",
                    choices=torch_allocators.WORKLOADS + torch_allocators.EXTRA_WORKLOADS)
    args = ap.parse_args()
    torch.manual_seed(0)
    rng = random.Random(0)
    dev = torch.device("cuda")
    torch.cuda.memory._record_memory_history(max_entries=2_000_000)
    model, batch, loss_of, train = torch_allocators.build(args.workload, torch, dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for step in range(args.steps):
        x, y = batch(rng)
        loss = torch_allocators.step_once(torch, model, opt, loss_of, train, x, y)
        if step % 10 == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    traces = snap["device_traces"][0]
    ids, freed, n_alloc, n_free = {}, set(), 0, 0
    next_id = 0
    with gzip.open(args.out, "wt") as f:
        f.write("op,id,bytes,stream,time_us\n")
        for e in traces:
            a = e["action"]
            if a == "alloc":
                next_id += 1
                ids[e["addr"]] = next_id
                f.write(f"alloc,{next_id},{e['size']},{e.get('stream', 0)},{e.get('time_us', 0)}\n")
                n_alloc += 1
            elif a in ("free_requested", "free_completed"):
                i = ids.get(e["addr"])
                if i is None or i in freed:
                    continue
                freed.add(i)
                f.write(f"free,{i},{e['size']},{e.get('stream', 0)},{e.get('time_us', 0)}\n")
                n_free += 1
    print(f"trace: {n_alloc} allocs, {n_free} frees, {len(traces)} history entries")
    print(f"torch peaks: allocated {torch.cuda.max_memory_allocated()} reserved {torch.cuda.max_memory_reserved()}")


if __name__ == "__main__":
    main()
