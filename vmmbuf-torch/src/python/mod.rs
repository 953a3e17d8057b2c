//! `vmmbuf._native`: the Python module inside the plug-in's library. The
//! `vmmbuf` package (`python/vmmbuf`) wraps it; its typed signatures are in
//! `python/vmmbuf/_native.pyi`. Every function releases the GIL while it
//! works and raises an exception from `vmmbuf.errors` on failure (out of
//! memory also as `torch.OutOfMemoryError` where PyTorch is loaded).

mod buffer;
mod dlpack;

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

fn stream_ptr(stream: usize) -> *mut c_void {
    stream as *mut c_void
}

/// Allocates `size` bytes on `device` for work on `stream` (a `CUstream`
/// as an int; 0 for the legacy default stream) under this thread's tag;
/// the address.
#[pyfunction]
fn malloc(py: Python<'_>, size: usize, device: c_int, stream: usize) -> PyResult<u64> {
    // The GIL is released on this thread: its tag is still the caller's.
    py.detach(|| state::malloc(size, device, stream_ptr(stream)))
        .map_err(to_py)
}

/// Frees `ptr` in stream order on `stream`.
#[pyfunction]
fn free(py: Python<'_>, ptr: u64, device: c_int, stream: usize) -> PyResult<()> {
    py.detach(|| state::free(ptr, device, stream_ptr(stream)))
        .map_err(to_py)
}

/// The device's statistics as JSON with PyTorch's key names; None before
/// its first allocation.
#[pyfunction]
fn stats_json(py: Python<'_>, device: c_int) -> Option<String> {
    py.detach(|| state::stats_json(device))
}

/// Sets every peak of the device's statistics to its current value.
#[pyfunction]
fn reset_peak(py: Python<'_>, device: c_int) {
    py.detach(|| state::reset_peak(device))
}

/// Sets the device's budget (before its first allocation).
#[pyfunction]
fn set_budget(device: c_int, bytes: usize) -> PyResult<()> {
    state::set_budget(device, bytes).map_err(to_py)
}

/// Gives the device's cached memory back to the driver.
#[pyfunction]
fn empty_cache(py: Python<'_>, device: c_int) -> PyResult<()> {
    py.detach(|| state::empty_cache(device)).map_err(to_py)
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

/// Moves `tag`'s allocations (None: every tag's) to pinned host memory at
/// the same addresses; the bytes moved.
#[pyfunction]
#[pyo3(signature = (tag=None))]
fn sleep(py: Python<'_>, tag: Option<String>) -> PyResult<u64> {
    py.detach(|| state::move_tag(tag.as_deref(), true))
        .map_err(to_py)
}

/// Brings `tag`'s allocations (None: every tag's) back to their devices;
/// the bytes moved.
#[pyfunction]
#[pyo3(signature = (tag=None))]
fn wake(py: Python<'_>, tag: Option<String>) -> PyResult<u64> {
    py.detach(|| state::move_tag(tag.as_deref(), false))
        .map_err(to_py)
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
    m.add_function(wrap_pyfunction!(stats_json, m)?)?;
    m.add_function(wrap_pyfunction!(reset_peak, m)?)?;
    m.add_function(wrap_pyfunction!(set_budget, m)?)?;
    m.add_function(wrap_pyfunction!(empty_cache, m)?)?;
    m.add_function(wrap_pyfunction!(set_tag, m)?)?;
    m.add_function(wrap_pyfunction!(get_tag, m)?)?;
    m.add_function(wrap_pyfunction!(sleep, m)?)?;
    m.add_function(wrap_pyfunction!(wake, m)?)?;
    m.add_function(wrap_pyfunction!(last_error, m)?)?;
    m.add_class::<buffer::Buffer>()?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
