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
use vmmbuf::cuda::{capture_state, Capture, CaptureState};
// The maps malloc and free consult at every call (addresses, stream
// handles, tags) hash with one multiply per word.
use vmmbuf::hash::QuickMap;
use vmmbuf::nccl::NcclHook;
use vmmbuf::stats::ArenaStats;
use vmmbuf::{
    Arena, ArenaStream, Budget, ChunkPool, CudaBackend, Error, GraphPoolId, Location, PoolDesc,
    Result, SleepDesc, SleepMode, WakeDesc,
};

mod alloc;
mod budget;
mod nccl;
mod peers;
pub(crate) mod pools;
mod preload;
mod settings;
mod sleep;
mod tags;

#[cfg(test)]
mod tests;

pub(crate) use alloc::*;
pub(crate) use budget::*;
pub(crate) use nccl::*;
use peers::*;
pub(crate) use preload::*;
use settings::{PeerMode, Settings};
pub(crate) use sleep::*;
pub(crate) use tags::*;

type TorchArena = Arena<CudaBackend, Arc<CudaStream>>;

/// Address space each tag's arena reserves on a device (no memory until
/// used).
const RESERVE: usize = 1 << 40;

/// One CUDA device's arenas, chunk pool, budget and live allocations.
pub(crate) struct Device {
    /// One arena per tag (the default tag is "").
    arenas: QuickMap<String, TorchArena>,
    /// Shared by the device's arenas.
    pool: Arc<ChunkPool<CudaBackend>>,
    backend: Arc<CudaBackend>,
    /// Foreign streams (PyTorch's, CuPy's), wrapped (not owned) once each.
    streams: QuickMap<usize, Arc<CudaStream>>,
    /// The device's budget, shared by all its tags' arenas ([`Budget::unlimited`]
    /// while none is set).
    budget: Arc<Budget>,
    /// Live allocations by address.
    live: QuickMap<usize, CudaAllocation>,
    /// The other streams PyTorch's `record_stream` named for a live
    /// allocation (see [`record_stream`]), handled at its free.
    recorded: QuickMap<usize, Vec<Arc<CudaStream>>>,
    /// Host pieces being created ahead of a sleep (`prepare_sleep`): a
    /// sleep waits for them rather than pin the same pages again.
    preparing: Option<std::thread::JoinHandle<Result<usize>>>,
    /// The graph pools of this device's memory: how many CUDA graphs not
    /// yet destroyed allocate into each (see [`Device::graph_pool`]).
    graphs: HashMap<GraphPoolId, usize>,
    /// The captures whose release callback is armed, by CUDA's capture id
    /// ([`Capture::pool`]): the graph pools each allocated into, the one it
    /// allocates into now last.
    captures: HashMap<GraphPoolId, Vec<GraphPoolId>>,
    /// Captures whose graphs CUDA has destroyed (their user objects'
    /// destructors put them here, on a driver thread that may not call
    /// CUDA): their pools are let go of at the next call.
    released: Arc<Mutex<Vec<GraphPoolId>>>,
    /// Which live allocations are in which of PyTorch's private pools (see
    /// [`pools`]).
    pools: pools::Pools,
    /// Chunks made as `ncclMemAlloc` makes them (`VMMBUF_TORCH_NCCL_READY=1`
    /// when the device was first used).
    nccl_ready: bool,
    /// Made at the first [`nccl_register`]: while it has communicators, the
    /// map hook of every arena of the device (kept after, for its counters).
    nccl: Option<Arc<NcclHook>>,
}

#[derive(Default)]
struct Registry {
    devices: HashMap<c_int, &'static Mutex<Device>>,
    /// Budgets set before their device's first allocation (later ones go
    /// to the device's own).
    budgets: HashMap<c_int, usize>,
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

thread_local! {
    /// The device of this thread's last call: malloc and free find it
    /// without the registry's lock (a device, once made, stays for the
    /// process).
    static LAST: std::cell::Cell<Option<(c_int, &'static Mutex<Device>)>> =
        const { std::cell::Cell::new(None) };
}

/// The device's state if it has been used, from this thread's last call
/// or the registry.
fn existing(device: c_int) -> Option<&'static Mutex<Device>> {
    // A thread whose thread-locals are being destroyed (a free from a
    // dying thread's destructors) asks the registry. A device is made once
    // and kept for the process (leaked): a plain reference, with no
    // reference count to touch at every call.
    let last = LAST
        .try_with(|l| l.get().filter(|(k, _)| *k == device).map(|(_, d)| d))
        .ok()
        .flatten();
    if last.is_some() {
        return last;
    }
    let d = registry().read().devices.get(&device).copied()?;
    let _ = LAST.try_with(|l| l.set(Some((device, d))));
    Some(d)
}

/// The device's state, created (driver, pool) on first use.
fn device(device: c_int) -> Result<&'static Mutex<Device>> {
    if let Some(d) = existing(device) {
        return Ok(d);
    }
    let mut r = registry().write();
    if let Some(&d) = r.devices.get(&device) {
        return Ok(d);
    }
    // VMMBUF_TORCH_NCCL_READY=1: chunks made as ncclMemAlloc makes them
    // (POSIX_FD/fabric handles, RDMA capable, mapped for every peer), so
    // that NCCL can register the memory (issue 24).
    let nccl_ready = std::env::var("VMMBUF_TORCH_NCCL_READY").as_deref() == Ok("1");
    let desc = if nccl_ready {
        vmmbuf::cuda::CudaBackendDesc::nccl_ready()
    } else {
        vmmbuf::cuda::CudaBackendDesc::default()
    };
    let backend = CudaBackend::with_desc(ordinal(device)?, &desc)?;
    let pool = ChunkPool::new(
        backend.clone(),
        PoolDesc::default().max_host_bytes(HOST_LIMIT.load(std::sync::atomic::Ordering::Relaxed)),
    )?;
    let d: &'static Mutex<Device> = Box::leak(Box::new(Mutex::new(Device {
        arenas: QuickMap::default(),
        pool,
        backend,
        // Every device has one, unlimited until set: a budget set later
        // (PyTorch's memory fraction) reaches every arena at once.
        budget: r
            .budgets
            .get(&device)
            .map_or_else(Budget::unlimited, |&b| Budget::new(b)),
        streams: QuickMap::default(),
        live: QuickMap::default(),
        recorded: QuickMap::default(),
        preparing: None,
        graphs: HashMap::new(),
        captures: HashMap::new(),
        released: Arc::default(),
        pools: pools::Pools::default(),
        nccl_ready,
        nccl: None,
    })));
    // The second device of an `Auto` process: the peers get access to the
    // others' chunks before any thread can allocate here (its lock is held
    // until then, so another thread's first allocation on it, and the copy
    // from another GPU that may follow, wait for the grant). No thread
    // holds one device's lock while it waits for another's, so holding
    // this one while the others are locked in turn cannot deadlock.
    let second = !r.devices.is_empty() && Settings::get().peers == PeerMode::Auto;
    let hold = second.then(|| d.lock());
    r.devices.insert(device, d);
    drop(r);
    if second {
        grant_peers_everywhere(device);
    }
    drop(hold);
    Ok(d)
}

/// Every device in use.
fn all_devices() -> Vec<(c_int, &'static Mutex<Device>)> {
    let r = registry().read();
    let mut v: Vec<_> = r.devices.iter().map(|(k, d)| (*k, *d)).collect();
    v.sort_by_key(|(k, _)| *k);
    v
}

impl Device {
    /// The graph pool the capture `c` allocates into: the one PyTorch's
    /// pool names ([`Device::share_pool`]), else one of the capture's own
    /// (CUDA's capture id). The first time, a callback is armed that CUDA
    /// runs once the graph and its executables are destroyed and their
    /// launches done (see [`Device::release_graphs`]).
    fn graph_pool(&mut self, c: &Capture) -> Result<GraphPoolId> {
        let key = c.pool();
        if let Some(g) = self.captures.get(&key).and_then(|v| v.last()) {
            return Ok(*g);
        }
        self.join_pool(c, key)?;
        Ok(key)
    }

    /// The capture `c` allocates into graph pool `g` from now on: armed
    /// the first time, and counted once among `g`'s graphs.
    fn join_pool(&mut self, c: &Capture, g: GraphPoolId) -> Result<()> {
        let key = c.pool();
        match self.captures.get_mut(&key) {
            Some(v) if v.last() == Some(&g) => return Ok(()),
            Some(v) => v.push(g),
            None => {
                let released = self.released.clone();
                c.on_release(move || released.lock().push(key))?;
                self.captures.insert(key, vec![g]);
            }
        }
        *self.graphs.entry(g).or_default() += 1;
        Ok(())
    }

    /// Lets go of the graphs CUDA has destroyed since the last call: a
    /// graph pool none of whose graphs is left is released in every arena
    /// (a capture may have used several tags).
    fn release_graphs(&mut self) {
        if self.captures.is_empty() {
            // No graph pool: nothing to release (and no lock taken).
            return;
        }
        let gone = std::mem::take(&mut *self.released.lock());
        for key in gone {
            for g in self.captures.remove(&key).unwrap_or_default() {
                let Some(n) = self.graphs.get_mut(&g) else {
                    continue;
                };
                *n -= 1;
                if *n > 0 {
                    continue;
                }
                self.graphs.remove(&g);
                self.forget_graph(g);
                for a in self.arenas.values() {
                    if let Err(e) = a.release_graph(g) {
                        tracing::warn!(error = %e, %g, "vmmbuf-torch: releasing a graph's memory failed");
                    }
                }
            }
        }
    }

    /// The arena of `tag`, created on first use.
    fn arena(&mut self, tag: &str) -> Result<&TorchArena> {
        if !self.arenas.contains_key(tag) {
            let mut desc = Settings::get().arena_desc(RESERVE, peers_on());
            desc = desc.shared_budget(self.budget.clone());
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
            if let Some(h) = self.nccl.as_ref().filter(|h| !h.is_empty()) {
                arena.set_map_hook(Some(h.clone()))?;
            }
            arena.set_device_margin(MARGIN.load(std::sync::atomic::Ordering::Relaxed));
            arena.set_spill_dir(SPILL_DIR.read().clone());
            arena.set_spill_file_bytes(
                budget::SPILL_FILE_BYTES.load(std::sync::atomic::Ordering::Relaxed),
            );
            self.arenas.insert(tag.to_owned(), arena);
        }
        Ok(&self.arenas[tag])
    }

    /// Takes the NCCL hook off every arena (each tells it its ranges are
    /// unmapping: with no communicator left, nothing is deregistered). An
    /// arena that cannot (poisoned by an earlier failure) is logged.
    fn unhook_nccl(&self) {
        for a in self.arenas.values() {
            if let Err(e) = a.set_map_hook(None) {
                tracing::warn!(error = %e, "vmmbuf-torch: taking the NCCL hook off an arena failed");
            }
        }
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
            sum.allocated_bytes_total += s.allocated_bytes_total;
            sum.freed_bytes_total += s.freed_bytes_total;
            sum.requested_bytes_total += s.requested_bytes_total;
            sum.requested_freed_total += s.requested_freed_total;
            sum.num_device_alloc += s.num_device_alloc;
            sum.num_device_free += s.num_device_free;
            sum.num_grows_past_pending += s.num_grows_past_pending;
            sum.num_chunks_moved += s.num_chunks_moved;
            sum.num_moving_growths += s.num_moving_growths;
            sum.move_ns += s.move_ns;
            sum.grown_past_pending_bytes += s.grown_past_pending_bytes;
            sum.num_waits_before_grow += s.num_waits_before_grow;
            sum.host_bytes += s.host_bytes;
            sum.discarded_bytes += s.discarded_bytes;
            sum.stash_bytes += s.stash_bytes;
            sum.pageable_bytes += s.pageable_bytes;
            sum.graph_bytes += s.graph_bytes;
            sum.device_bytes += s.device_bytes;
            sum.num_device_syncs = sum.num_device_syncs.max(s.num_device_syncs);
            sum.fragmentation = sum.fragmentation.max(s.fragmentation);
        }
        sum
    }

    /// Waits for the host pieces being created ahead of a sleep, if any
    /// (its failure is logged: the sleep then creates what it needs).
    fn finish_preparing(&mut self) {
        if let Some(h) = self.preparing.take() {
            match h.join() {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => tracing::warn!(error = %e, "vmmbuf-torch: preparing a sleep failed"),
                Err(_) => tracing::warn!("vmmbuf-torch: the preparing thread panicked"),
            }
        }
    }

    fn stream(&mut self, stream: *mut c_void) -> Arc<CudaStream> {
        if let Some(s) = self.streams.get(&(stream as usize)) {
            return s.clone();
        }
        // SAFETY: the caller (PyTorch, CuPy) passes a stream of this
        // device's primary context (the one CudaBackend::new retains) and
        // keeps it alive while it allocates on it; the wrapper never
        // destroys it.
        let s = unsafe {
            self.backend
                .context()
                .wrap_borrowed_stream(stream as sys::CUstream)
        };
        self.streams.insert(stream as usize, s.clone());
        s
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

/// CUDA devices this process can use: 0 without a driver. Asked once (the
/// set of visible devices does not change within a process).
#[cfg(feature = "python")]
pub(crate) fn device_count() -> usize {
    static N: OnceLock<usize> = OnceLock::new();
    // cuDeviceGetCount alone: a probe would make a context on every GPU
    // (memory on each, in every rank of a job) and leave the last one
    // current on the calling thread.
    *N.get_or_init(|| vmmbuf::cuda::device_count().map_or(0, |n| n as usize))
}

/// Nanoseconds spent in `malloc` and `free` so far, all devices: what the
/// allocator's own work costs the CPU (`host_ns_in_malloc` and
/// `host_ns_in_free` in the statistics). The C entry points' context guard
/// around it is not counted: it reads the caller's context (a
/// `cuCtxGetCurrent`, 46-470 ns on an H200 as caches are warm or cold)
/// only before a call that switches it, and puts it back after.
static MALLOC_NS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
static FREE_NS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Adds the time until it drops to a counter.
struct Timed(&'static std::sync::atomic::AtomicU64, std::time::Instant);

impl Timed {
    fn start(c: &'static std::sync::atomic::AtomicU64) -> Self {
        Self(c, std::time::Instant::now())
    }
}

impl Drop for Timed {
    fn drop(&mut self) {
        self.0.fetch_add(
            self.1.elapsed().as_nanos() as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
    }
}
