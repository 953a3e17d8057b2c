#!/usr/bin/env python3
"""Two importable ``torch_memory_saver`` packages for running
torch_memory_saver's own test suite: the real one, unpacked from
its wheel, and a shim whose public names are vmmbuf's
(``vmmbuf.torch_memory_saver``), as a user who changes the import gets.

The shim's test helpers (``testing_utils``, ``utils``: what the suite
imports besides the public interface) are the real package's own files,
copied at run time from the wheel into the output folder, never into the
project. The package's private modules are not served: a test that patches
or reads them (``hooks.mode_preload.get_binary_path_from_package``,
``entrypoint.is_xpu``, ``_impl``) fails, and is named as testing internals.

Usage: tms_shim.py WHEEL NATIVE_DIR SHIM_DIR
"""
from __future__ import annotations

import shutil
import sys
import zipfile
from pathlib import Path

SHIM_INIT = '''"""torch_memory_saver's public names, served by vmmbuf (a test shim)."""
from vmmbuf.torch_memory_saver import *  # noqa: F401,F403
from vmmbuf.torch_memory_saver import TorchMemorySaver, torch_memory_saver  # noqa: F401

try:
    from vmmbuf.torch_memory_saver import configure_subprocess  # noqa: F401
except ImportError:  # preload mode: not in vmmbuf yet
    pass
'''
SHIM_ENTRYPOINT = '''from vmmbuf.torch_memory_saver import TorchMemorySaver  # noqa: F401
'''
SHIM_PRELOAD = '''from vmmbuf.torch_memory_saver import configure_subprocess  # noqa: F401
'''


def main() -> int:
    wheel, native, shim = (Path(a) for a in sys.argv[1:4])
    for d in (native, shim):
        shutil.rmtree(d, ignore_errors=True)
    with zipfile.ZipFile(wheel) as z:
        z.extractall(native)
    pkg = shim / "torch_memory_saver"
    (pkg / "hooks").mkdir(parents=True)
    (pkg / "__init__.py").write_text(SHIM_INIT)
    (pkg / "entrypoint.py").write_text(SHIM_ENTRYPOINT)
    (pkg / "hooks" / "__init__.py").write_text("")
    (pkg / "hooks" / "mode_preload.py").write_text(SHIM_PRELOAD)
    for helper in ("testing_utils.py", "utils.py"):
        shutil.copy(native / "torch_memory_saver" / helper, pkg / helper)
    print(f"real package in {native}, vmmbuf's shim in {shim}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
