#!/usr/bin/env python3
"""torch.compile(mode="reduce-overhead") training (CUDA graph trees) under
PyTorch's caching allocator, expandable segments and vmmbuf process-wide,
one process per run, the runs interleaved over --rounds:

    python3 scripts/bench/compile_graphs.py [--rounds 2] [--steps 30]

The workload: a Transformer encoder (6 layers, d=512, 8 heads, batch 32,
sequence 256, fixed shapes so the tree records one forward and one
backward graph), SGD, the same seed everywhere. Per run: the loss at every
step, the peak device memory taken (cuMemGetInfo against the free memory
before the first allocation, sampled after every step), the peak allocated
(torch.cuda.max_memory_allocated) and the median step time after the
warm-up. Prints a markdown table (taken and step time as a ratio of
PyTorch's caching allocator, medians over the rounds with their range) and,
last, the runs as JSON.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ALLOCATORS = ("native", "expandable", "vmmbuf")


def child(alloc: str, steps: int) -> None:
    import torch

    if alloc == "vmmbuf":
        import vmmbuf.torch

        vmmbuf.torch.use()
    free0, _ = torch.cuda.mem_get_info()
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(512, 8, 2048, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 6).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    step_fn = torch.compile(model, mode="reduce-overhead")
    g = torch.Generator(device="cuda").manual_seed(1)
    xs = [torch.randn(32, 256, 512, device="cuda", generator=g) for _ in range(4)]
    losses, times, taken = [], [], 0
    for i in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.compiler.cudagraph_mark_step_begin()
        out = step_fn(xs[i % len(xs)])
        loss = out.float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.item()))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        free, _ = torch.cuda.mem_get_info()
        taken = max(taken, free0 - free)
    warm = times[len(times) // 3:]
    print("RESULT " + json.dumps({
        "alloc": alloc, "losses": losses, "taken": taken,
        "peak_allocated": int(torch.cuda.max_memory_allocated()),
        "step_ms": 1e3 * statistics.median(warm)}))


def run(alloc: str, steps: int) -> dict:
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if alloc == "expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    p = subprocess.run([sys.executable, __file__, "--child", alloc, "--steps", str(steps)],
                       capture_output=True, text=True, env=env, timeout=900)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not line:
        raise SystemExit(f"{alloc}: exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    return json.loads(line[-1][len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--child")
    a = ap.parse_args()
    if a.child:
        child(a.child, a.steps)
        return
    runs = []
    for r in range(a.rounds):
        for alloc in ALLOCATORS:
            res = run(alloc, a.steps)
            res["round"] = r
            runs.append(res)
            print(f"round {r} {alloc}: taken {res['taken'] / 2**20:.0f} MiB, "
                  f"step {res['step_ms']:.2f} ms", file=sys.stderr, flush=True)
    by = {x: [r for r in runs if r["alloc"] == x] for x in ALLOCATORS}

    def ratios(key: str, alloc: str) -> list:
        return [r[key] / n[key] for r, n in zip(by[alloc], by["native"])]

    print("| allocator | peak taken (MiB) | taken / caching allocator | peak allocated (MiB) "
          "| step (ms) | step / caching allocator | losses equal to the caching allocator's |")
    print("|---|---|---|---|---|---|---|")
    for alloc in ALLOCATORS:
        tk, st = ratios("taken", alloc), ratios("step_ms", alloc)
        same = all(r["losses"] == n["losses"] for r, n in zip(by[alloc], by["native"]))
        print(f"| {alloc} | {statistics.median(r['taken'] for r in by[alloc]) / 2**20:.0f} "
              f"| {statistics.median(tk):.3f} ({min(tk):.3f}-{max(tk):.3f}) "
              f"| {statistics.median(r['peak_allocated'] for r in by[alloc]) / 2**20:.0f} "
              f"| {statistics.median(r['step_ms'] for r in by[alloc]):.2f} "
              f"| {statistics.median(st):.3f} ({min(st):.3f}-{max(st):.3f}) "
              f"| {'yes' if same else 'no'} |")
    print(json.dumps(runs))


if __name__ == "__main__":
    main()
