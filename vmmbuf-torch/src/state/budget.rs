//! Statistics, budgets, the device margin and `empty_cache`.

use super::*;

/// Device bytes every arena leaves free when it maps (0: none), all
/// devices: torch_memory_saver's `memory_margin_bytes`.
pub(super) static MARGIN: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Sets [`MARGIN`] for the arenas there are and those to come.
#[cfg_attr(not(feature = "python"), allow(dead_code))]
pub(crate) fn set_memory_margin(bytes: usize) {
    MARGIN.store(bytes, std::sync::atomic::Ordering::Relaxed);
    for (_, d) in all_devices() {
        for a in d.lock().arenas.values() {
            a.set_device_margin(bytes);
        }
    }
}

/// Where every arena's disk sleeps write their files (torch_memory_saver's
/// `set_disk_backup_dir`), for the arenas there are and those to come.
pub(super) static SPILL_DIR: parking_lot::RwLock<Option<std::path::PathBuf>> =
    parking_lot::RwLock::new(None);

/// The most bytes one file of a disk sleep holds, 0 for a file per chunk
/// (`vmmbuf::Arena::set_spill_file_bytes`), for every arena.
pub(super) static SPILL_FILE_BYTES: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(0);

/// Sets [`SPILL_DIR`] (`vmmbuf::Arena::set_spill_dir`) and
/// [`SPILL_FILE_BYTES`] for the arenas there are and those to come.
#[cfg_attr(not(feature = "python"), allow(dead_code))]
pub(crate) fn set_spill_dir(dir: Option<std::path::PathBuf>, file_bytes: usize) {
    *SPILL_DIR.write() = dir.clone();
    SPILL_FILE_BYTES.store(file_bytes, std::sync::atomic::Ordering::Relaxed);
    for (_, d) in all_devices() {
        for a in d.lock().arenas.values() {
            a.set_spill_dir(dir.clone());
            a.set_spill_file_bytes(file_bytes);
        }
    }
}

/// The device's statistics with PyTorch's key names, as JSON; `None` if the
/// device has no arena yet.
pub(crate) fn stats_json(dev: c_int) -> Option<String> {
    let d = existing(dev)?;
    let mut d = d.lock();
    d.release_graphs();
    let s = d.stats();
    let mut m = serde_json::Map::new();
    for (name, v) in [
        ("allocated_bytes", s.allocated_bytes),
        ("reserved_bytes", s.reserved_bytes),
        ("active_bytes", s.active_bytes),
        ("inactive_split_bytes", s.inactive_split_bytes),
        ("requested_bytes", s.requested_bytes),
    ] {
        m.insert(format!("{name}.all.current"), v.current.into());
        m.insert(format!("{name}.all.peak"), v.peak.into());
    }
    m.insert("num_alloc_retries".into(), s.num_alloc_retries.into());
    m.insert("num_ooms".into(), s.num_ooms.into());
    m.insert("num_device_syncs".into(), s.num_device_syncs.into());
    m.insert("num_allocs".into(), s.num_allocs.into());
    m.insert("num_frees".into(), s.num_frees.into());
    m.insert("num_device_alloc".into(), s.num_device_alloc.into());
    m.insert("num_device_free".into(), s.num_device_free.into());
    m.insert(
        "num_grows_past_pending".into(),
        s.num_grows_past_pending.into(),
    );
    m.insert(
        "grown_past_pending_bytes".into(),
        s.grown_past_pending_bytes.into(),
    );
    m.insert(
        "num_waits_before_grow".into(),
        s.num_waits_before_grow.into(),
    );
    let ns = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    m.insert("host_ns_in_malloc".into(), ns(&MALLOC_NS).into());
    m.insert("host_ns_in_free".into(), ns(&FREE_NS).into());
    m.insert(
        "num_fence_queries".into(),
        vmmbuf::Backend::live(&*d.backend).fence_queries.into(),
    );
    m.insert("live_allocations".into(), d.live.len().into());
    let n = d.nccl.as_ref().map(|h| h.counts()).unwrap_or_default();
    m.insert("nccl_comms".into(), n.comms.into());
    m.insert("nccl_registrations".into(), n.registrations.into());
    m.insert("nccl_deregistrations".into(), n.deregistrations.into());
    m.insert("nccl_failures".into(), n.failures.into());
    m.insert("nccl_registered_bytes".into(), n.registered_bytes.into());
    m.insert("nccl_mapped_bytes".into(), n.mapped_bytes.into());
    let (announced, underway) = CAPTURES.state();
    m.insert("captures_announced".into(), announced.into());
    m.insert("captures_underway".into(), underway.into());
    m.insert("num_capture_queries".into(), ns(&CAPTURE_QUERIES).into());
    m.insert("pooled_bytes".into(), s.pooled_bytes.into());
    m.insert(
        "pooled_host_bytes".into(),
        d.pool.stats().pooled_host_bytes.into(),
    );
    m.insert("discarded_bytes".into(), s.discarded_bytes.into());
    m.insert("stash_bytes".into(), s.stash_bytes.into());
    m.insert("pageable_bytes".into(), s.pageable_bytes.into());
    m.insert("graph_bytes".into(), s.graph_bytes.into());
    m.insert("graph_pools".into(), d.graphs.len().into());
    m.insert("fragmentation".into(), s.fragmentation.into());
    m.insert("host_bytes".into(), s.host_bytes.into());
    m.insert("device_bytes".into(), s.device_bytes.into());
    m.insert(
        "budget_bytes".into(),
        d.budget.as_ref().map(|b| b.limit()).into(),
    );
    let mut sleeping: Vec<(&str, SleepMode)> = d
        .arenas
        .iter()
        .filter_map(|(t, a)| a.sleep_mode().map(|m| (t.as_str(), m)))
        .collect();
    sleeping.sort_unstable_by_key(|x| x.0);
    m.insert(
        "sleeping_tags".into(),
        sleeping.iter().map(|x| x.0).collect::<Vec<_>>().into(),
    );
    m.insert(
        "sleep_modes".into(),
        serde_json::Value::Object(
            sleeping
                .iter()
                .map(|(t, mode)| ((*t).to_owned(), mode.to_string().into()))
                .collect(),
        ),
    );
    Some(serde_json::Value::Object(m).to_string())
}

/// Sets every peak of the device's statistics to its current value.
pub(crate) fn reset_peak(dev: c_int) {
    if let Some(d) = existing(dev) {
        d.lock().arenas.values().for_each(|a| a.reset_peak());
    }
}

/// Sets the device's budget: the bytes all of its arenas may map together.
/// Only before the device's first allocation.
pub(crate) fn set_budget(dev: c_int, bytes: usize) -> Result<()> {
    ordinal(dev)?;
    let mut r = registry().write();
    if r.devices.contains_key(&dev) {
        return Err(Error::InvalidArgument(format!(
            "device {dev} is in use already: set its budget before its first allocation"
        )));
    }
    r.budgets.insert(dev, bytes);
    Ok(())
}

/// Gives the device's cached memory back to the driver.
pub(crate) fn empty_cache(dev: c_int) -> Result<()> {
    match existing(dev) {
        Some(d) => {
            let mut d = d.lock();
            d.release_graphs();
            d.arenas.values().try_for_each(|a| a.empty_cache())
        }
        None => Ok(()),
    }
}
