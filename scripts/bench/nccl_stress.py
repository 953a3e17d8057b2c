#!/usr/bin/env python3
"""FSDP and DDP with vmmbuf's memory registered with NCCL, under stress
: every rank trains the same model for 200+ steps while it also
grows at steps of its own (extra tensors of drawn sizes, kept a while) and
gives free chunks back at steps of its own (``empty_cache``: NCCL
deregistrations while the other ranks run collectives). Every 10 steps an
all-gather into an output of a drawn size is checked element by element.
A watchdog on every rank dumps all its threads' stacks and exits 3 when a
step does not finish within ``--stall`` seconds (each rank's own, so a
stall in a collective dumps every rank); SIGTERM dumps them too.

    python3 scripts/bench/nccl_stress.py [--nproc 2] [--modes fsdp,ddp] [--steps 220]
                                   [--stall 120] [--out stress.json]

Per mode it launches ``torch.distributed.run`` twice: with registration
(``register_nccl``) and without, and requires on every rank: no stall, the
losses of the two launches equal bit for bit (registration changes how
NCCL moves bytes, not what it computes, for these collectives), no check
that failed, registered bytes equal to mapped bytes at the end, no NCCL
call refused, and deregistrations made. The last line is the result as
JSON; the exit status is 0 only if every requirement held.

    torchrun --nproc_per_node 2 scripts/bench/nccl_stress.py --worker --mode fsdp --register 1
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

MIB = 1 << 20


def worker(a) -> None:
    os.environ["VMMBUF_TORCH_NCCL_READY"] = "1"
    import faulthandler
    import random
    import signal

    import torch
    import torch.distributed as dist
    import vmmbuf
    import vmmbuf.torch as vt

    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    vt.use()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    torch.manual_seed(0)
    data = random.Random(1000 + rank)     # this rank's batches
    mine = random.Random(5000 + rank)     # this rank's own growth
    shared = random.Random(77)            # the same on every rank
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)
    dist.barrier()
    reg = vt.register_nccl() if a.register else None
    start = vmmbuf.stats(dev.index)
    nn = torch.nn
    d = 512
    layer = nn.TransformerEncoderLayer(d, 8, 2048, batch_first=True)
    model = nn.Sequential(nn.TransformerEncoder(layer, 6), nn.Linear(d, 1000)).to(dev)
    if a.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model, device_ids=[dev.index])
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cuda", (world,))
        for m in model[0].layers:
            fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    losses, times = [], []
    extra = []                      # this rank's growth, kept a while
    checks = registered_checks = empties = 0
    grow_every, empty_every = 7 + 5 * rank, 45 + 17 * rank
    for step in range(a.steps):
        faulthandler.dump_traceback_later(a.stall, exit=True)
        if step % grow_every == 3:
            extra.append(torch.empty(mine.choice([8, 24, 40, 72, 150]) * MIB, dtype=torch.uint8,
                                     device=dev))
            if len(extra) > 3:
                extra.pop(0)
        if step % empty_every == empty_every - 1:
            extra.clear()
            torch.cuda.synchronize()
            vt.empty_cache()
            empties += 1
        seq, b = data.randint(32, 512), data.choice([16, 24, 32])
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
        losses.append(loss.item())
        del x, y, out, loss
        if step % 10 == 9:
            n = shared.choice([1, 3, 5, 12, 33]) * MIB // 4
            g = torch.Generator(device=dev).manual_seed(step * 100 + rank)
            src = torch.randint(-(1 << 30), 1 << 30, (n,), device=dev, generator=g, dtype=torch.int32)
            got = torch.empty(world * n, device=dev, dtype=torch.int32)
            dist.all_gather_into_tensor(got, src)
            for r in range(world):
                gr = torch.Generator(device=dev).manual_seed(step * 100 + r)
                want = torch.randint(-(1 << 30), 1 << 30, (n,), device=dev, generator=gr,
                                     dtype=torch.int32)
                if not torch.equal(got[r * n:(r + 1) * n], want):
                    raise SystemExit(f"RANK {rank} step {step}: rank {r}'s part of the check is wrong")
            checks += 1
            registered_checks += int(reg is not None and vt.nccl_registered(got))
            del src, got
    faulthandler.cancel_dump_traceback_later()
    extra.clear()
    torch.cuda.synchronize()
    st = vmmbuf.stats(dev.index)
    res = {"rank": rank, "mode": a.mode, "register": a.register, "losses": losses,
           "median_step_ms": 1000 * statistics.median(times[5:]), "checks": checks,
           "registered_checks": registered_checks, "empty_caches": empties,
           "reserved": st["reserved_bytes.all.current"],
           "peak_reserved": st["reserved_bytes.all.peak"],
           "nccl": {k: st[k] - (start[k] if k in ("nccl_registrations", "nccl_deregistrations") else 0)
                    for k in ("nccl_registrations", "nccl_deregistrations", "nccl_failures",
                              "nccl_registered_bytes", "nccl_mapped_bytes")}}
    with open(os.path.join(os.environ["STRESS_RESULT_DIR"], f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.barrier()
    if reg is not None:
        reg.close()
    dist.destroy_process_group()
    print(f"RANK {rank} {a.mode} register={a.register} steps={a.steps} done", flush=True)


def launch(a, mode: str, register: int) -> dict:
    out = tempfile.mkdtemp(prefix="stress-")
    env = {**os.environ, "STRESS_RESULT_DIR": out, "NCCL_NVLS_ENABLE": "0",
           "PYTHONFAULTHANDLER": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(a.nproc),
           os.path.abspath(__file__), "--worker", "--mode", mode, "--register", str(register),
           "--steps", str(a.steps), "--stall", str(a.stall)]
    t = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env,
                           timeout=a.stall + 30 + 3 * a.steps)
        rc, text = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = 124, (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
    ranks = []
    for r in range(a.nproc):
        path = os.path.join(out, f"rank{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                ranks.append(json.load(f))
    if rc != 0 or len(ranks) != a.nproc:
        print(f"--- {mode} register={register}: exit {rc}, last output:\n{text[-8000:]}", flush=True)
    return {"mode": mode, "register": register, "rc": rc, "seconds": round(time.time() - t, 1),
            "ranks": ranks, "stalled": "Timeout (0:" in text}


def run_all(a) -> int:
    results, ok = [], True
    for mode in a.modes.split(","):
        with_reg, without = launch(a, mode, 1), launch(a, mode, 0)
        results += [with_reg, without]
        for r in (with_reg, without):
            print(f"{mode:4} register={r['register']} exit {r['rc']} in {r['seconds']} s, "
                  f"{len(r['ranks'])}/{a.nproc} ranks reported, stalled: {r['stalled']}", flush=True)
        good = all(r["rc"] == 0 and len(r["ranks"]) == a.nproc for r in (with_reg, without))
        if good:
            for x, y in zip(sorted(with_reg["ranks"], key=lambda r: r["rank"]),
                            sorted(without["ranks"], key=lambda r: r["rank"])):
                n = x["nccl"]
                same = x["losses"] == y["losses"]
                held = (n["nccl_registered_bytes"] == n["nccl_mapped_bytes"] > 0
                        and n["nccl_failures"] == 0 and n["nccl_deregistrations"] > 0)
                print(f"  rank {x['rank']}: losses equal bit for bit: {same}; "
                      f"registrations {n['nccl_registrations']}, deregistrations "
                      f"{n['nccl_deregistrations']}, failures {n['nccl_failures']}, registered "
                      f"{n['nccl_registered_bytes'] / MIB:.0f} MiB = mapped "
                      f"{n['nccl_mapped_bytes'] / MIB:.0f} MiB: {held}; checks {x['checks']} "
                      f"({x['registered_checks']} over registered memory), empty_cache "
                      f"{x['empty_caches']}x; median step {x['median_step_ms']:.1f} ms "
                      f"(without registration {y['median_step_ms']:.1f}); peak mapped "
                      f"{x['peak_reserved'] / MIB:.0f} MiB (without {y['peak_reserved'] / MIB:.0f})",
                      flush=True)
                good = good and same and held and x["checks"] == y["checks"] > 0
        print(f"{mode}: {'PASS' if good else 'FAIL'}", flush=True)
        ok = ok and good
    print(json.dumps({"nproc": a.nproc, "steps": a.steps, "pass": ok, "runs": [
        {k: v for k, v in r.items() if k != "ranks"} | {"ranks": [
            {k: v for k, v in x.items() if k != "losses"} | {"final_loss": x["losses"][-1]}
            for x in r["ranks"]]} for r in results]}))
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--mode", default="fsdp")
    ap.add_argument("--register", type=int, default=1)
    ap.add_argument("--modes", default="fsdp,ddp")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=220)
    ap.add_argument("--stall", type=float, default=120.0)
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return 0
    return run_all(a)


if __name__ == "__main__":
    sys.exit(main())
