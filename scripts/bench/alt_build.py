"""Another build of vmmbuf in the same interleaved rounds (`vmmbuf-alt` in
scripts/bench/dist_train.py and scripts/bench/torch_alloc_cost.py): the package in the
directory DIST_ALT_PATH names (`pip install --target DIR <wheel>`)."""
from __future__ import annotations

import os
import sys
from types import ModuleType


def import_alt_build() -> ModuleType:
    """Puts DIST_ALT_PATH first on ``sys.path`` and imports ``vmmbuf`` from
    it; exits with the reason if DIST_ALT_PATH is not a directory or the
    import found another copy (one already imported, or none there)."""
    alt = os.environ.get("DIST_ALT_PATH")
    if not alt or not os.path.isdir(alt):
        raise SystemExit(f"vmmbuf-alt needs DIST_ALT_PATH, a directory holding a vmmbuf package (got {alt!r})")
    sys.path.insert(0, alt)
    import vmmbuf

    if not os.path.abspath(vmmbuf.__file__).startswith(os.path.abspath(alt) + os.sep):
        raise SystemExit(f"vmmbuf-alt imported {vmmbuf.__file__}, not DIST_ALT_PATH's ({alt})")
    return vmmbuf
