"""A failed allocation reaches PyTorch as a C++ exception, not a null
pointer: vmmbuf_torch_malloc, called from C++ as PyTorch's
CUDAPluggableAllocator calls it, throws with the cause (PyTorch's
c10::OutOfMemoryError when memory ran out and PyTorch is loaded, which the
GPU test ``test_torch_oom_gpu.py`` checks; else std::runtime_error).
Needs a C++ compiler (skipped without one); no GPU (the failures here are
refused before the driver)."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

import vmmbuf

HARNESS = r"""
#include <dlfcn.h>
#include <cstdio>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <sys/types.h>
// Loaded into this Python process (the extension module needs its symbols):
// calls vmmbuf_torch_malloc as PyTorch does, through a std::function.
extern "C" int run(const char* path, char* out, size_t n) {
    void* lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (!lib) { std::snprintf(out, n, "dlopen: %s", dlerror()); return 2; }
    using Fn = void*(ssize_t, int, void*);
    std::function<void*(ssize_t, int, void*)> alloc =
        reinterpret_cast<Fn*>(dlsym(lib, "vmmbuf_torch_malloc"));
    if (alloc(0, 0, nullptr) != nullptr) return 3;  // zero bytes: null
    std::string seen;
    for (ssize_t size : {ssize_t(-8), ssize_t(1) << 62}) {
        try {
            void* p = alloc(size, 0, nullptr);
            std::snprintf(out, n, "returned %p", p);
            return 1;
        } catch (const std::exception& e) {
            // One line each: with PyTorch loaded, c10's what() carries a
            // backtrace after the message.
            std::string what = e.what();
            what = what.substr(0, what.find('\n'));
            seen += std::string("caught: ") + what + "\n";
        }
    }
    std::snprintf(out, n, "%s", seen.c_str());
    return 0;
}
"""


def test_a_failed_allocation_is_thrown_to_cpp_with_the_cause(tmp_path: Path):
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    src = tmp_path / "harness.cpp"
    src.write_text(HARNESS)
    so = tmp_path / "harness.so"
    subprocess.run([cxx, "-std=c++17", "-shared", "-fPIC", "-o", str(so), str(src), "-ldl"],
                   check=True)
    harness = ctypes.CDLL(str(so))
    harness.run.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    buf = ctypes.create_string_buffer(4096)
    rc = harness.run(vmmbuf.library_path().encode(), buf, len(buf))
    text = buf.value.decode()
    assert rc == 0, text
    lines = text.splitlines()
    assert len(lines) == 2, text
    # A bad argument is not out of memory: a plain std::runtime_error.
    assert lines[0].startswith("caught: vmmbuf: vmmbuf_malloc: "), text
    assert "negative size -8" in lines[0]
    # 4 EiB: on a GPU out of memory, in PyTorch's words and then the call
    # (without PyTorch's c10 loaded in this process the exception is a
    # std::runtime_error); without a driver, the call and the missing
    # driver, as a failure that is not out of memory.
    oom = "caught: CUDA out of memory. Tried to allocate more than 1EB memory."
    assert lines[1].startswith((oom, "caught: vmmbuf: vmmbuf_malloc(")), text
    assert "vmmbuf_malloc(" in lines[1]
