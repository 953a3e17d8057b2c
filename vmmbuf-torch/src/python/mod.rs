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

/// The bytes a stashing or pageable sleep kept for `[ptr, ptr + nbytes)`
/// while their tag is asleep, or after a wake that kept them
/// (torch_memory_saver's `get_cpu_backup`); None otherwise.
#[pyfunction]
fn read_backup(
    py: Python<'_>,
    ptr: u64,
    nbytes: usize,
) -> PyResult<Option<Py<pyo3::types::PyBytes>>> {
    let got = detached(py, || state::read_backup(ptr, nbytes)).map_err(to_py)?;
    Ok(got.map(|b| pyo3::types::PyBytes::new(py, &b).unbind()))
}

/// The host address at which the backup of `[ptr, ptr + nbytes)` lies,
/// readable by the CPU (torch_memory_saver's `get_cpu_backup(zero_copy=
/// True)`): valid until the backup goes (a wake that does not keep it,
/// `release_host_cache`); None when there is no such backup.
#[pyfunction]
fn backup_address(py: Python<'_>, ptr: u64, nbytes: usize) -> PyResult<Option<u64>> {
    detached(py, || state::backup_address(ptr, nbytes)).map_err(to_py)
}

/// Sets the directory where disk sleeps ("disk") write their files, for
/// every arena (None: none; such a sleep is then refused). It must exist.
/// `file_bytes`: the most bytes one file holds (0: a file per chunk).
#[pyfunction]
#[pyo3(signature = (path=None, file_bytes=0))]
fn set_spill_dir(path: Option<std::path::PathBuf>, file_bytes: usize) {
    state::set_spill_dir(path, file_bytes);
}

/// The sleep modes' names, in the order of their numbers in the C
/// interface (`vmmbuf_sleep`'s `mode`): the one list Python checks a mode
/// against.
#[pyfunction]
fn sleep_modes() -> Vec<&'static str> {
    vmmbuf::SleepMode::ALL.iter().map(|m| m.name()).collect()
}

/// torch_memory_saver's region memory kinds ("pinned", "mmap", "disk",
/// "discard"), each with the suffix it adds to the region's tag and the
/// name of the sleep its pause takes: the one table the C `tms_pause`
/// reads too.
#[pyfunction]
fn tms_kinds() -> Vec<(&'static str, &'static str, &'static str)> {
    state::TMS_KINDS
        .iter()
        .map(|&(k, s, mode)| (k, s, mode.name()))
        .collect()
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

/// This thread allocates into PyTorch's pool `pool` on `device` until
/// [`torch_pool_end`] (PyTorch's `beginAllocateCurrentThreadToPool`, which
/// it does not pass to a pluggable allocator).
#[pyfunction]
fn torch_pool_begin(device: c_int, pool: (u64, u64)) {
    state::pools::begin(device, pool)
}

/// This thread stops allocating into `pool` on `device`.
#[pyfunction]
fn torch_pool_end(device: c_int, pool: (u64, u64)) {
    state::pools::end(device, pool)
}

/// The capture under way on `stream` allocates into PyTorch's pool
/// `pool`; False if the stream is not being captured.
#[pyfunction]
fn torch_capture_pool(
    py: Python<'_>,
    device: c_int,
    stream: usize,
    pool: (u64, u64),
) -> PyResult<bool> {
    detached(py, || {
        state::pools::capture_pool(device, stream_ptr(stream), pool)
    })
    .map_err(to_py)
}

/// The live allocations of PyTorch's pool `pool` on `device`: (address,
/// bytes asked), by address.
#[pyfunction]
fn torch_pool_live(py: Python<'_>, device: c_int, pool: (u64, u64)) -> Vec<(u64, usize)> {
    detached(py, || state::pools::live(device, pool))
}

/// This thread's next allocation takes again the block CUDA graphs hold at
/// `address`, into PyTorch's pool `pool` (`address` None withdraws it).
#[pyfunction]
#[pyo3(signature = (address, pool=(0, 0)))]
fn torch_retake_next(address: Option<u64>, pool: (u64, u64)) {
    state::pools::retake_next(address.map(|a| (a, pool)))
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

/// From now on every CUDA graph capture is announced (`capture_begins`,
/// `capture_ends`): streams are asked about captures only while one is
/// under way. `on=False`: every call asks again.
#[pyfunction]
#[pyo3(signature = (on=true))]
fn announce_captures(on: bool) {
    state::CAPTURES.announce(on)
}

/// An announced capture is about to begin.
#[pyfunction]
fn capture_begins() {
    state::CAPTURES.begins()
}

/// An announced capture has ended; raises if none was under way.
#[pyfunction]
fn capture_ends() -> PyResult<()> {
    state::CAPTURES.ends().map_err(to_py)
}

/// `(announced, captures under way)`.
#[pyfunction]
fn captures() -> (bool, usize) {
    state::CAPTURES.state()
}

/// The sleep mode named `mode` ("keep", "stash", "discard" or "pageable": the one
/// spelling of `vmmbuf::SleepMode::name`), or refused in words.
fn mode_named(mode: &str) -> PyResult<vmmbuf::SleepMode> {
    mode.parse().map_err(to_py)
}

/// Puts `tag`'s allocations (None: every tag's) to sleep in `mode`: the
/// data kept in pinned host memory at the same addresses ("keep"), away
/// from them ("stash"), in pageable host memory away from them
/// ("pageable"), or dropped ("discard"); the device memory goes
/// back, the addresses stay. `(bytes put to sleep, device bytes given
/// back)`.
#[pyfunction]
#[pyo3(signature = (tag=None, mode="keep"))]
fn sleep(py: Python<'_>, tag: Option<String>, mode: &str) -> PyResult<(u64, u64)> {
    let mode = mode_named(mode)?;
    detached(py, || state::sleep_tags(tag.as_deref(), mode))
        .map(|m| (m.bytes, m.device_bytes))
        .map_err(to_py)
}

/// Wakes `tag`'s allocations (None: every tag's) at the same addresses:
/// kept data comes back; discarded ranges get fresh memory (zeroed with
/// `zero`); a stashing or pageable sleep's host copy stays readable with
/// `keep_backup`; with `restore_free` the free memory the sleep gave back
/// is mapped again, free for the next allocations (torch_memory_saver's
/// resume). `(bytes woken, device bytes mapped)`.
#[pyfunction]
#[pyo3(signature = (tag=None, zero=false, keep_backup=false, restore_free=false))]
fn wake(
    py: Python<'_>,
    tag: Option<String>,
    zero: bool,
    keep_backup: bool,
    restore_free: bool,
) -> PyResult<(u64, u64)> {
    detached(py, || {
        state::wake_tags(tag.as_deref(), zero, keep_backup, restore_free)
    })
    .map(|m| (m.bytes, m.device_bytes))
    .map_err(to_py)
}

/// Creates the pinned host pieces a sleep of `tag` (None: every tag) in
/// `mode` would take ("keep" or "stash"; "discard" and "pageable" take
/// none): on a
/// thread of its own (`wait` false; the next sleep waits for it) or now.
/// The bytes created (0 when not waiting).
#[pyfunction]
#[pyo3(signature = (tag=None, wait=false, mode="keep"))]
fn prepare_sleep(py: Python<'_>, tag: Option<String>, wait: bool, mode: &str) -> PyResult<u64> {
    let mode = mode_named(mode)?;
    detached(py, || state::prepare_sleep(tag.as_deref(), mode, wait)).map_err(to_py)
}

/// Gives the host pieces kept between sleeps back to the driver; the bytes.
#[pyfunction]
fn release_host_cache(py: Python<'_>) -> PyResult<u64> {
    py.detach(state::release_host_cache).map_err(to_py)
}

/// Bounds the host pieces each device keeps between sleeps.
#[pyfunction]
fn set_host_cache_limit(py: Python<'_>, bytes: usize) -> PyResult<()> {
    detached(py, || state::set_host_cache_limit(bytes)).map_err(to_py)
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

/// Whether the C `tms_resume` maps back the free memory its pause gave
/// back, as `wake(restore_free=True)` does.
#[pyfunction]
fn set_tms_restore_free(on: bool) {
    state::set_tms_restore_free(on)
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
    m.add_function(wrap_pyfunction!(torch_pool_begin, m)?)?;
    m.add_function(wrap_pyfunction!(torch_pool_end, m)?)?;
    m.add_function(wrap_pyfunction!(torch_capture_pool, m)?)?;
    m.add_function(wrap_pyfunction!(torch_pool_live, m)?)?;
    m.add_function(wrap_pyfunction!(torch_retake_next, m)?)?;
    m.add_function(wrap_pyfunction!(read_backup, m)?)?;
    m.add_function(wrap_pyfunction!(backup_address, m)?)?;
    m.add_function(wrap_pyfunction!(tms_kinds, m)?)?;
    m.add_function(wrap_pyfunction!(sleep_modes, m)?)?;
    m.add_function(wrap_pyfunction!(set_spill_dir, m)?)?;
    m.add_function(wrap_pyfunction!(preload_library, m)?)?;
    m.add_function(wrap_pyfunction!(set_preload, m)?)?;
    m.add_function(wrap_pyfunction!(stats_json, m)?)?;
    m.add_function(wrap_pyfunction!(reset_peak, m)?)?;
    m.add_function(wrap_pyfunction!(set_budget, m)?)?;
    m.add_function(wrap_pyfunction!(budget, m)?)?;
    m.add_function(wrap_pyfunction!(empty_cache, m)?)?;
    m.add_function(wrap_pyfunction!(set_tag, m)?)?;
    m.add_function(wrap_pyfunction!(get_tag, m)?)?;
    m.add_function(wrap_pyfunction!(sleep, m)?)?;
    m.add_function(wrap_pyfunction!(wake, m)?)?;
    m.add_function(wrap_pyfunction!(prepare_sleep, m)?)?;
    m.add_function(wrap_pyfunction!(release_host_cache, m)?)?;
    m.add_function(wrap_pyfunction!(set_host_cache_limit, m)?)?;
    m.add_function(wrap_pyfunction!(last_error, m)?)?;
    m.add_function(wrap_pyfunction!(announce_captures, m)?)?;
    m.add_function(wrap_pyfunction!(capture_begins, m)?)?;
    m.add_function(wrap_pyfunction!(capture_ends, m)?)?;
    m.add_function(wrap_pyfunction!(captures, m)?)?;
    m.add_function(wrap_pyfunction!(nccl_register, m)?)?;
    m.add_function(wrap_pyfunction!(nccl_deregister, m)?)?;
    m.add_function(wrap_pyfunction!(nccl_covers, m)?)?;
    m.add_function(wrap_pyfunction!(set_default_tag, m)?)?;
    m.add_function(wrap_pyfunction!(set_memory_margin, m)?)?;
    m.add_function(wrap_pyfunction!(set_tms_restore_free, m)?)?;
    m.add_class::<buffer::Buffer>()?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
