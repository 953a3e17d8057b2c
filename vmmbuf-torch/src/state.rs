//! The plug-in's state: one [`Device`] per CUDA device, each behind its own
//! lock (work on one device never waits for another's), and the operations
//! the C ABI and the Python module share. Every operation returns a
//! [`vmmbuf::Result`]; the C ABI turns errors into null or -1 and a log line,
//! the Python module into exceptions.

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::sync::{Arc, OnceLock};

use cudarc::driver::{sys, CudaStream};
use parking_lot::{Mutex, RwLock};
use vmmbuf::cuda::CudaAllocation;
use vmmbuf::stats::ArenaStats;
use vmmbuf::{
    Arena, ArenaDesc, ArenaStream, Budget, ChunkPool, CudaBackend, Error, PoolDesc, Result,
};

type TorchArena = Arena<CudaBackend, Arc<CudaStream>>;

/// Address space each tag's arena reserves on a device (no memory until
/// used).
const RESERVE: usize = 1 << 40;

/// One CUDA device's arenas, chunk pool, budget and live allocations.
pub(crate) struct Device {
    /// One arena per tag (the default tag is "").
    arenas: HashMap<String, TorchArena>,
    /// Shared by the device's arenas.
    pool: Arc<ChunkPool<CudaBackend>>,
    backend: Arc<CudaBackend>,
    /// Foreign streams (PyTorch's, CuPy's), wrapped (not owned) once each.
    streams: HashMap<usize, Arc<CudaStream>>,
    /// The device's budget, shared by all its tags' arenas.
    budget: Option<Arc<Budget>>,
    /// Live allocations by address.
    live: HashMap<usize, CudaAllocation>,
}

#[derive(Default)]
struct Registry {
    devices: HashMap<c_int, Arc<Mutex<Device>>>,
    /// Budgets set before their device's first allocation.
    budgets: HashMap<c_int, usize>,
}

thread_local! {
    /// The tag this thread's allocations are made under ("" for none): per
    /// thread, as `torch.cuda.use_mem_pool` scopes are.
    static TAG: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) };
}

/// The registry: a read lock to find a device, the write lock only to add
/// one or set a budget.
fn registry() -> &'static RwLock<Registry> {
    static R: OnceLock<RwLock<Registry>> = OnceLock::new();
    R.get_or_init(|| {
        crate::init_logging();
        RwLock::default()
    })
}

fn ordinal(device: c_int) -> Result<u32> {
    u32::try_from(device).map_err(|_| Error::InvalidArgument(format!("device {device}")))
}

/// The device's state, created (driver, pool) on first use.
fn device(device: c_int) -> Result<Arc<Mutex<Device>>> {
    if let Some(d) = registry().read().devices.get(&device) {
        return Ok(d.clone());
    }
    let mut r = registry().write();
    if let Some(d) = r.devices.get(&device) {
        return Ok(d.clone());
    }
    let backend = CudaBackend::new(ordinal(device)?)?;
    let pool = ChunkPool::new(backend.clone(), PoolDesc::default())?;
    let d = Arc::new(Mutex::new(Device {
        arenas: HashMap::new(),
        pool,
        backend,
        budget: r.budgets.get(&device).map(|&b| Budget::new(b)),
        streams: HashMap::new(),
        live: HashMap::new(),
    }));
    r.devices.insert(device, d.clone());
    Ok(d)
}

/// The device's state if it has been used.
fn existing(device: c_int) -> Option<Arc<Mutex<Device>>> {
    registry().read().devices.get(&device).cloned()
}

/// Every device in use.
fn all_devices() -> Vec<(c_int, Arc<Mutex<Device>>)> {
    let r = registry().read();
    let mut v: Vec<_> = r.devices.iter().map(|(k, d)| (*k, d.clone())).collect();
    v.sort_by_key(|(k, _)| *k);
    v
}

impl Device {
    /// The arena of `tag`, created on first use.
    fn arena(&mut self, tag: &str) -> Result<&TorchArena> {
        if !self.arenas.contains_key(tag) {
            let mut desc = ArenaDesc::new(RESERVE);
            // Training changes tensor sizes every step: free chunks stay
            // mapped (given back on a budget, out of memory or empty_cache)
            // under expandable segments' block rules. On an H100 that kept
            // the median step within 1.4% of PyTorch's own allocator at
            // 0.885-0.905 utilization, where unmapping them on every miss
            // cost 2.5x the step time. VMMBUF_TORCH_RELEASE_BEFORE_MAP=1
            // turns the unmapping back on (tighter memory, slower).
            desc.release_before_map =
                std::env::var("VMMBUF_TORCH_RELEASE_BEFORE_MAP").as_deref() == Ok("1");
            if let Some(b) = &self.budget {
                desc = desc.shared_budget(b.clone());
            }
            let arena = Arena::with_pool(self.pool.clone(), desc)?;
            // VMMBUF_TORCH_TRACE=path records the default arena's allocs and
            // frees as a trace (replay it with the `replay` example).
            if let (true, Ok(path)) = (tag.is_empty(), std::env::var("VMMBUF_TORCH_TRACE")) {
                match std::fs::File::create(&path) {
                    // Unbuffered: the arena lives until the process exits.
                    Ok(f) => arena.record_trace(Box::new(f))?,
                    Err(e) => {
                        tracing::warn!(error = %e, path, "vmmbuf-torch: cannot write the trace")
                    }
                }
            }
            self.arenas.insert(tag.to_owned(), arena);
        }
        Ok(&self.arenas[tag])
    }

    /// The sum of the device's arenas' counters (peaks too: exact with one
    /// tag, an upper bound with several).
    fn stats(&self) -> ArenaStats {
        let mut all = self.arenas.values().map(|a| a.stats());
        let mut sum = all.next().unwrap_or_default();
        for s in all {
            for (t, v) in [
                (&mut sum.allocated_bytes, s.allocated_bytes),
                (&mut sum.reserved_bytes, s.reserved_bytes),
                (&mut sum.active_bytes, s.active_bytes),
                (&mut sum.inactive_split_bytes, s.inactive_split_bytes),
                (&mut sum.requested_bytes, s.requested_bytes),
            ] {
                t.current += v.current;
                t.peak += v.peak;
            }
            sum.num_alloc_retries += s.num_alloc_retries;
            sum.num_ooms += s.num_ooms;
            sum.num_allocs += s.num_allocs;
            sum.num_frees += s.num_frees;
            sum.host_bytes += s.host_bytes;
            sum.device_bytes += s.device_bytes;
            sum.num_device_syncs = sum.num_device_syncs.max(s.num_device_syncs);
            sum.fragmentation = sum.fragmentation.max(s.fragmentation);
        }
        sum
    }

    fn stream(&mut self, stream: *mut c_void) -> Arc<CudaStream> {
        let ctx = self.backend.context().clone();
        self.streams
            .entry(stream as usize)
            .or_insert_with(|| {
                // SAFETY: the caller (PyTorch, CuPy) passes a stream of this
                // device's primary context (the one CudaBackend::new retains)
                // and keeps it alive while it allocates on it; the wrapper
                // never destroys it.
                unsafe { ctx.wrap_borrowed_stream(stream as sys::CUstream) }
            })
            .clone()
    }

    /// The streams (once each) of the live allocations that lie in `arena`:
    /// what may still use its memory. Not every stream ever seen: its owner
    /// may have destroyed one (an ExternalStream) since, and recording on a
    /// dead handle fails, or worse. Frees already made carry their own
    /// fences, which the arena waits for.
    fn live_streams(&self, arena: &TorchArena) -> Vec<Arc<CudaStream>> {
        let range = arena.base()..arena.base() + RESERVE as u64;
        let mut seen = HashMap::new();
        for a in self.live.values().filter(|a| range.contains(&a.address())) {
            let s = a.stream();
            let key = <Arc<CudaStream> as ArenaStream<CudaBackend>>::key(s);
            seen.entry(key).or_insert_with(|| s.clone());
        }
        seen.into_values().collect()
    }
}

/// The tag of this thread's allocations ("" for none).
pub(crate) fn tag() -> String {
    TAG.with(|t| t.borrow().clone())
}

/// Makes `tag` the tag of this thread's allocations ("" for none).
pub(crate) fn set_tag(tag: &str) {
    TAG.with(|t| tag.clone_into(&mut t.borrow_mut()));
}

/// Allocates `size` bytes on `device` for work on `stream`, under this
/// thread's tag; the address.
pub(crate) fn malloc(size: usize, dev: c_int, stream: *mut c_void) -> Result<u64> {
    if size == 0 {
        return Err(Error::InvalidArgument("an allocation of 0 bytes".into()));
    }
    let d = device(dev)?;
    let mut d = d.lock();
    let tag = tag();
    let s = d.stream(stream);
    let a = match d.arena(&tag)?.alloc(size, &s) {
        // At the device's budget, shared by every tag: the other tags'
        // cached memory goes back too, then one more try (an arena gives
        // back only its own before failing).
        Err(e) if e.is_transient() && d.arenas.len() > 1 => {
            for a in d.arenas.values() {
                if let Err(e) = a.release_cached() {
                    tracing::warn!(error = %e, "vmmbuf-torch: releasing cached memory failed");
                }
            }
            d.arena(&tag)?.alloc(size, &s)?
        }
        r => r?,
    };
    let p = a.address();
    d.live.insert(p as usize, a);
    Ok(p)
}

/// Frees `ptr` in stream order on `stream` (if it is not the allocation's
/// own, the free waits for both).
pub(crate) fn free(ptr: u64, dev: c_int, stream: *mut c_void) -> Result<()> {
    let unknown = || {
        Error::InvalidArgument(format!(
            "free of {ptr:#x} on device {dev}: not a live allocation (unknown, or freed already)"
        ))
    };
    let d = existing(dev).ok_or_else(unknown)?;
    let mut d = d.lock();
    let a = d.live.remove(&(ptr as usize)).ok_or_else(unknown)?;
    let s = d.stream(stream);
    a.record_stream(&s);
    drop(a);
    Ok(())
}

/// The device's statistics with PyTorch's key names, as JSON; `None` if the
/// device has no arena yet.
pub(crate) fn stats_json(dev: c_int) -> Option<String> {
    let d = existing(dev)?;
    let d = d.lock();
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
    m.insert("live_allocations".into(), d.live.len().into());
    m.insert("pooled_bytes".into(), s.pooled_bytes.into());
    m.insert("fragmentation".into(), s.fragmentation.into());
    m.insert("host_bytes".into(), s.host_bytes.into());
    m.insert("device_bytes".into(), s.device_bytes.into());
    m.insert(
        "budget_bytes".into(),
        d.budget.as_ref().map(|b| b.limit()).into(),
    );
    let mut sleeping: Vec<&str> = d
        .arenas
        .iter()
        .filter(|(_, a)| a.is_offloaded())
        .map(|(t, _)| t.as_str())
        .collect();
    sleeping.sort_unstable();
    m.insert("sleeping_tags".into(), sleeping.into());
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
        Some(d) => d.lock().arenas.values().try_for_each(|a| a.empty_cache()),
        None => Ok(()),
    }
}

/// Moves `tag`'s allocations (`None`: every tag's) on every device to
/// pinned host memory (`sleep`) or back (`!sleep`), at the same addresses;
/// the bytes moved. On an error the arena that failed stays as it was and
/// the ones moved before it stay moved.
pub(crate) fn move_tag(tag: Option<&str>, sleep: bool) -> Result<u64> {
    let mut moved = 0u64;
    for (_, d) in all_devices() {
        let d = d.lock();
        let mut tags: Vec<&String> = d
            .arenas
            .keys()
            .filter(|t| tag.is_none_or(|want| want == t.as_str()))
            .collect();
        tags.sort_unstable();
        for t in tags {
            let arena = &d.arenas[t];
            let streams = d.live_streams(arena);
            let report = if sleep {
                arena.offload(&streams)
            } else {
                arena.restore(&streams)
            }?;
            moved += report.bytes_moved as u64;
        }
    }
    Ok(moved)
}
