#!/usr/bin/env python3
"""DDP and FSDP (fully_shard) training on two GPUs, one process per GPU,
under one allocator per launch, compared on the same machine:

  native       PyTorch's caching allocator
  expandable   PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  vmmbuf       vmmbuf.torch.use(): vmmbuf for the whole process
  vmmbuf-pool  a vmmbuf MemPool (torch.cuda.use_mem_pool) around the model,
               its wrapping and the training loop (PyTorch routes the
               allocating thread's allocations to the pool: the backward
               pass, on autograd's threads, uses the native allocator)
  vmmbuf-2m    process-wide, chunks of 2 MiB, the plug-in's default before
               it took expandable segments' 20 MiB (VMMBUF_TORCH_MAX_CHUNK_BYTES;
               only when named in --allocs)
  vmmbuf-defer process-wide, VMMBUF_TORCH_DEFER_FENCES=1 (a free on its own
               stream records no event; one later event covers many; the
               plug-in's default since issue 40, so the same as vmmbuf;
               only when named in --allocs)
  vmmbuf-nodefer process-wide, VMMBUF_TORCH_DEFER_FENCES=0 (an event at
               every free, the default before issue 40; only when named)
  vmmbuf-nographs  process-wide, VMMBUF_TORCH_GRAPHS=0 (no capture query or
               capture-mode switch per call; only when named in --allocs)
  vmmbuf-asked process-wide, VMMBUF_TORCH_ANNOUNCE_CAPTURES=0 (every
               malloc and free asks the driver whether its stream is
               captured, as before captures were announced; only when named
               in --allocs)
  vmmbuf-grow  process-wide, VMMBUF_TORCH_WAIT_BEFORE_GROW=0 (a request
               that would map new memory while another stream's free block
               that fits is pending maps it, as before the plug-in waited
               for such blocks by default; only when named in --allocs)
  vmmbuf-wait  process-wide, VMMBUF_TORCH_WAIT_BEFORE_GROW=1 (the
               plug-in's default now; the name of the runs that measured it)
  vmmbuf-nccl  process-wide, NCCL-ready chunks (VMMBUF_TORCH_NCCL_READY=1),
               and every device range vmmbuf maps kept registered with the
               default group's NCCL communicator from before the model is
               built (vmmbuf.torch.register_nccl; only when named in --allocs)
  vmmbuf-ready process-wide, NCCL-ready chunks (VMMBUF_TORCH_NCCL_READY=1)
               and no registration: what the chunk kind alone costs (a
               diagnosis of vmmbuf-nccl's step; only when named in --allocs)
  vmmbuf-hooked  vmmbuf-nccl with NCCL_LOCAL_REGISTER=0: the hook, the
               arena's layout under it and the chunk kind, with NCCL's
               registration a no-op (a diagnosis; only when named)
  vmmbuf-nopeer  process-wide, VMMBUF_TORCH_PEER_ACCESS=0 (chunks mapped
               for this GPU only, as expandable segments map theirs until a
               peer copy asks, and as the default now maps them in a process
               that uses one GPU; a diagnosis; only when named in --allocs)
  vmmbuf-alt   process-wide, from the package in DIST_ALT_PATH (put first
               on sys.path): another build against this one in the same
               interleaved rounds (a before/after; only when named)
  vmmbuf-warm  process-wide, one allocation of DIST_WARM_GIB (default 10)
               made and freed before training, so the arena has mapped
               what the steps need and never grows during them (a
               diagnosis: what growth costs; only when named in --allocs)

    python3 scripts/bench/dist_train.py --all [--modes ddp,fsdp] [--allocs native,...] [--rounds 2] [--steps 30] [--budget SECS]
                                    [--nproc 2] [--out runs.json]
    python3 scripts/bench/dist_train.py --probe-register     # register_mem_pool on a vmmbuf pool
    torchrun --nproc_per_node 2 scripts/bench/dist_train.py --worker --mode fsdp --alloc vmmbuf --profile
      (DIST_RESULT_DIR=dir: where each rank writes its result; --profile:
       torch.profiler tables of the last 5 steps on rank 0)

--all launches `torch.distributed.run --nproc_per_node 2` once per
(mode, allocator), in interleaved rounds (the order rotates each round), and
prints a table: median step time (rank 0, steps after the warm-up; the
median over rounds of each launch's median) and its ratio to native, peak
allocated, peak device memory taken (cuMemGetInfo against the free memory
after NCCL's set-up, sampled after every step, the larger of the two ranks)
and utilization (allocated / taken), and whether the losses equal native's
bit for bit on both ranks. The last line is the whole result as JSON.
DIST_LOG_DIR=dir keeps the whole output of a launch that failed.

The workload: nn.TransformerEncoder (6 layers, d=512) with random sequence
lengths 32-512 and batch sizes 16-32 (each rank its own data, the same on
every launch), AdamW. NVLink multicast stays off (NCCL_NVLS_ENABLE=0).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

from alt_build import import_alt_build
from paired_steps import step_ratios

ALLOCS = ("native", "expandable", "vmmbuf", "vmmbuf-pool")
# vmmbuf with 2 MiB chunks (the plug-in's default is 20 MiB, expandable
# segments' page for its large pool): VMMBUF_TORCH_MAX_CHUNK_BYTES.
EXTRA = ("vmmbuf-2m", "vmmbuf-defer", "vmmbuf-nodefer", "vmmbuf-nographs", "vmmbuf-asked", "vmmbuf-wait",
         "vmmbuf-grow", "vmmbuf-warm", "vmmbuf-nccl", "vmmbuf-ready", "vmmbuf-hooked", "vmmbuf-nopeer", "vmmbuf-alt")
PROCESS_WIDE = ("vmmbuf", "vmmbuf-2m", "vmmbuf-defer", "vmmbuf-nodefer", "vmmbuf-nographs", "vmmbuf-asked",
                "vmmbuf-wait", "vmmbuf-grow", "vmmbuf-warm", "vmmbuf-nccl", "vmmbuf-ready", "vmmbuf-hooked",
                "vmmbuf-nopeer", "vmmbuf-alt")
# Register every mapped range with NCCL (vmmbuf.torch.register_nccl).
REGISTERED = ("vmmbuf-nccl", "vmmbuf-hooked")
MODES = ("ddp", "fsdp")
WARMUP = 5


def worker(a):
    if a.alloc == "expandable":
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    import torch
    vt = None
    if a.alloc == "vmmbuf-2m":
        os.environ["VMMBUF_TORCH_MAX_CHUNK_BYTES"] = str(2 << 20)
    if a.alloc == "vmmbuf-defer":
        os.environ["VMMBUF_TORCH_DEFER_FENCES"] = "1"
    if a.alloc == "vmmbuf-nodefer":
        os.environ["VMMBUF_TORCH_DEFER_FENCES"] = "0"
    if a.alloc == "vmmbuf-nographs":
        os.environ["VMMBUF_TORCH_GRAPHS"] = "0"
    if a.alloc == "vmmbuf-asked":
        os.environ["VMMBUF_TORCH_ANNOUNCE_CAPTURES"] = "0"
    if a.alloc == "vmmbuf-wait":
        os.environ["VMMBUF_TORCH_WAIT_BEFORE_GROW"] = "1"
    if a.alloc == "vmmbuf-grow":
        os.environ["VMMBUF_TORCH_WAIT_BEFORE_GROW"] = "0"
    if a.alloc in REGISTERED or a.alloc == "vmmbuf-ready":
        os.environ["VMMBUF_TORCH_NCCL_READY"] = "1"
    if a.alloc == "vmmbuf-hooked":
        os.environ["NCCL_LOCAL_REGISTER"] = "0"
    if a.alloc == "vmmbuf-nopeer":
        os.environ["VMMBUF_TORCH_PEER_ACCESS"] = "0"
    if a.alloc == "vmmbuf-alt":
        import_alt_build()
    if a.alloc.startswith("vmmbuf"):
        import vmmbuf as vt
        import vmmbuf.torch
        if a.alloc in PROCESS_WIDE:
            vmmbuf.torch.use()
    import random
    import torch.distributed as dist
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", device_id=dev)
    torch.manual_seed(0)
    rng = random.Random(1000 + rank)
    torch.backends.cudnn.deterministic = True
    # The math attention kernels: the fused ones differ between runs.
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)
    dist.barrier()
    reg = vmmbuf.torch.register_nccl() if a.alloc in REGISTERED else None
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    pool = None
    if a.alloc == "vmmbuf-pool":
        pool = vmmbuf.torch.MemPool()
        ctx = torch.cuda.use_mem_pool(pool)
    else:
        ctx = _Null()
    losses, times, min_free = [], [], free0
    with ctx:
        nn = torch.nn
        d = 512
        layer = nn.TransformerEncoderLayer(d, 8, 2048, batch_first=True)
        model = nn.Sequential(nn.TransformerEncoder(layer, 6), nn.Linear(d, 1000)).to(dev)
        if a.mode == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP
            model = DDP(model, device_ids=[rank])
        else:
            from torch.distributed.fsdp import fully_shard
            for m in model[0].layers:
                fully_shard(m)
            fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if a.alloc == "vmmbuf-warm":
            warm = torch.empty(int(float(os.environ.get("DIST_WARM_GIB", "10")) * 2**30),
                               dtype=torch.uint8, device=dev)
            del warm
        prof = None
        cost0 = None
        # Per step, for vmmbuf: chunks mapped and microseconds inside the
        # plug-in's malloc and free (what each step's growth cost).
        step_maps, step_alloc_us, step_past, last = [], [], [], None
        for step in range(a.steps):
            if vt is not None and step == WARMUP:
                torch.cuda.synchronize()
                cost0 = vt.stats(rank)
            if a.profile and step == a.steps - 5:
                prof = torch.profiler.profile(activities=[
                    torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
                prof.__enter__()
            seq, b = rng.randint(32, 512), rng.choice([16, 24, 32])
            x = torch.randn(b, seq, d, device=dev)
            y = torch.randint(0, 1000, (b, seq), device=dev)
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = model(x)
            loss = nn.functional.cross_entropy(out.reshape(-1, 1000), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
            if vt is not None:
                now = vt.stats(rank)
                if last is not None:
                    step_maps.append(now["num_device_alloc"] - last["num_device_alloc"])
                    step_past.append(now.get("grown_past_pending_bytes", 0)
                                     - last.get("grown_past_pending_bytes", 0))
                    step_alloc_us.append((now["host_ns_in_malloc"] + now["host_ns_in_free"]
                                          - last["host_ns_in_malloc"] - last["host_ns_in_free"]) / 1e3)
                last = now
            losses.append(loss.item())
            min_free = min(min_free, torch.cuda.mem_get_info()[0])
            del x, y, out, loss
        if prof is not None:
            prof.__exit__(None, None, None)
            if rank == 0:
                ka = prof.key_averages()
                print(f"PROFILE {a.mode} {a.alloc} (last 5 steps, rank 0)")
                print(ka.table(sort_by="device_time_total", row_limit=12, max_name_column_width=60))
                print(ka.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
    if a.alloc in PROCESS_WIDE:
        peak = vt.stats(rank)["allocated_bytes.all.peak"]
    else:
        peak = torch.cuda.max_memory_allocated()
    taken = free0 - min_free
    res = {"rank": rank, "mode": a.mode, "alloc": a.alloc, "losses": losses,
           "median_step_ms": 1000 * statistics.median(times[WARMUP:]),
           "peak_allocated": peak, "peak_taken": taken,
           "utilization": peak / taken if taken else 0.0,
           "step_ms": [1000 * x for x in times]}
    if vt is not None:
        st = vt.stats(rank)
        res["vmmbuf_peak_allocated"] = st["allocated_bytes.all.peak"]
        res["vmmbuf_reserved"] = st["reserved_bytes.all.current"]
        # Growth while another stream's pending free could have served:
        # memory the GPU's lag made the arena map.
        res["grows_past_pending"] = st.get("num_grows_past_pending")
        res["grown_past_pending_bytes"] = st.get("grown_past_pending_bytes")
        res["waits_before_grow"] = st.get("num_waits_before_grow")
        # Whether the rank's chunks are mapped for the other GPUs too.
        res["peer_access"] = st.get("peer_access")
        res["step_maps"], res["step_alloc_us"] = step_maps, step_alloc_us
        res["step_past_pending_bytes"] = step_past
        if reg is not None:
            # Registered bytes equal mapped device bytes if every range
            # the steps mapped was registered and every one unmapped undone.
            res["nccl"] = {k: st[k] for k in (
                "nccl_registrations", "nccl_deregistrations", "nccl_failures",
                "nccl_registered_bytes", "nccl_mapped_bytes")}
        if cost0 is not None:
            # What the allocator cost the CPU per step after the warm-up.
            n = a.steps - WARMUP
            res["per_step"] = {k: (st.get(k, 0) - cost0.get(k, 0)) / n for k in (
                "host_ns_in_malloc", "host_ns_in_free", "num_allocs", "num_frees",
                "num_fence_queries", "num_device_alloc", "num_device_free")}
    _result(res)
    dist.barrier()
    if reg is not None:
        reg.close()
    dist.destroy_process_group()


def _result(res):
    """Each rank's result in its own file (two ranks' lines on one pipe
    interleave)."""
    with open(os.path.join(os.environ["DIST_RESULT_DIR"], f"rank{res['rank']}.json"), "w") as f:
        json.dump(res, f)


def probe_register(a):
    """register_mem_pool with a vmmbuf MemPool: what PyTorch does with it."""
    import torch
    import torch.distributed as dist
    import vmmbuf.torch
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", device_id=dev)
    pool = vmmbuf.torch.MemPool()
    with torch.cuda.use_mem_pool(pool):
        t = torch.full((64 << 20,), float(rank + 1), device=dev)
    pg = dist.distributed_c10d._get_default_group()
    backend = pg._get_backend(dev)
    out = {"rank": rank}
    try:
        backend.register_mem_pool(pool)
        out["register_mem_pool"] = "ok"
    except Exception as e:  # what stops it, said as PyTorch says it
        out["register_mem_pool"] = f"{type(e).__name__}: {e}"
    try:
        dist.all_reduce(t)
        torch.cuda.synchronize()
        out["all_reduce_ok"] = bool((t == 3.0).all().item())
    except Exception as e:
        out["all_reduce"] = f"{type(e).__name__}: {e}"
    try:
        backend.deregister_mem_pool(pool)
        out["deregister_mem_pool"] = "ok"
    except Exception as e:
        out["deregister_mem_pool"] = f"{type(e).__name__}: {e}"
    _result(out)
    del t
    dist.barrier()
    dist.destroy_process_group()


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *e):
        return False


def launch(extra, env_extra=None, timeout=600, want_stdout=False, nproc=2):
    import glob
    import tempfile
    tmp = tempfile.mkdtemp(prefix="dist_train")
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", DIST_RESULT_DIR=tmp, **(env_extra or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node", str(nproc), os.path.abspath(__file__)] + extra
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    res = []
    for f in sorted(glob.glob(os.path.join(tmp, "rank*.json"))):
        with open(f) as fh:
            res.append(json.load(fh))
    shutil.rmtree(tmp, ignore_errors=True)
    if p.returncode != 0 or len(res) != nproc:
        logs = os.environ.get("DIST_LOG_DIR")
        if logs:
            os.makedirs(logs, exist_ok=True)
            name = "failed" + "-".join(extra).replace("--", "_") + ".log"
            with open(os.path.join(logs, name), "w") as f:
                f.write(p.stdout + "\n---- stderr\n" + p.stderr)
        errs = [l for l in (p.stdout + p.stderr).splitlines()
                if "Error" in l or "error" in l or "panicked" in l]
        sys.stderr.write("\n".join(errs[-30:]) + "\n")
        raise SystemExit(f"launch {extra} failed ({p.returncode})")
    res = sorted(res, key=lambda r: r["rank"])
    return (res, p.stdout) if want_stdout else res


def run_all(a):
    modes = a.modes.split(",")
    allocs = tuple(a.allocs.split(","))
    runs = {}
    start, longest, done = time.time(), 0.0, 0
    for rnd in range(a.rounds):
        # Only whole rounds are compared: stop before one that would not
        # end within --budget (judged by the longest round so far).
        if a.budget and rnd > 0 and time.time() - start + 1.15 * longest > a.budget:
            print(f"round {rnd}: not started, the {a.budget:.0f} s budget would not hold it "
                  f"(longest round {longest:.0f} s); the tables use {rnd} rounds", flush=True)
            break
        t_round = time.time()
        for mode in modes:
            order = allocs[rnd % len(allocs):] + allocs[:rnd % len(allocs)]
            for alloc in order:
                t = time.time()
                r = launch(["--worker", "--mode", mode, "--alloc", alloc, "--steps", str(a.steps)],
                           nproc=a.nproc)
                runs.setdefault((mode, alloc), []).append(r)
                print(f"round {rnd} {mode} {alloc}: {r[0]['median_step_ms']:.2f} ms/step "
                      f"({time.time() - t:.0f} s)", flush=True)
        longest, done = max(longest, time.time() - t_round), rnd + 1
        if a.out:
            # Written after every round, so a run cut short keeps its launches.
            with open(a.out, "w") as f:
                json.dump({f"{m} {k}": v for (m, k), v in runs.items()}, f)
    table = []
    print(f"\n{'mode':<5} {'allocator':<12} {'step ms':>8} {'vs native':>9} {'peak alloc MiB':>15} "
          f"{'peak taken MiB':>15} {'utilization':>11} {'losses = native':>16}")
    for mode in modes:
        # Without native among the allocators (comparing builds of one),
        # there is nothing to compare with: "-".
        natives = runs.get((mode, "native"))
        base = statistics.median(r[0]["median_step_ms"] for r in natives) if natives else None
        ref = natives[0] if natives else None
        for alloc in allocs:
            rs = runs[(mode, alloc)]
            step = statistics.median(r[0]["median_step_ms"] for r in rs)
            peak = max(max(x["peak_allocated"] for x in r) for r in rs)
            taken = max(max(x["peak_taken"] for x in r) for r in rs)
            util = statistics.median(min(x["utilization"] for x in r) for r in rs)
            same = (all(r[k]["losses"] == ref[k]["losses"] for r in rs for k in range(a.nproc))
                    if ref else None)
            vs = step / base if base else None
            row = {"mode": mode, "alloc": alloc, "median_step_ms": step, "vs_native": vs,
                   "peak_allocated": peak, "peak_taken": taken, "utilization": util,
                   "losses_equal_native": same,
                   "step_ms_per_round": [r[0]["median_step_ms"] for r in rs]}
            table.append(row)
            vs_s = f"{vs:9.3f}" if vs is not None else f"{'-':>9}"
            same_s = str(same) if same is not None else "-"
            print(f"{mode:<5} {alloc:<12} {step:8.2f} {vs_s} {peak / 2**20:15.0f} "
                  f"{taken / 2**20:15.0f} {util:11.3f} {same_s:>16}")
    paired_table = paired(runs, modes, allocs)
    print("\nvmmbuf's CPU cost per step (rank 0, median over rounds): malloc ms, free ms, "
          "allocs, frees, fence queries, chunks mapped")
    for mode in modes:
        for alloc in allocs:
            ps = [r[0]["per_step"] for r in runs[(mode, alloc)] if "per_step" in r[0]]
            if ps:
                m = {k: statistics.median(p[k] for p in ps) for k in ps[0]}
                print(f"{mode:<5} {alloc:<12} {m['host_ns_in_malloc'] / 1e6:7.2f} "
                      f"{m['host_ns_in_free'] / 1e6:7.2f} {m['num_allocs']:7.0f} "
                      f"{m['num_frees']:7.0f} {m['num_fence_queries']:8.0f} "
                      f"{m.get('num_device_alloc', 0):8.1f}")
    for (mode, alloc), rs in runs.items():
        regs = [x["nccl"] for r in rs for x in r if "nccl" in x]
        if regs:
            same = all(g["nccl_registered_bytes"] == g["nccl_mapped_bytes"] > 0 for g in regs)
            print(f"\n{mode} {alloc}: NCCL registrations per rank and launch "
                  f"{min(g['nccl_registrations'] for g in regs)}-"
                  f"{max(g['nccl_registrations'] for g in regs)}, deregistrations "
                  f"{min(g['nccl_deregistrations'] for g in regs)}-"
                  f"{max(g['nccl_deregistrations'] for g in regs)}, failures "
                  f"{sum(g['nccl_failures'] for g in regs)}, registered bytes = mapped "
                  f"device bytes at the end in every rank: {same}")
    print(json.dumps({"rounds": done, "steps": a.steps, "table": table, "paired": paired_table}))


def paired(runs, modes, allocs, ref="expandable", skip=5):
    """Each allocator against `ref` round by round (both launched in the
    same round, minutes apart), where a median of per-round medians moves
    by up to 10% from machine drift: the per-round ratios of rank 0's
    median step, how many rounds read below 1, and the median of every
    step after the first `skip` of every round pooled; with vmmbuf's malloc
    time on its median step (steps that map chunks, a few per launch, left
    to the mean above). Then each against `ref` step by step: the median
    per-step ratio with its quartiles and the ratio of summed time
    (`step_ratio_median`, `step_ratio_quartiles`, `sum_ratio` in the
    rows)."""
    out, by_step = [], []
    print(f"\nagainst {ref}, round by round (rank 0): per-round step ratios, rounds below 1, "
          f"pooled median step ms (steps after the first {skip}), malloc ms on the median step")
    for mode in modes:
        base = runs.get((mode, ref))
        if not base:
            continue
        pooled_ref = statistics.median(t for r in base for t in r[0]["step_ms"][skip:])
        for alloc in allocs:
            rs = runs[(mode, alloc)]
            ratios = [r[0]["median_step_ms"] / b[0]["median_step_ms"] for r, b in zip(rs, base)]
            pooled = statistics.median(t for r in rs for t in r[0]["step_ms"][skip:])
            steady = [statistics.median(r[0]["step_alloc_us"]) / 1e3 for r in rs
                      if r[0].get("step_alloc_us")]
            row = {"mode": mode, "alloc": alloc, "ratios": ratios,
                   "rounds_below_1": sum(x < 1 for x in ratios), "pooled_median_ms": pooled,
                   "pooled_vs_ref": pooled / pooled_ref,
                   "steady_malloc_ms": statistics.median(steady) if steady else None}
            # Step by step (`paired_steps`): every launch draws the same
            # batch shapes in the same order (losses equal), and a step's
            # time moves 2x with its shape, which the medians mix with the
            # allocator.
            got = step_ratios(((r[0]["step_ms"], b[0]["step_ms"]) for r, b in zip(rs, base)), skip)
            if got is not None:
                med, lo, hi, total, n = got
                row.update(step_ratio_median=med, step_ratio_quartiles=[lo, hi], sum_ratio=total)
                by_step.append(f"{mode:<5} {alloc:<12} {med:.3f} [{lo:.3f}, {hi:.3f}] {total:.3f} {n:5d}")
            out.append(row)
            rat = ", ".join(f"{x:.3f}" for x in ratios)
            st = f"{row['steady_malloc_ms']:.2f}" if steady else "-"
            print(f"{mode:<5} {alloc:<12} [{rat}] {row['rounds_below_1']}/{len(ratios)} "
                  f"{pooled:8.2f} ({pooled / pooled_ref:.3f}x) {st:>6}")
    print(f"\nagainst {ref}, step by step (rank 0, same round, same step's shapes, steps after "
          f"the first {skip}): median per-step ratio [quartiles], summed time ratio, steps")
    print("\n".join(by_step))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--all", action="store_true")
    p.add_argument("--worker", action="store_true")
    p.add_argument("--probe-register", action="store_true")
    p.add_argument("--probe-worker", action="store_true")
    p.add_argument("--mode", choices=MODES, default="ddp")
    p.add_argument("--modes", default="ddp,fsdp")
    p.add_argument("--alloc", choices=ALLOCS + EXTRA, default="native")
    p.add_argument("--allocs", default=",".join(ALLOCS),
                   help="the allocators --all compares (native among them); also: " + ", ".join(EXTRA))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--profile", action="store_true",
                   help="with --worker: torch.profiler over the last 5 steps, tables on rank 0")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--nproc", type=int, default=2,
                   help="processes (GPUs) per launch; 1 runs FSDP/DDP on one GPU")
    p.add_argument("--out", help="with --all: every launch's per-rank results (per-step times) as JSON, "
                   "written after every round")
    p.add_argument("--budget", type=float, default=0,
                   help="with --all: seconds; no round is started that would end past them (judged by "
                        "the longest round so far), so a time limit cuts no round short (0: no limit)")
    a = p.parse_args()
    if a.worker:
        worker(a)
    elif a.probe_worker:
        probe_register(a)
    elif a.probe_register:
        env = {"VMMBUF_TORCH_NCCL_READY": "1", "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "REG"}
        res, out = launch(["--probe-worker"], env, want_stdout=True)
        for r in res:
            print(json.dumps(r))
        # NCCL's own word on what it registered.
        regs = [l for l in out.splitlines() if "NCCL INFO" in l and "regist" in l.lower()]
        print(f"NCCL registration lines: {len(regs)}")
        for l in regs[:8]:
            print("  " + l.strip())
    elif a.all:
        run_all(a)
    else:
        p.print_help()


if __name__ == "__main__":
    main()
