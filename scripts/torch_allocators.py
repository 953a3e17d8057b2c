#!/usr/bin/env python3
"""Train a PyTorch workload under one allocator per process and compare:
native caching, expandable_segments:True, backend:cudaMallocAsync, vmmbuf.

    python3 scripts/torch_allocators.py --all [--steps N]      # a table
    python3 scripts/torch_allocators.py --alloc vmmbuf         # one run, JSON last

Per run: the loss at every step (same seed everywhere), peak allocated
(PyTorch's counter, or the arena's), peak device memory taken (cuMemGetInfo
against the free memory before the first allocation, sampled after every
step), utilization (allocated / taken) and the median step time.
"""
import argparse
import json
import os
import subprocess
import sys
import time

CONF = {
    "native": None,
    "expandable": "expandable_segments:True",
    "async": "backend:cudaMallocAsync",
    "vmmbuf": None,
}


def run_one(alloc, steps):
    if CONF[alloc]:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = CONF[alloc]
    if alloc == "vmmbuf":
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
        import vmmbuf_torch
        vmmbuf_torch.use()
    import random
    import torch
    torch.manual_seed(0)
    random.seed(0)
    dev = torch.device("cuda")
    free0, _ = torch.cuda.mem_get_info()
    d = 512
    layer = torch.nn.TransformerEncoderLayer(d, 8, 2048, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 6).to(dev)
    head = torch.nn.Linear(d, 1000).to(dev)
    opt = torch.optim.AdamW(list(model.parameters()) + list(head.parameters()), lr=1e-4)
    losses, times, min_free = [], [], free0
    for step in range(steps):
        seq = random.randint(32, 512)
        batch = random.choice([16, 24, 32])
        x = torch.randn(batch, seq, d, device=dev)
        y = torch.randint(0, 1000, (batch, seq), device=dev)
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = head(model(x))
        loss = torch.nn.functional.cross_entropy(out.reshape(-1, 1000), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
        min_free = min(min_free, torch.cuda.mem_get_info()[0])
    if alloc == "vmmbuf":
        peak_alloc = vmmbuf_torch.stats()["allocated_bytes.all.peak"]
    else:
        peak_alloc = torch.cuda.max_memory_allocated()
    taken = free0 - min_free
    times.sort()
    res = {
        "alloc": alloc,
        "losses": losses,
        "peak_allocated": peak_alloc,
        "peak_taken": taken,
        "utilization": peak_alloc / taken if taken else 0.0,
        "median_step_ms": 1000 * times[len(times) // 2],
    }
    print(json.dumps(res), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--alloc", choices=list(CONF))
    ap.add_argument("--all", action="store_true")
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args()
    if not a.all:
        run_one(a.alloc, a.steps)
        return
    results = {}
    for alloc in CONF:
        out = subprocess.run([sys.executable, __file__, "--alloc", alloc, "--steps", str(a.steps)],
                             capture_output=True, text=True)
        last = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
        try:
            results[alloc] = json.loads(last)
        except ValueError:
            print(f"{alloc}: failed\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    native = results.get("native", {}).get("losses")
    print(f"{'allocator':<12} {'peak alloc MiB':>15} {'peak taken MiB':>15} {'utilization':>12} {'median step ms':>15} {'max |loss - native|':>20}")
    for alloc, r in results.items():
        diff = max(abs(p - q) for p, q in zip(r["losses"], native)) if native else float("nan")
        print(f"{alloc:<12} {r['peak_allocated'] / 2**20:15.1f} {r['peak_taken'] / 2**20:15.1f} "
              f"{r['utilization']:12.3f} {r['median_step_ms']:15.2f} {diff:20.2e}")
    print("losses (native):", " ".join(f"{x:.4f}" for x in (native or [])[:10]), "...")


if __name__ == "__main__":
    main()
