"""CUDA graphs and torch.compile(mode="reduce-overhead") with vmmbuf as the
allocator. Each test runs in a fresh interpreter: process-wide
mode must be installed before CUDA starts."""

from __future__ import annotations

import json

import pytest

from conftest import run_script

# Capture a function with temporaries, replay it with new inputs while other
# allocations come and go, and compare with eager each time.
_CAPTURE = """
    import json, torch, vmmbuf, vmmbuf.torch as vt
    MODE = {mode!r}
    if MODE == "wide":
        vt.use()
    g0 = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(1 << 20, device="cuda", generator=g0)
    w = torch.randn(1 << 20, device="cuda", generator=g0)

    def f(x):
        t = x * 2 + w          # temporaries: allocated and freed in the capture
        u = t.sin() * t.cos()
        return (u + t).relu()

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            f(x)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    base = vmmbuf.stats(0) if MODE == "wide" else None
    pool = vt.MemPool() if MODE == "mempool" else None
    g = torch.cuda.CUDAGraph()
    from vmmbuf import _captures
    with torch.cuda.graph(g, pool=pool.id if pool is not None else None):
        y = f(x)
        inside = list(_captures.state())
    st = vmmbuf.stats(0)
    out = dict(graph_pools=st["graph_pools"], graph_bytes=st["graph_bytes"], inside=inside,
               after_capture=list(_captures.state()))
    # Outside a capture, announced: no stream is asked about its capture.
    q0 = st["num_capture_queries"]
    for i in range(500):
        del_me = torch.empty(4096 + i, device="cuda")
        del del_me
    out["queries_per_pair"] = (vmmbuf.stats(0)["num_capture_queries"] - q0) / 500
    bad = 0
    for i in range(40):
        x.copy_(torch.randn(x.shape, device="cuda", generator=g0))
        g.replay()
        # Other allocations written after the replay: had they been given
        # the graph's memory, y would change.
        junk = [torch.randn(int(1 << (14 + i % 6)), device="cuda") for _ in range(6)]
        ref = f(x)
        del junk
        bad += int(not torch.equal(y, ref))
    torch.cuda.synchronize()
    out["bad"] = bad
    del g, y, ref
    torch.cuda.synchronize()
    if pool is not None:
        del pool
        torch.cuda.empty_cache()
    # Any call of the plug-in releases what CUDA has destroyed meanwhile
    # (its destructor runs on a driver thread, soon after).
    import time
    for _ in range(300):
        st = vmmbuf.stats(0)
        if st["graph_pools"] == 0:
            break
        time.sleep(0.01)
    out.update(after_pools=st["graph_pools"], after_bytes=st["graph_bytes"],
               live=st["live_allocations"])
    vt.empty_cache()
    st = vmmbuf.stats(0)
    out["reserved_after"] = st["reserved_bytes.all.current"]
    out["device_after"] = st["device_bytes"]
    out["base_live"] = base["live_allocations"] if base else None
    print(json.dumps(out))
"""


def _capture(mode: str, announce: bool = True) -> dict:
    env = {} if announce else {"VMMBUF_TORCH_ANNOUNCE_CAPTURES": "0"}
    out = run_script(_CAPTURE.format(mode=mode), env=env)
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("announce", [True, False], ids=["announced", "asked-every-call"])
def test_graph_capture_and_replay_process_wide(torch_gpu, announce):
    r = _capture("wide", announce)
    assert r["bad"] == 0, f"{r['bad']} of 40 replays differed from eager"
    if announce:
        # The capture was counted while under way, and no call outside it
        # asked a stream.
        assert r["inside"] == [True, 1] and r["after_capture"] == [True, 0], r
        assert r["queries_per_pair"] == 0, r
    else:
        assert r["inside"] == [False, 0], r
        assert r["queries_per_pair"] >= 2, r
    assert r["graph_pools"] == 1 and r["graph_bytes"] > 0, r
    # Destroyed: the graph's pool went back (CUDA ran the user object's
    # destructor after the last replay), and the memory with empty_cache.
    assert r["after_pools"] == 0 and r["after_bytes"] == 0, r
    assert r["live"] == r["base_live"], r
    assert r["device_after"] < 64 << 20, r


def test_graph_capture_and_replay_in_a_mempool(torch_gpu):
    r = _capture("mempool")
    assert r["bad"] == 0, f"{r['bad']} of 40 replays differed from eager"
    assert r["inside"] == [True, 1] and r["after_capture"] == [True, 0], r
    # PyTorch's private pool asks vmmbuf for segments during the capture:
    # vmmbuf keeps them the graph's too.
    assert r["graph_pools"] == 1, r
    assert r["after_pools"] == 0 and r["after_bytes"] == 0, r
    assert r["live"] == 0, r
    assert r["reserved_after"] == 0, r


# Two captures into one pool on one stream, as PyTorch's `pool=`: the
# second takes the block the first freed (PyTorch's private pool does), and
# the pool's memory stays until its last graph is gone; with sharing off,
# each graph keeps its own.
_SHARED_POOL = """
    import json, time, torch, vmmbuf, vmmbuf.torch as vt
    vt.use()
    x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    s = torch.cuda.Stream()
    pool = torch.cuda.graph_pool_handle()
    g0, g1 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g0, pool=pool, stream=s):
        t = x * 2
        p0 = t.data_ptr()
        y0 = t + 1
        del t                  # freed in g0's capture: the pool's again
    with torch.cuda.graph(g1, pool=pool, stream=s):
        u = x * 3
        p1 = u.data_ptr()
        y1 = u + 1
        del u
    pools = vmmbuf.stats(0)["graph_pools"]
    x.copy_(torch.randn(x.shape, device="cuda"))
    g0.replay()                # in capture order, as the contract asks
    g1.replay()
    torch.cuda.synchronize()
    ok = bool(torch.equal(y0, x * 2 + 1)) and bool(torch.equal(y1, x * 3 + 1))

    def pools_now(want):
        for _ in range(300):
            n = vmmbuf.stats(0)["graph_pools"]
            if n == want:
                break
            time.sleep(0.01)
        return n

    del g0
    torch.cuda.synchronize()
    time.sleep(0.5)            # CUDA runs the destroyed graph's callback meanwhile
    mid = pools_now(1)
    bytes_mid = vmmbuf.stats(0)["graph_bytes"]
    del g1
    torch.cuda.synchronize()
    end = pools_now(0)
    print(json.dumps(dict(reused=p1 == p0, pools=pools, ok=ok, mid=mid,
                          bytes_mid=bytes_mid, end=end,
                          bytes_end=vmmbuf.stats(0)["graph_bytes"])))
"""


@pytest.mark.parametrize("share", [True, False], ids=["shared", "VMMBUF_TORCH_SHARE_GRAPH_POOLS=0"])
def test_graphs_captured_into_one_pool_share_its_blocks(torch_gpu, share):
    env = {} if share else {"VMMBUF_TORCH_SHARE_GRAPH_POOLS": "0"}
    r = json.loads(run_script(_SHARED_POOL, env=env).strip().splitlines()[-1])
    assert r["ok"], f"a replay in capture order computed wrong values: {r}"
    assert r["reused"] == share, r
    if share:
        assert r["pools"] == 1, r
        # One graph of the pool alive: its blocks stay the pool's.
        assert r["mid"] == 1 and r["bytes_mid"] >= 4 << 20, r
    else:
        assert r["pools"] == 2, r
        assert r["mid"] == 1, r
    assert r["end"] == 0 and r["bytes_end"] == 0, r


_COMPILE = """
    import json, torch, vmmbuf, vmmbuf.torch as vt
    MODE = {mode!r}
    if MODE.startswith("wide"):
        vt.use()
    if MODE == "wide-no-trees":
        import torch._inductor.config as ic
        ic.triton.cudagraph_trees = False
    torch.manual_seed(0)
    def model():
        return torch.nn.TransformerEncoderLayer(256, 4, 512, dropout=0.0, batch_first=True).cuda()
    m = model(); ref_m = model(); ref_m.load_state_dict(m.state_dict())
    x = torch.randn(8, 64, 256, device="cuda")
    out = {{}}
    import contextlib
    scope = vt.pool("compiled") if MODE == "mempool" else contextlib.nullcontext()
    try:
        with scope:
            cm = torch.compile(m, mode="reduce-overhead")
            with torch.no_grad():
                diffs = []
                for i in range(4):
                    xi = x + i
                    y = cm(xi).clone()
                    diffs.append((y - ref_m(xi)).abs().max().item())
            out["infer_max_diff"] = max(diffs)
            opt, ref_opt = (torch.optim.SGD(mm.parameters(), lr=1e-2) for mm in (m, ref_m))
            losses, ref_losses = [], []
            for i in range(4):
                for mm, o, l in ((cm, opt, losses), (ref_m, ref_opt, ref_losses)):
                    o.zero_grad()
                    loss = mm(x * (1 + 0.1 * i)).square().mean()
                    loss.backward()
                    o.step()
                    l.append(loss.item())
            out["losses"], out["ref_losses"] = losses, ref_losses
            torch.cuda.synchronize()
        out["ok"] = True
    except Exception as e:
        out["ok"] = False
        out["error"] = f"{{type(e).__name__}}: {{e}}"[:400]
    # Eager work goes on, on the same allocator.
    z = torch.ones(1 << 20, device="cuda") * 3
    out["eager_after"] = float(z.sum().item())
    st = vmmbuf.stats(0) or {{}}
    out["graph_pools"] = st.get("graph_pools", 0)
    print(json.dumps(out))
"""


def _compile(mode: str) -> dict:
    return json.loads(run_script(_COMPILE.format(mode=mode), timeout=600).strip().splitlines()[-1])


def _close(a: list, b: list) -> bool:
    return all(abs(x - y) <= 1e-4 * max(1.0, abs(y)) for x, y in zip(a, b)) and len(a) == len(b)


def test_compile_reduce_overhead_in_a_vmmbuf_pool(torch_gpu):
    r = _compile("mempool")
    assert r["ok"], r
    assert r["infer_max_diff"] < 1e-4, r
    assert _close(r["losses"], r["ref_losses"]), r
    assert r["eager_after"] == 3.0 * (1 << 20)


def test_compile_reduce_overhead_process_wide_without_graph_trees(torch_gpu):
    r = _compile("wide-no-trees")
    assert r["ok"], r
    assert r["infer_max_diff"] < 1e-4, r
    assert _close(r["losses"], r["ref_losses"]), r
    assert r["graph_pools"] >= 1, "the compiled graphs' memory came from vmmbuf"
    assert r["eager_after"] == 3.0 * (1 << 20)


def test_compile_reduce_overhead_process_wide_with_graph_trees(torch_gpu):
    # PyTorch's default: CUDA graph trees, whose pool calls vmmbuf answers
    # (vmmbuf._torch_graphs), with PyTorch's slow-path asserts on (its
    # default): each compares the pool's live allocations with the tree's.
    r = _compile("wide")
    assert r["ok"], r
    assert r["infer_max_diff"] < 1e-4, r
    assert _close(r["losses"], r["ref_losses"]), r
    assert r["graph_pools"] >= 1, "the compiled graphs' memory came from vmmbuf"
    assert r["eager_after"] == 3.0 * (1 << 20)


# Graph trees restore a pool's checkpoint: f is replayed, then g (a new
# function, fed f's live output) is warmed up and recorded on f's path, and
# training steps go on in one tree. Every result is compared with eager.
_TREES = """
    import gc, json, torch, vmmbuf, vmmbuf.torch as vt
    vt.use()
    import torch._inductor.config as ic
    import torch._inductor.cudagraph_trees as ct
    assert ic.triton.cudagraph_trees and ic.triton.slow_path_cudagraph_asserts
    g0 = torch.Generator(device="cuda").manual_seed(5)
    w = torch.randn(512, 512, device="cuda", generator=g0) / 16
    def f_eager(x):
        return (x @ w).relu() + 1
    def g_eager(y):
        return (y * 2).sin().sum(dim=0)
    f = torch.compile(f_eager, mode="reduce-overhead")
    g = torch.compile(g_eager, mode="reduce-overhead")
    out = {}
    bad = 0
    steps = 0
    with torch.no_grad():
        for i in range(12):
            x = torch.randn(256, 512, device="cuda", generator=g0)
            a = f(x)
            if i >= 3:
                b = g(a)
                bad += int(not torch.allclose(b, g_eager(f_eager(x)), rtol=1e-4, atol=1e-3))
            bad += int(not torch.allclose(a, f_eager(x), rtol=1e-4, atol=1e-3))
            steps += 1
    mgr = ct.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    out["checkpoints"] = getattr(mgr, "debug_checkpointing_counter", -1)
    out["bad"], out["steps"] = bad, steps
    # A training loop in the same process: forward and backward graphs.
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(),
                            torch.nn.Linear(1024, 512)).cuda()
    ref = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(),
                              torch.nn.Linear(1024, 512)).cuda()
    ref.load_state_dict(m.state_dict())
    cm = torch.compile(m, mode="reduce-overhead")
    opt, ref_opt = (torch.optim.SGD(mm.parameters(), lr=1e-2) for mm in (m, ref))
    losses, ref_losses = [], []
    for i in range(10):
        x = torch.randn(64, 512, device="cuda", generator=g0)
        for mm, o, l in ((cm, opt, losses), (ref, ref_opt, ref_losses)):
            o.zero_grad()
            loss = mm(x).square().mean()
            loss.backward()
            o.step()
            l.append(loss.item())
    out["losses"], out["ref_losses"] = losses, ref_losses
    out["checkpoints_after_training"] = getattr(mgr, "debug_checkpointing_counter", -1)
    st = vmmbuf.stats(0) or {}
    out["graph_pools"] = st.get("graph_pools", 0)
    # The trees go: their graphs are destroyed, and their memory goes back.
    del f, g, cm, a, b
    torch._dynamo.reset()
    ct.reset_cudagraph_trees()
    gc.collect()
    torch.cuda.synchronize()
    z = torch.ones(16, device="cuda")
    del z
    torch.cuda.empty_cache()
    st = vmmbuf.stats(0) or {}
    out["graph_pools_after"] = st.get("graph_pools", 0)
    out["graph_bytes_after"] = st.get("graph_bytes", 0)
    print(json.dumps(out))
"""


def test_graph_trees_restore_pool_checkpoints_on_vmmbuf(torch_gpu):
    r = json.loads(run_script(_TREES, timeout=600).strip().splitlines()[-1])
    print(r)
    assert r["bad"] == 0 and r["steps"] == 12, r
    assert r["checkpoints"] >= 1, "no checkpoint was restored: the path under test did not run"
    assert _close(r["losses"], r["ref_losses"]), r
    assert r["graph_pools"] >= 1, r
    assert r["graph_pools_after"] == 0 and r["graph_bytes_after"] == 0, r
