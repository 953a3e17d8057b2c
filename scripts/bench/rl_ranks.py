#!/usr/bin/env python3
"""An RL step across ranks: on every rank an FSDP2 training step
of the decoder of scripts/bench/rl_loop.py, then the training memory paused on
all ranks, a generation phase in the memory the pause freed (a KV cache
filled step by step), the training memory resumed, the next step.

    python3 scripts/bench/rl_ranks.py --all [--nproc 2] [--iters 6] [--variants none,vmmbuf,vmmbuf-nccl,tms]
    torchrun --nproc_per_node 2 scripts/bench/rl_ranks.py --worker --variant vmmbuf

Variants (one torchrun launch each):
  none         no pause: the reference for the losses.
  vmmbuf       vmmbuf.torch pools per tag; sleep("train") keeps the sharded
               weights and AdamW state in pinned host memory at the same
               addresses; the KV cache's tag is discarded between rollouts.
  vmmbuf-nccl  the same with NCCL-ready chunks and register_nccl(): the
               registrations must follow the pause and the resume
               (registered bytes = mapped device bytes after each).
  vmmbuf-nopeer  vmmbuf with VMMBUF_TORCH_PEER_ACCESS=0: chunks mapped for
               their own GPU only, not for every peer (a diagnosis of the
               pause on four ranks; only when named in --variants)
  tms          torch_memory_saver (hook mode "torch"): "train" in a region
               with a CPU backup, the KV cache in one without.
  vtms         the same through vmmbuf's torch_memory_saver interface.

Per rank and iteration: the loss (every variant's must equal "none"'s bit
for bit), pause and resume seconds and GiB, the memory the pause freed
(cuMemGetInfo), and after the resume every byte of the rank's shards of
the weights and AdamW state compared with a copy taken before the pause.
The launcher prints ms/GiB per rank (first and steady) and the checks; the
last line is the whole result as JSON. RL_LOG_DIR=dir keeps each launch's
whole output there (`<variant>.log`).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = ("none", "vmmbuf", "vmmbuf-nccl", "vtms", "tms")
EXTRA = ("vmmbuf-nopeer",)
GiB = float(1 << 30)


def worker(a: argparse.Namespace) -> None:
    if a.variant == "vmmbuf-nccl":
        os.environ["VMMBUF_TORCH_NCCL_READY"] = "1"
    if a.variant == "vmmbuf-nopeer":
        os.environ["VMMBUF_TORCH_PEER_ACCESS"] = "0"
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    sys.path.insert(0, HERE)
    from rl_loop import Tms, Vmmbuf, model_classes, train_step

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    sl: Any = None
    if a.variant.startswith("vmmbuf"):
        sl = Vmmbuf(reachable=True)
    elif a.variant in ("tms", "vtms"):
        sl = Tms(retain=False, backup=True, preload=False, ours=a.variant == "vtms")
    reg = None
    if a.variant == "vmmbuf-nccl":
        import vmmbuf.torch as vt
        reg = vt.register_nccl()
    GPT = model_classes(torch)
    vocab, d, layers, heads = (4096, 512, 4, 8) if a.small else (32000, 1024, 8, 16)
    batch, prompt, gen, tmax = (4, 32, 8, 128) if a.small else (16, 128, 64, 1024)
    torch.manual_seed(0)
    mesh = init_device_mesh("cuda", (world,))
    with sl.train_scope() if sl else contextlib.nullcontext():
        with torch.device(dev):
            model = GPT(vocab, d, layers, heads)
        for blk in model.blocks:
            fully_shard(blk, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
        for p in model.parameters():
            st = opt.state[p]
            st["step"] = torch.tensor(0.0)
            st["exp_avg"] = torch.zeros_like(p)
            st["exp_avg_sq"] = torch.zeros_like(p)
    params = list(model.parameters())
    # This rank's shards of the weights and AdamW state.
    state = [t.to_local() for t in params] + [
        opt.state[p][k].to_local() for p in params for k in ("exp_avg", "exp_avg_sq")]
    state_bytes = sum(t.numel() * t.element_size() for t in state)
    with torch.device(dev):
        engine = GPT(vocab, d, layers, heads).to(torch.bfloat16)
    engine.eval()
    dh = d // heads
    with sl.kv_scope() if sl else contextlib.nullcontext():
        kv = [torch.empty(batch, heads, tmax, dh, dtype=torch.bfloat16, device=dev)
              for _ in range(2 * layers)]
    kv_bytes = sum(c.numel() * c.element_size() for c in kv)
    if sl:
        sl.after_init(state)

    def nccl_ok(when: str) -> Dict[str, Any]:
        import vmmbuf
        s = vmmbuf.stats(dev.index)
        ok = s["nccl_registered_bytes"] == s["nccl_mapped_bytes"] and s["nccl_failures"] == 0
        return {"when": when, "ok": ok, "registered": s["nccl_registered_bytes"],
                "registrations": s["nccl_registrations"],
                "deregistrations": s["nccl_deregistrations"]}

    def timed(f: Any) -> float:
        torch.cuda.synchronize()
        dist.barrier()
        t = time.perf_counter()
        f()
        torch.cuda.synchronize()
        return time.perf_counter() - t

    g = torch.Generator(device=dev).manual_seed(1 + rank)
    seqs = torch.randint(0, vocab, (batch, prompt + gen), device=dev, generator=g)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    rows: List[Dict[str, Any]] = []
    with sdpa_kernel(SDPBackend.MATH):
        for it in range(a.iters):
            row: Dict[str, Any] = {"iter": it}

            def step() -> None:
                row["loss"] = train_step(torch, model, opt, seqs, vocab)
            row["train_s"] = timed(step)
            # The engine gets the whole weights (an all-gather per tensor).
            with torch.no_grad():
                for pe, pt in zip(engine.parameters(), model.parameters()):
                    pe.copy_(pt.full_tensor())
            ref = [t.detach().cpu() for t in state] if sl else None
            torch.cuda.empty_cache()
            torch.cuda.synchronize()
            if sl:
                before = torch.cuda.mem_get_info()[0]
                row["pause_s"] = timed(lambda: sl.sleep_train(state))
                row["freed_gib"] = (torch.cuda.mem_get_info()[0] - before) / GiB
                if reg is not None:
                    row["nccl_paused"] = nccl_ok("paused")
                if it > 0:
                    row["kv_resume_s"] = timed(lambda: sl.wake_kv(kv))
            caches = [(kv[2 * i], kv[2 * i + 1]) for i in range(layers)]

            def rollout() -> None:
                with torch.no_grad():
                    p = seqs[:, :prompt]
                    logits = engine(p, caches, 0)
                    toks = [p]
                    nxt = logits[:, -1:].argmax(-1)
                    for t in range(gen):
                        toks.append(nxt)
                        logits = engine(nxt, caches, prompt + t)
                        nxt = logits[:, -1:].argmax(-1)
                    seqs.copy_(torch.cat(toks, dim=1)[:, :prompt + gen])
            row["rollout_s"] = timed(rollout)
            if sl:
                row["kv_discard_s"] = timed(lambda: sl.sleep_kv(kv))
                row["resume_s"] = timed(lambda: sl.wake_train(state))
                if reg is not None:
                    row["nccl_resumed"] = nccl_ok("resumed")
                row["intact"] = all(torch.equal(t.detach().cpu(), r) for t, r in zip(state, ref))
            rows.append(row)
    res = {"rank": rank, "variant": a.variant, "state_gib": state_bytes / GiB,
           "kv_gib": kv_bytes / GiB, "rows": rows}
    with open(os.path.join(os.environ["RL_RESULT_DIR"], f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.barrier()
    # As in rl_loop.py: no teardown (torch_memory_saver aborts on frees
    # outside its regions then); the result is written.
    sys.stdout.flush()
    os._exit(0)


def launch(a: argparse.Namespace, variant: str) -> Dict[str, Any]:
    out = tempfile.mkdtemp(prefix="rl-ranks-")
    env = {**os.environ, "RL_RESULT_DIR": out, "NCCL_NVLS_ENABLE": "0", "PYTHONFAULTHANDLER": "1"}
    # --standalone: a free port of its own, so that launches on other GPUs
    # of the machine can run beside it.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node", str(a.nproc),
           os.path.abspath(__file__), "--worker", "--variant", variant, "--iters", str(a.iters)]
    cmd += ["--small"] if a.small else []
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=a.timeout)
        rc, text = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = 124, str(e.stderr)[-4000:]
    logs = os.environ.get("RL_LOG_DIR")
    if logs:  # every launch's whole output (VMMBUF_LOG=debug lines, for one)
        os.makedirs(logs, exist_ok=True)
        with open(os.path.join(logs, f"{variant}.log"), "w") as f:
            f.write(text)
    ranks = []
    for r in range(a.nproc):
        path = os.path.join(out, f"rank{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                ranks.append(json.load(f))
    if rc != 0 or len(ranks) != a.nproc:
        print(f"--- {variant}: exit {rc}, {len(ranks)} ranks reported:\n{text[-6000:]}", flush=True)
    return {"variant": variant, "rc": rc, "ranks": ranks}


def ms_per_gib(rows: List[Dict[str, Any]], key: str, gib: float) -> float:
    v = [r[key] for r in rows if key in r]
    return 1000 * statistics.median(v) / gib if v and gib else float("nan")


def run_all(a: argparse.Namespace) -> int:
    results = {v: launch(a, v) for v in a.variants}
    ref = {x["rank"]: [r["loss"] for r in x["rows"]] for x in results.get("none", {}).get("ranks", [])}
    ok = True
    print("| variant | rank | state GiB | pause first ms/GiB | pause ms/GiB | resume ms/GiB | "
          "steady pause / resume ms | freed GiB | losses = none | data intact | registrations follow |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for v, r in results.items():
        good = r["rc"] == 0 and len(r["ranks"]) == a.nproc
        for x in sorted(r["ranks"], key=lambda x: x["rank"]):
            rows, gib = x["rows"], x["state_gib"]
            same = [row["loss"] for row in rows] == ref.get(x["rank"])
            intact = all(row.get("intact", True) for row in rows)
            nccl = [row[k]["ok"] for row in rows for k in ("nccl_paused", "nccl_resumed") if k in row]
            follows = all(nccl) if nccl else None
            print(f"| {v} | {x['rank']} | {gib:.2f} | "
                  f"{ms_per_gib(rows[:1], 'pause_s', gib):.1f} | {ms_per_gib(rows[1:], 'pause_s', gib):.1f} | "
                  f"{ms_per_gib(rows[1:], 'resume_s', gib):.1f} | "
                  f"{ms_per_gib(rows[1:], 'pause_s', 1.0):.0f} / {ms_per_gib(rows[1:], 'resume_s', 1.0):.0f} | "
                  f"{statistics.median([row.get('freed_gib', 0.0) for row in rows]):.2f} | {same} | "
                  f"{intact} | {follows} |")
            good = good and same and intact and follows is not False
        ok = ok and good
    print(json.dumps({"nproc": a.nproc, "iters": a.iters, "pass": ok, "results": results}))
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--all", action="store_true")
    ap.add_argument("--variant", choices=VARIANTS + EXTRA, default="vmmbuf")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--timeout", type=float, default=600.0)
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return 0
    if a.all:
        a.variants = [v for v in a.variants.split(",") if v]
        return run_all(a)
    ap.error("--worker or --all")
    return 2


if __name__ == "__main__":
    sys.exit(main())
