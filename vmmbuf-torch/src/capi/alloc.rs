//! Allocating and freeing: PyTorch's `CUDAPluggableAllocator` calls
//! (`vmmbuf_malloc`, `vmmbuf_free`), the throwing malloc PyTorch's own
//! out-of-memory error comes from, stream records, and the preload
//! library's calls; out-of-memory failures in PyTorch's words.

use super::*;

/// Allocates `size` bytes on `device` for work on `stream`, under this
/// thread's tag; null for 0 bytes, and null on failure (the cause is logged
/// and kept in [`vmmbuf_last_error`]). PyTorch takes a null for a tensor at
/// address 0: it loads [`vmmbuf_torch_malloc`] instead.
#[no_mangle]
pub extern "C" fn vmmbuf_malloc(size: isize, device: c_int, stream: *mut c_void) -> *mut c_void {
    lazy_guard("vmmbuf_malloc", std::ptr::null_mut(), || {
        let Ok(size) = usize::try_from(size) else {
            fail("vmmbuf_malloc", &format!("a negative size {size}"));
            return std::ptr::null_mut();
        };
        if size == 0 {
            // PyTorch asks for 0 bytes for empty tensors: null is the answer
            // (its DataPtr never frees a null), not a failure.
            return std::ptr::null_mut();
        }
        match state::malloc(size, device, stream) {
            Ok(p) => p as usize as *mut c_void,
            Err(e) => {
                let call = format!("vmmbuf_malloc({size}, device {device})");
                match pytorch_words(size, device, &e) {
                    Some(w) => {
                        let held = state::allocated_and_reserved(device)
                            .map(|(a, r)| in_use_words(a, r))
                            .unwrap_or_default();
                        fail_out_of_memory(&format!("{w}{held} {call}"), &e)
                    }
                    None => fail(&call, &e),
                }
                std::ptr::null_mut()
            }
        }
    })
}

/// PyTorch's own words for an allocation that did not fit ("Tried to
/// allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which
/// 1.03 GiB is free."), which its users' and its tests' checks look for;
/// None for a failure that is not out of memory.
fn pytorch_words(size: usize, device: c_int, e: &vmmbuf::Error) -> Option<String> {
    use vmmbuf::Error as E;
    let (free, total) = match e {
        E::ArenaOutOfMemory {
            free_bytes,
            total_bytes,
            ..
        } => (*free_bytes, *total_bytes),
        E::OutOfMemory { .. } => (None, None),
        _ => return None,
    };
    // PyTorch refuses these before asking any allocator, in these words.
    if size as u128 >= 1u128 << 60 {
        return Some("Tried to allocate more than 1EB memory.".into());
    }
    let mut w = format!("Tried to allocate {}.", pytorch_size(size));
    if let Some(total) = total {
        w.push_str(&format!(
            " GPU {device} has a total capacity of {}",
            pytorch_size(total)
        ));
        if let Some(free) = free {
            w.push_str(&format!(" of which {} is free", pytorch_size(free)));
        }
        w.push('.');
    }
    Some(w)
}

/// PyTorch's sentence on what the allocator holds, with vmmbuf's numbers
/// (" Of the allocated memory 1.00 GiB is allocated by vmmbuf, and 2.00 MiB
/// is reserved by vmmbuf but unallocated.").
fn in_use_words(allocated: usize, reserved: usize) -> String {
    format!(
        " Of the allocated memory {} is allocated by vmmbuf, and {} is reserved by vmmbuf but unallocated.",
        pytorch_size(allocated),
        pytorch_size(reserved.saturating_sub(allocated))
    )
}

/// A byte count as PyTorch's messages print one (c10's `format_size`).
fn pytorch_size(bytes: usize) -> String {
    let b = bytes as f64;
    if bytes <= 1 << 10 {
        format!("{bytes} bytes")
    } else if bytes <= 1 << 20 {
        format!("{:.2} KiB", b / 1024.0)
    } else if bytes <= 1 << 30 {
        format!("{:.2} MiB", b / 1048576.0)
    } else {
        format!("{:.2} GiB", b / 1073741824.0)
    }
}

#[cfg(target_os = "linux")]
unsafe extern "C-unwind" {
    /// Throws PyTorch's `c10::OutOfMemoryError` with "CUDA out of memory. "
    /// and `why` if PyTorch's c10 is loaded, else a `std::runtime_error`
    /// (src/throw.cpp).
    fn vmmbuf_throw_out_of_memory(why: *const c_char);
    /// Throws a `std::runtime_error` with `why` (src/throw.cpp).
    fn vmmbuf_throw_error(why: *const c_char);
}

/// `vmmbuf_malloc` for PyTorch's `CUDAPluggableAllocator` used process-wide:
/// on failure it throws a C++ exception instead of answering null, which
/// PyTorch would wrap as a tensor at address 0: PyTorch's own
/// `c10::OutOfMemoryError` when memory ran out (Python sees
/// `torch.OutOfMemoryError` with PyTorch's words and the cause), a
/// `std::runtime_error` for any other failure (a `RuntimeError`). Only for
/// C++ callers that handle exceptions; C callers use [`vmmbuf_malloc`].
/// Linux only (where the C++ shim is built).
#[cfg(target_os = "linux")]
#[no_mangle]
pub extern "C-unwind" fn vmmbuf_torch_malloc(
    size: isize,
    device: c_int,
    stream: *mut c_void,
) -> *mut c_void {
    let p = vmmbuf_malloc(size, device, stream);
    if p.is_null() && size != 0 {
        let oom = LAST_WAS_OOM.try_with(Cell::get).unwrap_or(false);
        if oom {
            // PyTorch's out-of-memory observers hear of it first, as its
            // own allocator tells them before it raises.
            notify_out_of_memory(device, size as usize);
        }
        // No Rust value that needs dropping lives in this frame: the
        // exception unwinds straight through it to the C++ caller.
        // SAFETY: a NUL-terminated string or null; the callee copies it
        // before throwing.
        unsafe {
            if oom {
                vmmbuf_throw_out_of_memory(vmmbuf_last_error());
            } else {
                vmmbuf_throw_error(vmmbuf_last_error());
            }
        }
    }
    p
}

/// Who hears of an allocation [`vmmbuf_torch_malloc`] refuses for want of
/// memory, before PyTorch raises it: `(device, bytes asked)`. The Python
/// module sets it once PyTorch's `_cuda_attach_out_of_memory_observer` has
/// an observer (its observers are Python callables).
static OOM_HOOK: std::sync::OnceLock<fn(c_int, usize)> = std::sync::OnceLock::new();

/// Sets the out-of-memory hook (the first one set stays).
#[cfg_attr(not(feature = "python"), allow(dead_code))]
pub(crate) fn set_oom_hook(hook: fn(c_int, usize)) {
    let _ = OOM_HOOK.set(hook);
}

/// Tells the out-of-memory hook, if one is set; a panic in it is logged,
/// never unwound into the C++ caller.
#[cfg(target_os = "linux")]
fn notify_out_of_memory(device: c_int, size: usize) {
    if let Some(hook) = OOM_HOOK.get() {
        unpanicked("an out-of-memory observer", (), || hook(device, size));
    }
}

/// Frees `ptr` in stream order on `stream` (the stream PyTorch names; if it
/// is not the allocation's own, the free waits for both). An unknown pointer
/// or a second free is logged and changes nothing.
#[no_mangle]
pub extern "C" fn vmmbuf_free(ptr: *mut c_void, size: isize, device: c_int, stream: *mut c_void) {
    lazy_guard("vmmbuf_free", (), || {
        if let Err(e) = state::free(ptr as usize as u64, device, stream) {
            fail(&format!("vmmbuf_free({ptr:?}, {size})"), &e);
        }
    })
}

/// [`vmmbuf_free`] for a segment that the cache above vmmbuf gives back,
/// as `cudaFree` frees: PyTorch's caching allocator over a vmmbuf `MemPool`
/// releases memory through it (`empty_cache`, a retry after running out, a
/// pool's end), and the memory then goes back to the driver instead of
/// staying cached twice (after the device's work, as `cudaFree` waits; not
/// while a capture may be under way, when it stays cached). Failures are
/// logged, as [`vmmbuf_free`]'s.
#[no_mangle]
pub extern "C" fn vmmbuf_segment_free(
    ptr: *mut c_void,
    size: isize,
    device: c_int,
    stream: *mut c_void,
) {
    guard("vmmbuf_segment_free", (), || {
        if let Err(e) = state::free_segment(ptr as usize as u64, device, stream) {
            fail(&format!("vmmbuf_segment_free({ptr:?}, {size})"), &e);
        }
    })
}

/// PyTorch's `Tensor.record_stream` (`CUDAPluggableAllocator`'s
/// `set_record_stream_fn` takes this function): the free of the allocation
/// at `ptr` also waits for the work queued on `stream` until then (or
/// leaves the block to the graph `stream` is being captured into at the
/// free). An unknown pointer is logged ([`vmmbuf_last_error`]) and changes
/// nothing.
#[no_mangle]
pub extern "C" fn vmmbuf_record_stream(ptr: *mut c_void, stream: *mut c_void) {
    guard("vmmbuf_record_stream", (), || {
        if let Err(e) = state::record_stream(ptr as usize as u64, stream) {
            fail(&format!("vmmbuf_record_stream({ptr:?}, {stream:?})"), &e);
        }
    })
}

/// The preload library's `cudaMalloc` (src/preload.c): 0 with vmmbuf's
/// memory at `*ptr`, 1 to leave the call to the CUDA runtime (preload mode
/// off, or no tag on this thread), 2 (`cudaErrorMemoryAllocation`) when
/// vmmbuf could not serve it (logged, [`vmmbuf_last_error`]).
///
/// # Safety
///
/// `ptr` is null (answered 1) or valid for writing one pointer, as
/// `cudaMalloc`'s first argument is.
#[no_mangle]
pub unsafe extern "C" fn vmmbuf_preload_malloc(ptr: *mut *mut c_void, size: usize) -> c_int {
    guard("vmmbuf_preload_malloc", 2, || {
        if ptr.is_null() {
            return 1;
        }
        match state::preload_malloc(size) {
            Ok(None) => 1,
            Ok(Some(p)) => {
                // SAFETY: `ptr` is not null, and valid for a write (the
                // caller's contract: cudaMalloc's out-pointer).
                unsafe { *ptr = p as usize as *mut c_void };
                0
            }
            Err(e) => {
                fail(&format!("cudaMalloc({size}) under preload mode"), &e);
                2
            }
        }
    })
}

/// The preload library's `cudaFree`: 0 when `ptr` was vmmbuf's and is
/// freed, 1 to leave the call to the CUDA runtime, 719
/// (`cudaErrorLaunchFailure`, what `cudaFree` answers when the device's
/// work failed) when the device synchronisation before the free failed:
/// then nothing is freed (logged, [`vmmbuf_last_error`]).
#[no_mangle]
pub extern "C" fn vmmbuf_preload_free(ptr: *mut c_void) -> c_int {
    guard("vmmbuf_preload_free", 1, || {
        match state::preload_free(ptr as usize as u64) {
            Ok(true) => 0,
            Ok(false) => 1,
            Err(e) => {
                fail(&format!("cudaFree({ptr:?}) under preload mode"), &e);
                719
            }
        }
    })
}

/// Frees `ptr` after the stream it was allocated on was destroyed: nothing
/// is recorded on that stream, and no stream takes the bytes before a
/// device synchronisation shows its work finished. 0 on success, -1 on
/// failure (an unknown pointer, logged, [`vmmbuf_last_error`]).
#[no_mangle]
pub extern "C" fn vmmbuf_free_stream_destroyed(ptr: *mut c_void, device: c_int) -> c_int {
    guard(
        "vmmbuf_free_stream_destroyed",
        -1,
        || match state::free_stream_destroyed(ptr as usize as u64, device) {
            Ok(()) => 0,
            Err(e) => {
                fail(&format!("vmmbuf_free_stream_destroyed({ptr:?})"), &e);
                -1
            }
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn oom(requested: usize, free: Option<usize>, total: Option<usize>) -> vmmbuf::Error {
        vmmbuf::Error::ArenaOutOfMemory {
            requested_bytes: requested,
            free_bytes: free,
            total_bytes: total,
            reserved_bytes: 0,
            budget_bytes: None,
            never_fits: false,
            during_capture: false,
        }
    }

    /// The words PyTorch's own tests and users match on
    /// (test_cuda.py's test_out_of_memory, test_out_of_memory_retry).
    #[test]
    fn out_of_memory_is_told_in_pytorchs_words() {
        let total = 150_110_011_392; // an H200's, as the driver reports it
        let w = pytorch_words(
            8_589_934_592_000_000_000,
            0,
            &oom(0, Some(20 << 20), Some(total)),
        );
        assert_eq!(
            w.as_deref(),
            Some("Tried to allocate more than 1EB memory.")
        );
        let w = pytorch_words(800_000_000 << 30, 3, &oom(0, Some(20 << 20), Some(total))).unwrap();
        assert!(
            w.starts_with(
                "Tried to allocate 800000000.00 GiB. GPU 3 has a total capacity of 139.80 GiB"
            ),
            "{w}"
        );
        assert!(w.ends_with("of which 20.00 MiB is free."), "{w}");
        let w = pytorch_words(1536, 1, &oom(0, None, None)).unwrap();
        assert_eq!(w, "Tried to allocate 1.50 KiB.");
        assert_eq!(pytorch_size(1024), "1024 bytes");
        assert_eq!(pytorch_size(3 << 20), "3.00 MiB");
        assert!(pytorch_words(8, 0, &vmmbuf::Error::InvalidArgument("x".into())).is_none());
    }
}
