#!/usr/bin/env python3
"""What one tensor allocation and free cost the CPU through PyTorch, per
allocator, each in its own process, interleaved over rounds:

    python3 scripts/bench/torch_alloc_cost.py [--allocs native,expandable,vmmbuf] [--rounds 3]

The pattern is a training step's (benches/hot_path.rs in vmmbuf-torch draws
the same): sizes from 48 shapes, 512 B to 24 MiB, small ones more often, 40
tensors live, each step one `torch.empty` and one free of the oldest, on the
current stream. Reported: microseconds per pair (the median over rounds of
each round's mean), against native's; for vmmbuf also the time the plug-in
itself measured inside its malloc and free (`host_ns_in_malloc`,
`host_ns_in_free`), so what PyTorch and the plug-in's C entry points (their
context guard) add around it shows.

Allocators: native, expandable (expandable_segments:True), vmmbuf
(process-wide plug-in), vmmbuf-nographs (VMMBUF_TORCH_GRAPHS=0),
vmmbuf-defer (VMMBUF_TORCH_DEFER_FENCES=1), vmmbuf-asked
(VMMBUF_TORCH_ANNOUNCE_CAPTURES=0: every call asks the driver whether its
stream is captured, as before captures were announced), vmmbuf-alt (the
package in DIST_ALT_PATH, put first on sys.path: another build in the same
rounds).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from alt_build import import_alt_build

WARM, PAIRS, LIVE = 4000, 40000, 40


def sizes(n):
    import math
    lo, hi = math.log(512), math.log(24 << 20)
    shapes = [int(math.exp(lo + (hi - lo) * i / 47)) for i in range(48)]
    x, out, mask = 0x2545F4914F6CDD1D, [], (1 << 64) - 1
    for _ in range(n):
        x ^= (x << 13) & mask
        x ^= x >> 7
        x ^= (x << 17) & mask
        out.append(shapes[min(x % 48, (x >> 8) % 48)])
    return out


def worker(alloc):
    if alloc == "expandable":
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if alloc == "vmmbuf-nographs":
        os.environ["VMMBUF_TORCH_GRAPHS"] = "0"
    if alloc == "vmmbuf-defer":
        os.environ["VMMBUF_TORCH_DEFER_FENCES"] = "1"
    if alloc == "vmmbuf-asked":
        os.environ["VMMBUF_TORCH_ANNOUNCE_CAPTURES"] = "0"
    if alloc == "vmmbuf-alt":
        import_alt_build()
    import torch
    vt = None
    if alloc.startswith("vmmbuf"):
        import vmmbuf as vt
        import vmmbuf.torch
        vmmbuf.torch.use()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    draw = sizes(WARM + PAIRS)
    empty, u8 = torch.empty, torch.uint8
    live = []
    for n in draw[:WARM]:
        live.append(empty(n, dtype=u8, device=dev))
        if len(live) > LIVE:
            del live[0]
    torch.cuda.synchronize()
    s0 = vt.stats(0) if vt else None
    t = time.perf_counter()
    for n in draw[WARM:]:
        live.append(empty(n, dtype=u8, device=dev))
        if len(live) > LIVE:
            del live[0]
    dt = time.perf_counter() - t
    res = {"alloc": alloc, "us_per_pair": 1e6 * dt / PAIRS}
    # The loop itself without allocation: list work and the Python calls.
    t = time.perf_counter()
    x = empty(1, dtype=u8, device=dev)
    for n in draw[WARM:]:
        live.append(x)
        if len(live) > LIVE:
            del live[0]
    res["us_loop_only"] = 1e6 * (time.perf_counter() - t) / PAIRS
    if vt:
        s1 = vt.stats(0)
        allocs = s1["num_allocs"] - s0["num_allocs"]
        res["us_in_plugin_malloc"] = (s1["host_ns_in_malloc"] - s0["host_ns_in_malloc"]) / 1e3 / max(allocs, 1)
        res["us_in_plugin_free"] = (s1["host_ns_in_free"] - s0["host_ns_in_free"]) / 1e3 / max(allocs, 1)
        res["fence_queries_per_pair"] = (s1["num_fence_queries"] - s0["num_fence_queries"]) / PAIRS
    print("RESULT " + json.dumps(res), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--allocs", default="native,expandable,vmmbuf,vmmbuf-nographs")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a.worker)
    allocs = a.allocs.split(",")
    got = {k: [] for k in allocs}
    for r in range(a.rounds):
        order = allocs[r % len(allocs):] + allocs[:r % len(allocs)]
        for k in order:
            p = subprocess.run([sys.executable, __file__, "--worker", k], capture_output=True, text=True, timeout=600)
            line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            if p.returncode != 0 or not line:
                sys.stderr.write(p.stdout + p.stderr)
                raise SystemExit(f"{k}: failed (rc {p.returncode})")
            got[k].append(json.loads(line[0][7:]))
    base = statistics.median(x["us_per_pair"] for x in got["native"]) if "native" in got else None
    print(f"alloc+free pairs ({PAIRS} a round, {LIVE} live), median of {a.rounds} rounds' means")
    print("| allocator | us per pair | vs native | loop alone us | in plug-in malloc us | in plug-in free us | fence queries/pair |")
    print("|---|---|---|---|---|---|---|")
    for k, v in got.items():
        med = statistics.median(x["us_per_pair"] for x in v)
        loop = statistics.median(x["us_loop_only"] for x in v)
        rel = f"{med / base:.2f}x" if base else "-"
        extra = ["-", "-", "-"]
        if "us_in_plugin_malloc" in v[0]:
            extra = [f"{statistics.median(x[c] for x in v):.2f}" for c in
                     ("us_in_plugin_malloc", "us_in_plugin_free", "fence_queries_per_pair")]
        print(f"| {k} | {med:.2f} | {rel} | {loop:.2f} | " + " | ".join(extra) + " |")


if __name__ == "__main__":
    main()
