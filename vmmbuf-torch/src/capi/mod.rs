//! The C entry points: PyTorch's `CUDAPluggableAllocator` loads
//! `vmmbuf_malloc` and `vmmbuf_free`; the rest serve any C caller. No panic
//! crosses the boundary: each entry point catches it, logs it and answers
//! null or -1. Every failure is logged (stderr, `VMMBUF_LOG`) and kept as
//! this thread's [`vmmbuf_last_error`].

use std::cell::{Cell, RefCell};
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::state;

mod alloc;
mod sleep;
pub use alloc::*;
pub use sleep::*;

thread_local! {
    /// The last stats JSON handed out on this thread, kept alive for the
    /// caller to copy: another thread's call never frees it.
    static JSON: RefCell<Option<CString>> = const { RefCell::new(None) };
    /// This thread's last failure, in words.
    static LAST_ERROR: RefCell<Option<CString>> = const { RefCell::new(None) };
    /// Whether this thread's last failed allocation ran out of memory (as
    /// opposed to a bad argument or a driver failure).
    static LAST_WAS_OOM: Cell<bool> = const { Cell::new(false) };
}

/// Keeps `what: error` as this thread's last error and logs it: a failure
/// that is not out of memory (see [`fail_out_of_memory`]). Every failure
/// passes here, a caught panic included, so the out-of-memory mark never
/// outlives the failure it was made for.
pub(crate) fn fail(what: &str, error: &dyn std::fmt::Display) {
    tracing::warn!(%error, "vmmbuf-torch: {what} failed");
    let text = format!("{what}: {error}").replace('\0', " ");
    // A thread being torn down keeps no last error (the failure is logged).
    let _ = LAST_ERROR.try_with(|e| *e.borrow_mut() = CString::new(text).ok());
    let _ = LAST_WAS_OOM.try_with(|o| o.set(false));
}

/// [`fail`] for an allocation that ran out of memory.
fn fail_out_of_memory(what: &str, error: &dyn std::fmt::Display) {
    fail(what, error);
    let _ = LAST_WAS_OOM.try_with(|o| o.set(true));
}

/// Runs `f`, turning a panic into `fallback` (logged). The caller's
/// current CUDA context comes back whatever the call bound (a free of
/// another GPU's memory binds that GPU's context).
fn guard<T>(what: &str, fallback: T, f: impl FnOnce() -> T) -> T {
    let _keep = vmmbuf::cuda::KeepCurrentContext::new().ok();
    unpanicked(what, fallback, f)
}

/// [`guard`] for an allocation or a free: the caller's context is read
/// only if the call is about to switch it (`KeepCurrentContext::lazy`),
/// and put back then. One served from cached memory, with no fence to
/// record, makes no driver call for it (a cuCtxGetCurrent costs 46-69 ns
/// with warm caches and 351-470 ns with cold ones, H200, `hot_path`).
fn lazy_guard<T>(what: &str, fallback: T, f: impl FnOnce() -> T) -> T {
    let _keep = vmmbuf::cuda::KeepCurrentContext::lazy();
    unpanicked(what, fallback, f)
}

/// Runs `f`, turning a panic into `fallback` (logged).
fn unpanicked<T>(what: &str, fallback: T, f: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(_) => {
            fail(what, &"panicked; answered as a failure");
            fallback
        }
    }
}

/// The device's arena statistics as a JSON object with PyTorch's key names
/// (`allocated_bytes.all.current`, ...). The string stays valid until the
/// next call on the same thread (each thread has its own); null if the
/// device has no arena yet.
#[no_mangle]
pub extern "C" fn vmmbuf_stats_json(device: c_int) -> *const c_char {
    guard("vmmbuf_stats_json", std::ptr::null(), || {
        let Some(text) = state::stats_json(device) else {
            return std::ptr::null();
        };
        JSON.try_with(|j| {
            let mut j = j.borrow_mut();
            *j = CString::new(text).ok();
            j.as_ref().map_or(std::ptr::null(), |c| c.as_ptr())
        })
        .unwrap_or(std::ptr::null())
    })
}

/// This thread's last failure in words, or null if none. Valid until this
/// thread's next failing call.
#[no_mangle]
pub extern "C" fn vmmbuf_last_error() -> *const c_char {
    LAST_ERROR
        .try_with(|e| e.borrow().as_ref().map_or(std::ptr::null(), |c| c.as_ptr()))
        .unwrap_or(std::ptr::null())
}

/// Sets every peak of the device's statistics to its current value.
#[no_mangle]
pub extern "C" fn vmmbuf_reset_peak(device: c_int) {
    guard("vmmbuf_reset_peak", (), || state::reset_peak(device))
}

/// Sets the device's memory budget: the bytes all of its arenas (one per
/// tag) may map together, at any time (what is mapped past a lower budget
/// stays mapped until it goes back). Returns 0, or -1 for a device that
/// does not exist.
#[no_mangle]
pub extern "C" fn vmmbuf_set_budget(device: c_int, bytes: u64) -> c_int {
    guard("vmmbuf_set_budget", -1, || {
        match state::set_budget(device, bytes as usize) {
            Ok(()) => 0,
            Err(e) => {
                fail("vmmbuf_set_budget", &e);
                -1
            }
        }
    })
}

/// Gives the device's cached memory back to the driver (`empty_cache`).
/// Returns 0, or -1 on an error (logged).
#[no_mangle]
pub extern "C" fn vmmbuf_empty_cache(device: c_int) -> c_int {
    guard("vmmbuf_empty_cache", -1, || {
        match state::empty_cache(device) {
            Ok(()) => 0,
            Err(e) => {
                fail("vmmbuf_empty_cache", &e);
                -1
            }
        }
    })
}

/// Tells the plug-in that every CUDA graph capture which may allocate or
/// free through it will be announced with [`vmmbuf_capture_begins`] and
/// [`vmmbuf_capture_ends`] (as PyTorch's `beginAllocateToPool` and
/// `endAllocateToPool` announce them to its own cache). From then on malloc
/// and free ask the driver whether a stream is captured only while an
/// announced capture is under way, instead of at every call. A capture
/// that is not announced is then not seen: its allocations are ordinary
/// ones, which its replays may overwrite after they are freed. The Python
/// package calls this when it hooks `torch.cuda.CUDAGraph`. `on` = 0 turns
/// it off again: every call asks.
#[no_mangle]
pub extern "C" fn vmmbuf_announce_captures(on: c_int) {
    guard("vmmbuf_announce_captures", (), || {
        state::CAPTURES.announce(on != 0)
    })
}

/// A CUDA graph capture is about to begin: call it before the capture
/// begins (`cudaStreamBeginCapture`), even if it may then fail to begin.
#[no_mangle]
pub extern "C" fn vmmbuf_capture_begins() {
    guard("vmmbuf_capture_begins", (), || state::CAPTURES.begins())
}

/// An announced capture has ended: call it after `cudaStreamEndCapture`,
/// once the stream is no longer captured. Returns 0, or -1 if no capture
/// was under way (nothing changes; logged). A capture whose end is never
/// announced keeps the plug-in asking at every call: correct, only slower.
#[no_mangle]
pub extern "C" fn vmmbuf_capture_ends() -> c_int {
    guard("vmmbuf_capture_ends", -1, || match state::CAPTURES.ends() {
        Ok(()) => 0,
        Err(e) => {
            fail("vmmbuf_capture_ends", &e);
            -1
        }
    })
}

/// The tag `tag` names: null or "" for the default one; `None` if it is not
/// UTF-8.
fn tag_of(tag: *const c_char) -> Option<String> {
    if tag.is_null() {
        return Some(String::new());
    }
    // SAFETY: the caller passes a NUL-terminated string that lives for the
    // call (the C ABI's contract for `const char*`).
    let s = unsafe { CStr::from_ptr(tag) };
    s.to_str().ok().map(str::to_owned)
}

/// Makes `tag` the tag of this thread's allocations from now on (null or ""
/// for none); other threads keep theirs. Returns 0, or -1 for a tag that is
/// not UTF-8.
///
/// # Safety
/// `tag` is null or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn vmmbuf_set_tag(tag: *const c_char) -> c_int {
    guard("vmmbuf_set_tag", -1, || match tag_of(tag) {
        Some(t) => {
            state::set_tag(&t);
            0
        }
        None => {
            fail("vmmbuf_set_tag", &"a tag that is not UTF-8");
            -1
        }
    })
}

/// Keeps every device range the plug-in maps on `device` registered with
/// the NCCL communicator `comm` (`ncclCommRegister`), registering those
/// mapped already at once and deregistering each before it is unmapped,
/// until [`vmmbuf_nccl_deregister`]. `library`: null for the NCCL the
/// process loaded (PyTorch's `libnccl.so.2`), or the path of the library
/// `comm` belongs to. Needs `VMMBUF_TORCH_NCCL_READY=1` before the device's
/// first allocation. The registration's id (>= 1), or -1 (the cause in
/// [`vmmbuf_last_error`]).
///
/// # Safety
///
/// `comm` must be a live communicator of that NCCL library and stay live
/// until [`vmmbuf_nccl_deregister`] is called with the id returned;
/// `library` must be null or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn vmmbuf_nccl_register(
    device: c_int,
    comm: *mut c_void,
    library: *const c_char,
) -> i64 {
    guard("vmmbuf_nccl_register", -1, || {
        let library = if library.is_null() {
            None
        } else {
            // SAFETY: FFI: the caller passes a NUL-terminated string.
            match unsafe { CStr::from_ptr(library) }.to_str() {
                Ok(l) => Some(l),
                Err(e) => {
                    fail("vmmbuf_nccl_register", &format!("the library path: {e}"));
                    return -1;
                }
            }
        };
        // SAFETY: the caller keeps `comm` live until it deregisters.
        match unsafe { state::nccl_register(device, comm as usize, library) } {
            Ok(id) => id as i64,
            Err(e) => {
                fail(&format!("vmmbuf_nccl_register(device {device})"), &e);
                -1
            }
        }
    })
}

/// 1 if `bytes` at `ptr` on `device` lie in one range registered with
/// every communicator [`vmmbuf_nccl_register`] added there (NCCL can use
/// them zero-copy), 0 if not (or no registration there).
#[no_mangle]
pub extern "C" fn vmmbuf_nccl_covers(device: c_int, ptr: *const c_void, bytes: usize) -> c_int {
    guard("vmmbuf_nccl_covers", 0, || {
        c_int::from(state::nccl_covers(device, ptr as u64, bytes))
    })
}

/// Undoes every registration [`vmmbuf_nccl_register`] made under `id` on
/// `device`. 0, or -1 (an unknown id; the cause in [`vmmbuf_last_error`]).
#[no_mangle]
pub extern "C" fn vmmbuf_nccl_deregister(device: c_int, id: u64) -> c_int {
    guard(
        "vmmbuf_nccl_deregister",
        -1,
        || match state::nccl_deregister(device, id) {
            Ok(()) => 0,
            Err(e) => {
                fail(
                    &format!("vmmbuf_nccl_deregister(device {device}, {id})"),
                    &e,
                );
                -1
            }
        },
    )
}
