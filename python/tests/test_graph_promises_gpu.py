"""CUDA graphs and backups through PyTorch, in the default process-wide
mode: blocks shared by two graphs, kept backups, out of memory in a capture,
frees of memory used before a capture. Each program runs in a fresh
interpreter and prints PASS or FAIL with what it saw. Skipped without a GPU
(failed under VMMBUF_REQUIRE_GPU=1)."""

from __future__ import annotations

from conftest import run_script


_GRAPH_OUTPUT_FREED_IN_A_SECOND_CAPTURE = 'import gc\n\nimport torch\nimport vmmbuf\nimport vmmbuf.torch as vt\n\nvt.use()  # vmmbuf is the process\'s allocator (graphs allocate from it)\nN = 8 << 20  # 32 MiB of float32: chunks of their own\nx = torch.ones(N, device="cuda")\ng, h = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()\nwith torch.cuda.graph(g):\n    out = x + 1.0          # made in g\'s capture: g\'s memory\nwith torch.cuda.graph(h):\n    res = out * 2.0        # h reads out\'s bytes at every replay...\n    del out                # ...and out is freed during h\'s capture\ndel g                      # g is gone; h lives on\ngc.collect()\ntorch.cuda.synchronize()\nfor _ in range(100):       # any call of the plug-in releases what CUDA destroyed\n    if vmmbuf.stats(0)["graph_pools"] <= 1:\n        break\ntorch.cuda.empty_cache()   # synchronises for owed frees, gives free chunks back\njunk = [torch.full((N,), 7.0, device="cuda") for _ in range(2)]  # others take the bytes\ntry:\n    h.replay()\n    torch.cuda.synchronize()\n    got = float(res[0])\n    ok = bool((res == 4.0).all())\n    print(("PASS" if ok else "FAIL") + f": h\'s replay computed res[0] = {got} (expected 4.0)")\nexcept Exception as e:  # an unmapped range: illegal address\n    print(f"FAIL: h\'s replay faulted after g\'s release: {e}")\n'


def test_graph_output_freed_in_a_second_capture(torch_gpu) -> None:
    """A tensor made in graph g's capture and freed in graph h's capture stays
    out of circulation while h lives, after g is destroyed: h's replay still
    computes from it."""
    said = run_script(_GRAPH_OUTPUT_FREED_IN_A_SECOND_CAPTURE, timeout=240)
    print(said)
    assert "PASS" in said and "FAIL" not in said, said


_KEPT_BACKUP_AFTER_ANOTHER_REGION = 'import torch\nfrom vmmbuf.torch_memory_saver import torch_memory_saver as tms\n\ntms.retain_cpu_backup = True\nN = 3 << 20  # 12 MiB of float32\nwith tms.region("w", enable_cpu_backup=True):\n    x = torch.full((N,), 3.0, device="cuda")\ntms.pause("w")\ntms.resume("w")\nbefore = tms.get_cpu_backup(x)\nview = tms.get_cpu_backup(x, zero_copy=True)\nprint("retained backup after resume:", None if before is None else float(before[0]),\n      "zero-copy:", None if view is None else float(view[0]))\nwith tms.region("w", enable_cpu_backup=True):\n    y = torch.ones(N, device="cuda")      # the tag\'s memory grows\ntms._prepared()                           # the region\'s background preparation has run\nafter = tms.get_cpu_backup(x)\nok = after is None or bool((after == 3.0).all())\nprint(("PASS" if ok else "FAIL") + ": get_cpu_backup(x) after another region ended: "\n      + ("None" if after is None else f"{float(after[0])} (expected 3.0)"))\ntry:\n    print("zero-copy view taken before now reads", float(view[0]))\nexcept Exception as e:\n    print("zero-copy view taken before faults:", e)\n'


def test_kept_backup_after_another_region(torch_gpu) -> None:
    """With retain_cpu_backup, a resumed tag's backup reads the same bytes after
    another region of the tag has ended (its preparation does not refit it)."""
    said = run_script(_KEPT_BACKUP_AFTER_ANOTHER_REGION, timeout=240)
    print(said)
    assert "PASS" in said and "FAIL" not in said, said


_OUT_OF_MEMORY_IN_A_CAPTURE = 'import torch\nimport vmmbuf.torch as vt\n\nMiB = 1 << 20\nvt.use(budget_bytes=64 * MiB)\ns, s2 = torch.cuda.Stream(), torch.cuda.Stream()\nwith torch.cuda.stream(s):\n    a = torch.empty(40 * MiB, dtype=torch.uint8, device="cuda")\nwith torch.cuda.stream(s2):\n    b = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")\nwith torch.cuda.stream(s):\n    del a        # the call before was on s2: a fence is recorded (it passes below)\nwith torch.cuda.stream(s2):\n    t = torch.empty(MiB // 2, dtype=torch.uint8, device="cuda")\n    del t        # the call before was on s2: a deferred free, covered by no later call\ntorch.cuda.synchronize()\ng = torch.cuda.CUDAGraph()\ntry:\n    with torch.cuda.stream(s):\n        g.capture_begin()\n        # 48 MiB: fits the 64 MiB budget once a\'s 40 MiB of cached chunks go back.\n        y = torch.empty(48 * MiB, dtype=torch.uint8, device="cuda")\n        y.fill_(1)\n        g.capture_end()\n    g.replay()\n    torch.cuda.synchronize()\n    print("PASS: the capture got its memory once the cached chunks went back")\nexcept Exception as e:\n    print(f"FAIL: the capture failed: {type(e).__name__}: {e}")\n'


def test_out_of_memory_in_a_capture(torch_gpu) -> None:
    """An allocation inside a capture that needs the arena's cached chunks back
    gets them without a synchronisation: the capture survives and replays."""
    said = run_script(_OUT_OF_MEMORY_IN_A_CAPTURE, timeout=240)
    print(said)
    assert "PASS" in said and "FAIL" not in said, said


_PRECAPTURE_FREE = 'import gc\nimport torch\nimport vmmbuf.torch as vt\n\nvt.use()  # process-wide: vmmbuf_torch_malloc / vmmbuf_free\nN = 16 << 20  # bytes\ns1, s2 = torch.cuda.Stream(), torch.cuda.Stream()\nwith torch.cuda.stream(s1):\n    x = torch.zeros(N // 4, device="cuda")\n    torch.cuda._sleep(2_000_000_000)  # ~1 s of spinning on s1\n    x.add_(1.0)                         # pre-capture work on x, queued after the spin\n    addr = x.data_ptr()\n    g = torch.cuda.CUDAGraph()\n    g.capture_begin()                   # no synchronize: s1\'s work still queued\n    del x                               # freed while s1 is captured -> the graph\'s\n    y = torch.ones(4, device="cuda")\n    y.mul_(2)\n    g.capture_end()\ndel g, y\ngc.collect()\nwith torch.cuda.stream(s2):\n    z = torch.empty(N // 4, device="cuda")\n    same = z.data_ptr() == addr\n    z.fill_(7.0)\ntorch.cuda.synchronize()\nprint(("FAIL" if same else "PASS") + f": s2 got x\'s bytes while s1\'s pre-capture add_ was queued: {same}")\n'


def test_precapture_free(torch_gpu) -> None:
    """A tensor used by work queued before a capture and freed in the capture is
    not handed out before that work finished."""
    said = run_script(_PRECAPTURE_FREE, timeout=240)
    print(said)
    assert "PASS" in said and "FAIL" not in said, said

