"""PyTorch's own memory API in vmmbuf's default, process-wide mode
(``vmmbuf.torch.use()``): each call a training script, Lightning or the
Hugging Face Trainer makes, asserted on its value against vmmbuf's own
statistics, in a fresh interpreter. Skipped without a GPU (failed under
VMMBUF_REQUIRE_GPU=1)."""

from __future__ import annotations

import json

from conftest import run_script

_STATS = r"""
import json, torch, vmmbuf.torch as vt
vt.use()
MiB = 1 << 20
out = {}
x = torch.empty(5 * MiB, dtype=torch.uint8, device="cuda")
out["allocated"] = torch.cuda.memory_allocated()
out["vmmbuf_allocated"] = vt.memory_allocated()
y = torch.empty(20 * MiB, dtype=torch.uint8, device="cuda")
del y
out["peak"] = torch.cuda.max_memory_allocated()
out["vmmbuf_peak"] = vt.max_memory_allocated()
torch.cuda.reset_peak_memory_stats()
out["peak_after_reset"] = torch.cuda.max_memory_allocated()
out["allocated_after_reset"] = torch.cuda.memory_allocated()
out["reserved"] = torch.cuda.memory_reserved()
out["max_reserved"] = torch.cuda.max_memory_reserved()
torch.cuda.empty_cache()
out["reserved_after_empty"] = torch.cuda.memory_reserved()
out["vmmbuf_reserved_after_empty"] = vt.memory_reserved()
st = torch.cuda.memory_stats()
vs = vt.memory_stats()
out["stats_agree"] = all(st[k] == vs[k] for k in vs if k.endswith((".current", ".peak")))
out["summary"] = "Allocated memory" in torch.cuda.memory_summary()
out["totals"] = [st["allocated_bytes.all.allocated"], st["allocated_bytes.all.freed"],
                 st["allocated_bytes.all.current"]]
torch.cuda.reset_accumulated_memory_stats()
z = torch.empty(MiB, dtype=torch.uint8, device="cuda")
del z
st = torch.cuda.memory_stats()
out["totals_after_reset"] = [st["allocated_bytes.all.allocated"], st["allocated_bytes.all.freed"],
                             st["num_alloc_retries"], st["allocation.all.allocated"]]
print("RESULT " + json.dumps(out))
"""


def test_pytorchs_statistics_calls_answer_with_vmmbufs_numbers(torch_gpu) -> None:
    said = run_script(_STATS, timeout=120)
    r = json.loads(said.split("RESULT ", 1)[1])
    print(r)
    mib = 1 << 20
    assert r["allocated"] == r["vmmbuf_allocated"] and r["allocated"] >= 5 * mib, r
    assert r["peak"] == r["vmmbuf_peak"] and r["peak"] >= 25 * mib, r
    assert r["peak_after_reset"] == r["allocated_after_reset"] == r["allocated"], r
    assert r["reserved"] >= r["allocated"] and r["max_reserved"] >= 25 * mib, r
    assert r["allocated"] <= r["reserved_after_empty"] < r["reserved"], r
    assert r["reserved_after_empty"] == r["vmmbuf_reserved_after_empty"], r
    assert r["stats_agree"] and r["summary"], r
    # PyTorch's totals: current = allocated - freed; the 20 MiB freed; a
    # reset of the accumulated statistics starts them again.
    allocated, freed, current = r["totals"]
    assert allocated - freed == current and freed >= 20 * mib and allocated >= 25 * mib, r
    assert r["totals_after_reset"] == [mib, mib, 0, 1], r


_AFTER_A_TENSOR = r"""
import torch, vmmbuf.torch as vt
from vmmbuf.errors import VmmbufError
x = torch.ones(1024, device="cuda")   # PyTorch's own allocator is in use now
try:
    vt.use()
    print("RESULT installed")
except VmmbufError as e:
    print("RESULT refused:", e)
print("process-wide:", vt.is_process_wide(), "allocated:", torch.cuda.memory_allocated())
"""


def test_use_after_the_first_tensor_is_refused_in_words_and_installs_nothing(torch_gpu) -> None:
    said = run_script(_AFTER_A_TENSOR, timeout=120)
    print(said)
    assert "RESULT refused:" in said and "before the first CUDA tensor" in said, said
    assert "vmmbuf.torch.pool()" in said, "it says what to do instead"
    assert "process-wide: False allocated: 4096" in said, said


_SNAPSHOT = r"""
import json, os, pickle, tempfile, torch, vmmbuf.torch as vt
vt.use()
torch.cuda.memory._record_memory_history()
MiB = 1 << 20
x = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
y = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
del y
path = os.path.join(tempfile.mkdtemp(), "snapshot.pickle")
torch.cuda.memory._dump_snapshot(path)
with open(path, "rb") as f:
    snap = pickle.load(f)
blocks = [b for s in snap["segments"] for b in s["blocks"]]
out = {
    "segments": len(snap["segments"]),
    "x_found": any(b["address"] == x.data_ptr() and b["state"] == "active_allocated"
                   and b["requested_size"] == 3 * MiB for b in blocks),
    "total": sum(s["total_size"] for s in snap["segments"]),
    "reserved": torch.cuda.memory_reserved(),
    "allocated_in_snapshot": sum(s["allocated_size"] for s in snap["segments"]),
    "allocated": torch.cuda.memory_allocated(),
    "memory_snapshot": len(torch.cuda.memory_snapshot()),
}
# PyTorch's own readers of the file (offline: its flame graphs download a
# script): the text summary of segments, and the visualizer's page.
from torch.cuda import _memory_viz
out["segsum"] = _memory_viz.segsum(snap)
out["page"] = len(_memory_viz.segment_plot(snap))
print("RESULT " + json.dumps(out))
"""


def test_a_memory_snapshot_shows_vmmbufs_segments_and_blocks(torch_gpu) -> None:
    """``_record_memory_history`` then ``_dump_snapshot`` write a file whose
    segments are vmmbuf's mapped memory and whose blocks include every live
    tensor, which PyTorch's visualizer reads (its segment view)."""
    said = run_script(_SNAPSHOT, timeout=120)
    r = json.loads(said.split("RESULT ", 1)[1])
    print(r)
    assert r["segments"] >= 1 and r["x_found"], r
    assert r["total"] == r["reserved"], r
    assert r["allocated_in_snapshot"] == r["allocated"], r
    assert r["memory_snapshot"] == r["segments"], r
    assert isinstance(r["segsum"], str) and r["segsum"].strip(), r
    assert r["page"] > 0, r


_BATCH_SIZE_FINDER = r"""
import json, torch, vmmbuf.torch as vt
vt.use()
GiB = 1 << 30
keep = torch.arange(1 << 20, device="cuda", dtype=torch.int64)   # must survive
base = torch.cuda.memory_allocated()
free0, total = torch.cuda.mem_get_info()
told = []
torch._C._cuda_attach_out_of_memory_observer(lambda *a: told.append(list(a)))

def step(batch):
    # batch GiB in 1 GiB tensors: an out-of-memory midway leaves the ones
    # already made to be freed as the exception unwinds.
    xs = [torch.full((GiB,), i % 251, dtype=torch.uint8, device="cuda") for i in range(batch)]
    return [int(x[-1]) for x in xs[-2:]]

# Accelerate's find_executable_batch_size: catch, empty the cache, halve.
batch, caught, last = 1024, [], None
while batch >= 1:
    try:
        last = step(batch)
        break
    except torch.cuda.OutOfMemoryError as e:
        caught.append([type(e).__name__, isinstance(e, torch.OutOfMemoryError), str(e)])
        torch.cuda.empty_cache()
        batch //= 2
out = {"batch": batch, "last": last, "caught": caught, "free0": free0, "total": total,
       "keep_intact": bool(torch.equal(keep, torch.arange(1 << 20, device="cuda"))),
       "allocated_after": torch.cuda.memory_allocated(), "base": base,
       "num_ooms": torch.cuda.memory_stats()["num_ooms"], "told": told,
       "vmmbuf_num_ooms": vt.memory_stats()["num_ooms"]}
print("RESULT " + json.dumps(out))
"""


def test_out_of_memory_is_torchs_and_a_batch_size_finder_goes_on(torch_gpu) -> None:
    """An allocation that does not fit raises ``torch.cuda.OutOfMemoryError``
    (PyTorch's own class, from its C++ ``c10::OutOfMemoryError``) in
    PyTorch's words, and the process goes on: the batch-size finder's
    pattern (catch, ``empty_cache``, retry smaller) settles on the largest
    batch that fits, nothing kept is lost, and everything the failed tries
    made goes back."""
    said = run_script(_BATCH_SIZE_FINDER, timeout=300)
    r = json.loads(said.split("RESULT ", 1)[1])
    print({k: v for k, v in r.items() if k != "caught"}, r["caught"][:1])
    gib = 1 << 30
    assert r["caught"], "1 TiB never fits"
    for name, is_torchs, msg in r["caught"]:
        assert name == "OutOfMemoryError" and is_torchs, (name, msg)
        # 1 GiB reads "1024.00 MiB" in PyTorch's words too (c10's format_size).
        assert msg.startswith("CUDA out of memory. Tried to allocate 1024.00 MiB. GPU 0 has a "
                              "total capacity of "), msg
        assert "is allocated by vmmbuf" in msg, msg
        assert ", budget" not in msg, "no budget was set: none is named"
    b = r["batch"]
    assert b >= 1 and r["last"] == [(b - 2) % 251, (b - 1) % 251], r
    # The largest power of two that fits in what was free.
    assert b * gib <= r["free0"] < 2 * b * gib + gib, r
    assert len(r["caught"]) == 10 - b.bit_length() + 1, r
    assert r["keep_intact"], "the tensor kept across the failures"
    assert r["allocated_after"] == r["base"], "every failed try's tensors went back"
    assert r["num_ooms"] == r["vmmbuf_num_ooms"] >= len(r["caught"]), r
    # PyTorch's out-of-memory observers heard of each, in PyTorch's terms:
    # (device, bytes asked, the most the process may have, bytes free).
    assert len(r["told"]) == len(r["caught"]), r["told"]
    for device, asked, most, free in r["told"]:
        assert (device, asked, most) == (0, gib, r["total"]) and 0 <= free < 2 * gib, r["told"]


_FRACTION = r"""
import json, torch, vmmbuf, vmmbuf.torch as vt
vt.use()
MiB = 1 << 20
total = torch.cuda.mem_get_info()[1]
a = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
out = {"before": torch.cuda.get_per_process_memory_fraction()}
torch.cuda.set_per_process_memory_fraction(1024 * MiB / total)
out["fraction"] = torch.cuda.get_per_process_memory_fraction()
out["budget"] = vmmbuf.stats(0)["budget_bytes"]
try:
    torch.empty(1024 * MiB, dtype=torch.uint8, device="cuda")
    out["over"] = "allocated"
except torch.OutOfMemoryError as e:
    out["over"] = str(e)
b = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")   # fits beside a
torch.cuda.set_per_process_memory_fraction(1.0)
c = torch.empty(2048 * MiB, dtype=torch.uint8, device="cuda")
out["after"] = torch.cuda.get_per_process_memory_fraction()
out["expected_budget"] = int(1024 * MiB / total * total)
out["total"] = total
print("RESULT " + json.dumps(out))
"""


def test_the_memory_fraction_is_vmmbufs_budget(torch_gpu) -> None:
    """``set_per_process_memory_fraction`` caps what vmmbuf maps (its device
    budget, at any time), ``get_per_process_memory_fraction`` reads it back,
    and an allocation past it raises ``torch.OutOfMemoryError``."""
    said = run_script(_FRACTION, timeout=120)
    r = json.loads(said.split("RESULT ", 1)[1])
    print(r)
    mib = 1 << 20
    assert r["before"] == 1.0 and r["after"] == 1.0, r
    assert abs(r["fraction"] - 1024 * mib / r["total"]) < 1e-9, r
    assert abs(r["budget"] - 1024 * mib) <= 1 and r["budget"] == r["expected_budget"], r
    assert r["over"] != "allocated", "past the fraction"
    assert r["over"].startswith("CUDA out of memory. Tried to allocate 1024.00 MiB."), r
    assert ", budget 1" in r["over"], r
