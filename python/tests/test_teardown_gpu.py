"""Frees during thread exit and interpreter shutdown (issue 38): tensors
freed from dying threads (thread-locals, an autograd backward run on a
worker thread, a DataLoader-like pool of threads), tensors still alive at
``atexit`` and at the interpreter's end. Nothing may panic, and no free may
be answered as failed: vmmbuf logs every failed free to stderr, and the
library's own teardown must stay quiet. Each case runs in a fresh
interpreter with vmmbuf process-wide. Skipped without a GPU (failed under
VMMBUF_REQUIRE_GPU=1)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

_SCRIPT = """
    import atexit, threading, torch, vmmbuf, vmmbuf.torch as vt
    from concurrent.futures import ThreadPoolExecutor
    vt.use()
    keep = [torch.randn(1 << 20, device="cuda") for _ in range(4)]   # alive at the end

    local = threading.local()

    def worker(i):
        # Tensors in a thread-local, freed as the thread's state is torn down.
        local.t = [torch.full((4096 * (i + 1),), float(i), device="cuda") for _ in range(3)]
        x = torch.randn(256, 256, device="cuda", requires_grad=True)
        (x @ x).relu().sum().backward()       # autograd's own threads free too
        return float(x.grad.sum().item())

    for _ in range(3):
        ts = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    with ThreadPoolExecutor(4) as pool:       # a DataLoader-like pool
        list(pool.map(worker, range(16)))

    at_exit = [torch.ones(1 << 18, device="cuda")]
    atexit.register(lambda: at_exit.clear())  # freed inside atexit
    torch.cuda.synchronize()
    st = vmmbuf.stats(0)
    print("LIVE", st["allocated_bytes.all.current"], "FAILED", vmmbuf.last_error())
"""


def test_frees_from_dying_threads_and_at_shutdown_neither_panic_nor_fail(torch_gpu):
    env = dict(os.environ, VMMBUF_LOG="warn", RUST_BACKTRACE="1")
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(_SCRIPT)], capture_output=True,
                       text=True, timeout=300, env=env)
    out, err = p.stdout, p.stderr
    assert p.returncode == 0, f"exit {p.returncode}\nstdout:\n{out}\nstderr:\n{err}"
    assert "LIVE" in out, out
    for bad in ("panicked", "Thread Local Storage", "vmmbuf_free", "failed"):
        assert bad not in err, f"{bad!r} in stderr:\n{err}"
    # Only the tensors kept on purpose are alive before the end.
    live = int(out.split("LIVE", 1)[1].split()[0])
    assert live >= 4 * (4 << 20), out
