/* vmmbuf.h: the C interface of vmmbuf's plug-in library (libvmmbuf_torch.so,
 * the same file as the Python package's native module; vmmbuf.library_path()
 * names it). PyTorch's CUDAPluggableAllocator, the preload library of
 * torch_memory_saver's preload mode (src/preload.c) and C programs call it.
 *
 * Every function is exported with C linkage and declared once, here; CI checks
 * that the library exports exactly these names.
 *
 * Rules that hold for every function below:
 * - Thread safety: any function may be called from any thread at any time.
 *   Each device has its own lock; calls on different devices never wait for
 *   each other. Tags (vmmbuf_set_tag) are per thread.
 * - Failures never cross this boundary as a crash or a panic: each function
 *   catches them, logs them to stderr (VMMBUF_LOG sets the level: warn by
 *   default; off, error, info, debug, trace, or a tracing filter), keeps the
 *   cause for vmmbuf_last_error() on the calling thread, and answers with the
 *   failure value its comment names (null, -1, or nothing). A failed call
 *   changes nothing. The one exception is vmmbuf_torch_malloc, which throws.
 * - Streams are CUDA streams (cudaStream_t / CUstream) passed as void*; NULL
 *   is the legacy default stream. Devices are CUDA device ordinals.
 * - Memory is freed in stream order: a free waits for the work queued on the
 *   stream it names (and on streams given to vmmbuf_record_stream) before the
 *   bytes go to another stream. Nothing synchronises while an announced CUDA
 *   graph capture is under way; a block a captured graph may replay over is
 *   kept until every such graph is destroyed.
 *
 * Settings (environment variables, read at a device's first allocation):
 *   VMMBUF_LOG                          log level (see above)
 *   VMMBUF_TORCH_MAX_CHUNK_BYTES=N      largest chunk mapped at once (20 MiB)
 *   VMMBUF_TORCH_DEFER_FENCES=0         record an event at every free
 *   VMMBUF_TORCH_WAIT_BEFORE_GROW=0     grow instead of waiting for another
 *                                       stream's pending free block
 *   VMMBUF_TORCH_RELEASE_BEFORE_MAP=1   unmap free chunks before mapping new
 *   VMMBUF_TORCH_RELEASE_OVER_PERCENT=P give whole free chunks back past P%
 *                                       (>= 100) of the peak allocated
 *   VMMBUF_TORCH_MOVE_FREE=1            move free chunks to where it grows
 *   VMMBUF_TORCH_PEER_ACCESS=1|0        map for every peer GPU from the start
 *                                       (1) or never (0); default: once the
 *                                       process allocates on a second GPU
 *   VMMBUF_TORCH_NCCL_READY=1           chunks made as ncclMemAlloc makes them
 *                                       (needed by vmmbuf_nccl_register)
 *   VMMBUF_TORCH_GRAPHS=0               the process captures no CUDA graphs:
 *                                       skip the capture queries
 *   VMMBUF_TORCH_ANNOUNCE_CAPTURES=0    (Python package) do not announce
 *                                       PyTorch's captures
 *   VMMBUF_TORCH_TRACE=path             record the default arena's calls
 */
#ifndef VMMBUF_H
#define VMMBUF_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Sleep modes (vmmbuf_sleep, vmmbuf_prepare_sleep). */
#define VMMBUF_KEEP 0     /* to pinned host memory at the same addresses */
#define VMMBUF_DISCARD 1  /* give the memory back; the contents are lost */
#define VMMBUF_STASH 2    /* copy to a pinned stash, unmap */
#define VMMBUF_PAGEABLE 3 /* copy to pageable host memory, unmap */
#define VMMBUF_DISK 4     /* copy to unnamed files of the spill directory, unmap */

/* Wake flags (vmmbuf_wake), or-ed. */
#define VMMBUF_ZERO 1         /* discarded memory comes back zeroed */
#define VMMBUF_KEEP_BACKUP 2  /* a stash's or pageable copy stays readable */
#define VMMBUF_RESTORE_FREE 4 /* map again the free memory the sleep gave back */

/* ---- Allocation ---- */

/* Allocates `size` bytes on `device` for work on `stream`, under this
 * thread's tag. Null for 0 bytes, and null on failure (a negative size, out
 * of memory, no device). */
void* vmmbuf_malloc(ptrdiff_t size, int device, void* stream);

/* vmmbuf_malloc for PyTorch's CUDAPluggableAllocator used process-wide: on
 * failure it throws a C++ exception (PyTorch raises it in Python with the
 * cause and PyTorch's own words, "Tried to allocate ...") instead of answering
 * null. For C++ callers that handle exceptions only; Linux only. */
void* vmmbuf_torch_malloc(ptrdiff_t size, int device, void* stream);

/* Frees `ptr` in stream order on `stream` (if it is not the allocation's
 * own, the free waits for both). `size` and `device` are PyTorch's; an
 * unknown pointer or a second free is logged and changes nothing. */
void vmmbuf_free(void* ptr, ptrdiff_t size, int device, void* stream);

/* vmmbuf_free for a segment that a cache above vmmbuf gives back (PyTorch's
 * caching allocator over a vmmbuf MemPool): the memory then goes back to the
 * driver, as cudaFree's would (after the device's work; not while a capture
 * may be under way, when it stays cached). */
void vmmbuf_segment_free(void* ptr, ptrdiff_t size, int device, void* stream);

/* PyTorch's Tensor.record_stream: the free of the allocation at `ptr` also
 * waits for the work queued on `stream` until then (or leaves the block to
 * the graph `stream` is captured into at the free). Unknown pointer: logged,
 * nothing changes. */
void vmmbuf_record_stream(void* ptr, void* stream);

/* Frees `ptr` after the stream it was allocated on was destroyed: no stream
 * takes the bytes before a device synchronisation. 0, or -1 (unknown
 * pointer). */
int vmmbuf_free_stream_destroyed(void* ptr, int device);

/* The preload library's cudaMalloc: 0 with vmmbuf's memory at `*ptr`, 1 to
 * leave the call to the CUDA runtime (preload mode off, or no tag on this
 * thread), 2 (cudaErrorMemoryAllocation) when vmmbuf could not serve it.
 * `ptr` is null (answered 1) or valid for writing one pointer. */
int vmmbuf_preload_malloc(void** ptr, size_t size);

/* The preload library's cudaFree: 0 when `ptr` was vmmbuf's and is freed, 1
 * to leave the call to the CUDA runtime, 719 (cudaErrorLaunchFailure) when
 * the device synchronisation before the free failed (nothing is freed). */
int vmmbuf_preload_free(void* ptr);

/* ---- Tags, budgets, statistics ---- */

/* Makes `tag` (null or "" for none) the tag of this thread's allocations from
 * now on. 0, or -1 for a tag that is not UTF-8. */
int vmmbuf_set_tag(const char* tag);

/* The bytes all of a device's arenas may map together, at any time (what is
 * mapped past a lower budget stays mapped until it goes back): 0, or -1 for
 * a device that does not exist. */
int vmmbuf_set_budget(int device, uint64_t bytes);

/* Gives the device's cached memory back to the driver. 0, or -1. */
int vmmbuf_empty_cache(int device);

/* The device's statistics as a JSON object with PyTorch's key names
 * ("allocated_bytes.all.current", ...); valid until this thread's next call
 * of it; null before the device's first allocation. */
const char* vmmbuf_stats_json(int device);

/* Sets every peak of the device's statistics to its current value. */
void vmmbuf_reset_peak(int device);

/* This thread's last failure in words, or null; valid until this thread's
 * next failing call. */
const char* vmmbuf_last_error(void);

/* ---- CUDA graph captures ---- */

/* From now on (`on` != 0) every capture that may allocate or free through
 * the plug-in is announced with vmmbuf_capture_begins/ends, and the plug-in
 * asks the driver about a stream's capture only while one is under way; 0:
 * every call asks again. */
void vmmbuf_announce_captures(int on);

/* A capture is about to begin (call it before cudaStreamBeginCapture, even if
 * the capture may then fail to begin). No vmmbuf call synchronises the
 * device until its end is announced. */
void vmmbuf_capture_begins(void);

/* An announced capture has ended (after cudaStreamEndCapture, whether it
 * succeeded or not). 0, or -1 if none was under way (nothing changes). */
int vmmbuf_capture_ends(void);

/* ---- Sleep and wake ---- */

/* Puts the memory of `tag` (null: every tag) to sleep in `mode` (VMMBUF_KEEP
 * ... VMMBUF_DISK), waiting for the streams of its live allocations. The
 * bytes put to sleep, or -1 (the arena that failed stays as it was). */
int64_t vmmbuf_sleep(const char* tag, int mode);

/* Wakes `tag` (null: every tag) at its addresses; `flags` or-ed from
 * VMMBUF_ZERO, VMMBUF_KEEP_BACKUP, VMMBUF_RESTORE_FREE. The bytes woken, or
 * -1 (it stays asleep). */
int64_t vmmbuf_wake(const char* tag, int flags);

/* Pins, ahead of a sleep of `tag` in `mode`, the host memory it will take:
 * on a thread of its own if `wait` is 0 (the next sleep waits for it), else
 * now. The bytes pinned (0 when not waiting), or -1. */
int64_t vmmbuf_prepare_sleep(const char* tag, int mode, int wait);

/* Gives the pinned host memory kept between sleeps back to the driver, on
 * every device. The bytes, or -1. */
int64_t vmmbuf_release_host_cache(void);

/* Bounds the pinned host memory each device keeps between sleeps. 0, or -1. */
int vmmbuf_set_host_cache_limit(size_t bytes);

/* torch_memory_saver's C tms_pause and tms_resume: the memory of the region
 * tag `tag` (null: every region's) sleeps as torch_memory_saver.pause puts it
 * (pinned backups stashed, mmap backups pageable, disk backups in files, the
 * rest discarded), or wakes. 0, or -1. */
int vmmbuf_tms_pause(const char* tag);
int vmmbuf_tms_resume(const char* tag);

/* ---- NCCL ---- */

/* Keeps every range the plug-in maps on `device` registered with the NCCL
 * communicator `comm` (ncclCommRegister), deregistering each before it is
 * unmapped, until vmmbuf_nccl_deregister. `library`: null for the NCCL the
 * process loaded, or the path of the library `comm` belongs to. Needs
 * VMMBUF_TORCH_NCCL_READY=1 before the device's first allocation. The
 * registration's id (>= 1), or -1. `comm` must stay live until the
 * deregistration. */
int64_t vmmbuf_nccl_register(int device, void* comm, const char* library);

/* 1 if `[ptr, ptr + bytes)` on `device` lies in one range registered with
 * every communicator vmmbuf_nccl_register added there (NCCL can use it
 * zero-copy), 0 if not (or no registration there). */
int vmmbuf_nccl_covers(int device, const void* ptr, size_t bytes);

/* Undoes every registration vmmbuf_nccl_register made under `id` on
 * `device`. 0, or -1 (an unknown id). */
int vmmbuf_nccl_deregister(int device, uint64_t id);

#ifdef __cplusplus
}
#endif

#endif /* VMMBUF_H */
