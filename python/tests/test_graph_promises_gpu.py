"""CUDA graphs and backups through PyTorch, in the default process-wide
mode: a block two graphs use, a kept backup, out of memory in a capture.
Each program runs in a fresh interpreter and prints PASS or FAIL with what
it saw. (Frees of memory used by work queued before a capture are in
test_capture_states_gpu.py.) Skipped without a GPU (failed under
VMMBUF_REQUIRE_GPU=1)."""

from __future__ import annotations

from conftest import run_script

_SHARED_BY_TWO_GRAPHS = r"""
import gc

import torch
import vmmbuf
import vmmbuf.torch as vt

vt.use()  # vmmbuf is the process's allocator (graphs allocate from it)
N = 8 << 20  # 32 MiB of float32: chunks of their own
x = torch.ones(N, device="cuda")
s = torch.cuda.Stream()    # both captures on s; the others take memory on s too
g, h = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
with torch.cuda.graph(g, stream=s):
    out = x + 1.0          # made in g's capture: g's memory
g.replay()                 # out = 2.0: a capture runs nothing
torch.cuda.synchronize()
with torch.cuda.graph(h, stream=s):
    res = out * 2.0        # h reads out's bytes at every replay...
    del out                # ...and out is freed during h's capture
del g                      # g is gone; h lives on
gc.collect()
torch.cuda.synchronize()
for _ in range(100):       # any call of the plug-in releases what CUDA destroyed
    if vmmbuf.stats(0)["graph_pools"] <= 1:
        break
torch.cuda.empty_cache()   # synchronises for owed frees, gives free chunks back
with torch.cuda.stream(s):  # s's own frees are s's at once: others take the bytes
    junk = [torch.full((N,), 7.0, device="cuda") for _ in range(2)]
torch.cuda.synchronize()
try:
    h.replay()
    torch.cuda.synchronize()
    got = float(res[0])
    ok = bool((res == 4.0).all())
    print(("PASS" if ok else "FAIL") + f": h's replay computed res[0] = {got} (expected 4.0)")
except Exception as e:  # an unmapped range: illegal address
    print(f"FAIL: h's replay faulted after g's release: {e}")
"""

_KEPT_BACKUP = r"""
import torch
from vmmbuf.torch_memory_saver import torch_memory_saver as tms

tms.retain_cpu_backup = True
N = 3 << 20  # 12 MiB of float32
with tms.region("w", enable_cpu_backup=True):
    x = torch.full((N,), 3.0, device="cuda")
tms.pause("w")
tms.resume("w")
before = tms.get_cpu_backup(x)
view = tms.get_cpu_backup(x, zero_copy=True)
print("retained backup after resume:", None if before is None else float(before[0]),
      "zero-copy:", None if view is None else float(view[0]))
with tms.region("w", enable_cpu_backup=True):
    y = torch.ones(N, device="cuda")      # the tag's memory grows
tms._prepared()                           # the region's background preparation has run
after = tms.get_cpu_backup(x)
ok = after is None or bool((after == 3.0).all())
print(("PASS" if ok else "FAIL") + ": get_cpu_backup(x) after another region ended: "
      + ("None" if after is None else f"{float(after[0])} (expected 3.0)"))
try:
    print("zero-copy view taken before now reads", float(view[0]))
except Exception as e:
    print("zero-copy view taken before faults:", e)
"""

_OUT_OF_MEMORY_IN_A_CAPTURE = r"""
import torch
import vmmbuf.torch as vt

MiB = 1 << 20
vt.use(budget_bytes=64 * MiB)
s, s2 = torch.cuda.Stream(), torch.cuda.Stream()
with torch.cuda.stream(s):
    a = torch.empty(40 * MiB, dtype=torch.uint8, device="cuda")
with torch.cuda.stream(s2):
    b = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
with torch.cuda.stream(s):
    del a        # the call before was on s2: a fence is recorded (it passes below)
with torch.cuda.stream(s2):
    t = torch.empty(MiB // 2, dtype=torch.uint8, device="cuda")
    del t        # the call before was on s2: a deferred free, covered by no later call
torch.cuda.synchronize()
g = torch.cuda.CUDAGraph()
try:
    with torch.cuda.stream(s):
        g.capture_begin()
        # 48 MiB: fits the 64 MiB budget once a's 40 MiB of cached chunks go back.
        y = torch.empty(48 * MiB, dtype=torch.uint8, device="cuda")
        y.fill_(1)
        g.capture_end()
    g.replay()
    torch.cuda.synchronize()
    print("PASS: the capture got its memory once the cached chunks went back")
except Exception as e:
    print(f"FAIL: the capture failed: {type(e).__name__}: {e}")
"""


def _passes(code: str, env: dict | None = None) -> None:
    said = run_script(code, timeout=240, env=env)
    print(said)
    assert "PASS" in said and "FAIL" not in said, said


def test_a_graph_output_freed_in_a_second_capture_stays_while_that_graph_lives(
        torch_gpu) -> None:
    """A tensor made in graph g's capture (and computed by g's replay), then
    used and freed in graph h's capture, stays out of circulation after g is
    destroyed while h lives: h's replay still computes from it, whoever
    allocates on the capture stream after. (PyTorch's own allocator hands
    those bytes out in the same program: its users must keep such a tensor
    alive.)"""
    _passes(_SHARED_BY_TWO_GRAPHS)


def test_a_kept_backup_survives_another_region(torch_gpu) -> None:
    """With retain_cpu_backup, a resumed tag's backup reads the same bytes
    after another region of the tag has ended (its preparation does not
    refit it)."""
    _passes(_KEPT_BACKUP)


def test_out_of_memory_in_a_capture_takes_cached_chunks_without_a_sync(torch_gpu) -> None:
    """An allocation inside a capture that needs the arena's cached chunks
    back gets them without a synchronisation: the capture survives and
    replays."""
    _passes(_OUT_OF_MEMORY_IN_A_CAPTURE)
