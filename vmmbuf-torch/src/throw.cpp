// Raising a failed allocation to PyTorch as an exception.
//
// PyTorch's CUDAPluggableAllocator wraps whatever the allocation function
// returns in a DataPtr, null included (torch/csrc/cuda/CUDAPluggableAllocator.cpp:
// allocate() has no check), so a null from vmmbuf_malloc becomes a tensor at
// address 0. A C++ exception thrown from the function instead propagates to
// PyTorch's Python binding. vmmbuf_torch_malloc (Rust, "C-unwind") calls
// vmmbuf_throw_out_of_memory when memory ran out, vmmbuf_throw_error on any
// other failure (a bad argument, a driver failure: a RuntimeError).
//
// The exception is PyTorch's own c10::OutOfMemoryError when the process has
// PyTorch's c10 loaded (it has, whenever PyTorch calls the plug-in), so
// Python sees torch.OutOfMemoryError, as with PyTorch's own allocator, and
// C++ callers that catch c10::Error see one. vmmbuf is not built against
// PyTorch: the class is found at the throw, in the loaded libc10_cuda.so and
// libc10.so, by the names the Itanium C++ ABI gives it:
// - its vtable (_ZTVN3c1016OutOfMemoryErrorE), emitted by libc10_cuda.so,
//   which throws the class itself, and through the vtable its type_info;
// - the exported constructor of its base c10::Error(SourceLocation,
//   std::string) (OutOfMemoryError only inherits Error's constructors and
//   adds no member, so it is an Error whose vtable pointer is its own).
// The object is built as the compiler builds one: Error's constructor into
// storage from __cxa_allocate_exception (sized with room to spare: Error is
// about 130 bytes in PyTorch 2.x), then the vtable pointer set to
// OutOfMemoryError's address point (two words into its vtable), then
// __cxa_throw with its type_info and the destructor its vtable names. If
// any name is missing (no PyTorch loaded, or a PyTorch whose ABI differs),
// a std::runtime_error with the same message is thrown instead, which
// PyTorch raises as a RuntimeError.
#include <cxxabi.h>
#include <dlfcn.h>

#include <cstdint>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
#include <typeinfo>
#include <utility>

namespace {

// c10::SourceLocation, as c10/util/Exception.h declares it.
struct SourceLocation {
    const char* function;
    const char* file;
    uint32_t line;
};

// c10::Error::Error(SourceLocation, std::string), called as the ABI calls a
// constructor: the object's address first.
using ErrorCtor = void (*)(void* self, SourceLocation where, std::string msg);
using Dtor = void (*)(void*);

// Room for a c10::Error: its real size is about 130 bytes (a vtable
// pointer, three strings, a vector, a shared pointer, a pointer).
constexpr size_t kRoom = 512;

void* find(const char* symbol) {
    for (const char* lib : {"libc10_cuda.so", "libc10.so"}) {
        // Only a library already loaded: never loads a PyTorch of its own.
        void* h = dlopen(lib, RTLD_NOW | RTLD_NOLOAD);
        if (h == nullptr) {
            continue;
        }
        void* p = dlsym(h, symbol);
        dlclose(h);  // the library stays: PyTorch holds it
        if (p != nullptr) {
            return p;
        }
    }
    return nullptr;
}

[[noreturn]] void throw_c10_or_std(const std::string& msg) {
    auto* vtable = static_cast<void**>(find("_ZTVN3c1016OutOfMemoryErrorE"));
    auto ctor = reinterpret_cast<ErrorCtor>(
        find("_ZN3c105ErrorC1ENS_14SourceLocationENSt7__cxx1112basic_stringIcSt11char_"
             "traitsIcESaIcEEE"));
    if (vtable == nullptr || ctor == nullptr) {
        throw std::runtime_error(msg);
    }
    // The vtable: [offset to top, type_info, complete destructor, deleting
    // destructor, what(), ...]; objects point two words in. Its type_info
    // is the one objects of the class carry (a catch matches it by name).
    auto* type = static_cast<std::type_info*>(vtable[1]);
    if (vtable[0] != nullptr || type == nullptr ||
        std::strcmp(type->name(), "N3c1016OutOfMemoryErrorE") != 0) {
        throw std::runtime_error(msg);  // not the layout this code knows
    }
    void** address_point = vtable + 2;
    auto dtor = reinterpret_cast<Dtor>(address_point[0]);
    void* obj = __cxxabiv1::__cxa_allocate_exception(kRoom);
    try {
        ctor(obj, SourceLocation{"vmmbuf_torch_malloc", __FILE__, __LINE__}, msg);
    } catch (...) {
        __cxxabiv1::__cxa_free_exception(obj);
        throw std::runtime_error(msg);
    }
    *static_cast<void***>(obj) = address_point;
    __cxxabiv1::__cxa_throw(obj, type, dtor);
}

}  // namespace

extern "C" void vmmbuf_throw_error(const char* why) {
    throw std::runtime_error(std::string("vmmbuf: ") +
                             (why != nullptr ? why : "the allocation failed"));
}

extern "C" void vmmbuf_throw_out_of_memory(const char* why) {
    throw_c10_or_std(std::string("CUDA out of memory. ") +
                     (why != nullptr ? why : "The allocation failed (vmmbuf)."));
}
