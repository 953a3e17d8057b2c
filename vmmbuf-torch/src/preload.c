// torch_memory_saver's preload mode on vmmbuf: a library loaded with
// LD_PRELOAD (vmmbuf.torch_memory_saver.configure_subprocess() sets it) whose
// cudaMalloc and cudaFree come before the CUDA runtime's. Each asks vmmbuf
// first, through the plug-in the Python package loaded (attached by
// vmmbuf_preload_attach): inside a torch_memory_saver region the memory is
// vmmbuf's, tagged, and pauses with its tag; elsewhere, and before the
// attach, the call goes on to the CUDA runtime unchanged. It needs nothing
// but libdl, so the processes a preloaded one starts (which inherit
// LD_PRELOAD) load it harmlessly.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>

#include "vmmbuf.h"

typedef int cuda_error;  // cudaError_t
typedef cuda_error (*malloc_fn)(void**, size_t);
typedef cuda_error (*free_fn)(void*);
// The plug-in's entry points, as vmmbuf.h declares them (looked up by name
// at the attach): vmmbuf's answers, 0 served, 1 not vmmbuf's (the runtime
// serves it), anything else a cudaError_t to return; torch_memory_saver's C
// pause and resume, 0 or -1 (logged by vmmbuf).
typedef __typeof__(vmmbuf_preload_malloc)* vmmbuf_malloc_fn;
typedef __typeof__(vmmbuf_preload_free)* vmmbuf_free_fn;
typedef __typeof__(vmmbuf_tms_pause)* vmmbuf_tag_fn;

static vmmbuf_malloc_fn vmmbuf_malloc_hook;
static vmmbuf_free_fn vmmbuf_free_hook;
static vmmbuf_tag_fn vmmbuf_pause_hook;
static vmmbuf_tag_fn vmmbuf_resume_hook;

// cudaErrorInitializationError: no CUDA runtime after this library.
enum { NO_RUNTIME = 3 };

// The next definition of `name` after this library (the CUDA runtime's),
// looked up once into `*slot`.
static void* next_symbol(const char* name, void** slot) {
    void* g = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
    if (g == NULL) {
        g = dlsym(RTLD_NEXT, name);
        __atomic_store_n(slot, g, __ATOMIC_RELEASE);
    }
    return g;
}

static malloc_fn next_malloc(void) {
    static void* f;
    return (malloc_fn)next_symbol("cudaMalloc", &f);
}

static free_fn next_free(void) {
    static void* f;
    return (free_fn)next_symbol("cudaFree", &f);
}

__attribute__((visibility("default"))) cuda_error cudaMalloc(void** ptr, size_t size) {
    vmmbuf_malloc_fn v = __atomic_load_n(&vmmbuf_malloc_hook, __ATOMIC_ACQUIRE);
    if (v != NULL) {
        int r = v(ptr, size);
        if (r != 1) return r;
    }
    malloc_fn f = next_malloc();
    return f != NULL ? f(ptr, size) : NO_RUNTIME;
}

__attribute__((visibility("default"))) cuda_error cudaFree(void* ptr) {
    vmmbuf_free_fn v = __atomic_load_n(&vmmbuf_free_hook, __ATOMIC_ACQUIRE);
    if (v != NULL && ptr != NULL) {
        int r = v(ptr);
        if (r != 1) return r;
    }
    free_fn f = next_free();
    return f != NULL ? f(ptr) : NO_RUNTIME;
}

// torch_memory_saver's C entry points (its preload library's): pause and
// resume the memory of `tag` (NULL: every region's) from C, as
// torch_memory_saver.pause/resume do. Before vmmbuf is attached nothing of
// vmmbuf's exists, and nothing is done.
__attribute__((visibility("default"))) void tms_pause(const char* tag) {
    vmmbuf_tag_fn f = __atomic_load_n(&vmmbuf_pause_hook, __ATOMIC_ACQUIRE);
    if (f != NULL) (void)f(tag);
}

__attribute__((visibility("default"))) void tms_resume(const char* tag) {
    vmmbuf_tag_fn f = __atomic_load_n(&vmmbuf_resume_hook, __ATOMIC_ACQUIRE);
    if (f != NULL) (void)f(tag);
}

// Points the functions above at the plug-in already loaded from `native`
// (the Python package's native module): 0 on success, -1 if it is not
// loaded or lacks the hooks. Nothing is loaded here (RTLD_NOLOAD).
__attribute__((visibility("default"))) int vmmbuf_preload_attach(const char* native) {
    void* h = dlopen(native, RTLD_NOW | RTLD_NOLOAD);
    if (h == NULL) return -1;
    vmmbuf_malloc_fn m = (vmmbuf_malloc_fn)dlsym(h, "vmmbuf_preload_malloc");
    vmmbuf_free_fn f = (vmmbuf_free_fn)dlsym(h, "vmmbuf_preload_free");
    vmmbuf_tag_fn p = (vmmbuf_tag_fn)dlsym(h, "vmmbuf_tms_pause");
    vmmbuf_tag_fn r = (vmmbuf_tag_fn)dlsym(h, "vmmbuf_tms_resume");
    if (m == NULL || f == NULL || p == NULL || r == NULL) return -1;
    __atomic_store_n(&vmmbuf_pause_hook, p, __ATOMIC_RELEASE);
    __atomic_store_n(&vmmbuf_resume_hook, r, __ATOMIC_RELEASE);
    __atomic_store_n(&vmmbuf_free_hook, f, __ATOMIC_RELEASE);
    __atomic_store_n(&vmmbuf_malloc_hook, m, __ATOMIC_RELEASE);
    return 0;
}

// Whether vmmbuf is attached: 1 or 0.
__attribute__((visibility("default"))) int vmmbuf_preload_attached(void) {
    return __atomic_load_n(&vmmbuf_malloc_hook, __ATOMIC_ACQUIRE) != NULL;
}
