"""PyTorch on vmmbuf, on a GPU: process-wide and MemPool-scoped use,
torch_memory_saver's interface with data checked, GrowableTensor through
torch.from_dlpack, typed out-of-memory errors. Skipped without a GPU
(failed under VMMBUF_REQUIRE_GPU=1)."""

from __future__ import annotations

import gc
import json

import pytest

from conftest import run_script

MiB = 1 << 20


# Script lines for the context tests (indented as their scripts are):
# `current()`, the CUDA context current on the calling thread.
CURRENT_CONTEXT = """
        import ctypes
        cu = ctypes.CDLL("libcuda.so.1")
        def current():
            c = ctypes.c_void_p()
            assert cu.cuCtxGetCurrent(ctypes.byref(c)) == 0
            return c.value
"""


def test_process_wide_every_tensor_from_vmmbuf_and_stats(torch_gpu):
    out = run_script("""
        import torch, vmmbuf, vmmbuf.torch as vt
        vt.use()
        assert vt.is_process_wide()
        g = torch.Generator(device="cuda").manual_seed(3)
        xs = [torch.randn(n, device="cuda", generator=g) for n in (1, 1000, 1 << 20, 12_345_678)]
        refs = [x.cpu() for x in xs]
        s = vt.memory_stats()
        total = sum(x.numel() * 4 for x in xs)
        assert s["allocated_bytes.all.current"] >= total, s
        assert s["allocation.all.current"] >= len(xs), s
        assert vt.max_memory_allocated() >= total
        # A small model trains on it; its result matches the host's.
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)).cuda()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        x = torch.randn(64, 256, device="cuda"); y = torch.randint(0, 10, (64,), device="cuda")
        for _ in range(5):
            loss = torch.nn.functional.cross_entropy(m(x), y)
            opt.zero_grad(); loss.backward(); opt.step()
        for x_, r in zip(xs, refs):
            assert torch.equal(x_.cpu(), r)
        peak = vt.max_memory_allocated()
        del xs, m, opt, x, y, loss
        torch.cuda.synchronize()
        vt.reset_peak_memory_stats()
        assert vt.max_memory_allocated() < peak
        before = torch.cuda.mem_get_info()[0]
        vt.empty_cache()
        assert torch.cuda.mem_get_info()[0] >= before
        summary = vt.memory_summary()
        assert "allocated memory" in summary and "process-wide" in summary
        print("OK", vmmbuf.stats()["num_allocs"])
    """)
    assert out.strip().startswith("OK")


def test_process_wide_record_stream_keeps_a_block_from_its_own_stream(torch_gpu):
    """``Tensor.record_stream`` reaches vmmbuf process-wide (PyTorch's own
    test_record_stream_on_shifted_view failed without the hook): a tensor
    read by a spinning kernel on another stream, recorded there and freed on
    its own stream, is not handed to its own stream's next allocation until
    that work is done: the late read sees the original bytes, never the
    next owner's fill."""
    out = run_script("""
        import torch, vmmbuf.torch as vt
        vt.use()
        torch.cuda._sleep(1000); torch.cuda.synchronize()   # load the kernel first
        s_alloc, s_use = torch.cuda.Stream(), torch.cuda.Stream()
        n = 1 << 20
        g = torch.Generator(device="cuda").manual_seed(11)
        same = 0
        for trial in range(4):
            with torch.cuda.stream(s_alloc):
                x = torch.randint(0, 1 << 30, (n,), dtype=torch.int32, device="cuda", generator=g)
                ref = x.cpu()
                base = x.data_ptr()
                view = x[n // 2:]                       # a shifted view, as PyTorch's test
            s_use.wait_stream(s_alloc)
            with torch.cuda.stream(s_use):
                torch.cuda._sleep(200_000_000)          # the read comes late
                seen = x.clone()
            view.record_stream(s_use)
            x.record_stream(s_use)
            del x, view
            with torch.cuda.stream(s_alloc):
                y = torch.full((n,), -1, dtype=torch.int32, device="cuda")
            # The same address is fine only after the read is over (the
            # plug-in waits for the other stream rather than grow): y's
            # fill, queued on s_alloc, must not reach the late read.
            same += y.data_ptr() == base
            torch.cuda.synchronize()
            assert torch.equal(seen.cpu(), ref), "the late read saw another owner's bytes"
            del y, seen
        with torch.cuda.stream(s_alloc):
            z = torch.empty((n,), dtype=torch.int32, device="cuda")
        print("OK same_address", same, "reused_after_sync", z.data_ptr() == base)
    """)
    assert "OK" in out, out


def test_c_allocation_and_free_leave_the_callers_context_current(torch_gpu):
    """The C entry points put the caller's CUDA context back: a thread with
    none current has none after allocations and frees, a thread with another
    context of the same GPU current (made with cuCtxCreate) still has it,
    and the thread whose current context is the device's own keeps it
    (malloc and free read the context only when they are about to switch
    it, and put it back then)."""
    out = run_script(CURRENT_CONTEXT + """
        import ctypes, threading, torch, vmmbuf, vmmbuf.torch as vt
        vt.use()
        torch.empty(1, device="cuda")
        lib = ctypes.CDLL(vmmbuf.library_path())
        lib.vmmbuf_malloc.restype = ctypes.c_void_p
        lib.vmmbuf_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        lib.vmmbuf_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        def pairs(k):
            for i in range(k):
                n = (i % 7 + 1) << 20
                p = lib.vmmbuf_malloc(n, 0, None)
                assert p, vmmbuf.last_error()
                lib.vmmbuf_free(p, n, 0, None)
        primary = current()
        assert primary, "torch made the device's primary context current"
        seen = {}
        def fresh():
            before = current()
            pairs(20)
            seen["fresh"] = (before, current())
        t = threading.Thread(target=fresh); t.start(); t.join()
        assert seen["fresh"] == (None, None), seen
        pairs(20)
        assert current() == primary
        dev = ctypes.c_int()
        assert cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
        other = ctypes.c_void_p()
        r = cu.cuCtxCreate_v2(ctypes.byref(other), 0, dev)
        if r != 0:
            r = cu.cuCtxCreate_v4(ctypes.byref(other), None, 0, dev)
        assert r == 0, f"cuCtxCreate: {r}"
        assert current() == other.value != primary
        pairs(20)
        assert current() == other.value, "the caller's own context was replaced"
        popped = ctypes.c_void_p()
        assert cu.cuCtxPopCurrent_v2(ctypes.byref(popped)) == 0
        assert cu.cuCtxDestroy_v2(other) == 0
        assert current() == primary
        assert vmmbuf.stats()["allocated_bytes.all.current"] < 1 << 20
        print("OK")
    """)
    assert out.strip() == "OK", out


def test_process_wide_out_of_memory_raises_with_the_cause(torch_gpu):
    out = run_script("""
        import torch, vmmbuf, vmmbuf.torch as vt
        vt.use(budget_bytes=64 << 20)
        a = torch.empty(40 << 20, dtype=torch.uint8, device="cuda")
        assert torch.empty(0, device="cuda").numel() == 0  # empty tensors still work
        try:
            torch.empty(40 << 20, dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError as e:
            msg = str(e)
            assert msg.startswith("CUDA out of memory. Tried to allocate 40.00 MiB. GPU 0 has"), msg
            assert "budget 64.0 MiB" in msg and "Some(" not in msg, msg
            assert "budget" in (vmmbuf.last_error() or "")
            print("OOM", msg.splitlines()[0])
        else:
            raise SystemExit("no error past the budget")
        a.fill_(7)  # the live tensor is untouched (checked in small pieces: the budget is full)
        assert all(int(a[i:i + 4096].sum()) == 7 * 4096 for i in range(0, 40 << 20, 8 << 20))
        del a
        torch.cuda.synchronize()
        b = torch.empty(40 << 20, dtype=torch.uint8, device="cuda")
        print("after free", b.numel())
    """)
    assert "OOM" in out and "after free" in out


def test_mempool_out_of_memory_is_torchs(torch_gpu):
    out = run_script("""
        import torch, vmmbuf, vmmbuf.torch as vt
        vmmbuf.set_budget(64 << 20, device=0)
        pool = vt.MemPool()
        with torch.cuda.use_mem_pool(pool):
            a = torch.empty(40 << 20, dtype=torch.uint8, device="cuda")
            try:
                torch.empty(40 << 20, dtype=torch.uint8, device="cuda")
            except torch.OutOfMemoryError as e:
                assert "budget" in (vmmbuf.last_error() or ""), vmmbuf.last_error()
                print("OOM")
        outside = torch.empty(40 << 20, dtype=torch.uint8, device="cuda")  # PyTorch's own
        print("outside", outside.numel())
    """)
    assert "OOM" in out and "outside" in out


def test_mempool_scope_inside_vmmbuf_outside_pytorch(torch_gpu):
    torch = torch_gpu
    import vmmbuf
    import vmmbuf.torch as vt

    dev = torch.cuda.current_device()
    before = vmmbuf.stats(dev).get("allocated_bytes.all.current", 0)
    pool = vt.MemPool()
    g = torch.Generator(device="cuda").manual_seed(5)
    with torch.cuda.use_mem_pool(pool):
        inside = torch.randn(8 * MiB, device="cuda", generator=g)
    mid = vmmbuf.stats(dev)["allocated_bytes.all.current"]
    assert mid - before >= inside.numel() * 4, "the scope's tensor came from vmmbuf"
    outside = torch.randn(8 * MiB, device="cuda", generator=g)
    assert vmmbuf.stats(dev)["allocated_bytes.all.current"] == mid, "outside: PyTorch's own"
    p = inside.data_ptr()
    assert any(s["address"] <= p < s["address"] + s["total_size"] for s in pool.snapshot())
    ref = inside.cpu()
    assert torch.equal(inside.cpu(), ref) and outside.abs().sum() > 0
    del inside
    torch.cuda.synchronize()
    del pool
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    after = vmmbuf.stats(dev)["allocated_bytes.all.current"]
    assert after < mid, f"the pool's segments went back to vmmbuf ({mid} -> {after})"


def test_mempool_memory_goes_back_to_the_driver_when_pytorch_releases_it(torch_gpu):
    """A MemPool's segments that PyTorch's caching allocator gives back (at
    the pool's end; empty_cache leaves a pool in use alone, under PyTorch's
    own MemPool too) leave vmmbuf too, as cudaFree's would: kept in vmmbuf's
    cache, they starved PyTorch's own allocations (PyTorch's test_cuda.py
    ran out of memory after a MemPool test took half the GPU)."""
    out = run_script("""
        import gc, json, torch, vmmbuf, vmmbuf.torch as vt
        free0, total = torch.cuda.mem_get_info()
        n = int(free0 * 0.6)                   # most of the GPU, twice over
        pool = vt.MemPool()
        g = torch.Generator(device="cuda").manual_seed(11)
        with torch.cuda.use_mem_pool(pool):
            a = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda", generator=g)
            s = int(a[::4096].sum())
            del a
        del pool                               # its segment goes back
        gc.collect()
        torch.cuda.empty_cache()
        mid = vmmbuf.stats(0)["reserved_bytes.all.current"]
        b = torch.ones(n, dtype=torch.uint8, device="cuda")   # PyTorch's own
        ok_b = int(b[::4096].sum()) == (n + 4095) // 4096
        del b
        torch.cuda.empty_cache()
        pool = vt.MemPool()                    # a pool works again
        with torch.cuda.use_mem_pool(pool):
            c = torch.full((n // 2,), 3, dtype=torch.uint8, device="cuda")
            ok_c = int(c[::4096].sum()) == 3 * ((n // 2 + 4095) // 4096)
            del c
        del pool
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        st = vmmbuf.stats(0)
        free1, _ = torch.cuda.mem_get_info()
        print("RESULT " + json.dumps(dict(s=s, mid=mid, ok_b=ok_b, ok_c=ok_c,
              reserved=st["reserved_bytes.all.current"], device=st["device_bytes"],
              free0=free0, free1=free1, n=n)))
    """)
    r = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
    assert r["s"] > 0, r
    assert r["mid"] == 0, r
    assert r["ok_b"] and r["ok_c"], r
    assert r["reserved"] == 0 and r["device"] == 0, r
    # Everything back on the device but what PyTorch's and vmmbuf's handles
    # keep (well under the tensor's size).
    assert r["free1"] > r["free0"] - r["n"] // 8, r


def test_torch_memory_saver_interface_pause_resume_keeps_data_and_frees(torch_gpu):
    torch = torch_gpu
    from vmmbuf.torch_memory_saver import torch_memory_saver

    g = torch.Generator(device="cuda").manual_seed(7)
    with torch_memory_saver.region(tag="w", enable_cpu_backup=True):
        w = torch.randn(64 * MiB, device="cuda", generator=g)  # 256 MiB
    with torch_memory_saver.region(tag="kv"):
        kv = torch.randn(16 * MiB, device="cuda", generator=g)
    ref_w, ref_kv = w.cpu(), kv.cpu()
    ptr = w.data_ptr()
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    moved = torch_memory_saver.pause("w")
    assert moved >= 256 * MiB
    free1 = torch.cuda.mem_get_info()[0]
    assert free1 - free0 >= 256 * MiB, f"device memory freed: {(free1 - free0) / MiB:.0f} MiB"
    st = vmmbuf_stats()
    assert st["sleep_modes"] == {"w": "stash"} and st["stash_bytes"] >= 256 * MiB
    assert torch_memory_saver.resume("w") == moved
    assert w.data_ptr() == ptr and torch.equal(w.cpu(), ref_w)
    assert torch.equal(kv.cpu(), ref_kv), "another tag was not touched"
    # Every tag at once: "kv" had no CPU backup, so its memory is dropped
    # (as torch_memory_saver drops it) and comes back fresh at its address.
    kv_ptr = kv.data_ptr()
    free0 = torch.cuda.mem_get_info()[0]
    paused = torch_memory_saver.pause()
    assert paused >= (256 + 64) * MiB
    assert torch.cuda.mem_get_info()[0] - free0 >= (256 + 64) * MiB
    # A region without a backup is a vmmbuf tag of its own ("kv" + a mark).
    assert vmmbuf_stats()["sleep_modes"] == {"kv\x1fdiscard": "discard", "w": "stash"}
    assert torch_memory_saver.resume() == paused
    assert torch.equal((w * 2).cpu(), ref_w * 2)
    assert kv.data_ptr() == kv_ptr
    kv.copy_(ref_kv.cuda())
    assert torch.equal(kv.cpu(), ref_kv), "the fresh memory is usable"
    assert not torch_memory_saver.retain_cpu_backup, "False by default, as in torch_memory_saver"
    # reachable=True: paused tensors stay readable, from host memory.
    from vmmbuf.torch_memory_saver import TorchMemorySaver

    saver = TorchMemorySaver(reachable=True)
    with saver.region(tag="w", enable_cpu_backup=True):
        pass
    assert saver.pause("w") >= 256 * MiB
    assert vmmbuf_stats()["sleep_modes"]["w"] == "keep"
    assert torch.equal(w.cpu(), ref_w), "readable while paused"
    saver.resume("w")
    assert w.data_ptr() == ptr and torch.equal(w.cpu(), ref_w)


def vmmbuf_stats():
    import vmmbuf
    import torch

    return vmmbuf.stats(torch.cuda.current_device())


def test_discarding_sleep_gives_memory_back_and_wakes_zeroed(torch_gpu):
    torch = torch_gpu
    import vmmbuf
    import vmmbuf.torch as vt

    g = torch.Generator(device="cuda").manual_seed(9)
    with vt.pool("kv22"):
        kv = torch.randn(96 * MiB, device="cuda", generator=g)  # 384 MiB
    with vt.pool("w22"):
        w = torch.randn(32 * MiB, device="cuda", generator=g)
    ref_w = w.cpu()
    ptr = kv.data_ptr()
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    slept = vmmbuf.sleep("kv22", discard=True)
    assert slept >= 384 * MiB
    assert torch.cuda.mem_get_info()[0] - free0 >= 384 * MiB, "device memory given back"
    st = vmmbuf_stats()
    assert st["discarded_bytes"] >= 384 * MiB and st["sleep_modes"]["kv22"] == "discard"
    assert vmmbuf.wake("kv22", zero=True) == slept
    assert kv.data_ptr() == ptr
    assert int(torch.count_nonzero(kv)) == 0, "woken zeroed"
    kv.fill_(3.0)
    assert float(kv.sum()) == 3.0 * kv.numel()
    # The kept sleep of another tag: prepared ahead, so it pins nothing.
    vmmbuf.release_host_cache()
    vmmbuf.prepare_sleep("w22", wait=True)
    prepared = vmmbuf_stats()["pooled_host_bytes"]
    assert prepared >= 128 * MiB
    assert vmmbuf.sleep("w22") >= 128 * MiB
    assert vmmbuf_stats()["pooled_host_bytes"] < prepared, "the sleep took the prepared pieces"
    assert torch.equal(w.cpu(), ref_w), "readable asleep"
    vmmbuf.wake("w22")
    assert torch.equal(w.cpu(), ref_w)
    assert vmmbuf_stats()["pooled_host_bytes"] >= 128 * MiB, "kept for the next sleep"
    assert vmmbuf.release_host_cache() >= 128 * MiB
    assert vmmbuf_stats()["pooled_host_bytes"] == 0
    # Stashed (reachable=False): unmapped while asleep, every byte back.
    slept = vmmbuf.sleep("w22", reachable=False)
    st = vmmbuf_stats()
    assert st["sleep_modes"]["w22"] == "stash" and st["stash_bytes"] >= 128 * MiB
    assert vmmbuf.wake("w22") == slept
    assert torch.equal(w.cpu(), ref_w)
    w.mul_(2)
    vmmbuf.sleep("w22", reachable=False)
    vmmbuf.wake("w22")
    assert torch.equal(w.cpu(), ref_w * 2), "a second cycle through the kept stash"
    assert vmmbuf.release_host_cache() >= 128 * MiB
    assert vmmbuf_stats()["stash_bytes"] == 0


def test_growable_tensor_with_torch_grows_in_place(torch_gpu):
    torch = torch_gpu
    from vmmbuf import GrowableTensor

    g = torch.Generator(device="cuda").manual_seed(11)
    t = GrowableTensor(torch.bfloat16, (200_000, 8, 64), device="cuda")
    base = t.data_ptr()
    rows = []
    for i in range(1000):
        k = 1 + i % 5
        r = torch.randn(k, 8, 64, device="cuda", generator=g).to(torch.bfloat16)
        t.append(r)
        rows.append(r)
        v = t.tensor
        assert v.data_ptr() == base and v.shape[0] == sum(x.shape[0] for x in rows)
    assert torch.equal(t.tensor, torch.cat(rows)), "every element kept"
    assert t.data_ptr() == base
    # Another stream reads what the current stream wrote (DLPack's stream).
    side = torch.cuda.Stream()
    t.append(torch.full((3, 8, 64), 2.5, device="cuda", dtype=torch.bfloat16))
    with torch.cuda.stream(side):
        tail = torch.from_dlpack(t)[-3:].float().sum()
    side.synchronize()
    assert tail.item() == 2.5 * 3 * 8 * 64
    # Shrinking gives memory back to the driver once views are gone.
    n = len(t)
    t.resize(10)
    del v, tail
    gc.collect()
    torch.cuda.synchronize()
    mapped = t.mapped_bytes
    free0 = torch.cuda.mem_get_info()[0]
    t.shrink_to_fit()
    assert t.mapped_bytes < mapped and torch.cuda.mem_get_info()[0] > free0
    assert torch.equal(t.tensor, torch.cat(rows)[:10])
    assert n > 10


def test_our_out_of_memory_is_a_torch_out_of_memory_error(torch_gpu):
    torch = torch_gpu
    import vmmbuf
    from vmmbuf import GrowableTensor

    total = torch.cuda.mem_get_info()[1]
    t = GrowableTensor("uint8", 4 * total, device="cuda")
    t.resize(1 << 20)
    with pytest.raises(torch.OutOfMemoryError) as e:
        t.resize(2 * total)
    assert isinstance(e.value, vmmbuf.OutOfMemoryError) and "out of memory" in str(e.value)
    assert len(t) == 1 << 20, "nothing changed"


def test_torch_memory_saver_disable_nesting_mixed_regions_and_retain(torch_gpu):
    """torch_memory_saver's semantics beyond region/pause/resume (issue 39):
    ``disable()`` inside a region makes a tensor that no pause touches;
    regions nest (the inner tag applies, then the outer again); one tag with
    a region with and one without a CPU backup keeps the first and drops
    the second; ``retain_cpu_backup`` False drops the backups' contents at
    resume (their pinned memory stays for the next pause while
    ``prepare_backup``, and goes back without it), True keeps them. In a
    fresh interpreter (MemPool mode)."""
    out = run_script("""
        import torch, vmmbuf
        from vmmbuf.torch_memory_saver import TorchMemorySaver
        MiB = 1 << 20
        tms = TorchMemorySaver()
        g = torch.Generator(device="cuda").manual_seed(4)
        with tms.region("a", enable_cpu_backup=True):
            kept = torch.randn(16 * MiB, device="cuda", generator=g)
            with tms.disable():
                free_t = torch.randn(4 * MiB, device="cuda", generator=g)
            with tms.region("b", enable_cpu_backup=True):
                inner = torch.randn(8 * MiB, device="cuda", generator=g)
            after_inner = torch.randn(2 * MiB, device="cuda", generator=g)
        with tms.region("a", enable_cpu_backup=False):
            dropped = torch.empty(32 * MiB, device="cuda")
        refs = [t.cpu() for t in (kept, free_t, inner, after_inner)]
        torch.cuda.synchronize()
        before = torch.cuda.mem_get_info()[0]
        paused = tms.pause("a")
        assert paused >= (16 + 2 + 32) * 4 * MiB, paused
        assert torch.cuda.mem_get_info()[0] - before >= (16 + 2 + 32) * 4 * MiB
        assert torch.equal(free_t.cpu(), refs[1]), "disable(): not paused"
        assert torch.equal(inner.cpu(), refs[2]), "the inner region's tag is not 'a'"
        tms.pause("b")
        modes = vmmbuf.stats()["sleep_modes"]
        assert modes.get("a") == "stash" and modes.get("b") == "stash", modes
        assert modes.get("a\x1fdiscard") == "discard", modes
        tms.resume()
        for t, r in zip((kept, free_t, inner, after_inner), refs):
            assert torch.equal(t.cpu(), r)
        dropped.fill_(1.0)
        assert float(dropped.sum()) == dropped.numel()
        st = vmmbuf.stats()
        assert tms.get_cpu_backup(kept) is None, "retain_cpu_backup False: the backup's contents go"
        held = st["pooled_host_bytes"] + st["stash_bytes"]
        assert held >= (16 + 2) * 4 * MiB, ("prepare_backup: the pinned memory stays", st)
        tms.prepare_backup = False
        tms.pause("a")
        tms.resume("a")
        st = vmmbuf.stats()
        assert st["pooled_host_bytes"] == 0 and st["stash_bytes"] == 0, "prepare_backup False: given back"
        tms.prepare_backup = True
        tms.retain_cpu_backup = True
        tms.pause("a")
        tms.resume("a")
        # Kept as the awake arena's stash, for the next pause.
        assert vmmbuf.stats()["stash_bytes"] >= 16 * 4 * MiB, "retained"
        assert torch.equal(kept.cpu(), refs[0])
        print("OK")
    """)
    assert out.strip().endswith("OK"), out


def test_torch_memory_saver_init_enable_pauses_every_allocation(torch_gpu):
    """``TMS_INIT_ENABLE=1`` with ``TMS_INIT_ENABLE_CPU_BACKUP=1``: every
    tensor of the process is pausable from the start, gradients made on
    autograd's thread too; ``pause()`` gives the memory back; inside
    ``disable()`` new tensors work and go back to the driver as it ends;
    ``resume()`` brings every byte back. As torch_memory_saver's
    training-engine example expects of it (written from reading it)."""
    out = run_script("""
        import torch, vmmbuf
        from vmmbuf.torch_memory_saver import torch_memory_saver as tms
        import vmmbuf.torch as vt
        MiB = 1 << 20
        assert vt.is_process_wide()
        weights = [torch.full((n,), 42, dtype=torch.uint8, device="cuda")
                   for n in (512 * MiB, MiB, 1024, 42)]
        lin = torch.nn.Linear(1024, 1024, device="cuda")
        lin(torch.randn(64, 1024, device="cuda")).sum().backward()
        grad = lin.weight.grad.clone().cpu()
        torch.cuda.synchronize()
        before = torch.cuda.mem_get_info()[0]
        paused = tms.pause()
        after_pause = torch.cuda.mem_get_info()[0]
        assert paused >= 512 * MiB and after_pause - before >= 512 * MiB, (paused, after_pause - before)
        with tms.disable():
            t = torch.full((256 * MiB,), 53, dtype=torch.uint8, device="cuda")
            assert t.float().mean().item() == 53
            del t
        torch.cuda.synchronize()
        assert torch.cuda.mem_get_info()[0] >= after_pause - 16 * MiB, "disable's memory went back"
        tms.resume()
        for w in weights:
            assert bool((w == 42).all())
        assert torch.equal(lin.weight.grad.cpu(), grad), "autograd's gradient kept"
        print("OK")
    """, env={"TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "1"})
    assert out.strip().endswith("OK"), out


def test_torch_memory_saver_resume_maps_back_what_pause_gave(torch_gpu):
    """``TMS_INIT_ENABLE=1`` (vmmbuf the process's allocator): after a
    forward pass leaves 768 MiB of freed activations in vmmbuf's cache,
    ``resume()`` maps back all that ``pause()`` gave, as torch_memory_saver
    does (its training-engine example checks this), so the next forward
    pass maps nothing; with ``restore_free = False`` it maps back only what
    the weights hold, and the C ``tms_resume`` follows the setting. The
    weights keep every byte throughout."""
    out = run_script("""
        import ctypes, torch, vmmbuf
        from vmmbuf.torch_memory_saver import torch_memory_saver as tms, preload_library_path
        MiB = 1 << 20
        g = torch.Generator(device="cuda").manual_seed(5)
        w = torch.randint(0, 255, (96 * MiB,), dtype=torch.uint8, device="cuda", generator=g)
        ref = w.clone().cpu()

        def forward():
            act = torch.ones(192 * MiB, device="cuda")  # 768 MiB, freed at return
            return (act * w[:1].float()).sum().item()

        def used():
            torch.cuda.synchronize()
            free, total = torch.cuda.mem_get_info()
            return total - free

        lib = ctypes.CDLL(vmmbuf.library_path())
        first = forward()
        for restore in (True, False):
            tms.restore_free = restore
            before = used()
            tms.pause()
            paused = used()
            assert before - paused >= 800 * MiB, (before, paused)
            if restore:
                tms.resume()
            else:
                assert lib.vmmbuf_tms_resume(None) == 0, vmmbuf.last_error()
            back = used() - paused
            if restore:
                assert abs(back - (before - paused)) <= 8 * MiB, (back, before - paused)
                at = used()
                assert forward() == first
                assert abs(used() - at) <= 2 * MiB, "the next pass mapped nothing"
            else:
                assert 96 * MiB <= back <= 120 * MiB, back
                assert forward() == first
            assert torch.equal(w.cpu(), ref), "the weights kept every byte"
            print("restore", restore, "paused", (before - paused) // MiB, "MiB, resumed", back // MiB, "MiB")
        print("OK")
    """, env={"TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "1"})
    assert out.strip().endswith("OK"), out


def test_torch_memory_saver_cuda_graph_memory_pauses_and_the_graph_replays(torch_gpu):
    """``cuda_graph()`` (vmmbuf process-wide): a graph whose intermediate
    tensors (1 GiB) live in its pool; ``pause("graph")`` gives that memory
    back, ``pause("kv_cache")`` the input buffer's (its contents kept);
    after ``resume()`` the graph replays and computes what it did, and a
    new buffer value flows through it. As torch_memory_saver's cuda_graph
    example expects (written from reading it)."""
    out = run_script("""
        import torch, vmmbuf.torch as vt
        vt.use()
        from vmmbuf.torch_memory_saver import torch_memory_saver as tms
        GiB = 1 << 30
        with tms.region(tag="kv_cache", enable_cpu_backup=True):
            kv = torch.full((5, 1 << 24), 1.0, device="cuda")
        x = torch.zeros(5, device="cuda")

        def fn():
            v = (x + kv.mean(dim=1)).mean()
            return (torch.ones(GiB // 4, device="cuda") * v).mean()

        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with tms.cuda_graph(g, tag="graph"):
            y = fn()
        g.replay()
        torch.cuda.synchronize()
        assert abs(float(y) - 1.0) < 1e-4, float(y)
        free0 = torch.cuda.mem_get_info()[0]
        tms.pause("graph")
        tms.pause("kv_cache")
        freed = torch.cuda.mem_get_info()[0] - free0
        assert freed >= GiB, freed
        tms.resume("kv_cache")
        tms.resume("graph")
        x.fill_(2.0)
        g.replay()
        torch.cuda.synchronize()
        assert abs(float(y) - 3.0) < 1e-4, float(y)
        print("OK")
    """)
    assert out.strip().endswith("OK"), out


def test_torch_memory_saver_get_cpu_backup_reads_a_paused_tensor(torch_gpu):
    """``get_cpu_backup`` (torch_memory_saver's): while paused, a tensor of a
    region with a CPU backup reads back as a CPU tensor of its contents;
    one without a backup, or any after the resume, gives None."""
    out = run_script("""
        import torch
        from vmmbuf.torch_memory_saver import TorchMemorySaver
        tms = TorchMemorySaver()
        g = torch.Generator(device="cuda").manual_seed(21)
        with tms.region("kept", enable_cpu_backup=True, cpu_backup_backend="pinned"):
            w = torch.randn(3, 1 << 20, device="cuda", generator=g)
        with tms.region("dropped"):
            kv = torch.ones(1 << 20, device="cuda")
        ref = w.cpu()
        assert tms.get_cpu_backup(w) is None, "not paused: no backup"
        tms.pause()
        b = tms.get_cpu_backup(w)
        assert b is not None and b.device.type == "cpu" and b.shape == w.shape and b.dtype == w.dtype
        assert torch.equal(b, ref), "the backup holds every byte"
        assert torch.equal(tms.get_cpu_backup(w[1], zero_copy=True), ref[1])
        assert tms.get_cpu_backup(kv) is None, "paused without a backup"
        tms.resume()
        assert tms.get_cpu_backup(w) is None, "resumed"
        assert torch.equal(w.cpu(), ref)
        print("OK")
    """)
    assert "OK" in out, out


@pytest.mark.parametrize("backend", ["pinned", "mmap"])
def test_torch_memory_saver_retained_backup_is_one_zero_copy_view(torch_gpu, backend):
    """``retain_cpu_backup`` and ``get_cpu_backup(zero_copy=True)``
    (torch_memory_saver's), for both backends: after a retained resume the
    backup still reads the paused bytes; the next pause takes the new
    bytes; a resume without retain ends it (None). The zero-copy view is
    the backup itself, at one host address from pause to pause while
    retained (torch_memory_saver's ``test_cpu_backup`` checks the same).
    After that resume a pinned backup's host memory stays for the next
    pause (``prepare_backup``, the default) and goes back to the system at
    a resume once it is off."""
    out = run_script(f"""
        import torch, vmmbuf
        from vmmbuf.torch_memory_saver import TorchMemorySaver
        tms = TorchMemorySaver()
        g = torch.Generator(device="cuda").manual_seed(23)
        with tms.region("w", enable_cpu_backup=True, cpu_backup_backend={backend!r}):
            w = torch.randn(5, 1 << 18, device="cuda", generator=g)
        ref = w.cpu()
        tms.pause("w")
        v1 = tms.get_cpu_backup(w, zero_copy=True)
        p1 = v1.data_ptr()
        assert torch.equal(v1, ref) and v1.device.type == "cpu"
        assert p1 != w.data_ptr(), "a host address of its own"
        del v1
        tms.retain_cpu_backup = True
        tms.resume("w")
        v2 = tms.get_cpu_backup(w, zero_copy=True)
        assert v2 is not None and v2.data_ptr() == p1 and torch.equal(v2, ref), "retained"
        assert torch.equal(tms.get_cpu_backup(w), ref)
        del v2
        w.mul_(-2.0)
        ref2 = w.cpu()
        tms.pause("w")
        v3 = tms.get_cpu_backup(w, zero_copy=True)
        assert v3.data_ptr() == p1 and torch.equal(v3, ref2), "the same memory, the new bytes"
        del v3
        tms.retain_cpu_backup = False
        tms.resume("w")
        assert tms.get_cpu_backup(w) is None and tms.get_cpu_backup(w, zero_copy=True) is None
        assert torch.equal(w.cpu(), ref2)
        st = vmmbuf.stats(0)
        # A pinned backup's host memory stays for the next pause while
        # prepare_backup is on (the default), its contents gone; a
        # pageable one goes back at the resume.
        kept = st["stash_bytes"]
        assert st["pageable_bytes"] == 0, st
        assert (kept >= ref2.numel() * 4) if {backend!r} == "pinned" else (kept == 0), st
        tms.prepare_backup = False
        w.add_(1.0)
        ref3 = w.cpu()
        tms.pause("w")
        tms.resume("w")
        assert torch.equal(w.cpu(), ref3)
        st = vmmbuf.stats(0)
        assert st["pageable_bytes"] == 0 and st["stash_bytes"] == 0, st
        print("OK")
    """)
    assert "OK" in out, out


def test_torch_memory_saver_mmap_backup_is_pageable_memory_given_back_at_resume(torch_gpu):
    """``cpu_backup_backend="mmap"``: the pause copies to pageable host
    memory (the process's resident memory grows by about the tensor, no
    pinned memory is taken), the resume brings every byte back for every
    stream and gives that memory back to the system (resident memory falls
    again)."""
    out = run_script("""
        import json, torch, vmmbuf
        from vmmbuf.torch_memory_saver import TorchMemorySaver
        def rss():
            with open("/proc/self/status") as f:
                return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))
        tms = TorchMemorySaver()
        n = 1 << 30
        with tms.region("m", enable_cpu_backup=True, cpu_backup_backend="mmap"):
            x = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
        ref = x[::4096].cpu()
        total = int(x.sum(dtype=torch.int64))
        torch.cuda.synchronize()
        r0 = rss()
        tms.pause("m")
        r1 = rss()
        st = vmmbuf.stats(0)
        back = tms.get_cpu_backup(x[: 1 << 20])
        tms.resume("m")
        r2 = rss()
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):              # another stream sees the bytes
            got = int(x.sum(dtype=torch.int64))
            got_ref = x[::4096].cpu()
        s.synchronize()
        print("RESULT " + json.dumps(dict(
            grew=r1 - r0, fell=r1 - r2, pageable=st["pageable_bytes"],
            modes=st["sleep_modes"], pooled_host=st["pooled_host_bytes"],
            back_ok=bool(torch.equal(back[::4096], ref[:256])),
            same=got == total and bool(torch.equal(got_ref, ref)),
            after=vmmbuf.stats(0)["pageable_bytes"])))
    """)
    r = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
    n = 1 << 30
    assert r["modes"] == {"m\x1fmmap": "pageable"}, r
    assert r["pageable"] >= n and r["pooled_host"] == 0, r
    assert r["grew"] > 0.75 * n, r
    assert r["fell"] > 0.75 * n, r
    assert r["back_ok"] and r["same"], r
    assert r["after"] == 0, r


def test_torch_memory_saver_disk_backup_keeps_the_bytes_in_files_until_resume(torch_gpu, tmp_path):
    """``region(enable_disk_backup=True)``: the pause writes the contents to
    files of the disk backup directory (one per chunk, as large as the
    tensors at least), the resume brings every byte back and removes them;
    two cycles use the same space; memory without a backup is dropped. The
    files have no name in the directory (a killed process leaves none):
    they are found through the process's mappings."""
    out = run_script(f"""
        import os, torch
        from vmmbuf.torch_memory_saver import TorchMemorySaver
        tms = TorchMemorySaver()
        d = {str(tmp_path / "disk")!r}
        tms.set_disk_backup_dir(d)
        g = torch.Generator(device="cuda").manual_seed(29)
        with tms.region(enable_disk_backup=True):
            big = torch.randn(3 << 20, device="cuda", generator=g)
            small = torch.full((7,), 10, dtype=torch.uint8, device="cuda")
        with tms.region():
            gone = torch.full((1 << 20,), 20, dtype=torch.uint8, device="cuda")
        ref = big.cpu()

        def spill_files():
            # /proc/self/maps lists an unnamed file under its directory as
            # deleted; map_files gives its size.
            seen, sizes = set(), []
            for line in open("/proc/self/maps"):
                f = line.split(None, 5)
                if len(f) == 6 and f[5].startswith(d + "/") and f[4] not in seen:
                    seen.add(f[4])
                    sizes.append(os.stat("/proc/self/map_files/" + f[0]).st_size)
            return sizes

        sizes = []
        for _ in range(2):
            tms.pause()
            assert os.listdir(d) == [], "no file has a name"
            files = spill_files()
            total = sum(files)
            assert len(files) >= 1 and total >= big.numel() * 4, (files, total)
            sizes.append(total)
            tms.resume()
            assert os.listdir(d) == [] and spill_files() == [], "gone at the resume"
            assert torch.equal(big.cpu(), ref) and small.tolist() == [10] * 7
        assert sizes[0] == sizes[1], sizes
        print("OK", sizes)
    """)
    assert "OK" in out, out


def test_torch_memory_saver_preload_mode_pauses_what_pytorchs_own_allocator_took(torch_gpu):
    """torch_memory_saver's preload mode on vmmbuf: in a process started
    with vmmbuf's preload library (``configure_subprocess``), PyTorch's own
    caching allocator takes a region's segment with ``cudaMalloc``, which
    the library hands to vmmbuf under the region's tag; ``pause`` gives the
    GiB back, ``resume`` brings every sampled byte back at the same address,
    and memory made outside the region is the CUDA runtime's, untouched."""
    from vmmbuf.torch_memory_saver import preload_library_path

    out = run_script("""
        import torch
        from vmmbuf.torch_memory_saver import torch_memory_saver as tms
        tms.hook_mode = "preload"
        normal = torch.full((1_000_000,), 100, dtype=torch.uint8, device="cuda")
        g = torch.Generator(device="cuda").manual_seed(3)
        with tms.region("w", enable_cpu_backup=True):
            x = torch.randint(0, 256, (1 << 30,), dtype=torch.uint8, device="cuda", generator=g)
        ref = x[:: 4099].cpu()
        addr = x.data_ptr()
        torch.cuda.synchronize()
        before = torch.cuda.mem_get_info()[0]
        tms.pause()
        after = torch.cuda.mem_get_info()[0]
        assert after - before > 0.9 * (1 << 30), (before, after)
        tms.resume()
        assert x.data_ptr() == addr
        assert torch.equal(x[:: 4099].cpu(), ref), "every sampled byte back"
        assert int(normal.sum()) == 100 * 1_000_000
        print("OK")
    """, env={"LD_PRELOAD": preload_library_path()})
    assert "OK" in out, out


def test_torch_memory_saver_preload_mode_keeps_regions_segments_to_themselves(torch_gpu):
    """In preload mode PyTorch's allocator must not carve a tensor made
    outside a region (or in another region) from a segment a region's
    ``cudaMalloc`` made, or a pause takes that tensor's memory away too: the
    region's small tensors (PyTorch's 2 MiB segments) and large ones sit in
    segments no later tensor shares; while one tag is paused, tensors made
    after it and in another tag are read and written, and every byte of both
    tags comes back."""
    from vmmbuf.torch_memory_saver import preload_library_path

    out = run_script("""
        import torch
        from vmmbuf.torch_memory_saver import torch_memory_saver as tms
        tms.hook_mode = "preload"
        g = torch.Generator(device="cuda").manual_seed(31)
        with tms.region("a", enable_cpu_backup=True):
            big = torch.randn(3000, 2048, device="cuda", generator=g)
            small = torch.randn(100, device="cuda", generator=g)
        with tms.region("b", enable_cpu_backup=True):
            other = torch.randn(300, device="cuda", generator=g)
        after_big = torch.randn(4096, 1024, device="cuda", generator=g)
        after_small = torch.randn(77, device="cuda", generator=g)
        refs = [t.cpu() for t in (big, small, other, after_big, after_small)]
        seg = {s["address"]: s["address"] + s["total_size"] for s in torch.cuda.memory_snapshot()}
        def segment(t):
            return next(a for a, e in seg.items() if a <= t.data_ptr() < e)
        ids = [segment(t) for t in (big, small, other, after_big, after_small)]
        assert len({ids[0], ids[1]} & {ids[2], ids[3], ids[4]}) == 0, ids
        assert ids[2] not in (ids[3], ids[4]), ids
        torch.cuda.synchronize()
        tms.pause("a")
        # Tensors of other tags and of none: read, written, and new ones made.
        assert torch.equal(after_small.cpu(), refs[4]) and torch.equal(other.cpu(), refs[2])
        after_big.mul_(2.0); after_big.div_(2.0)  # exact: a power of two
        v = float(after_small.sum())
        extra = torch.full((1000,), v, device="cuda")
        assert torch.equal(after_big.cpu(), refs[3])
        tms.pause("b")
        assert torch.equal(after_small.cpu(), refs[4]) and bool((extra == v).all())
        tms.resume()
        for t, r in zip((big, small, other, after_big, after_small), refs):
            assert torch.equal(t.cpu(), r)
        print("OK")
    """, env={"LD_PRELOAD": preload_library_path()})
    assert "OK" in out, out


def test_two_gpus_freeing_another_gpus_tensors_keeps_the_current_context(torch_gpu):
    """PyTorch frees a tensor of another GPU without switching device (its
    deleter calls the plug-in's free on the current one): the free binds
    that GPU's context when it records a fence, so the plug-in must read
    the caller's context before it switches and put it back. With
    device 0 current, tensors made on device 1 (and device 1's tensors
    freed from a thread with no context) leave device 0's context current,
    the next allocation lands on device 0, and every byte is kept."""
    import os

    if torch_gpu.cuda.device_count() < 2:
        if os.environ.get("VMMBUF_REQUIRE_PEERS") == "1":
            pytest.fail("VMMBUF_REQUIRE_PEERS=1 but one GPU")
        pytest.skip("needs two GPUs")
    out = run_script(CURRENT_CONTEXT + """
        import ctypes, threading, torch, vmmbuf.torch as vt
        vt.use()
        torch.cuda.set_device(0)
        g0 = torch.Generator(device="cuda:0").manual_seed(1)
        g1 = torch.Generator(device="cuda:1").manual_seed(2)
        x = torch.randn(1 << 20, device="cuda:0", generator=g0)
        ref = x.cpu()
        ctx0 = current()
        for i in range(50):
            t = torch.randn((i % 9 + 1) << 16, device="cuda:1", generator=g1)
            s = float(t.sum())
            del t                                   # freed on device 1, device 0 current
            assert current() == ctx0, f"step {i}: the free left another context current"
            y = torch.empty(1 << 16, device="cuda")
            assert y.device.index == 0 and torch.cuda.current_device() == 0
            del y
        keep = [torch.randn(1 << 18, device="cuda:1", generator=g1) for _ in range(8)]
        refs = [k.cpu() for k in keep]
        for k, r in zip(keep, refs):
            assert torch.equal(k.cpu(), r)
        torch.cuda.synchronize(1)
        seen = {}
        def drop():
            before = current()
            keep.clear()                            # frees from a thread with no context
            seen["thread"] = (before, current())
        t = threading.Thread(target=drop); t.start(); t.join()
        assert seen["thread"] == (None, None), seen
        assert current() == ctx0 and torch.equal(x.cpu(), ref)
        print("OK")
    """)
    assert out.strip() == "OK", out


def test_two_gpus_peers_get_access_once_a_second_gpu_is_used(torch_gpu):
    """Chunks are mapped for their own GPU until the process allocates on a
    second one (a rank of FSDP or DDP, which sees every GPU, maps for its
    own only); then the chunks mapped before are granted to the peers too:
    copies both ways between the GPUs keep every byte, of a tensor made
    before the second GPU was used and of one made after.
    ``VMMBUF_TORCH_PEER_ACCESS=0`` keeps chunks for their own GPU only, and
    ``1`` maps them for the peers from the first."""
    import os

    if torch_gpu.cuda.device_count() < 2:
        if os.environ.get("VMMBUF_REQUIRE_PEERS") == "1":
            pytest.fail("VMMBUF_REQUIRE_PEERS=1 but one GPU")
        pytest.skip("needs two GPUs")
    code = """
        import json, os, sys, torch, vmmbuf.torch as vt
        vt.use()
        g = torch.Generator(device="cuda:0").manual_seed(11)
        before = torch.randn(9_000_000, device="cuda:0", generator=g)   # several chunks
        small = torch.randint(0, 1 << 30, (777,), device="cuda:0", generator=g)
        ref, ref_small = before.cpu(), small.cpu()
        out = {"alone": vt.stats(0)["peer_access"]}
        if os.environ["VMMBUF_TORCH_PEER_ACCESS"] == "0":
            # For its own GPU only: the other GPU's copy is refused (the
            # driver's invalid-argument error, not a fault).
            try:
                before.to("cuda:1")
                out["refused"] = False
            except (RuntimeError, getattr(torch, "AcceleratorError", RuntimeError)) as e:
                out["refused"] = "invalid argument" in str(e)
            out["after"] = [vt.stats(0)["peer_access"], vt.stats(1)["peer_access"]]
            print(json.dumps(out))
            sys.exit(0)
        on1 = before.to("cuda:1")                                        # the second GPU's first tensor
        out["after"] = [vt.stats(0)["peer_access"], vt.stats(1)["peer_access"]]
        assert torch.equal(on1.cpu(), ref)
        with torch.cuda.device(1):
            back = torch.empty_like(before, device="cuda:1")
            back.copy_(before)                                          # a copy GPU 1 runs
            assert torch.equal(back.cpu(), ref)
            assert torch.equal(small.to("cuda:1").cpu(), ref_small)
        later = torch.randn(5_000_000, device="cuda:1", generator=torch.Generator(device="cuda:1").manual_seed(5))
        assert torch.equal(later.to("cuda:0").cpu(), later.cpu())
        torch.cuda.synchronize(0); torch.cuda.synchronize(1)
        print(json.dumps(out))
    """
    for setting, want in (("", {"alone": False, "after": [True, True]}),
                          ("0", {"alone": False, "refused": True, "after": [False, False]}),
                          ("1", {"alone": True, "after": [True, True]})):
        # Empty reads as unset.
        out = json.loads(run_script(code, env={"VMMBUF_TORCH_PEER_ACCESS": setting})
                         .strip().splitlines()[-1])
        assert out == want, (setting, out)
