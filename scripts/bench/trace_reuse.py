#!/usr/bin/env python3
"""How many of a trace's allocations an exact-size, same-stream cache of
freed blocks would serve: a diagnostic for the plug-in's per-call cost
(issue 40), not a claim about any allocator.

    python3 scripts/bench/trace_reuse.py traces/torch-fsdp-h100.csv.gz [...]

A freed block of N bytes on stream S is kept, unbounded and uncoalesced; a
later allocation of exactly N bytes on S takes the most recent one. Such a
hit would touch a few cache lines instead of the free-block index, and
needs no fence (the same stream orders the reuse after the old uses).
Prints, per trace, the allocations, the hits, and the frees made on another
stream than the allocation's (never cacheable this way).
"""
import collections
import csv
import gzip
import sys
from typing import Dict, Iterable, Tuple


def reuse(rows: Iterable[Dict[str, str]]) -> Tuple[int, int, int]:
    """(allocations, exact-size same-stream hits, frees on another stream)."""
    live: Dict[str, Tuple[int, str]] = {}
    kept: Dict[Tuple[str, int], int] = collections.defaultdict(int)
    allocs = hits = cross = 0
    for r in rows:
        if r["op"] == "alloc":
            size, stream = int(r["bytes"]), r["stream"]
            allocs += 1
            if kept[(stream, size)] > 0:
                kept[(stream, size)] -= 1
                hits += 1
            live[r["id"]] = (size, stream)
        elif r["op"] == "free" and r["id"] in live:
            size, stream = live.pop(r["id"])
            if r["stream"] == stream:
                kept[(stream, size)] += 1
            else:
                cross += 1
    return allocs, hits, cross


def main() -> None:
    paths = sys.argv[1:] or ["traces/torch-fsdp-h100.csv.gz"]
    for p in paths:
        opener = gzip.open if p.endswith(".gz") else open
        with opener(p, "rt") as f:
            allocs, hits, cross = reuse(csv.DictReader(f))
        share = hits / allocs if allocs else 0.0
        print(f"{p}: {allocs} allocations, {hits} exact-size same-stream hits ({share:.1%}),"
              f" {cross} frees on another stream")


if __name__ == "__main__":
    main()
