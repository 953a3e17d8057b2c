//! Sleep and wake from Python: the modes by name, sleeping and waking a
//! tag, preparing a sleep, the host cache, and reading backups.

use pyo3::prelude::*;

use super::{detached, to_py};
use crate::state;

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

/// Whether the C `tms_resume` maps back the free memory its pause gave
/// back, as `wake(restore_free=True)` does.
#[pyfunction]
fn set_tms_restore_free(on: bool) {
    state::set_tms_restore_free(on)
}

/// Adds this file's functions to the module.
pub(super) fn add(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(read_backup, m)?)?;
    m.add_function(wrap_pyfunction!(backup_address, m)?)?;
    m.add_function(wrap_pyfunction!(set_spill_dir, m)?)?;
    m.add_function(wrap_pyfunction!(sleep_modes, m)?)?;
    m.add_function(wrap_pyfunction!(tms_kinds, m)?)?;
    m.add_function(wrap_pyfunction!(sleep, m)?)?;
    m.add_function(wrap_pyfunction!(wake, m)?)?;
    m.add_function(wrap_pyfunction!(prepare_sleep, m)?)?;
    m.add_function(wrap_pyfunction!(release_host_cache, m)?)?;
    m.add_function(wrap_pyfunction!(set_host_cache_limit, m)?)?;
    m.add_function(wrap_pyfunction!(set_tms_restore_free, m)?)?;
    Ok(())
}
