"""vLLM's sleep-mode allocator interface on vmmbuf (``vmmbuf.vllm``), on a
GPU: what vLLM's own ``tests/basic_correctness/test_cumem.py`` checks of its
``CuMemAllocator`` (written from reading it), and its sleep levels. Each in
a fresh interpreter. Skipped without a GPU (failed under
VMMBUF_REQUIRE_GPU=1)."""

from __future__ import annotations

from conftest import run_script


def test_pool_tensors_sleep_and_wake_beside_default_ones(torch_gpu):
    """Tensors from the default allocator and from the pool are used
    together; a sleep gives device memory back and the wake-up restores
    the pool's tensors (offloaded: the default tag)."""
    out = run_script("""
        import torch
        from vmmbuf.vllm import CuMemAllocator
        shape = (1024, 1024)
        x = torch.zeros(shape, device="cuda")
        a = CuMemAllocator.get_instance()
        assert a is CuMemAllocator.get_instance()
        with a.use_memory_pool():
            y = torch.zeros(shape, device="cuda") + 1
            z = torch.zeros(shape, device="cuda") + 2
        assert torch.allclose(x + y + z, torch.full(shape, 3.0, device="cuda"))
        assert a.get_current_usage() >= 2 * y.numel() * 4, a.get_current_usage()
        torch.cuda.synchronize()
        free = torch.cuda.mem_get_info()[0]
        usage = a.get_current_usage()
        a.sleep()
        assert torch.cuda.mem_get_info()[0] > free, "the sleep gave memory back"
        assert a.get_current_usage() == usage, "sleeping tensors still count"
        a.wake_up()
        assert torch.allclose(x + y + z, torch.full(shape, 3.0, device="cuda"))
        print("OK")
    """)
    assert out.strip().endswith("OK"), out


def test_a_wake_up_without_room_raises_and_changes_nothing(torch_gpu):
    """70% of the GPU in the pool, slept; 70% taken outside it; the wake-up
    raises RuntimeError (vLLM's behaviour) and leaves the pool asleep; once
    the room is back it wakes with every byte."""
    out = run_script("""
        import torch
        from vmmbuf.vllm import CuMemAllocator
        a = CuMemAllocator.get_instance()
        n = int(torch.cuda.mem_get_info()[1] * 0.7) // (2 << 20) * (2 << 20)
        with a.use_memory_pool():
            x = torch.empty(n, dtype=torch.uint8, device="cuda")
            g = torch.Generator(device="cuda").manual_seed(5)
            x.random_(0, 256, generator=g)   # in place: no second 70% for a temporary
            ref = x[:: 4099].cpu()
        a.sleep()
        y = torch.empty(n, dtype=torch.uint8, device="cuda")
        try:
            a.wake_up()
        except RuntimeError as e:
            print("refused:", str(e)[:200])
        else:
            raise SystemExit("the wake-up had no room and did not raise")
        del y
        torch.cuda.empty_cache()
        a.wake_up()
        assert torch.equal(x[:: 4099].cpu(), ref), "every byte back"
        print("OK")
    """)
    assert "refused:" in out and out.strip().endswith("OK"), out


def test_a_captured_graph_replays_after_sleep_and_wake_up(torch_gpu):
    """A weight in the default tag, a cache in a tag that is discarded; a
    CUDA graph captured over both replays after the sleep and the wake-up:
    the weight kept, the cache written afresh."""
    out = run_script("""
        import torch
        from vmmbuf.vllm import CuMemAllocator
        a = CuMemAllocator.get_instance()
        with a.use_memory_pool():
            weight = torch.eye(1024, device="cuda")
        with a.use_memory_pool(tag="discard"):
            cache = torch.empty(1024, 1024, device="cuda")

        def model(x):
            out = x @ weight
            cache[: out.size(0)].copy_(out)
            return out + 1

        x = torch.empty(128, 1024, device="cuda")
        model(x)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = model(x)
        torch.cuda.synchronize()
        free = torch.cuda.mem_get_info()[0]
        a.sleep()
        assert torch.cuda.mem_get_info()[0] > free
        a.wake_up()
        x.random_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.allclose(x, cache[: x.size(0)])
        assert torch.allclose(y, x + 1)
        print("OK")
    """)
    assert out.strip().endswith("OK"), out


def test_sleep_levels_keep_what_they_say(torch_gpu):
    """Level 1 (``offload_tags=("weights",)``): the weights come back, the
    KV cache's memory is given back without a copy. Level 2 (``()``): both
    are dropped. Waking one tag leaves the other asleep; a pool that is
    asleep refuses new tensors."""
    out = run_script("""
        import torch, vmmbuf
        from vmmbuf.vllm import CuMemAllocator
        from vmmbuf.errors import InvalidArgumentError
        a = CuMemAllocator.get_instance()
        g = torch.Generator(device="cuda").manual_seed(9)
        with a.use_memory_pool(tag="weights"):
            w = torch.randn(8 << 20, device="cuda", generator=g)
        with a.use_memory_pool(tag="kv_cache"):
            kv = torch.randn(16 << 20, device="cuda", generator=g)
        ref = w.cpu()
        torch.cuda.synchronize()
        free = torch.cuda.mem_get_info()[0]
        a.sleep(offload_tags=("weights",))
        freed = torch.cuda.mem_get_info()[0] - free
        assert freed >= (w.numel() + kv.numel()) * 4, freed
        try:
            with a.use_memory_pool(tag="kv_cache"):
                pass
        except InvalidArgumentError as e:
            print("refused:", e)
        a.wake_up(tags=["weights"])
        assert torch.equal(w.cpu(), ref), "level 1 kept the weights"
        a.wake_up()
        kv.fill_(3.0)
        assert float(kv.sum()) == 3.0 * kv.numel()
        a.sleep(offload_tags=())
        a.wake_up()
        w.fill_(1.0)
        assert float(w.sum()) == w.numel(), "level 2: memory back, contents new"
        print("OK")
    """)
    assert "refused:" in out and out.strip().endswith("OK"), out
