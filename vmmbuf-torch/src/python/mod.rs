//! `vmmbuf._native`: the Python module inside the plug-in's library. The
//! `vmmbuf` package (`python/vmmbuf`) wraps it; its typed signatures are in
//! `python/vmmbuf/_native.pyi`. Every function releases the GIL while it
//! works and raises an exception from `vmmbuf.errors` on failure (out of
//! memory also as `torch.OutOfMemoryError` where PyTorch is loaded).

mod buffer;
mod dlpack;
mod graphs;
mod sleep;

use std::ffi::{c_int, c_void};

use pyo3::prelude::*;

use crate::state;

/// A vmmbuf error as the Python exception `vmmbuf.errors` makes of it (its
/// class by kind, its message with every cause in the chain).
pub(crate) fn to_py(e: vmmbuf::Error) -> PyErr {
    use vmmbuf::Error as E;
    let kind = match &e {
        E::OutOfMemory { .. } | E::ArenaOutOfMemory { .. } => "out_of_memory",
        E::ReservationExhausted { .. } => "capacity",
        E::InvalidArgument(_) | E::MixedPlacement { .. } => "invalid_argument",
        E::Unsupported { .. } | E::VmmUnsupported { .. } => "unsupported",
        E::DriverUnavailable { .. } | E::InvalidDevice { .. } => "no_device",
        _ => "driver",
    };
    let mut message = e.to_string();
    let mut cause = std::error::Error::source(&e);
    while let Some(c) = cause {
        message.push_str(&format!("; caused by: {c}"));
        cause = c.source();
    }
    Python::attach(|py| {
        let made = py
            .import("vmmbuf.errors")
            .and_then(|m| m.getattr("_from_native"))
            .and_then(|f| f.call1((kind, &message)));
        match made {
            Ok(exc) => PyErr::from_value(exc),
            // The module alone, without its package: still an exception
            // with the cause.
            Err(_) => pyo3::exceptions::PyRuntimeError::new_err(format!("{kind}: {message}")),
        }
    })
}

/// Runs `f` with the GIL released, then puts back the CUDA context the
/// caller had current (see [`vmmbuf::cuda::KeepCurrentContext`]): a free of
/// another GPU's memory must not leave that GPU current for CuPy or PyTorch.
fn detached<T: Send>(py: Python<'_>, f: impl FnOnce() -> T + Send) -> T {
    py.detach(|| {
        let _keep = vmmbuf::cuda::KeepCurrentContext::new().ok();
        f()
    })
}

fn stream_ptr(stream: usize) -> *mut c_void {
    stream as *mut c_void
}

/// Allocates `size` bytes on `device` for work on `stream` (a `CUstream`
/// as an int; 0 for the legacy default stream) under this thread's tag;
/// the address.
#[pyfunction]
fn malloc(py: Python<'_>, size: usize, device: c_int, stream: usize) -> PyResult<u64> {
    // The GIL is released on this thread: its tag is still the caller's.
    detached(py, || state::malloc(size, device, stream_ptr(stream))).map_err(to_py)
}

/// Frees `ptr` in stream order on `stream`.
#[pyfunction]
fn free(py: Python<'_>, ptr: u64, device: c_int, stream: usize) -> PyResult<()> {
    detached(py, || state::free(ptr, device, stream_ptr(stream))).map_err(to_py)
}

/// Frees `ptr` after the stream it was allocated on was destroyed: nothing
/// is recorded on that stream, and no stream takes the bytes before a
/// device synchronisation.
#[pyfunction]
fn free_stream_destroyed(py: Python<'_>, ptr: u64, device: c_int) -> PyResult<()> {
    detached(py, || state::free_stream_destroyed(ptr, device)).map_err(to_py)
}

/// The preload library of torch_memory_saver's preload mode (a shared
/// library, src/preload.c), as bytes to write out for LD_PRELOAD; None
/// where it is not built (outside Linux).
#[pyfunction]
fn preload_library(py: Python<'_>) -> Option<Py<pyo3::types::PyBytes>> {
    #[cfg(target_os = "linux")]
    {
        static LIB: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/libvmmbuf_preload.so"));
        Some(pyo3::types::PyBytes::new(py, LIB).unbind())
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = py;
        None
    }
}

/// Turns preload mode on or off: the preload library's cudaMalloc and
/// cudaFree are answered by vmmbuf under a tag, or all passed on.
#[pyfunction]
fn set_preload(on: bool) {
    state::set_preload(on)
}

/// The address of the C function `vmmbuf_record_stream`, for PyTorch's
/// `CUDAPluggableAllocator.allocator().set_record_stream_fn`.
#[pyfunction]
fn record_stream_fn() -> u64 {
    crate::capi::vmmbuf_record_stream as *const () as usize as u64
}

/// PyTorch's out-of-memory observers (`torch._C._cuda_attach_out_of_memory_observer`),
/// called as PyTorch calls them: `(device, bytes asked, the most the
/// process may have, the device's free bytes)`.
static OOM_OBSERVERS: parking_lot::Mutex<Vec<Py<PyAny>>> = parking_lot::Mutex::new(Vec::new());

/// Adds an out-of-memory observer: told of every allocation the
/// process-wide plug-in refuses for want of memory, before PyTorch raises
/// `torch.OutOfMemoryError`.
#[pyfunction]
fn attach_oom_observer(observer: Py<PyAny>) {
    OOM_OBSERVERS.lock().push(observer);
    crate::capi::set_oom_hook(tell_oom_observers);
}

/// Calls every observer with the interpreter held (the allocation may come
/// from a thread that does not hold it); an observer's exception is
/// printed, as PyTorch prints it, and the others still run.
fn tell_oom_observers(device: c_int, size: usize) {
    let (limit, free) = state::oom_figures(device);
    Python::attach(|py| {
        let observers: Vec<Py<PyAny>> = OOM_OBSERVERS
            .lock()
            .iter()
            .map(|o| o.clone_ref(py))
            .collect();
        for o in observers {
            if let Err(e) = o.call1(py, (device, size, limit, free)) {
                e.print(py);
            }
        }
    });
}

/// The device's statistics as JSON with PyTorch's key names; None before
/// its first allocation.
#[pyfunction]
fn stats_json(py: Python<'_>, device: c_int) -> Option<String> {
    detached(py, || state::stats_json(device))
}

/// Every arena of the device, its mapped segments and blocks, as JSON
/// (see `state::snapshot_json`); None before its first allocation.
#[pyfunction]
fn snapshot_json(py: Python<'_>, device: c_int) -> Option<String> {
    detached(py, || state::snapshot_json(device))
}

/// Sets every peak of the device's statistics to its current value.
#[pyfunction]
fn reset_peak(py: Python<'_>, device: c_int) {
    detached(py, || state::reset_peak(device))
}

/// Sets the device's budget, at any time (see `state::set_budget`).
#[pyfunction]
fn set_budget(py: Python<'_>, device: c_int, bytes: usize) -> PyResult<()> {
    detached(py, || state::set_budget(device, bytes)).map_err(to_py)
}

/// The device's budget in bytes; None while none is set.
#[pyfunction]
fn budget(py: Python<'_>, device: c_int) -> Option<usize> {
    detached(py, || state::budget(device))
}

/// Gives the device's cached memory back to the driver: every tag's, or
/// only those in `only`, and none in `skip`.
#[pyfunction]
#[pyo3(signature = (device, only=None, skip=None))]
fn empty_cache(
    py: Python<'_>,
    device: c_int,
    only: Option<Vec<String>>,
    skip: Option<Vec<String>>,
) -> PyResult<()> {
    let skip = skip.unwrap_or_default();
    detached(py, || {
        state::empty_cache_of(device, |tag| {
            only.as_ref().is_none_or(|o| o.iter().any(|t| t == tag))
                && !skip.iter().any(|t| t == tag)
        })
    })
    .map_err(to_py)
}

/// CUDA devices this process can use (0 without a driver).
#[pyfunction]
fn device_count(py: Python<'_>) -> usize {
    py.detach(state::device_count)
}

/// Why CUDA cannot be used here, in words (no driver, a driver that does
/// not start, no device), or None when it can.
#[pyfunction]
fn cuda_unavailable(py: Python<'_>) -> Option<String> {
    py.detach(|| match vmmbuf::cuda::device_count() {
        Ok(0) => Some("the CUDA driver sees no device".to_owned()),
        Ok(_) => None,
        Err(e) => Some(e.to_string()),
    })
}

/// Every tag that has memory on some device ("" is the default tag).
#[pyfunction]
fn tags(py: Python<'_>) -> Vec<String> {
    py.detach(state::tags)
}

/// Makes `tag` the tag of this thread's allocations ("" for none).
#[pyfunction]
fn set_tag(tag: &str) {
    state::set_tag(tag)
}

/// This thread's tag ("" for none).
#[pyfunction]
fn get_tag() -> String {
    state::tag()
}

/// `vmmbuf.torch.register_nccl`'s native half: see `state::nccl_register`.
/// The Python wrapper passes a communicator from a PyTorch process group or
/// its caller, who promises it stays live until `nccl_deregister`.
#[pyfunction]
#[pyo3(signature = (device, comm, library=None))]
fn nccl_register(
    py: Python<'_>,
    device: c_int,
    comm: usize,
    library: Option<String>,
) -> PyResult<u64> {
    // SAFETY: the caller keeps `comm` live until it deregisters (the
    // package's documented contract).
    py.detach(|| unsafe { crate::state::nccl_register(device, comm, library.as_deref()) })
        .map_err(to_py)
}

/// Undoes a registration `nccl_register` made.
#[pyfunction]
fn nccl_deregister(py: Python<'_>, device: c_int, id: u64) -> PyResult<()> {
    py.detach(|| crate::state::nccl_deregister(device, id))
        .map_err(to_py)
}

/// Whether `bytes` at `addr` on `device` lie in one range registered with
/// every NCCL communicator added there.
#[pyfunction]
fn nccl_covers(py: Python<'_>, device: c_int, addr: u64, bytes: usize) -> bool {
    py.detach(|| crate::state::nccl_covers(device, addr, bytes))
}

/// Makes `tag` the tag of every thread that has not set its own ("" for
/// none).
#[pyfunction]
fn set_default_tag(tag: &str) {
    state::set_default_tag(tag)
}

/// Device bytes every arena leaves free when it maps, all devices (0:
/// none).
#[pyfunction]
fn set_memory_margin(py: Python<'_>, bytes: usize) {
    detached(py, || state::set_memory_margin(bytes))
}

/// This thread's last failure in the C entry points (what PyTorch saw as a
/// null from `vmmbuf_malloc`), or None.
#[pyfunction]
fn last_error() -> Option<String> {
    let p = crate::capi::vmmbuf_last_error();
    if p.is_null() {
        return None;
    }
    // SAFETY: a NUL-terminated string this thread's storage keeps until its
    // next failing call, which cannot happen while we copy it.
    let s = unsafe { std::ffi::CStr::from_ptr(p) };
    Some(s.to_string_lossy().into_owned())
}

/// The module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    crate::init_logging();
    m.add_function(wrap_pyfunction!(malloc, m)?)?;
    m.add_function(wrap_pyfunction!(free, m)?)?;
    m.add_function(wrap_pyfunction!(device_count, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_unavailable, m)?)?;
    m.add_function(wrap_pyfunction!(snapshot_json, m)?)?;
    m.add_function(wrap_pyfunction!(tags, m)?)?;
    m.add_function(wrap_pyfunction!(free_stream_destroyed, m)?)?;
    m.add_function(wrap_pyfunction!(record_stream_fn, m)?)?;
    m.add_function(wrap_pyfunction!(attach_oom_observer, m)?)?;
    m.add_function(wrap_pyfunction!(preload_library, m)?)?;
    m.add_function(wrap_pyfunction!(set_preload, m)?)?;
    m.add_function(wrap_pyfunction!(stats_json, m)?)?;
    m.add_function(wrap_pyfunction!(reset_peak, m)?)?;
    m.add_function(wrap_pyfunction!(set_budget, m)?)?;
    m.add_function(wrap_pyfunction!(budget, m)?)?;
    m.add_function(wrap_pyfunction!(empty_cache, m)?)?;
    m.add_function(wrap_pyfunction!(set_tag, m)?)?;
    m.add_function(wrap_pyfunction!(get_tag, m)?)?;
    m.add_function(wrap_pyfunction!(last_error, m)?)?;
    m.add_function(wrap_pyfunction!(nccl_register, m)?)?;
    m.add_function(wrap_pyfunction!(nccl_deregister, m)?)?;
    m.add_function(wrap_pyfunction!(nccl_covers, m)?)?;
    m.add_function(wrap_pyfunction!(set_default_tag, m)?)?;
    m.add_function(wrap_pyfunction!(set_memory_margin, m)?)?;
    sleep::add(m)?;
    graphs::add(m)?;
    m.add_class::<buffer::Buffer>()?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
