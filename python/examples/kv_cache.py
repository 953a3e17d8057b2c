#!/usr/bin/env python3
"""A KV cache grown token by token, three ways, on PyTorch:

  growable  vmmbuf.GrowableTensor.append: grows in place, never copies, the
            address never changes (one reservation for the maximum);
  cat       torch.cat([cache, token]) every step (a new tensor each time);
  doubling  a preallocated tensor, doubled (allocate twice, copy) when full.

Each runs in its own process under PyTorch's native allocator or expandable
segments, and reports the total time, the worst step, the peak device
memory taken (cuMemGetInfo after every step, against the free memory before
the cache) and the data check (every element of the final cache).

    python3 python/examples/kv_cache.py                      # one run: growable
    python3 python/examples/kv_cache.py --method cat --alloc expandable
    python3 python/examples/kv_cache.py --all --repeats 3    # the table
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

METHODS = ("growable", "cat", "doubling")
ALLOCS = {"native": None, "expandable": "expandable_segments:True"}


def run(a: argparse.Namespace) -> None:
    if ALLOCS[a.alloc]:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOCS[a.alloc]
    import torch

    import vmmbuf

    dev = torch.device("cuda")
    row = (a.layers, 2, a.heads, a.head_dim)  # one token's K and V for every layer
    dtype = torch.float16
    torch.cuda.init()
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    min_free = free0
    g = torch.Generator(device=dev).manual_seed(0)
    # The tokens, made up front (the same for every method) as one tensor.
    tokens = torch.randn((a.tokens, *row), device=dev, dtype=dtype, generator=g)
    torch.cuda.synchronize()
    token_bytes = free0 - torch.cuda.mem_get_info()[0]
    if a.method == "growable":
        cache = vmmbuf.GrowableTensor(dtype, (a.tokens, *row), device=dev)
    elif a.method == "cat":
        cache = torch.empty((0, *row), device=dev, dtype=dtype)
    else:
        cache, n = torch.empty((16, *row), device=dev, dtype=dtype), 0
    steps = []
    data_ptrs = set()
    t0 = time.perf_counter()
    for i in range(a.tokens):
        s = time.perf_counter()
        tok = tokens[i:i + 1]
        if a.method == "growable":
            cache.append(tok)
            data_ptrs.add(cache.data_ptr())
        elif a.method == "cat":
            cache = torch.cat([cache, tok])
        else:
            if n == cache.shape[0]:
                bigger = torch.empty((2 * n, *row), device=dev, dtype=dtype)
                bigger[:n].copy_(cache)
                cache = bigger
            cache[n:n + 1].copy_(tok)
            n += 1
        torch.cuda.synchronize()
        steps.append(time.perf_counter() - s)
        if a.sample:
            min_free = min(min_free, torch.cuda.mem_get_info()[0])
    total = time.perf_counter() - t0
    final = cache.tensor if a.method == "growable" else (cache if a.method == "cat" else cache[:n])
    ok = bool(torch.equal(final, tokens))
    peak = free0 - min_free - token_bytes
    print(json.dumps({
        "method": a.method, "alloc": a.alloc, "tokens": a.tokens,
        "cache_mib": tokens.numel() * 2 / 2**20, "total_s": total,
        "median_step_us": statistics.median(steps) * 1e6, "worst_step_ms": max(steps) * 1e3,
        "peak_mib": peak / 2**20 if a.sample else None, "data_ok": ok,
        "addresses": len(data_ptrs) if a.method == "growable" else None,
    }))
    if not ok:
        raise SystemExit("the cache's data differ from the tokens appended")


def table(a: argparse.Namespace) -> None:
    rows: dict = {}
    for rep in range(a.repeats):
        for alloc in ALLOCS:
            for method in METHODS:
                for sample in (False, True):  # timing runs, then memory runs
                    cmd = [sys.executable, os.path.abspath(__file__), "--method", method,
                           "--alloc", alloc, "--tokens", str(a.tokens), "--layers", str(a.layers),
                           "--heads", str(a.heads), "--head-dim", str(a.head_dim)]
                    if sample:
                        cmd.append("--sample")
                    p = subprocess.run(cmd, capture_output=True, text=True)
                    if p.returncode != 0:
                        raise SystemExit(f"{cmd} failed:\n{p.stdout}\n{p.stderr}")
                    r = json.loads(p.stdout.strip().splitlines()[-1])
                    rows.setdefault((alloc, method), []).append(r)
                    print(f"# rep {rep} {alloc} {method} sample={sample}: {r}", flush=True)
    first = next(iter(rows.values()))[0]
    print(f"\nKV cache of {a.tokens} tokens x {a.layers} layers x 2 x {a.heads} heads x "
          f"{a.head_dim} (fp16): {first['cache_mib']:.0f} MiB; medians of {a.repeats} runs\n")
    print("| allocator | method | total (s) | median step (us) | worst step (ms) | peak memory (MiB) "
          "| peak / data | data checked |")
    print("|---|---|---|---|---|---|---|---|")
    for (alloc, method), rs in rows.items():
        timing = [r for r in rs if r["peak_mib"] is None]
        mem = [r["peak_mib"] for r in rs if r["peak_mib"] is not None]
        med = lambda k: statistics.median(r[k] for r in timing)  # noqa: E731
        peak = statistics.median(mem)
        print(f"| {alloc} | {method} | {med('total_s'):.3f} | {med('median_step_us'):.0f} | "
              f"{med('worst_step_ms'):.2f} | {peak:.0f} | {peak / first['cache_mib']:.2f}x | "
              f"{'yes' if all(r['data_ok'] for r in rs) else 'NO'} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", choices=METHODS, default="growable")
    ap.add_argument("--alloc", choices=list(ALLOCS), default="native")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--sample", action="store_true", help="sample device memory at every step")
    ap.add_argument("--all", action="store_true", help="every method under every allocator")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    # One line and exit 0 where what it needs is missing.
    try:
        import torch
    except ImportError:
        print("PyTorch is not installed: this example needs it and a CUDA GPU")
        return
    if not torch.cuda.is_available():
        print("no CUDA device: this example needs a GPU (PyTorch sees none)")
        return
    table(a) if a.all else run(a)


if __name__ == "__main__":
    main()
