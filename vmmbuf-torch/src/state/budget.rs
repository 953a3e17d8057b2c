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
    torchs_keys(&mut m, &s);
    memory_keys(&mut m, &d, &s);
    plugin_keys(&mut m, &d);
    Some(serde_json::Value::Object(m).to_string())
}

/// The device's allocated and reserved bytes now (all its arenas), for an
/// out-of-memory message; `None` if the device has no arena yet.
pub(crate) fn allocated_and_reserved(dev: c_int) -> Option<(usize, usize)> {
    let s = existing(dev)?.lock().stats();
    Some((s.allocated_bytes.current, s.reserved_bytes.current))
}

/// Every arena of the device at this moment, as JSON: a list of
/// `{"tag", "base", "segments": [[offset, bytes]], "blocks": [[offset,
/// bytes, allocated, requested, pending, graph]]}` (offsets from `base`;
/// `pending`: a free block another stream's work may still use; `graph`:
/// a block a CUDA graph holds). None before the device's first allocation.
#[cfg_attr(not(feature = "python"), allow(dead_code))]
pub(crate) fn snapshot_json(dev: c_int) -> Option<String> {
    let d = existing(dev)?;
    let mut d = d.lock();
    d.release_graphs();
    let arenas: Vec<serde_json::Value> = d
        .arenas
        .iter()
        .map(|(tag, a)| {
            let s = a.snapshot();
            let blocks: Vec<serde_json::Value> = s
                .blocks
                .iter()
                .map(|b| {
                    serde_json::json!([
                        b.offset,
                        b.bytes,
                        b.allocated,
                        b.requested_bytes,
                        !b.allocated && b.stream.is_some(),
                        b.graph.is_some()
                    ])
                })
                .collect();
            serde_json::json!({
                "tag": tag,
                "base": s.base,
                "segments": s.segments,
                "blocks": blocks,
            })
        })
        .collect();
    Some(serde_json::Value::Array(arenas).to_string())
}

type Json = serde_json::Map<String, serde_json::Value>;

/// The keys PyTorch's `torch.cuda.memory_stats()` has, with its names.
fn torchs_keys(m: &mut Json, s: &vmmbuf::stats::ArenaStats) {
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
    // What PyTorch counts as allocated and freed so far (bytes).
    for (name, v) in [
        ("allocated_bytes.all.allocated", s.allocated_bytes_total),
        ("allocated_bytes.all.freed", s.freed_bytes_total),
        ("requested_bytes.all.allocated", s.requested_bytes_total),
        ("requested_bytes.all.freed", s.requested_freed_total),
    ] {
        m.insert(name.into(), v.into());
    }
    for (name, v) in [
        ("num_alloc_retries", s.num_alloc_retries),
        ("num_ooms", s.num_ooms),
        ("num_device_syncs", s.num_device_syncs),
        ("num_allocs", s.num_allocs),
        ("num_frees", s.num_frees),
        ("num_device_alloc", s.num_device_alloc),
        ("num_device_free", s.num_device_free),
        ("num_grows_past_pending", s.num_grows_past_pending),
        ("grown_past_pending_bytes", s.grown_past_pending_bytes),
        ("num_waits_before_grow", s.num_waits_before_grow),
        ("num_chunks_moved", s.num_chunks_moved),
        ("num_moving_growths", s.num_moving_growths),
        ("move_ns", s.move_ns),
    ] {
        m.insert(name.into(), v.into());
    }
}

/// Where the device's memory is: pooled, asleep (and how), in graphs, on
/// the host; the budget; which tags sleep, in which mode.
fn memory_keys(m: &mut Json, d: &Device, s: &vmmbuf::stats::ArenaStats) {
    for (name, v) in [
        ("pooled_bytes", s.pooled_bytes),
        ("pooled_host_bytes", d.pool.stats().pooled_host_bytes),
        ("discarded_bytes", s.discarded_bytes),
        ("stash_bytes", s.stash_bytes),
        ("pageable_bytes", s.pageable_bytes),
        ("graph_bytes", s.graph_bytes),
        ("graph_pools", d.graphs.len()),
        ("host_bytes", s.host_bytes),
        ("device_bytes", s.device_bytes),
    ] {
        m.insert(name.into(), v.into());
    }
    m.insert("fragmentation".into(), s.fragmentation.into());
    m.insert("budget_bytes".into(), d.budget.limit_set().into());
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
}

/// The plug-in's own costs and state: time in malloc and free, fence and
/// capture queries, live allocations, NCCL registrations, captures.
fn plugin_keys(m: &mut Json, d: &Device) {
    let ns = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    let n = d.nccl.as_ref().map(|h| h.counts()).unwrap_or_default();
    let (announced, underway) = CAPTURES.state();
    for (name, v) in [
        ("host_ns_in_malloc", ns(&MALLOC_NS)),
        ("host_ns_in_free", ns(&FREE_NS)),
        (
            "num_fence_queries",
            vmmbuf::Backend::live(&*d.backend).fence_queries,
        ),
        ("num_capture_queries", ns(&CAPTURE_QUERIES)),
    ] {
        m.insert(name.into(), v.into());
    }
    use serde_json::Value as J;
    for (name, v) in [
        ("live_allocations", J::from(d.live.len())),
        ("nccl_comms", J::from(n.comms)),
        ("nccl_registrations", J::from(n.registrations)),
        ("nccl_deregistrations", J::from(n.deregistrations)),
        ("nccl_failures", J::from(n.failures)),
        ("nccl_registered_bytes", J::from(n.registered_bytes)),
        ("nccl_mapped_bytes", J::from(n.mapped_bytes)),
        ("captures_announced", J::from(announced)),
        ("captures_underway", J::from(underway)),
        // Whether chunks are mapped for the peer GPUs (see `PeerMode`;
        // NCCL-ready chunks always are, as ncclMemAlloc maps them).
        ("peer_access", J::from(peers_on() || d.nccl_ready)),
    ] {
        m.insert(name.into(), v);
    }
}

/// Sets every peak of the device's statistics to its current value.
pub(crate) fn reset_peak(dev: c_int) {
    if let Some(d) = existing(dev) {
        d.lock().arenas.values().for_each(|a| a.reset_peak());
    }
}

/// Sets the device's budget: the bytes all of its arenas may map together,
/// at any time. Memory mapped past a new, lower budget stays mapped (what
/// is live and what is cached); the next allocation that needs more gives
/// the cache back first.
pub(crate) fn set_budget(dev: c_int, bytes: usize) -> Result<()> {
    ordinal(dev)?;
    let device = {
        let mut r = registry().write();
        r.budgets.insert(dev, bytes);
        r.devices.get(&dev).copied()
    };
    // The device's lock is never taken under the registry's.
    if let Some(d) = device {
        d.lock().budget.set_limit(bytes);
    }
    Ok(())
}

/// The device's budget in bytes, `None` while none is set.
#[cfg_attr(not(feature = "python"), allow(dead_code))]
pub(crate) fn budget(dev: c_int) -> Option<usize> {
    match existing(dev) {
        Some(d) => d.lock().budget.limit_set(),
        None => registry().read().budgets.get(&dev).copied(),
    }
}

/// What PyTorch's out-of-memory observers are told of the device besides
/// the request: the most the process may have (the budget, or the device's
/// total memory) and the device's free memory, in bytes (0 where unknown).
#[cfg_attr(not(feature = "python"), allow(dead_code))]
pub(crate) fn oom_figures(dev: c_int) -> (usize, usize) {
    let Some(d) = existing(dev) else {
        return (0, 0);
    };
    let (limit, backend) = {
        let d = d.lock();
        (d.budget.limit_set(), d.backend.clone())
    };
    let (free, total) = vmmbuf::Backend::device_memory(&*backend).unwrap_or((0, 0));
    (limit.unwrap_or(total), free)
}

/// Gives the device's cached memory back to the driver.
pub(crate) fn empty_cache(dev: c_int) -> Result<()> {
    empty_cache_of(dev, |_| true)
}

/// Gives the cached memory of the device's tags that `which` picks back to
/// the driver (a PyTorch `MemPool` keeps its cache until its end).
pub(crate) fn empty_cache_of(dev: c_int, which: impl Fn(&str) -> bool) -> Result<()> {
    match existing(dev) {
        Some(d) => {
            let mut d = d.lock();
            d.release_graphs();
            d.arenas
                .iter()
                .filter(|(tag, _)| which(tag))
                .try_for_each(|(_, a)| a.empty_cache())
        }
        None => Ok(()),
    }
}
