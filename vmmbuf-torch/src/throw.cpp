// Raising a failed allocation to PyTorch as an exception.
//
// PyTorch's CUDAPluggableAllocator wraps whatever the allocation function
// returns in a DataPtr, null included (torch/csrc/cuda/CUDAPluggableAllocator.cpp:
// allocate() has no check), so a null from vmmbuf_malloc becomes a tensor at
// address 0. A C++ exception thrown from the function instead propagates to
// PyTorch's Python binding, which raises it as a RuntimeError carrying this
// message, as it does for its own allocator's failures; nothing is recorded
// for the failed allocation. vmmbuf_torch_malloc (Rust, "C-unwind") calls
// this on failure.
#include <stdexcept>
#include <string>

extern "C" void vmmbuf_throw_out_of_memory(const char* why) {
    throw std::runtime_error(std::string("CUDA out of memory (vmmbuf): ") +
                             (why != nullptr ? why : "the allocation failed"));
}
