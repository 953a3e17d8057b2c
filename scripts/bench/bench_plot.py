#!/usr/bin/env python3
"""Plots grow_step medians from one criterion run: scripts/bench/bench_plot.py DIR OUT.png"""
import json
import pathlib
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

root, out = pathlib.Path(sys.argv[1]), sys.argv[2]
sizes = ["64MiB", "1GiB", "8GiB"]
who = [("vmmbuf_pooled", "vmmbuf, pooled chunk"), ("vmmbuf", "vmmbuf"), ("raw_create_map_access", "raw create+map+access"),
       ("cuMemAllocAsync_copy_free", "cuMemAllocAsync + copy"), ("cuMemAlloc_copy_free", "cuMemAlloc + copy")]
med = lambda b: json.loads((root / b / "new" / "estimates.json").read_text())["median"]["point_estimate"] / 1e3
fig, ax = plt.subplots(figsize=(8, 4.2))
w = 0.16
for i, (key, label) in enumerate(who):
    ax.bar([x + (i - 2) * w for x in range(3)], [med(f"grow_step/{key}/{n}") for n in sizes], w, label=label)
ax.set_yscale("log")
ax.set_xticks(range(3), [f"N = {n}" for n in sizes])
ax.set_ylabel("one growth step N -> 2N, median (us, log)")
ax.set_title("grow_step on an H200 (driver 580.159.04), lower is better")
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(out, dpi=110)
