#!/usr/bin/env python3
"""An RL post-training loop on PyTorch, with the training state put to
sleep during each rollout, measured side by side for several ways of
sleeping:

    python3 scripts/bench/rl_loop.py --all [--repeats 2] [--iters 10]   # tables
    python3 scripts/bench/rl_loop.py --variant vmmbuf --iters 3 --small   # one run

Per iteration:
  1. train: one step of a decoder-only transformer (fp32 weights, AdamW
     state; both tagged "train") on the previous rollout's sequences;
  2. the trainer's weights are copied into the inference engine (bf16,
     resident), and the "train" tag sleeps, keeping its data;
  3. rollout: the "kv" tag wakes (its memory was discarded), the engine
     prefills prompts and generates greedily into a preallocated KV cache
     (vLLM's layout: the used part grows step by step), then "kv" sleeps
     discarding its contents;
  4. the "train" tag wakes, and every byte of the training state is
     compared with a copy taken before the sleep (not timed).

Variants (one process each, run interleaved):
  vmmbuf         vmmbuf.torch pools per tag; sleep keeps "train" in pinned
                 host memory at the same addresses (reachable while
                 asleep), "kv" is discarded; the pinned memory is
                 prepared on a thread at start-up and kept between sleeps.
  vmmbuf-stash   the same with sleep("train", reachable=False): the data
                 copied to a kept pinned stash, the tensors unmapped while
                 asleep (as the others leave them).
  tms            torch_memory_saver 0.0.10 (hook mode "torch"): "train" in a
                 region with a CPU backup, "kv" without.
  tms-preload    the same in its preload mode (the process started inside
                 its configure_subprocess(), LD_PRELOAD interposing the CUDA
                 runtime's cudaMalloc/cudaFree).
  tms-retain     the same with retain_cpu_backup = True (its PR #86).
  tms-nobackup   "train" without a CPU backup: its contents are dropped, so
                 neither the data check nor the loss apply (timing only).
  vtms, vtms-preload, vtms-retain
                 tms, tms-preload and tms-retain with the import changed to
                 vmmbuf.torch_memory_saver (what a user switching gets).
  pinned         vLLM-style: PyTorch's allocator; pinned CPU tensors kept
                 across iterations, copy_(non_blocking=True) both ways, the
                 GPU tensors freed and empty_cache() (new addresses on wake).

Per phase: wall time (the call and a synchronize), device memory freed
(cuMemGetInfo). Each process also times a copy of 1 GiB between a pinned
host tensor and the GPU, both ways (the link rate the pauses are held to),
and the table gives the pauses and resumes in ms per GiB of training state. The losses of every iteration must be equal across the
variants that keep the data.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

VARIANTS = ("vmmbuf", "vmmbuf-stash", "tms", "tms-preload", "tms-retain", "tms-nobackup",
            "vtms", "vtms-preload", "vtms-retain", "pinned")
HERE = os.path.dirname(os.path.abspath(__file__))
GiB = float(1 << 30)


def model_classes(torch: Any) -> Any:
    nn = torch.nn
    F = torch.nn.functional

    class Block(nn.Module):
        def __init__(self, d: int, heads: int) -> None:
            super().__init__()
            self.heads = heads
            self.ln1 = nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
            self.ln2 = nn.LayerNorm(d)
            self.fc1 = nn.Linear(d, 4 * d)
            self.fc2 = nn.Linear(4 * d, d)

        def split(self, x: Any) -> Any:
            b, t, _ = x.shape
            return x.view(b, t, self.heads, -1).transpose(1, 2)

        def forward(self, x: Any, cache: Optional[Any] = None, at: int = 0) -> Any:
            q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
            q, k, v = self.split(q), self.split(k), self.split(v)
            if cache is None:
                a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                t = x.shape[1]
                cache[0][:, :, at:at + t] = k
                cache[1][:, :, at:at + t] = v
                kk, vv = cache[0][:, :, :at + t], cache[1][:, :, :at + t]
                a = F.scaled_dot_product_attention(q, kk, vv, is_causal=(t > 1 and at == 0))
            b, h, t, dh = a.shape
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, h * dh))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self, vocab: int, d: int, layers: int, heads: int) -> None:
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
            self.ln = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab, bias=False)

        def forward(self, tokens: Any, caches: Optional[List[Any]] = None, at: int = 0) -> Any:
            x = self.emb(tokens)
            for i, blk in enumerate(self.blocks):
                x = blk(x, None if caches is None else caches[i], at)
            return self.head(self.ln(x))

    return GPT


class Sleeper:
    """One way of putting the training state and the KV cache to sleep."""

    name = ""
    keeps_data = True

    def train_scope(self) -> Any:
        import contextlib
        return contextlib.nullcontext()

    def kv_scope(self) -> Any:
        import contextlib
        return contextlib.nullcontext()

    def after_init(self, state: List[Any]) -> None:
        pass

    def sleep_train(self, state: List[Any]) -> None:
        raise NotImplementedError

    def wake_train(self, state: List[Any]) -> None:
        raise NotImplementedError

    def sleep_kv(self, kv: List[Any]) -> None:
        raise NotImplementedError

    def wake_kv(self, kv: List[Any]) -> None:
        raise NotImplementedError


class Vmmbuf(Sleeper):
    def __init__(self, reachable: bool) -> None:
        import vmmbuf
        import vmmbuf.torch as vt
        self.v, self.vt = vmmbuf, vt
        self.reachable = reachable
        self.name = "vmmbuf" if reachable else "vmmbuf-stash"

    def train_scope(self) -> Any:
        return self.vt.pool("train")

    def kv_scope(self) -> Any:
        return self.vt.pool("kv")

    def after_init(self, state: List[Any]) -> None:
        # Pin the host memory of the first sleep on a thread while the
        # first step trains.
        self.v.prepare_sleep("train", reachable=self.reachable)

    def sleep_train(self, state: List[Any]) -> None:
        self.v.sleep("train", reachable=self.reachable)

    def wake_train(self, state: List[Any]) -> None:
        self.v.wake("train")

    def sleep_kv(self, kv: List[Any]) -> None:
        self.v.sleep("kv", discard=True)

    def wake_kv(self, kv: List[Any]) -> None:
        self.v.wake("kv")


class Tms(Sleeper):
    """torch_memory_saver's interface: the real package, or vmmbuf's
    (``ours``), in either hook mode."""

    def __init__(self, retain: bool, backup: bool, preload: bool, ours: bool) -> None:
        if ours:
            from vmmbuf.torch_memory_saver import torch_memory_saver as tms
        else:
            from torch_memory_saver import torch_memory_saver as tms
        tms.hook_mode = "preload" if preload else "torch"
        self.tms, self.backup = tms, backup
        self.keeps_data = backup
        self.name = (("vtms" if ours else "tms") + ("-preload" if preload else "")
                     + ("-retain" if retain else "") + ("" if backup else "-nobackup"))
        if retain:
            tms.retain_cpu_backup = True

    def train_scope(self) -> Any:
        return self.tms.region("train", enable_cpu_backup=self.backup)

    def kv_scope(self) -> Any:
        return self.tms.region("kv", enable_cpu_backup=False)

    def sleep_train(self, state: List[Any]) -> None:
        self.tms.pause("train")

    def wake_train(self, state: List[Any]) -> None:
        self.tms.resume("train")

    def sleep_kv(self, kv: List[Any]) -> None:
        self.tms.pause("kv")

    def wake_kv(self, kv: List[Any]) -> None:
        self.tms.resume("kv")


class Pinned(Sleeper):
    """vLLM-style: pinned CPU copies kept across iterations."""

    name = "pinned"

    def __init__(self, torch: Any) -> None:
        self.torch = torch
        self.host: List[Any] = []

    def sleep_train(self, state: List[Any]) -> None:
        torch = self.torch
        if not self.host:
            self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in state]
        for h, t in zip(self.host, state):
            h.copy_(t, non_blocking=True)
        torch.cuda.synchronize()
        for t in state:
            t.data = torch.empty(0, dtype=t.dtype, device="cuda")
        torch.cuda.empty_cache()

    def wake_train(self, state: List[Any]) -> None:
        torch = self.torch
        for h, t in zip(self.host, state):
            t.data = torch.empty(h.shape, dtype=h.dtype, device="cuda")
            t.data.copy_(h, non_blocking=True)

    def sleep_kv(self, kv: List[Any]) -> None:
        torch = self.torch
        self.kv_shape = [(c.shape, c.dtype) for c in kv]
        for c in kv:
            c.data = torch.empty(0, dtype=c.dtype, device="cuda")
        torch.cuda.empty_cache()

    def wake_kv(self, kv: List[Any]) -> None:
        torch = self.torch
        for c, (shape, dtype) in zip(kv, self.kv_shape):
            c.data = torch.empty(shape, dtype=dtype, device="cuda")


def train_step(torch: Any, model: Any, opt: Any, seqs: Any, vocab: int) -> float:
    """One training step of the decoder on next-token prediction over
    ``seqs``; the loss (read back, so the step has finished)."""
    out = model(seqs[:, :-1])
    loss = torch.nn.functional.cross_entropy(out.reshape(-1, vocab).float(),
                                             seqs[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss)


def make(variant: str, torch: Any) -> Sleeper:
    if variant in ("vmmbuf", "vmmbuf-stash"):
        return Vmmbuf(reachable=variant == "vmmbuf")
    if variant == "pinned":
        return Pinned(torch)
    return Tms(retain=variant.endswith("-retain"), backup=not variant.endswith("-nobackup"),
               preload=variant.endswith("-preload"), ours=variant.startswith("vtms"))


def link_rate(torch: Any) -> Dict[str, float]:
    """ms per GiB of a copy of 1 GiB between a pinned host tensor and the
    GPU, each way (the median of three), in this process."""
    n = 1 << 30
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    out: Dict[str, float] = {}
    for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        times = []
        for _ in range(3):
            torch.cuda.synchronize()
            t = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        out[f"link_{name}_ms_per_gib"] = statistics.median(times) * 1e3
    del host, dev
    return out


def run_one(a: argparse.Namespace) -> None:
    import torch
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    dev = torch.device("cuda")
    sl = make(a.variant, torch)
    GPT = model_classes(torch)
    vocab, d, layers, heads = (4096, 512, 4, 8) if a.small else (32000, 2048, 8, 16)
    batch, prompt, gen, tmax = (4, 32, 8, 128) if a.small else (32, 128, 64, 1024)
    torch.manual_seed(0)
    free_start = torch.cuda.mem_get_info()[0]

    with sl.train_scope():
        with torch.device(dev):
            model = GPT(vocab, d, layers, heads)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
        # AdamW's state, made now (what its first step does) inside the scope.
        for p in model.parameters():
            st = opt.state[p]
            st["step"] = torch.tensor(0.0)
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    params = list(model.parameters())
    state = params + [opt.state[p][k] for p in params for k in ("exp_avg", "exp_avg_sq")]
    state_bytes = sum(t.numel() * t.element_size() for t in state)
    with torch.device(dev):
        engine = GPT(vocab, d, layers, heads).to(torch.bfloat16)
    engine.eval()
    dh = d // heads
    with sl.kv_scope():
        kv = [torch.empty(batch, heads, tmax, dh, dtype=torch.bfloat16, device=dev)
              for _ in range(2 * layers)]
    kv_bytes = sum(c.numel() * c.element_size() for c in kv)
    sl.after_init(state)

    g = torch.Generator(device=dev).manual_seed(1)
    seqs = torch.randint(0, vocab, (batch, prompt + gen), device=dev, generator=g)
    rows: List[Dict[str, Any]] = []
    torch.cuda.synchronize()

    def timed(f: Any) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        f()
        torch.cuda.synchronize()
        return time.perf_counter() - t

    # The math attention kernels: deterministic forward and backward, so
    # that every variant must reach the same losses bit for bit.
    from torch.nn.attention import SDPBackend, sdpa_kernel
    math_only = sdpa_kernel(SDPBackend.MATH)
    math_only.__enter__()
    for it in range(a.iters):
        row: Dict[str, Any] = {"iter": it}
        # 1. train
        def step() -> None:
            row["loss"] = train_step(torch, model, opt, seqs, vocab)
        row["train_s"] = timed(step)
        # 2. weights to the engine, then the training state sleeps
        with torch.no_grad():
            for pe, pt in zip(engine.parameters(), model.parameters()):
                pe.copy_(pt)
        ref = [t.detach().cpu() for t in state] if sl.keeps_data and a.check else None
        # PyTorch's own cache (activations, gradients) goes first, in every
        # variant: what a pause frees is its own doing.
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        before = torch.cuda.mem_get_info()[0]
        row["sleep_train_s"] = timed(lambda: sl.sleep_train(state))
        row["freed_train_gib"] = (torch.cuda.mem_get_info()[0] - before) / GiB
        # 3. rollout
        if it > 0:
            row["wake_kv_s"] = timed(lambda: sl.wake_kv(kv))
        caches = [(kv[2 * i], kv[2 * i + 1]) for i in range(layers)]

        def rollout() -> None:
            with torch.no_grad():
                p = torch.randint(0, vocab, (batch, prompt), device=dev, generator=g)
                logits = engine(p, caches, 0)
                toks = [p]
                nxt = logits[:, -1:].argmax(-1)
                for t in range(gen):
                    toks.append(nxt)
                    logits = engine(nxt, caches, prompt + t)
                    nxt = logits[:, -1:].argmax(-1)
                seqs.copy_(torch.cat(toks, dim=1)[:, :prompt + gen])
        row["rollout_s"] = timed(rollout)
        before = torch.cuda.mem_get_info()[0]
        row["sleep_kv_s"] = timed(lambda: sl.sleep_kv(kv))
        row["freed_kv_gib"] = (torch.cuda.mem_get_info()[0] - before) / GiB
        # 4. the training state wakes, checked byte for byte
        row["wake_train_s"] = timed(lambda: sl.wake_train(state))
        if ref is not None:
            row["intact"] = all(torch.equal(t.detach().cpu(), r) for t, r in zip(state, ref))
            del ref
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    # The link, after the loop (its memory outside every region and pool).
    link = link_rate(torch)
    result = {
        **link,
        "variant": sl.name,
        "state_gib": state_bytes / GiB,
        "kv_gib": kv_bytes / GiB,
        "taken_gib_at_end": (free_start - torch.cuda.mem_get_info()[0]) / GiB,
        "rows": rows,
        "keeps_data": sl.keeps_data,
    }
    # Printed before anything is freed, and the interpreter's teardown is
    # skipped: torch_memory_saver aborts on frees outside its regions then.
    print(json.dumps(result), flush=True)
    sys.stderr.flush()
    os._exit(0)


def child(variant: str, a: argparse.Namespace) -> Dict[str, Any]:
    import contextlib
    cmd = [sys.executable, os.path.abspath(__file__), "--variant", variant,
           "--iters", str(a.iters)] + (["--small"] if a.small else [])
    started: Any = contextlib.nullcontext()
    if variant == "tms-preload":
        from torch_memory_saver import configure_subprocess
        started = configure_subprocess()
    elif variant == "vtms-preload":
        from vmmbuf.torch_memory_saver import configure_subprocess as ours
        started = ours()
    with started:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        return {"variant": variant, "error": (r.stderr or r.stdout)[-3000:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def med(rows: List[Dict[str, Any]], key: str) -> float:
    v = [r[key] for r in rows if key in r]
    return statistics.median(v) if v else float("nan")


def table(a: argparse.Namespace) -> None:
    runs: Dict[str, List[Dict[str, Any]]] = {v: [] for v in a.variants}
    for rep in range(a.repeats):
        order = a.variants if rep % 2 == 0 else list(reversed(a.variants))
        for v in order:
            r = child(v, a)
            runs[v].append(r)
            if "error" in r:
                print(f"{v}: failed:\n{r['error']}", flush=True)
            else:
                # As each run ends, so that a run cut short still says
                # what it measured (first pause, steady pause and resume,
                # ms/GiB, and the link's rates in that process).
                gib, rows = r["state_gib"], r["rows"]
                print(f"{v}: first pause {rows[0]['sleep_train_s'] * 1e3 / gib:.1f}, pause "
                      f"{med(rows[1:], 'sleep_train_s') * 1e3 / gib:.1f}, resume "
                      f"{med(rows[1:], 'wake_train_s') * 1e3 / gib:.1f} ms/GiB; link "
                      f"{r['link_d2h_ms_per_gib']:.1f} / {r['link_h2d_ms_per_gib']:.1f}", flush=True)
    ok = {v: [r for r in rs if "error" not in r] for v, rs in runs.items()}
    any_run = next((rs[0] for rs in ok.values() if rs), None)
    if any_run is None:
        print("no run succeeded")
        sys.exit(1)
    print(f"\ntraining state {any_run['state_gib']:.2f} GiB (weights + AdamW), "
          f"KV cache {any_run['kv_gib']:.2f} GiB, {a.iters} iterations x {a.repeats} runs; "
          f"medians over iterations 2..{a.iters} (steady) and iteration 1 (first), seconds")
    print()
    print("| variant | pause train (first) | pause train | resume train | freed by pause | "
          "KV discard | KV resume | freed by discard | train step | rollout | data intact |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rates: List[str] = []
    losses: Dict[str, List[float]] = {}
    for v, rs in ok.items():
        if not rs:
            print(f"| {v} | failed | | | | | | | | | |")
            continue
        steady = [row for r in rs for row in r["rows"][1:]]
        first = [r["rows"][0] for r in rs]
        intact = [row.get("intact") for r in rs for row in r["rows"]]
        checked = [x for x in intact if x is not None]
        data = (f"{sum(checked)}/{len(checked)}" if checked else "n/a (dropped)")
        print(f"| {v} | {med(first, 'sleep_train_s'):.3f} | {med(steady, 'sleep_train_s'):.3f} | "
              f"{med(steady, 'wake_train_s'):.3f} | {med(steady, 'freed_train_gib'):.2f} GiB | "
              f"{med(steady, 'sleep_kv_s'):.4f} | {med(steady, 'wake_kv_s'):.4f} | "
              f"{med(steady, 'freed_kv_gib'):.2f} GiB | {med(steady, 'train_s'):.3f} | "
              f"{med(steady, 'rollout_s'):.3f} | {data} |")
        gib = rs[0]["state_gib"]
        d2h = statistics.median(r["link_d2h_ms_per_gib"] for r in rs)
        h2d = statistics.median(r["link_h2d_ms_per_gib"] for r in rs)
        p1, p, w = (med(first, "sleep_train_s") * 1e3 / gib, med(steady, "sleep_train_s") * 1e3 / gib,
                    med(steady, "wake_train_s") * 1e3 / gib)
        rates.append(f"| {v} | {p1:.1f} | {p:.1f} | {w:.1f} | {d2h:.1f} / {h2d:.1f} | "
                     f"{d2h / p:.2f}x / {h2d / w:.2f}x | "
                     f"{med(steady, 'sleep_kv_s') * 1e3 / rs[0]['kv_gib']:.2f} |")
        if rs[0]["keeps_data"]:
            for r in rs:
                losses.setdefault(v, []).append([row["loss"] for row in r["rows"]])
    print()
    print("ms per GiB of training state (first pause, steady pause and resume), the pinned "
          "copy's in the same process (to the host / to the GPU), the pause and resume as a "
          "fraction of it (1.00x: at the link's rate), and the KV discard per GiB of cache:")
    print()
    print("| variant | first pause | pause | resume | link d2h / h2d | pause / resume vs link "
          "| KV discard |")
    print("|---|---|---|---|---|---|---|")
    for line in rates:
        print(line)
    print()
    all_losses = [tuple(l) for ls in losses.values() for l in ls]
    same = len(set(all_losses)) == 1
    print(f"losses equal across every run that keeps the data: {same}")
    for v, ls in losses.items():
        print(f"  {v}: {['%.6f' % x for x in ls[0]]}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(runs, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", choices=VARIANTS)
    ap.add_argument("--all", action="store_true")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--small", action="store_true", help="a small model (for compute-sanitizer)")
    ap.add_argument("--no-check", dest="check", action="store_false")
    ap.add_argument("--json", help="write every run here (--all)")
    a = ap.parse_args()
    if a.all:
        a.variants = [v for v in a.variants.split(",") if v]
        table(a)
    elif a.variant:
        run_one(a)
    else:
        ap.error("--variant or --all")


if __name__ == "__main__":
    main()
