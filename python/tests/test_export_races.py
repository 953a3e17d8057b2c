"""RT4-3 (issue 38): ``Buffer.export`` checked the capacity, then registered
its view; ``shrink_to_fit`` read the end of the live views, then unmapped.
Neither held one lock across both steps, so a view could be exported (and
stay alive) over bytes that a shrink unmapped at the same time. Host
backend: runs everywhere."""

from __future__ import annotations

import threading
import time

from vmmbuf import _native

G = 64 << 10


def test_a_view_exported_while_another_thread_shrinks_keeps_its_bytes_mapped():
    n = 64 * G
    buf = _native.Buffer(1 << 30, None)
    done = threading.Event()
    shrinks = [0]

    def shrinker() -> None:
        while not done.is_set():
            buf.shrink_to_fit()
            shrinks[0] += 1

    t = threading.Thread(target=shrinker, daemon=True)
    t.start()
    bad, exported, refused = [], 0, 0
    stop = time.monotonic() + 4.0
    try:
        while time.monotonic() < stop and not bad:
            buf.resize(n)
            buf.resize(0)  # the capacity stays: a view of it may be exported
            try:
                cap = buf.export(0, [n], [1], 1, 8, 1)
            except Exception:  # noqa: BLE001 - the shrink came first: refused
                refused += 1
                continue
            exported += 1
            # The view is alive: its bytes must stay mapped, whatever the
            # other thread does now.
            buf.shrink_to_fit()
            if buf.capacity < n or buf.views_end < n:
                bad.append((buf.capacity, buf.views_end))
            del cap
    finally:
        done.set()
        t.join()
    print(f"exported {exported}, refused {refused}, shrinks {shrinks[0]}")
    assert exported > 0 and shrinks[0] > 0, "the race was never run"
    assert not bad, f"a live view of {n} bytes, but capacity/views_end = {bad[0]}"
