//! The plug-in's state: one [`Device`] per CUDA device, each behind its own
//! lock (work on one device never waits for another's), and the operations
//! the C ABI and the Python module share. Every operation returns a
//! [`vmmbuf::Result`]; the C ABI turns errors into null or -1 and a log line,
//! the Python module into exceptions.

use std::collections::{HashMap, HashSet};
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
    Arena, ArenaDesc, ArenaStream, Budget, ChunkPool, CudaBackend, Error, GraphPoolId, Location,
    PoolDesc, Result, SleepDesc, SleepMode, WakeDesc,
};

type TorchArena = Arena<CudaBackend, Arc<CudaStream>>;

/// Address space each tag's arena reserves on a device (no memory until
/// used).
const RESERVE: usize = 1 << 40;

/// The largest chunk of a plug-in arena unless `VMMBUF_TORCH_MAX_CHUNK_BYTES`
/// says otherwise: expandable segments' page for their large pool.
const DEFAULT_MAX_CHUNK: usize = 20 << 20;

/// One CUDA device's arenas, chunk pool, budget and live allocations.
pub(crate) struct Device {
    /// One arena per tag (the default tag is "").
    arenas: QuickMap<String, TorchArena>,
    /// Shared by the device's arenas.
    pool: Arc<ChunkPool<CudaBackend>>,
    backend: Arc<CudaBackend>,
    /// Foreign streams (PyTorch's, CuPy's), wrapped (not owned) once each.
    streams: QuickMap<usize, Arc<CudaStream>>,
    /// The device's budget, shared by all its tags' arenas.
    budget: Option<Arc<Budget>>,
    /// Live allocations by address.
    live: QuickMap<usize, CudaAllocation>,
    /// The other streams PyTorch's `record_stream` named for a live
    /// allocation (see [`record_stream`]), handled at its free.
    recorded: QuickMap<usize, Vec<Arc<CudaStream>>>,
    /// Host pieces being created ahead of a sleep (`prepare_sleep`): a
    /// sleep waits for them rather than pin the same pages again.
    preparing: Option<std::thread::JoinHandle<Result<usize>>>,
    /// The CUDA graphs captured with this device's memory whose release
    /// callback is armed (see [`Device::graph_pool`]).
    graphs: HashSet<GraphPoolId>,
    /// Graphs CUDA has destroyed (their user objects' destructors put them
    /// here, on a driver thread that may not call CUDA): released into the
    /// arenas at the next call.
    released: Arc<Mutex<Vec<GraphPoolId>>>,
    /// Chunks made as `ncclMemAlloc` makes them (`VMMBUF_TORCH_NCCL_READY=1`
    /// when the device was first used).
    nccl_ready: bool,
    /// Made at the first [`nccl_register`]: while it has communicators, the
    /// map hook of every arena of the device (kept after, for its counters).
    nccl: Option<Arc<NcclHook>>,
}

#[derive(Default)]
struct Registry {
    devices: HashMap<c_int, Arc<Mutex<Device>>>,
    /// Budgets set before their device's first allocation.
    budgets: HashMap<c_int, usize>,
}

thread_local! {
    /// The tag this thread's allocations are made under ("" for none): per
    /// thread, as `torch.cuda.use_mem_pool` scopes are; `None` until the
    /// thread sets one, then [`DEFAULT_TAG`] applies.
    static TAG: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

/// The tag of every thread that set none ("" for none):
/// torch_memory_saver's `TMS_INIT_ENABLE`, where every allocation of the
/// process is pausable, autograd's threads' included.
static DEFAULT_TAG: parking_lot::RwLock<String> = parking_lot::const_rwlock(String::new());
/// Whether [`DEFAULT_TAG`] is not "" (read without its lock on every
/// malloc).
static HAS_DEFAULT_TAG: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

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
    static LAST: std::cell::RefCell<Option<(c_int, Arc<Mutex<Device>>)>> =
        const { std::cell::RefCell::new(None) };
}

/// The device's state if it has been used, from this thread's last call
/// or the registry.
fn existing(device: c_int) -> Option<Arc<Mutex<Device>>> {
    // A thread whose thread-locals are being destroyed (a free from a
    // dying thread's destructors) asks the registry.
    let last = LAST
        .try_with(|l| {
            l.borrow()
                .as_ref()
                .filter(|(k, _)| *k == device)
                .map(|(_, d)| d.clone())
        })
        .ok()
        .flatten();
    if last.is_some() {
        return last;
    }
    let d = registry().read().devices.get(&device).cloned()?;
    let _ = LAST.try_with(|l| *l.borrow_mut() = Some((device, d.clone())));
    Some(d)
}

/// The device's state, created (driver, pool) on first use.
fn device(device: c_int) -> Result<Arc<Mutex<Device>>> {
    if let Some(d) = existing(device) {
        return Ok(d);
    }
    let mut r = registry().write();
    if let Some(d) = r.devices.get(&device) {
        return Ok(d.clone());
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
    let d = Arc::new(Mutex::new(Device {
        arenas: QuickMap::default(),
        pool,
        backend,
        budget: r.budgets.get(&device).map(|&b| Budget::new(b)),
        streams: QuickMap::default(),
        live: QuickMap::default(),
        recorded: QuickMap::default(),
        preparing: None,
        graphs: HashSet::new(),
        released: Arc::default(),
        nccl_ready,
        nccl: None,
    }));
    r.devices.insert(device, d.clone());
    Ok(d)
}

/// Every device in use.
fn all_devices() -> Vec<(c_int, Arc<Mutex<Device>>)> {
    let r = registry().read();
    let mut v: Vec<_> = r.devices.iter().map(|(k, d)| (*k, d.clone())).collect();
    v.sort_by_key(|(k, _)| *k);
    v
}

impl Device {
    /// The pool of the graph `c` is capturing into: the first time, a
    /// callback is armed that CUDA runs once the graph and its executables
    /// are destroyed and their launches done; the pool is then released
    /// (see [`Device::release_graphs`]).
    fn graph_pool(&mut self, c: &Capture) -> Result<GraphPoolId> {
        let id = c.pool();
        if !self.graphs.contains(&id) {
            let released = self.released.clone();
            c.on_release(move || released.lock().push(id))?;
            self.graphs.insert(id);
        }
        Ok(id)
    }

    /// Releases the pools of the graphs CUDA has destroyed since the last
    /// call, in every arena (a capture may have used several tags).
    fn release_graphs(&mut self) {
        if self.graphs.is_empty() {
            // No graph pool: nothing to release (and no lock taken).
            return;
        }
        let gone = std::mem::take(&mut *self.released.lock());
        for id in gone {
            self.graphs.remove(&id);
            for a in self.arenas.values() {
                if let Err(e) = a.release_graph(id) {
                    tracing::warn!(error = %e, %id, "vmmbuf-torch: releasing a graph's memory failed");
                }
            }
        }
    }

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
            // Chunks of up to 20 MiB, as expandable segments map their large
            // pool: growth maps what a request needs (rounded to the 2 MiB
            // granularity, so no more memory is taken than with 2 MiB
            // chunks) in a tenth of the mappings, and each mapping costs
            // ~20 us whatever its size. Under FSDP on one H100 the plug-in's
            // time per step was 6.1 ms with 2 MiB chunks and 3.7-4.4 ms with
            // 20 MiB ones (issue 24); large
            // tensors in larger chunks are also faster for NCCL's peer
            // copies (all-gather at 0.8x of ncclMemAlloc's speed on 2 MiB
            // chunks, equal on one chunk). VMMBUF_TORCH_MAX_CHUNK_BYTES
            // sets another largest chunk.
            desc = desc.max_chunk_bytes(DEFAULT_MAX_CHUNK);
            // VMMBUF_TORCH_DEFER_FENCES=1: a free on the allocation's own
            // stream records no event; a later call on that stream records
            // one for many (`ArenaDesc::defer_free_fences`; empty_cache, a
            // sleep or out of memory then may synchronise the device).
            desc = desc.defer_free_fences(
                std::env::var("VMMBUF_TORCH_DEFER_FENCES").as_deref() == Ok("1"),
            );
            // A request that would map new memory while another stream's
            // free block that fits is pending waits for that block on the
            // CPU instead (`ArenaDesc::wait_before_grow`). Under FSDP on
            // 2x H200 (issue 24), growing instead left 6 of 11 launches at
            // 0.79-0.93 utilization on one rank, as the GPU's lag decided;
            // waiting kept all 11 at or above expandable segments' (0.948,
            // 0.952), after 0-11 waits a launch and rank, with no step-time
            // cost the noise could show (per-round ratio median 1.00).
            // VMMBUF_TORCH_WAIT_BEFORE_GROW=0 grows instead.
            desc = desc.wait_before_grow(
                std::env::var("VMMBUF_TORCH_WAIT_BEFORE_GROW").as_deref() != Ok("0"),
            );
            // Every GPU that can reach this one maps its chunks too, as
            // every GPU with peer access enabled reaches cudaMalloc memory:
            // PyTorch's and CuPy's copies between devices (cudaMemcpyPeer,
            // or a kernel on the other GPU) failed without it (issue 38).
            // VMMBUF_TORCH_PEER_ACCESS=0 maps for this GPU only.
            desc =
                desc.peer_access(std::env::var("VMMBUF_TORCH_PEER_ACCESS").as_deref() != Ok("0"));
            if let Ok(v) = std::env::var("VMMBUF_TORCH_MAX_CHUNK_BYTES") {
                match v.parse::<usize>() {
                    Ok(n) if n > 0 => desc = desc.max_chunk_bytes(n),
                    _ => {
                        tracing::warn!(value = %v, "vmmbuf-torch: VMMBUF_TORCH_MAX_CHUNK_BYTES is not a byte count; ignored")
                    }
                }
            }
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
            if let Some(h) = self.nccl.as_ref().filter(|h| !h.is_empty()) {
                arena.set_map_hook(Some(h.clone()))?;
            }
            arena.set_device_margin(MARGIN.load(std::sync::atomic::Ordering::Relaxed));
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
            sum.num_device_alloc += s.num_device_alloc;
            sum.num_device_free += s.num_device_free;
            sum.num_grows_past_pending += s.num_grows_past_pending;
            sum.grown_past_pending_bytes += s.grown_past_pending_bytes;
            sum.num_waits_before_grow += s.num_waits_before_grow;
            sum.host_bytes += s.host_bytes;
            sum.discarded_bytes += s.discarded_bytes;
            sum.stash_bytes += s.stash_bytes;
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

/// Every tag that has memory (an arena) on some device, sorted, once each.
#[cfg(feature = "python")]
pub(crate) fn tags() -> Vec<String> {
    let mut v: Vec<String> = all_devices()
        .into_iter()
        .flat_map(|(_, d)| d.lock().arenas.keys().cloned().collect::<Vec<_>>())
        .collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// The tag of this thread's allocations ("" for none).
pub(crate) fn tag() -> String {
    use std::sync::atomic::Ordering::Relaxed;
    // A thread being torn down (its thread-locals destroyed) frees and
    // allocates under no tag.
    match TAG.try_with(|t| t.borrow().clone()) {
        Ok(Some(t)) => t,
        Ok(None) if HAS_DEFAULT_TAG.load(Relaxed) => DEFAULT_TAG.read().clone(),
        _ => String::new(),
    }
}

/// Makes `tag` the tag of every thread that has not set its own ("" for
/// none).
#[cfg_attr(not(feature = "python"), allow(dead_code))]
pub(crate) fn set_default_tag(tag: &str) {
    let mut d = DEFAULT_TAG.write();
    tag.clone_into(&mut d);
    HAS_DEFAULT_TAG.store(!tag.is_empty(), std::sync::atomic::Ordering::Relaxed);
}

/// Nanoseconds spent in `malloc` and `free` so far, all devices: what the
/// allocator costs the CPU (`host_ns_in_malloc` and `host_ns_in_free` in
/// the statistics).
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

/// Makes `tag` the tag of this thread's allocations ("" for none).
pub(crate) fn set_tag(tag: &str) {
    // During the thread's teardown there is no tag to set.
    let _ = TAG.try_with(|t| *t.borrow_mut() = Some(tag.to_owned()));
}

/// Allocates `size` bytes on `device` for work on `stream`, under this
/// thread's tag; the address.
pub(crate) fn malloc(size: usize, dev: c_int, stream: *mut c_void) -> Result<u64> {
    let _t = Timed::start(&MALLOC_NS);
    if size == 0 {
        return Err(Error::InvalidArgument("an allocation of 0 bytes".into()));
    }
    // A capture in CUDA's global mode (PyTorch's default) forbids every
    // thread's unsafe calls: vmmbuf makes each of its own (an event query,
    // a mapping) in relaxed mode, so the common path switches no mode.
    let d = device(dev)?;
    let mut d = d.lock();
    d.release_graphs();
    let tag = tag();
    let s = d.stream(stream);
    // Captured into a CUDA graph: the memory is the graph's until CUDA
    // destroys it (the graph replays the captured work at these addresses).
    let graph = match capture(&s)? {
        Some(c) => Some(d.graph_pool(&c)?),
        None => None,
    };
    let alloc = |a: &TorchArena| match graph {
        Some(g) => a.alloc_in_graph(size, &s, g),
        None => a.alloc(size, &s),
    };
    let a = match alloc(d.arena(&tag)?) {
        // At the device's budget, shared by every tag: the other tags'
        // cached memory goes back too, then one more try (an arena gives
        // back only its own before failing).
        Err(e) if e.is_transient() && d.arenas.len() > 1 => {
            for a in d.arenas.values() {
                if let Err(e) = a.release_cached() {
                    tracing::warn!(error = %e, "vmmbuf-torch: releasing cached memory failed");
                }
            }
            alloc(d.arena(&tag)?)?
        }
        r => r?,
    };
    let p = a.address();
    d.live.insert(p as usize, a);
    Ok(p)
}

/// `VMMBUF_TORCH_GRAPHS=0`: the process never captures CUDA graphs, so
/// malloc and free skip the capture query (`cuStreamIsCapturing`, a driver
/// call PyTorch's own cache does not make on a hit). A capture with it set
/// is not supported (allocations inside it are ordinary ones, and CUDA may
/// refuse the frees' fences).
fn graphs_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("VMMBUF_TORCH_GRAPHS").as_deref() != Ok("0"))
}

/// What the plug-in has been told of CUDA graph captures. Unless told,
/// malloc and free ask the driver about the stream at every call
/// (`cuStreamIsCapturing`, 0.4-0.7 us with cold caches, twice a pair).
/// Once a caller announces captures (the Python package does: it hooks
/// `torch.cuda.CUDAGraph`'s capture_begin and capture_end), the plug-in
/// asks only while one is under way, as PyTorch's own cache consults its
/// list of captures under way. Every uncertainty keeps it asking: a count
/// that cannot be brought down stays up.
pub(crate) struct Captures {
    /// Every capture that can touch this plug-in's memory is announced.
    announced: std::sync::atomic::AtomicBool,
    /// Captures begun and not yet ended.
    underway: std::sync::atomic::AtomicUsize,
}

impl Captures {
    const fn new() -> Self {
        Self {
            announced: std::sync::atomic::AtomicBool::new(false),
            underway: std::sync::atomic::AtomicUsize::new(0),
        }
    }

    /// From now on every capture is announced (`on`): a stream is asked
    /// only while one is under way; or not (every call asks again).
    pub(crate) fn announce(&self, on: bool) {
        self.announced
            .store(on, std::sync::atomic::Ordering::SeqCst);
    }

    /// A capture is about to begin (call it before `cudaStreamBeginCapture`).
    pub(crate) fn begins(&self) {
        self.underway
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }

    /// A capture has ended (call it after `cudaStreamEndCapture`). An end
    /// with none under way is refused and changes nothing.
    pub(crate) fn ends(&self) -> Result<()> {
        self.underway
            .fetch_update(
                std::sync::atomic::Ordering::SeqCst,
                std::sync::atomic::Ordering::SeqCst,
                |n| n.checked_sub(1),
            )
            .map(drop)
            .map_err(|_| {
                Error::InvalidArgument("a capture ended with none announced as begun".into())
            })
    }

    /// Whether streams must be asked: captures are not announced, or one is
    /// under way.
    fn may_capture(&self) -> bool {
        !self.announced.load(std::sync::atomic::Ordering::SeqCst)
            || self.underway.load(std::sync::atomic::Ordering::SeqCst) > 0
    }

    /// `(announced, under way)`.
    pub(crate) fn state(&self) -> (bool, usize) {
        (
            self.announced.load(std::sync::atomic::Ordering::SeqCst),
            self.underway.load(std::sync::atomic::Ordering::SeqCst),
        )
    }
}

/// Streams asked about their capture so far (`num_capture_queries`).
static CAPTURE_QUERIES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The process's announcements (see [`Captures`]).
pub(crate) static CAPTURES: Captures = Captures::new();

/// `capture_state`, or `None` without a query when graphs are off or no
/// announced capture is under way.
fn capture_state_of(s: &Arc<CudaStream>) -> Result<CaptureState> {
    if graphs_on() && CAPTURES.may_capture() {
        CAPTURE_QUERIES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        capture_state(s)
    } else {
        Ok(CaptureState::None)
    }
}

/// The capture `s` is in, if one is active (an invalidated capture is
/// none: allocations on its stream are ordinary ones).
fn capture(s: &Arc<CudaStream>) -> Result<Option<Capture>> {
    Ok(capture_state_of(s)?.into_active())
}

/// Frees `ptr` in stream order on `stream` (if it is not the allocation's
/// own, the free waits for both).
pub(crate) fn free(ptr: u64, dev: c_int, stream: *mut c_void) -> Result<()> {
    let _t = Timed::start(&FREE_NS);
    let d = existing(dev).ok_or_else(|| unknown_free(ptr, dev))?;
    let mut d = d.lock();
    let (a, recorded) = d.take_live(ptr, dev)?;
    // PyTorch frees on the allocation's own stream: then its handle is the
    // allocation's, and the stream map is not consulted.
    let s =
        (!std::ptr::eq(a.stream().cu_stream().cast::<c_void>(), stream)).then(|| d.stream(stream));
    let key = <Arc<CudaStream> as ArenaStream<CudaBackend>>::key;
    let other = s.as_ref().filter(|s| key(s) != key(a.stream()));
    // Freed while its stream (or the one named) is captured: no fence can
    // be recorded there, and the graph may use the bytes in every replay,
    // so they are the graph's until CUDA destroys it. Each stream is asked
    // once. A stream whose capture was invalidated takes no fence either:
    // the free is owed there, and covered at its next call once the
    // capture has ended. A failed question counts as "invalidated": a
    // fence is then recorded nowhere it might not belong.
    let ask = |t: &Arc<CudaStream>| {
        capture_state_of(t).unwrap_or_else(|e| {
            tracing::warn!(error = %e, "vmmbuf-torch: asking a stream's capture failed");
            CaptureState::Invalidated
        })
    };
    let own = ask(a.stream());
    let named = other.map(ask);
    // Streams named by record_stream: each not captured gets a fence at the
    // free, as the stream named does; one under capture makes the block
    // its graph's, since the graph's replays may use it.
    let recorded: Vec<(Arc<CudaStream>, CaptureState)> = recorded
        .into_iter()
        .map(|s| {
            let c = ask(&s);
            (s, c)
        })
        .collect();
    for (s, c) in &recorded {
        if c.active().is_none() {
            a.record_stream(s);
        }
    }
    let plain = |c: &CaptureState| matches!(c, CaptureState::None);
    // The stream named, not captured, gets a fence of its own: at the
    // free, or (an ordinary free) with the free's.
    // (Its capture invalidated, the fence fails and the free is owed
    // there instead: nothing is lost.)
    if let (Some(other), Some(n)) = (other, named.as_ref()) {
        if n.active().is_none() {
            a.record_stream(other);
        }
    }
    match own
        .active()
        .or(named.as_ref().and_then(CaptureState::active))
        .or(recorded.iter().find_map(|(_, c)| c.active()))
    {
        Some(c) => {
            let g = d.graph_pool(c)?;
            // Its own stream not captured: a real fence there.
            if plain(&own) {
                a.record_use(d.backend.fence(a.stream())?);
            }
            a.free_into_graph(g);
        }
        None if plain(&own) => drop(a),
        None => a.free_deferred(),
    }
    Ok(())
}

/// Frees `ptr` after its stream was destroyed (a CuPy stream collected
/// before the memory it allocated): nothing is recorded on that stream,
/// and no stream takes the bytes before a device synchronisation shows its
/// work finished (see `Allocation::free_stream_destroyed`).
pub(crate) fn free_stream_destroyed(ptr: u64, dev: c_int) -> Result<()> {
    let _t = Timed::start(&FREE_NS);
    let d = existing(dev).ok_or_else(|| unknown_free(ptr, dev))?;
    let mut d = d.lock();
    // The streams record_stream named need nothing more: the device
    // synchronisation this free waits for covers them too.
    let (a, _recorded) = d.take_live(ptr, dev)?;
    a.free_stream_destroyed();
    Ok(())
}

/// PyTorch's `Tensor.record_stream` on the plug-in's memory (PyTorch's
/// pluggable allocator calls it once `set_record_stream_fn` names it; without
/// it PyTorch skips the call): the free of the live allocation at `ptr`
/// then also waits for the work queued on `stream` up to the free, or, if
/// `stream` is being captured at the free, leaves the block to that graph.
/// `ptr` must be an allocation's start, as PyTorch passes it.
pub(crate) fn record_stream(ptr: u64, stream: *mut c_void) -> Result<()> {
    let key = <Arc<CudaStream> as ArenaStream<CudaBackend>>::key;
    for (_, d) in all_devices() {
        let mut d = d.lock();
        let Some(own) = d.live.get(&(ptr as usize)).map(|a| key(a.stream())) else {
            continue;
        };
        let s = d.stream(stream);
        if key(&s) != own {
            let v = d.recorded.entry(ptr as usize).or_default();
            if !v.iter().any(|t| key(t) == key(&s)) {
                v.push(s);
            }
        }
        return Ok(());
    }
    Err(Error::InvalidArgument(format!(
        "record_stream of {ptr:#x}: not a live allocation of the plug-in"
    )))
}

impl Device {
    /// The live allocation at `ptr`, taken out to be freed (after releasing
    /// the graphs CUDA destroyed since the last call), with the streams
    /// `record_stream` named for it.
    fn take_live(
        &mut self,
        ptr: u64,
        dev: c_int,
    ) -> Result<(CudaAllocation, Vec<Arc<CudaStream>>)> {
        self.release_graphs();
        let a = self
            .live
            .remove(&(ptr as usize))
            .ok_or_else(|| unknown_free(ptr, dev))?;
        Ok((a, self.recorded.remove(&(ptr as usize)).unwrap_or_default()))
    }
}

fn unknown_free(ptr: u64, dev: c_int) -> Error {
    Error::InvalidArgument(format!(
        "free of {ptr:#x} on device {dev}: not a live allocation (unknown, or freed already)"
    ))
}

/// Keeps every device range the plug-in maps on `dev` registered with the
/// NCCL communicator `comm` (an `ncclComm_t` of the NCCL this process
/// loaded, PyTorch's unless `library` names another), from now until
/// [`nccl_deregister`]: the ranges mapped already are registered at once,
/// those mapped later when they are mapped, and each is deregistered
/// before it is unmapped (`empty_cache`, a budget, a sleep). The id of the
/// registration. The device's chunks must be NCCL-ready
/// (`VMMBUF_TORCH_NCCL_READY=1` before its first allocation). `library` is
/// used by the first registration on a device only.
///
/// # Safety
///
/// `comm` must be a live communicator of that NCCL library, and stay live
/// until [`nccl_deregister`] is called with the id returned (a communicator
/// destroyed first would be called through a dangling pointer).
pub(crate) unsafe fn nccl_register(dev: c_int, comm: usize, library: Option<&str>) -> Result<u64> {
    let d = device(dev)?;
    let mut d = d.lock();
    if !d.nccl_ready {
        return Err(Error::Unsupported {
            what: format!(
                "NCCL registration on device {dev}: its chunks were not made NCCL-ready; set VMMBUF_TORCH_NCCL_READY=1 before its first allocation"
            ),
        });
    }
    let hook = match &d.nccl {
        Some(h) => h.clone(),
        None => {
            let h = Arc::new(match library {
                Some(path) => NcclHook::open(path)?,
                None => NcclHook::loaded()?,
            });
            d.nccl = Some(h.clone());
            h
        }
    };
    // The first communicator: the hook joins every arena, which tells it
    // of each range mapped now. Refused (an arena cannot take the hook, or
    // the communicator is), no arena keeps a hook with no communicator.
    if hook.is_empty() {
        if let Err(e) = d
            .arenas
            .values()
            .try_for_each(|a| a.set_map_hook(Some(hook.clone())))
        {
            d.unhook_nccl();
            return Err(e);
        }
    }
    // SAFETY: forwarded to the caller: `comm` is live until deregistered.
    let id = unsafe { hook.add(comm as *mut c_void) };
    if hook.is_empty() {
        d.unhook_nccl();
    }
    id
}

/// Undoes every registration `nccl_register` made under `id` on `dev` and
/// stops registering with that communicator; with none left, the arenas
/// go back to having no map hook.
pub(crate) fn nccl_deregister(dev: c_int, id: u64) -> Result<()> {
    let unknown = || Error::InvalidArgument(format!("no NCCL registration {id} on device {dev}"));
    let d = existing(dev).ok_or_else(unknown)?;
    let d = d.lock();
    let hook = d.nccl.clone().ok_or_else(unknown)?;
    hook.remove(id)?;
    if hook.is_empty() {
        d.unhook_nccl();
    }
    Ok(())
}

/// Device bytes every arena leaves free when it maps (0: none), all
/// devices: torch_memory_saver's `memory_margin_bytes`.
static MARGIN: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

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

/// Whether `[addr, addr + bytes)` on `dev` lies in one range registered
/// with every communicator `nccl_register` added there (so NCCL can use it
/// zero-copy); false with no registration.
pub(crate) fn nccl_covers(dev: c_int, addr: u64, bytes: usize) -> bool {
    let Some(d) = existing(dev) else {
        return false;
    };
    let hook = d.lock().nccl.clone();
    hook.is_some_and(|h| h.covers(addr, bytes))
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

/// What a sleep or a wake of tags did, summed over devices and tags.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Moved {
    /// Bytes put to sleep or woken.
    pub(crate) bytes: u64,
    /// Device bytes given back (sleep) or mapped (wake).
    pub(crate) device_bytes: u64,
}

impl Moved {
    fn add(&mut self, r: &vmmbuf::SleepReport) {
        self.bytes += r.bytes as u64;
        self.device_bytes += r.device_bytes as u64;
    }
}

/// The tags of `d` that `tag` names (`None`: all), sorted.
fn tags_of<'a>(d: &'a Device, tag: Option<&str>) -> Vec<&'a String> {
    let mut tags: Vec<&String> = d
        .arenas
        .keys()
        .filter(|t| tag.is_none_or(|want| want == t.as_str()))
        .collect();
    tags.sort_unstable();
    tags
}

/// Puts `tag`'s arena (`None`: every tag's) on every device to sleep in
/// `mode`: keeping the data in pinned host memory at its addresses,
/// stashing it there away from them, or discarding it; the memory goes back
/// to the driver, the addresses stay. A preparation under way
/// (`prepare_sleep`) is waited for first. On an error the arena that failed
/// stays as it was and the ones before it stay asleep.
pub(crate) fn sleep_tags(tag: Option<&str>, mode: SleepMode) -> Result<Moved> {
    let desc = SleepDesc::from(mode);
    let mut moved = Moved::default();
    for (_, d) in all_devices() {
        let mut d = d.lock();
        d.finish_preparing();
        for t in tags_of(&d, tag) {
            let arena = &d.arenas[t];
            let r = arena.sleep(&d.live_streams(arena), &desc)?;
            moved.add(&r);
        }
    }
    Ok(moved)
}

/// Wakes `tag`'s arena (`None`: every tag's) on every device: kept data
/// comes back, discarded ranges get fresh memory (zeroed if `zero`), at the
/// same addresses. On an error the arena that failed stays asleep.
pub(crate) fn wake_tags(tag: Option<&str>, zero: bool) -> Result<Moved> {
    let desc = if zero {
        WakeDesc::zeroed()
    } else {
        WakeDesc::default()
    };
    let mut moved = Moved::default();
    for (_, d) in all_devices() {
        let d = d.lock();
        for t in tags_of(&d, tag) {
            let arena = &d.arenas[t];
            if arena.sleep_mode().is_none() {
                continue;
            }
            let r = arena.wake(&d.live_streams(arena), &desc)?;
            moved.add(&r);
        }
    }
    Ok(moved)
}

/// Creates the host pieces a kept sleep of `tag` (`None`: every tag) would
/// take, on a thread of its own per device (the GPU keeps working); the
/// next sleep waits for it. With `wait`, returns once they exist, with the
/// bytes created.
pub(crate) fn prepare_sleep(tag: Option<&str>, mode: SleepMode, wait: bool) -> Result<u64> {
    let desc = SleepDesc::from(mode);
    let mut made = 0u64;
    for (_, d) in all_devices() {
        let mut d = d.lock();
        let arenas: Vec<TorchArena> = tags_of(&d, tag)
            .into_iter()
            .map(|t| d.arenas[t].clone())
            .filter(|a| a.sleep_mode().is_none())
            .collect();
        d.finish_preparing();
        let work = move || -> Result<usize> {
            let mut n = 0;
            for a in arenas {
                n += a.prepare_sleep(&desc)?;
            }
            Ok(n)
        };
        if wait {
            drop(d);
            made += work()? as u64;
        } else {
            let h = std::thread::Builder::new()
                .name("vmmbuf-prepare".into())
                .spawn(work)
                .map_err(|e| Error::Os {
                    call: "spawning the preparing thread",
                    source: e,
                })?;
            d.preparing = Some(h);
        }
    }
    Ok(made)
}

/// Gives the host pieces kept between sleeps back to the driver, on every
/// device (after any preparation under way); the bytes they held.
pub(crate) fn release_host_cache() -> Result<u64> {
    let mut gone = 0u64;
    for (_, d) in all_devices() {
        let mut d = d.lock();
        // A preparation under way finishes first (its pieces go too).
        d.finish_preparing();
        for a in d.arenas.values() {
            // An arena asleep stashed keeps its stash (its data).
            if a.sleep_mode() != Some(SleepMode::Stash) {
                a.release_stash()?;
            }
        }
        gone += d.pool.stats().pooled_host_bytes as u64;
        d.pool.trim_at(Location::Host)?;
    }
    Ok(gone)
}

/// Bounds the host pieces each device keeps between sleeps (shedding the
/// largest at once if it holds more).
pub(crate) fn set_host_cache_limit(bytes: usize) -> Result<()> {
    for (_, d) in all_devices() {
        let d = d.lock();
        let desc = d.pool.desc().max_host_bytes(bytes);
        d.pool.set_desc(desc)?;
    }
    HOST_LIMIT.store(bytes, std::sync::atomic::Ordering::Relaxed);
    Ok(())
}

/// The host bound for devices used later (`usize::MAX`: none).
static HOST_LIMIT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(usize::MAX);

#[cfg(test)]
mod tests {
    use super::Captures;

    /// A default tag reaches every thread that set none (a new thread
    /// included), not one that set its own ("" too), and goes with "".
    #[test]
    fn a_default_tag_reaches_threads_that_set_none() {
        super::set_default_tag("default");
        let seen = std::thread::spawn(|| {
            let first = super::tag();
            super::set_tag("");
            (first, super::tag())
        })
        .join()
        .unwrap();
        super::set_default_tag("");
        assert_eq!(seen, ("default".to_owned(), String::new()));
        assert_eq!(std::thread::spawn(super::tag).join().unwrap(), "");
    }

    /// A free (and a tag, a last error) from a thread-local destructor that
    /// runs after the plug-in's own thread-locals were destroyed, as at a
    /// torchrun worker's exit: no panic, a typed answer. Without
    /// `try_with`, every one of these panicked ("cannot access a Thread
    /// Local Storage value during or after destruction").
    #[test]
    fn calls_from_a_dying_threads_destructors_do_not_panic() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static CALLS: AtomicUsize = AtomicUsize::new(0);
        static PANICS: AtomicUsize = AtomicUsize::new(0);
        struct Late;
        impl Drop for Late {
            fn drop(&mut self) {
                CALLS.fetch_add(1, Ordering::SeqCst);
                let r = std::panic::catch_unwind(|| {
                    assert_eq!(super::tag(), "", "no tag during teardown");
                    super::set_tag("late");
                    let e = super::free(0x1000, 0, std::ptr::null_mut())
                        .expect_err("an unknown pointer");
                    assert!(e.to_string().contains("not a live allocation"), "{e}");
                    crate::capi::vmmbuf_free(0x1000 as *mut _, 8, 0, std::ptr::null_mut());
                    let _ = crate::capi::vmmbuf_last_error();
                    let _ = crate::capi::vmmbuf_stats_json(0);
                });
                if r.is_err() {
                    PANICS.fetch_add(1, Ordering::SeqCst);
                }
            }
        }
        thread_local! {
            static LATE: std::cell::RefCell<Option<Late>> = const { std::cell::RefCell::new(None) };
        }
        std::thread::spawn(|| {
            // Registered first, destroyed after the plug-in's own.
            LATE.with(|l| *l.borrow_mut() = Some(Late));
            super::set_tag("worker");
            assert_eq!(super::tag(), "worker");
            assert!(super::free(0x1000, 0, std::ptr::null_mut()).is_err());
            crate::capi::vmmbuf_free(0x1000 as *mut _, 8, 0, std::ptr::null_mut());
            assert!(!crate::capi::vmmbuf_last_error().is_null());
        })
        .join()
        .unwrap();
        assert_eq!(CALLS.load(Ordering::SeqCst), 1, "the destructor ran");
        assert_eq!(
            PANICS.load(Ordering::SeqCst),
            0,
            "a call panicked in teardown"
        );
    }

    #[test]
    fn captures_are_asked_about_until_announced_and_while_one_is_under_way() {
        // A local instance: the process's own is shared with GPU tests.
        let c = Captures::new();
        assert!(c.may_capture(), "not announced: every call asks");
        c.begins();
        c.ends().unwrap();
        assert!(c.may_capture(), "counting alone does not announce");
        c.announce(true);
        assert!(!c.may_capture());
        assert_eq!(c.state(), (true, 0));
        c.begins();
        c.begins();
        assert!(c.may_capture());
        c.ends().unwrap();
        assert!(c.may_capture(), "one of two still under way");
        c.ends().unwrap();
        assert!(!c.may_capture());
        // An end too many is refused and leaves the count at 0 (not
        // wrapped round to a huge number, which would also ask: refused
        // loudly instead).
        assert!(c.ends().is_err());
        assert_eq!(c.state(), (true, 0));
        c.begins();
        assert_eq!(c.state(), (true, 1));
        assert!(c.may_capture());
        c.ends().unwrap();
        assert!(!c.may_capture());
        c.announce(false);
        assert!(c.may_capture(), "announcing off: every call asks again");
    }
}
