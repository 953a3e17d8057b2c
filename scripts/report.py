#!/usr/bin/env python3
"""BENCHMARKS.md, made from the result files in benches/results/.

    python3 scripts/report.py            # rewrite BENCHMARKS.md from the results
    python3 scripts/report.py --check    # fail (exit 1, with a diff) if it differs: CI runs this
    python3 scripts/report.py --plots    # also redraw the plots (needs matplotlib)

Every figure in BENCHMARKS.md is computed here from a result file (a
benchmark's own output: criterion's text, a script's JSON, a script's
printed table), and every section names its file, GPU, date, commit,
command and the peer measured in the same run, from
benches/results/index.json. So the page cannot drift from the data: a new
run replaces a result file (same name, by benchmark and GPU) and its entry
in index.json, and this script rewrites the page. Only the standard library
is needed, except for --plots.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benches" / "results"
PAGE = ROOT / "BENCHMARKS.md"
MIB = 1 << 20

Row = List[str]


def index() -> Dict[str, Dict[str, str]]:
    return json.loads((RESULTS / "index.json").read_text())


def md_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def provenance(name: str, meta: Dict[str, str]) -> str:
    return (f"{meta['gpu']}, {meta['date']}, commit {meta['commit']}. Command: "
            f"`{meta['command']}`. Measured beside: {meta['peer']}. Raw: "
            f"[`benches/results/{name}`](benches/results/{name}).")


# --- growth: criterion's text ------------------------------------------------

_UNIT = {"ns": 1e-6, "µs": 1e-3, "us": 1e-3, "ms": 1.0, "s": 1e3}


def criterion(text: str) -> Dict[str, float]:
    """Each benchmark's median point estimate, in ms, by name."""
    out: Dict[str, float] = {}
    name = None
    for line in text.splitlines():
        m = re.match(r"^(\S+/\S+)\s*(time:.*)?$", line)
        if m and "/" in m.group(1) and not line.startswith((" ", "\t")):
            name = m.group(1)
            line = m.group(2) or ""
        t = re.search(r"time:\s+\[\S+ \S+ (\S+) (\S+) \S+ \S+\]", line)
        if t and name:
            out[name] = float(t.group(1)) * _UNIT[t.group(2)]
            name = None
    return out


def growth() -> Tuple[str, List[Row], Dict[str, float]]:
    name = "grow-h200.txt"
    c = criterion((RESULTS / name).read_text())
    rows, fresh, pooled = [], [], []
    for size in ("64MiB", "1GiB", "8GiB"):
        g = {k.split("/")[1]: v for k, v in c.items() if k.startswith("grow_step/") and k.endswith("/" + size)}
        v, p, a, m, r = (g["vmmbuf"], g["vmmbuf_pooled"], g["cuMemAllocAsync_copy_free"],
                         g["cuMemAlloc_copy_free"], g["raw_create_map_access"])
        fresh.append(a / v)
        pooled.append(a / p)
        rows.append([size.replace("MiB", " MiB").replace("GiB", " GiB"), ms(v), ms(p), ms(r), ms(m), ms(a),
                     f"{a / v:.2f}x", f"{a / p:.0f}x"])
    return name, rows, {"fresh_min": min(fresh), "fresh_max": max(fresh),
                        "pooled_min": min(pooled), "pooled_max": max(pooled)}


def ms(x: float) -> str:
    return f"{x * 1e3:.1f} us" if x < 1 else f"{x:.2f} ms"


# --- training: scripts/bench/torch_allocators.py's JSON ----------------------------

def runs_by_workload(name: str) -> Dict[str, Dict[str, List[Dict[str, Any]]]]:
    """A torch_allocators.py result file's runs, by workload and allocator."""
    by: Dict[str, Dict[str, List[Dict[str, Any]]]] = {}
    for row in json.loads((RESULTS / name).read_text())["rows"]:
        by.setdefault(row["workload"], {})[row["alloc"]] = row["runs"]
    return by


def training() -> Tuple[str, List[Row], Dict[str, Any]]:
    name = "torch_allocators-h200.json"
    by = runs_by_workload(name)
    labels = {"transformer": "Transformer encoder, random lengths",
              "conv": "conv net, random batches", "causal-lm": "causal LM, random batch and length"}
    rows: List[Row] = []
    figures: Dict[str, Any] = {"util": {}, "step": {}, "taken_vs_es": {}}
    for w, runs in by.items():
        med = {a: {k: statistics.median(r[k] for r in rs)
                   for k in ("utilization", "peak_taken", "median_step_ms")} for a, rs in runs.items()}
        n, e, v = med["native"], med["expandable"], med["vmmbuf"]
        taken = [rv["peak_taken"] / re_["peak_taken"] for rv, re_ in zip(runs["vmmbuf"], runs["expandable"])]
        rows.append([labels.get(w, w), f"{n['utilization']:.3f}", f"{e['utilization']:.3f}",
                     f"**{v['utilization']:.3f}**",
                     f"{n['peak_taken'] / MIB:.0f} / {e['peak_taken'] / MIB:.0f} / {v['peak_taken'] / MIB:.0f}",
                     f"{n['median_step_ms']:.2f} / {e['median_step_ms']:.2f} / {v['median_step_ms']:.2f}",
                     f"**{v['median_step_ms'] / n['median_step_ms']:.3f}x**",
                     f"{min(taken):.3f}-{max(taken):.3f}"])
        figures["util"][w] = (n["utilization"], e["utilization"], v["utilization"])
        figures["step"][w] = v["median_step_ms"] / n["median_step_ms"]
        figures["taken_vs_es"][w] = (min(taken), max(taken))
    return name, rows, figures


# --- moving free chunks: the same script's JSON, against expandable segments ---

def moves() -> Tuple[str, List[Row]]:
    """Per workload and allocator: memory taken and the summed time of the
    same steps (after the first 5, round by round) over expandable
    segments', with the per-step median and quartiles (scripts/bench/
    paired_steps.py, as torch_allocators.py prints them)."""
    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    from paired_steps import step_ratios  # noqa: PLC0415

    name = "torch_allocators-moves-h200.json"
    by = runs_by_workload(name)
    rows: List[Row] = []
    for w, runs in by.items():
        ref = runs["expandable"]
        for alloc in ("vmmbuf", "vmmbuf-move"):
            rs = runs[alloc]
            taken = [r["peak_taken"] / e["peak_taken"] for r, e in zip(rs, ref)]
            pr = step_ratios(((r["step_ms"], e["step_ms"]) for r, e in zip(rs, ref)), 5)
            assert pr is not None, (w, alloc)
            med, lo, hi, summed, n = pr
            rows.append([w, alloc, f"{min(taken):.3f}-{max(taken):.3f}",
                         f"{statistics.median(r['utilization'] for r in rs):.3f}",
                         f"**{summed:.3f}x**", f"{med:.3f} [{lo:.3f}, {hi:.3f}]", str(n)])
    return name, rows


# --- sleep: benches/sleep.rs's steady-state table -----------------------------

def sleep_bench() -> Tuple[str, List[Row], Dict[str, float]]:
    name = "sleep-h200.txt"
    rows: List[Row] = []
    fig: Dict[str, float] = {}
    for line in (RESULTS / name).read_text().splitlines():
        m = re.match(r"^\s*\| ([a-zA-Z +]+?) \| ([0-9.]+) \| ([0-9.]+x)? ?\|$", line)
        if m:
            rows.append([m.group(1), m.group(2), m.group(3) or ""])
            fig[m.group(1)] = float(m.group(2))
    return name, rows, fig


# --- the RL loop: scripts/bench/rl_loop.py's JSON -----------------------------------

VARIANTS = {"vtms": "vmmbuf's torch_memory_saver interface",
            "vtms-preload": "the same, preload hook mode",
            "tms": "torch_memory_saver 0.0.10",
            "tms-preload": "torch_memory_saver 0.0.10, preload hook mode",
            "pinned": "pinned tensors (`.to('cpu', pin_memory)` and back)"}


def rl_loop() -> Tuple[str, List[Row], Dict[str, Tuple[float, float, float, float, float]]]:
    name = "rl_loop-h200.json"
    runs = json.loads((RESULTS / name).read_text())
    rows: List[Row] = []
    fig = {}
    for v, rs in runs.items():
        rs = [r for r in rs if "error" not in r]
        if not rs:
            continue
        gib = rs[0]["state_gib"]
        first = statistics.median(r["rows"][0]["sleep_train_s"] for r in rs) * 1e3 / gib
        steady = [row for r in rs for row in r["rows"][1:]]
        pause = statistics.median(x["sleep_train_s"] for x in steady) * 1e3 / gib
        resume = statistics.median(x["wake_train_s"] for x in steady) * 1e3 / gib
        d2h = statistics.median(r["link_d2h_ms_per_gib"] for r in rs)
        h2d = statistics.median(r["link_h2d_ms_per_gib"] for r in rs)
        rows.append([VARIANTS.get(v, v), f"{first:.1f}", f"{pause:.1f}", f"{resume:.1f}",
                     f"{d2h:.1f} / {h2d:.1f}", f"{d2h / pause:.2f}x / {h2d / resume:.2f}x"])
        fig[v] = (first, pause, resume, d2h, h2d)
    return name, rows, fig


# --- several GPUs: scripts/bench/dist_train.py's printed summary ---------------------

DIST_HEADER = ["mode", "allocator", "pooled median ms", "vs expandable", "rounds below 1",
               "utilization"]


def dist_train(name: str) -> Tuple[List[Row], Dict[str, Any]]:
    text = (RESULTS / name).read_text()
    util = {m.group(2): float(m.group(3)) for m in re.finditer(
        r"^(fsdp|ddp)\s+(native|expandable|vmmbuf)\s+[0-9.]+\s+[0-9.]+\s+\d+\s+\d+\s+([0-9.]+)\s+\w+$",
        text, re.M)}
    rows: List[Row] = []
    fig: Dict[str, Any] = {}
    for m in re.finditer(r"^(fsdp|ddp)\s+(native|expandable|vmmbuf)\s+\[([^\]]*)\]\s+(\d+)/(\d+)\s+"
                         r"([0-9.]+) \(([0-9.]+)x\)", text, re.M):
        mode, alloc, ratios, below, rounds, pooled, rel = m.groups()
        rows.append([mode.upper(), alloc, f"{float(pooled):.2f}", f"**{float(rel):.3f}x**",
                     f"{below} of {rounds}", f"{util.get(alloc, float('nan')):.3f}"])
        fig[alloc] = float(rel)
    return rows, fig


# --- tables the raw files print themselves ------------------------------------

def printed_table(name: str, header_start: str) -> Tuple[List[str], List[Row]]:
    """The markdown table in a raw file whose header begins with
    `header_start`, as printed there."""
    lines = (RESULTS / name).read_text().splitlines()
    i = next(k for k, line in enumerate(lines) if line.strip().startswith(header_start))
    header = [c.strip() for c in lines[i].strip().strip("|").split("|")]
    rows = []
    for line in lines[i + 2:]:
        if not line.strip().startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return header, rows


def nccl() -> Tuple[List[str], List[Row]]:
    name = "nccl-h200x2.txt"
    rows = []
    for line in (RESULTS / name).read_text().splitlines():
        f = line.split()
        if len(f) == 10 and f[1] in ("all-reduce", "all-gather") and f[0] in ("1", "16", "256"):
            rows.append([f"{f[0]} MiB", f[1], f[2], f[3], f[5], f[8]])
    return ["size", "op", "vmmbuf, registered", "vmmbuf, unregistered", "ncclMemAlloc, registered",
            "vmmbuf reg / ncclMemAlloc reg"], rows


# --- the page -----------------------------------------------------------------

def page() -> str:
    idx = index()
    g_name, g_rows, g = growth()
    t_name, t_rows, t = training()
    s_name, s_rows, s = sleep_bench()
    r_name, r_rows, r = rl_loop()
    f2_rows, f2 = dist_train("dist_train-fsdp-h200x2.txt")
    f4_rows, f4 = dist_train("dist_train-fsdp-h200x4.txt")
    d4_rows, d4 = dist_train("dist_train-ddp-h200x4.txt")
    gd_head, gd_rows = printed_table("graph_decode-h100.txt", "| variant | steps/s")
    cg_head, cg_rows = printed_table("compile_graphs-h200.txt", "| allocator | peak taken")
    kv_head, kv_rows = printed_table("kv_cache-h100.txt", "| allocator | method")
    n_head, n_rows = nccl()
    m_name, m_rows = moves()
    ws = list(t["util"])
    util = lambda i: ", ".join(f"{t['util'][w][i]:.3f}" for w in ws)  # noqa: E731
    vt = r["vtms"]
    tm = [r[k] for k in ("tms", "tms-preload") if k in r]
    steps = [t["step"][w] for w in ws]
    short = [
        ["growing a buffer N -> 2N, data kept (64 MiB-8 GiB)",
         f"{g['fresh_min']:.1f}-{g['fresh_max']:.1f}x faster; from vmmbuf's chunk pool "
         f"{g['pooled_min']:.0f}-{g['pooled_max']:.0f}x", "a warm `cuMemAllocAsync` pool plus a copy",
         "[Growth](#growth-n---2n)"],
        ["training memory, `vmmbuf.torch.use()` (allocated / taken; " + ", ".join(ws) + ")",
         util(2), f"expandable segments {util(1)}; PyTorch alone {util(0)}",
         "[Training](#pytorch-training-process-wide)"],
        ["training step, one GPU, `vmmbuf.torch.use()`",
         f"{min(steps):.3f}-{max(steps):.3f}x", "PyTorch alone", "[Training](#pytorch-training-process-wide)"],
        ["sleep / wake keeping the data (`benches/sleep.rs`, stash mode)",
         f"{s['pinned cuMemcpyDtoH'] / s['stashed sleep']:.2f}x / {s['pinned cuMemcpyHtoD'] / s['stashed wake']:.2f}x "
         "the link", "a pinned copy", "[Sleep](#sleep-and-wake)"],
        ["first pause / pause / resume through torch_memory_saver's interface (ms/GiB)",
         f"{vt[0]:.1f} / {vt[1]:.1f} / {vt[2]:.1f}",
         "torch_memory_saver 0.0.10: " + "; ".join(f"{x[0]:.0f} / {x[1]:.0f} / {x[2]:.0f}" for x in tm),
         "[RL loop](#an-rl-loop-through-torch_memory_savers-interface)"],
        ["FSDP step, pooled median (2 GPUs / 4 GPUs)", f"{f2['vmmbuf']:.3f}x / {f4['vmmbuf']:.3f}x",
         "expandable segments", "[Several GPUs](#several-gpus)"],
        ["DDP step, pooled median (4 GPUs)", f"{d4['vmmbuf']:.3f}x", "expandable segments",
         "[Several GPUs](#several-gpus)"],
    ]
    parts = [
        "# vmmbuf benchmarks",
        "",
        "One current figure per claim. This page is generated by `python3 scripts/report.py` "
        "from the result files in `benches/results/` (their GPU, date, commit and command in "
        "`benches/results/index.json`); CI runs `python3 scripts/report.py --check`, so the page "
        "and the files cannot disagree. Every comparison ran its peer in the same run. History: "
        "CHANGELOG.md and git.",
        "",
        "## In short",
        "",
        md_table(["what", "vmmbuf", "against", "section"], short),
        "",
        "![training footprint](benches/plots/footprint.png) ![growth](benches/plots/growth.png) "
        "![pauses](benches/plots/pause.png)",
        "",
        "## Growth N -> 2N",
        "",
        "One growth of a buffer from N to 2N bytes with its data kept: vmmbuf maps new memory "
        "behind the same address; the peers allocate 2N elsewhere, copy N and free the old. "
        "\"Pooled\": vmmbuf maps a chunk its pool kept from an earlier shrink (no new physical "
        "memory, which the driver scrubs at about 2 ms per GiB). Criterion medians. "
        + provenance(g_name, idx[g_name]),
        "",
        md_table(["N", "vmmbuf", "vmmbuf, pooled chunk", "raw create+map+access",
                  "cuMemAlloc+copy+free", "cuMemAllocAsync+copy+free", "async / vmmbuf",
                  "async / pooled"], g_rows),
        "",
        "## PyTorch training, process-wide",
        "",
        "Allocated over memory taken at the peak (higher is tighter) and the median step, "
        "medians over 3 interleaved rounds of 40 steps; the last column is vmmbuf's memory "
        "taken over expandable segments', round by round. " + provenance(t_name, idx[t_name]),
        "",
        md_table(["workload", "PyTorch alone", "expandable segments", "vmmbuf", "peak taken MiB "
                  "(alone / ES / vmmbuf)", "median step ms (alone / ES / vmmbuf)",
                  "vmmbuf step / alone", "vmmbuf taken / ES"], t_rows),
        "",
        "### Moving free chunks (an experiment, off by default)",
        "",
        "`VMMBUF_TORCH_MOVE_FREE=1` (with 2 MiB chunks) maps whole free chunks a second time "
        "where the arena grows instead of mapping new memory. Against expandable segments, "
        "round by round: memory taken, and the summed time of the same steps after the first "
        "5 (the per-step median and quartiles beside it). It pays where shapes repeat (the "
        "causal LM: less memory at the same time) and costs where every step brings new "
        "shapes (the conv net's batch sizes: the free space is rearranged at every step). "
        + provenance(m_name, idx[m_name]),
        "",
        md_table(["workload", "allocator", "taken / expandable", "allocated / taken",
                  "summed step time / expandable", "per-step median [quartiles]", "steps"], m_rows),
        "",
        "## Sleep and wake",
        "",
        "4 GiB in 160 tensors, steady state, medians of 7 rounds in ms per GiB; the rate is "
        "the pinned copy's time over the mode's. " + provenance(s_name, idx[s_name]),
        "",
        md_table(["", "ms/GiB", "rate vs pinned copy"], s_rows),
        "",
        "## An RL loop through torch_memory_saver's interface",
        "",
        "Train, pause 5.97 GiB of training state (weights and AdamW, with a CPU backup), roll "
        "out with a 2 GiB KV cache (discarded), resume: ms per GiB of training state (first "
        "pause, then medians of the steady iterations) and the pinned copy's rate in the same "
        "process. Losses are equal across the variants. " + provenance(r_name, idx[r_name]),
        "",
        md_table(["variant", "first pause", "pause", "resume", "link d2h / h2d",
                  "pause / resume vs link"], r_rows),
        "",
        "## Several GPUs",
        "",
        "Pooled median step over interleaved rounds (steps after the first 5), relative to "
        "expandable segments; utilization is allocated over memory taken. FSDP is not shown at "
        "parity on 4 GPUs; on 2 GPUs the latest run reads below 1, with rounds that move by up "
        "to 20% on these machines.",
        "",
        "FSDP, 2 GPUs: " + provenance("dist_train-fsdp-h200x2.txt", idx["dist_train-fsdp-h200x2.txt"]),
        "",
        md_table(DIST_HEADER, f2_rows),
        "",
        "FSDP, 4 GPUs: " + provenance("dist_train-fsdp-h200x4.txt", idx["dist_train-fsdp-h200x4.txt"]),
        "",
        md_table(DIST_HEADER, f4_rows),
        "",
        "DDP, 4 GPUs: " + provenance("dist_train-ddp-h200x4.txt", idx["dist_train-ddp-h200x4.txt"]),
        "",
        md_table(DIST_HEADER, d4_rows),
        "",
        "NCCL bus bandwidth (GB/s, medians of 7 interleaved rounds) over an arena registered "
        "as it grows: " + provenance("nccl-h200x2.txt", idx["nccl-h200x2.txt"]),
        "",
        md_table(n_head, n_rows),
        "",
        "## A decode loop in a CUDA graph while its KV cache grows",
        "",
        "Four layers, the cache may reach 32768 tokens (2 GiB); the run writes 4096. The "
        "graph is captured once on vmmbuf (the cache's address never moves). "
        + provenance("graph_decode-h100.txt", idx["graph_decode-h100.txt"]),
        "",
        md_table(gd_head, gd_rows),
        "",
        "## torch.compile's CUDA graph trees",
        "",
        "`torch.compile(mode=\"reduce-overhead\")` training a Transformer encoder (6 layers, "
        "d=512, batch 32, sequence 256, fixed shapes) for 30 steps, one process per run, "
        "2 interleaved rounds; vmmbuf process-wide. The tree's graphs share one pool, as "
        "under PyTorch: a later capture takes the blocks an earlier one freed. "
        + provenance("compile_graphs-h200.txt", idx["compile_graphs-h200.txt"]),
        "",
        md_table(cg_head, cg_rows),
        "",
        "## A KV cache grown token by token",
        "",
        "4096 tokens x 32 layers (512 MiB of fp16), medians of 2 runs; `growable` is "
        "`vmmbuf.GrowableTensor`. " + provenance("kv_cache-h100.txt", idx["kv_cache-h100.txt"]),
        "",
        md_table(kv_head, kv_rows),
        "",
        "## Reproduce",
        "",
        "Build on a machine with Rust, run on the GPU machine: `../shared/gpu/pack --benches "
        "--libs` and the wheel (`maturin build --release --locked`), then each command above "
        "from the repository root (`scripts/README.md` lists every script). Replace the result "
        "file of the same name, update its entry in `benches/results/index.json`, and run "
        "`python3 scripts/report.py --plots`.",
        "",
    ]
    return "\n".join(parts)


def plots() -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    out = ROOT / "benches" / "plots"
    out.mkdir(exist_ok=True)
    _, _, t = training()
    ws = list(t["util"])
    fig, ax = plt.subplots(figsize=(5, 3), dpi=80)
    for i, (label, color) in enumerate((("PyTorch alone", "#999"), ("expandable segments", "#69c"),
                                        ("vmmbuf", "#c63"))):
        ax.bar([k + (i - 1) * 0.27 for k in range(len(ws))], [t["util"][w][i] for w in ws], 0.27,
               label=label, color=color)
    ax.set_xticks(range(len(ws)), ws)
    ax.set_ylim(0, 1)
    ax.set_ylabel("allocated / taken")
    ax.set_title("Training footprint (H200, higher is tighter)")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(out / "footprint.png")
    fig, ax = plt.subplots(figsize=(5, 3), dpi=80)
    c = criterion((RESULTS / "grow-h200.txt").read_text())
    sizes = ("64MiB", "1GiB", "8GiB")
    for i, (key, label, color) in enumerate((("vmmbuf", "vmmbuf", "#c63"),
                                             ("vmmbuf_pooled", "vmmbuf, pooled chunk", "#e96"),
                                             ("cuMemAllocAsync_copy_free", "cuMemAllocAsync + copy", "#69c"),
                                             ("cuMemAlloc_copy_free", "cuMemAlloc + copy", "#999"))):
        ax.bar([k + (i - 1.5) * 0.2 for k in range(3)], [c[f"grow_step/{key}/{s}"] for s in sizes], 0.2,
               label=label, color=color)
    ax.set_yscale("log")
    ax.set_xticks(range(3), sizes)
    ax.set_ylabel("ms (log)")
    ax.set_title("One growth N -> 2N, data kept (H200)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "growth.png")
    _, _, r = rl_loop()
    fig, ax = plt.subplots(figsize=(5, 3), dpi=80)
    names = [v for v in ("vtms", "vtms-preload", "pinned", "tms", "tms-preload") if v in r]
    ax.bar([k - 0.2 for k in range(len(names))], [r[v][1] for v in names], 0.4, label="pause", color="#c63")
    ax.bar([k + 0.2 for k in range(len(names))], [r[v][2] for v in names], 0.4, label="resume", color="#69c")
    ax.axhline(statistics.median(r[v][3] for v in names), color="k", lw=0.8, ls="--", label="pinned copy")
    ax.set_yscale("log")
    ax.set_xticks(range(len(names)), names, fontsize=7)
    ax.set_ylabel("ms per GiB (log)")
    ax.set_title("Steady pause and resume in an RL loop (H200)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "pause.png")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if BENCHMARKS.md differs")
    ap.add_argument("--plots", action="store_true", help="redraw benches/plots/*.png")
    a = ap.parse_args(argv)
    text = page()
    listed = set(index())
    files = {p.name for p in RESULTS.iterdir() if p.name != "index.json"}
    if listed != files:
        print(f"benches/results/ and index.json disagree: unlisted {sorted(files - listed)}, "
              f"missing {sorted(listed - files)}", file=sys.stderr)
        return 1
    if a.check:
        old = PAGE.read_text()
        if old != text:
            sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), text.splitlines(True),
                                                       "BENCHMARKS.md", "from benches/results/"))
            print("BENCHMARKS.md differs from what scripts/report.py makes of benches/results/: "
                  "run python3 scripts/report.py", file=sys.stderr)
            return 1
        print(f"BENCHMARKS.md matches benches/results/ ({len(files)} files)")
        return 0
    PAGE.write_text(text)
    if a.plots:
        plots()
    print(f"wrote BENCHMARKS.md ({text.count(chr(10))} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
