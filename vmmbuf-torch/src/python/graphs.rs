//! CUDA graphs from Python: PyTorch's pools begun and ended around
//! captures, a capture's pool, retaking a graph's output, and the capture
//! announcements the plug-in's capture rules need.

use super::*;

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

/// Adds this file's functions to the module.
pub(super) fn add(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(torch_pool_begin, m)?)?;
    m.add_function(wrap_pyfunction!(torch_pool_end, m)?)?;
    m.add_function(wrap_pyfunction!(torch_capture_pool, m)?)?;
    m.add_function(wrap_pyfunction!(torch_pool_live, m)?)?;
    m.add_function(wrap_pyfunction!(torch_retake_next, m)?)?;
    m.add_function(wrap_pyfunction!(announce_captures, m)?)?;
    m.add_function(wrap_pyfunction!(capture_begins, m)?)?;
    m.add_function(wrap_pyfunction!(capture_ends, m)?)?;
    m.add_function(wrap_pyfunction!(captures, m)?)?;
    Ok(())
}
