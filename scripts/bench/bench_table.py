#!/usr/bin/env python3
"""Ratio tables for BENCHMARKS.md from one criterion run.

Usage: scripts/bench/bench_table.py DIR   (DIR holds criterion's output, e.g. the
`criterion/` folder unpacked from the GPU runner's criterion.tgz)
Prints markdown: each benchmark's median (criterion's point estimate of the
median) and the ratios the issue's targets are stated in.
"""
import json
import pathlib
import sys


def median_ns(root, bench):
    est = json.loads((root / bench / "new" / "estimates.json").read_text())
    return est["median"]["point_estimate"]


def fmt(ns):
    return f"{ns / 1e6:.2f} ms" if ns >= 1e6 else f"{ns / 1e3:.1f} us"


def main():
    root = pathlib.Path(sys.argv[1])
    m = lambda b: median_ns(root, b)
    print("| grow_step N -> 2N | vmmbuf | raw create+map+access | cuMemAlloc+copy+free | cuMemAllocAsync+copy+free | vmmbuf, pooled chunk | alloc+copy / vmmbuf | vmmbuf / raw | alloc+copy / pooled |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in ["64MiB", "1GiB", "8GiB"]:
        v, r, a, s, p = (m(f"grow_step/{w}/{n}") for w in
                         ["vmmbuf", "raw_create_map_access", "cuMemAlloc_copy_free", "cuMemAllocAsync_copy_free", "vmmbuf_pooled"])
        print(f"| {n} | {fmt(v)} | {fmt(r)} | {fmt(a)} | {fmt(s)} | {fmt(p)} | {a / v:.2f}x | {v / r:.3f}x | {a / p:.0f}x |")
    d, e, c = (m(f"kv_growth/{w}") for w in ["vmmbuf_default", "vmmbuf_exact_2MiB", "cuMemAlloc_doubling"])
    print()
    print("| kv_growth to 2 GiB in 2 MiB steps | total | vs doubling |")
    print("|---|---|---|")
    print(f"| vmmbuf, default policy | {fmt(d)} | {d / c:.2f}x |")
    print(f"| vmmbuf, exact 2 MiB chunks | {fmt(e)} | {e / c:.2f}x |")
    print(f"| cuMemAlloc doubling + copy | {fmt(c)} | 1x |")
    n, p = m("regrow/no_pool"), m("regrow/pool")
    v, r = m("overhead/vmmbuf_map_2MiB"), m("overhead/raw_map_2MiB")
    print()
    print("| other | vmmbuf | baseline | ratio |")
    print("|---|---|---|---|")
    print(f"| regrow: shrink to 0, grow back to 1 GiB (pool vs none) | {fmt(p)} | {fmt(n)} | {n / p:.2f}x faster |")
    print(f"| overhead: map one 2 MiB chunk (vs raw calls) | {fmt(v)} | {fmt(r)} | {100 * (v / r - 1):+.1f}% |")


if __name__ == "__main__":
    main()
