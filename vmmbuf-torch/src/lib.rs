//! PyTorch's pluggable CUDA allocator on a vmmbuf [`Arena`]: one arena per
//! device and tag, stream-ordered frees on the stream PyTorch passes,
//! PyTorch-named statistics as JSON, a memory budget, and sleep/wake.
//!
//! Tags: allocations a thread makes after `vmmbuf_set_tag("weights")` live
//! in that tag's arena (untagged ones in the default arena; the tag is per
//! thread; all of a device's arenas share one chunk pool and one budget).
//! Failures are logged to stderr (`VMMBUF_LOG` sets the level). `vmmbuf_sleep(tag)` moves a tag's memory to pinned
//! host memory at the same addresses and gives the device memory back;
//! kernels still reach the tensors there, more slowly. `vmmbuf_wake(tag)`
//! brings it back.
//!
//! PyTorch calls `void* vmmbuf_malloc(ssize_t size, int device,
//! cudaStream_t stream)` and `void vmmbuf_free(void* ptr, ssize_t size, int
//! device, cudaStream_t stream)` (load it with
//! `torch.cuda.memory.CUDAPluggableAllocator(path, "vmmbuf_malloc",
//! "vmmbuf_free")`; `python/vmmbuf_torch.py` does). No panic crosses the C
//! boundary: each entry point catches it, logs it and answers null (or
//! nothing). A zero size, an unknown pointer or a second free of one pointer
//! is logged and changes nothing.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, OnceLock};

use cudarc::driver::{sys, CudaStream};
use parking_lot::Mutex;
use vmmbuf::cuda::CudaAllocation;
use vmmbuf::stats::ArenaStats;
use vmmbuf::{Arena, ArenaDesc, ArenaStream, Budget, ChunkPool, CudaBackend, PoolDesc};

type TorchArena = Arena<CudaBackend, Arc<CudaStream>>;

/// Address space each device's arena reserves (no memory until used).
const RESERVE: usize = 1 << 40;

struct Device {
    /// One arena per tag (the default tag is "").
    arenas: HashMap<String, TorchArena>,
    /// Shared by the device's arenas.
    pool: Arc<ChunkPool<CudaBackend>>,
    backend: Arc<CudaBackend>,
    /// PyTorch's streams, wrapped (not owned) once each.
    streams: HashMap<usize, Arc<CudaStream>>,
    /// The device's budget, shared by all its tags' arenas.
    budget: Option<Arc<Budget>>,
}

#[derive(Default)]
struct Global {
    devices: HashMap<c_int, Device>,
    /// Live allocations by address.
    live: HashMap<usize, CudaAllocation>,
    budgets: HashMap<c_int, usize>,
}

thread_local! {
    /// The tag this thread's allocations are made under ("" for none): per
    /// thread, as `torch.cuda.use_mem_pool` scopes are.
    static TAG: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) };
}

thread_local! {
    /// The last stats JSON handed out on this thread, kept alive for the
    /// caller to copy: another thread's call never frees it.
    static JSON: std::cell::RefCell<Option<CString>> = const { std::cell::RefCell::new(None) };
}

fn global() -> &'static Mutex<Global> {
    static G: OnceLock<Mutex<Global>> = OnceLock::new();
    G.get_or_init(|| {
        init_logging();
        Mutex::default()
    })
}

/// Failures are visible: the plug-in logs to stderr, at the level
/// `VMMBUF_LOG` names (`warn` by default; `off`, `error`, `info`, `debug`,
/// `trace`, or a tracing filter such as `vmmbuf=debug`). A process that set
/// a subscriber of its own keeps it.
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("VMMBUF_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(filter)
        .try_init();
}

impl Global {
    fn device(&mut self, device: c_int) -> vmmbuf::Result<&mut Device> {
        if !self.devices.contains_key(&device) {
            let ordinal = u32::try_from(device)
                .map_err(|_| vmmbuf::Error::InvalidArgument(format!("device {device}")))?;
            let backend = CudaBackend::new(ordinal)?;
            let pool = ChunkPool::new(backend.clone(), PoolDesc::default())?;
            self.devices.insert(
                device,
                Device {
                    arenas: HashMap::new(),
                    pool,
                    backend,
                    budget: self.budgets.get(&device).map(|&b| Budget::new(b)),
                    streams: HashMap::new(),
                },
            );
        }
        Ok(self.devices.get_mut(&device).expect("inserted above"))
    }
}

impl Device {
    /// The arena of `tag`, created on first use.
    fn arena(&mut self, tag: &str) -> vmmbuf::Result<&TorchArena> {
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
                // SAFETY: PyTorch passes a stream of this device's primary
                // context (the one CudaBackend::new retains) and keeps it
                // alive while it allocates on it; the wrapper never destroys
                // it.
                unsafe { ctx.wrap_borrowed_stream(stream as sys::CUstream) }
            })
            .clone()
    }
}

/// Runs `f`, turning a panic into `fallback` (logged).
fn guard<T>(what: &str, fallback: T, f: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(_) => {
            tracing::error!("vmmbuf-torch: {what} panicked; answered as a failure");
            fallback
        }
    }
}

/// Allocates `size` bytes on `device` for work on `stream`; null on failure
/// (PyTorch then reports out of memory).
#[no_mangle]
pub extern "C" fn vmmbuf_malloc(size: isize, device: c_int, stream: *mut c_void) -> *mut c_void {
    guard("vmmbuf_malloc", std::ptr::null_mut(), || {
        if size <= 0 {
            tracing::warn!(size, "vmmbuf-torch: malloc of a non-positive size");
            return std::ptr::null_mut();
        }
        let mut g = global().lock();
        let tag = TAG.with(|t| t.borrow().clone());
        let r = g.device(device).and_then(|d| {
            let s = d.stream(stream);
            match d.arena(&tag)?.alloc(size as usize, &s) {
                // At the device's budget, shared by every tag: the other
                // tags' cached memory goes back too, then one more try (an
                // arena gives back only its own before failing).
                Err(e) if e.is_transient() && d.arenas.len() > 1 => {
                    for a in d.arenas.values() {
                        if let Err(e) = a.release_cached() {
                            tracing::warn!(error = %e, "vmmbuf-torch: releasing cached memory failed");
                        }
                    }
                    d.arena(&tag)?.alloc(size as usize, &s)
                }
                r => r,
            }
        });
        match r {
            Ok(a) => {
                let p = a.address() as usize;
                g.live.insert(p, a);
                p as *mut c_void
            }
            Err(e) => {
                tracing::warn!(error = %e, size, device, "vmmbuf-torch: malloc failed");
                std::ptr::null_mut()
            }
        }
    })
}

/// Frees `ptr` in stream order on `stream` (the stream PyTorch names; if it
/// is not the allocation's own, the free waits for both).
#[no_mangle]
pub extern "C" fn vmmbuf_free(ptr: *mut c_void, size: isize, device: c_int, stream: *mut c_void) {
    guard("vmmbuf_free", (), || {
        let mut g = global().lock();
        let Some(a) = g.live.remove(&(ptr as usize)) else {
            tracing::warn!(
                ?ptr,
                size,
                device,
                "vmmbuf-torch: free of an unknown pointer (or a second free)"
            );
            return;
        };
        if let Ok(d) = g.device(device) {
            let s = d.stream(stream);
            a.record_stream(&s);
        }
        drop(a);
    })
}

/// The device's arena statistics as a JSON object with PyTorch's key names
/// (`allocated_bytes.all.current`, ...). The string stays valid until the
/// next call on the same thread (each thread has its own); null if the
/// device has no arena yet.
#[no_mangle]
pub extern "C" fn vmmbuf_stats_json(device: c_int) -> *const c_char {
    guard("vmmbuf_stats_json", std::ptr::null(), || {
        let g = global().lock();
        let Some(d) = g.devices.get(&device) else {
            return std::ptr::null();
        };
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
        m.insert("pooled_bytes".into(), s.pooled_bytes.into());
        m.insert("fragmentation".into(), s.fragmentation.into());
        m.insert("host_bytes".into(), s.host_bytes.into());
        m.insert("device_bytes".into(), s.device_bytes.into());
        m.insert(
            "sleeping_tags".into(),
            d.arenas
                .iter()
                .filter(|(_, a)| a.is_offloaded())
                .map(|(t, _)| serde_json::Value::from(t.as_str()))
                .collect::<Vec<_>>()
                .into(),
        );
        drop(g);
        let text = serde_json::Value::Object(m).to_string();
        JSON.with(|j| {
            let mut j = j.borrow_mut();
            *j = CString::new(text).ok();
            j.as_ref().map_or(std::ptr::null(), |c| c.as_ptr())
        })
    })
}

/// Sets every peak of the device's statistics to its current value.
#[no_mangle]
pub extern "C" fn vmmbuf_reset_peak(device: c_int) {
    guard("vmmbuf_reset_peak", (), || {
        if let Some(d) = global().lock().devices.get(&device) {
            d.arenas.values().for_each(|a| a.reset_peak());
        }
    })
}

/// Sets the device's memory budget: the bytes all of its arenas (one per
/// tag) may map together. Call it before the device's first allocation.
/// Returns 0, or -1 if the device is in use already.
#[no_mangle]
pub extern "C" fn vmmbuf_set_budget(device: c_int, bytes: u64) -> c_int {
    guard("vmmbuf_set_budget", -1, || {
        let mut g = global().lock();
        if g.devices.contains_key(&device) {
            return -1;
        }
        g.budgets.insert(device, bytes as usize);
        0
    })
}

/// Gives the device's cached memory back to the driver (`empty_cache`).
/// Returns 0, or -1 on an error (logged).
#[no_mangle]
pub extern "C" fn vmmbuf_empty_cache(device: c_int) -> c_int {
    guard("vmmbuf_empty_cache", -1, || {
        let g = global().lock();
        let Some(d) = g.devices.get(&device) else {
            return 0;
        };
        match d.arenas.values().try_for_each(|a| a.empty_cache()) {
            Err(e) => {
                tracing::warn!(error = %e, "vmmbuf-torch: empty_cache failed");
                -1
            }
            Ok(()) => 0,
        }
    })
}

/// The tag `tag` names: null or "" for the default one; `None` if it is not
/// UTF-8.
fn tag_of(tag: *const c_char) -> Option<String> {
    if tag.is_null() {
        return Some(String::new());
    }
    // SAFETY: the caller passes a NUL-terminated string that lives for the
    // call (the C ABI's contract for `const char*`).
    let s = unsafe { CStr::from_ptr(tag) };
    s.to_str().ok().map(str::to_owned)
}

/// Makes `tag` the tag of this thread's allocations from now on (null or ""
/// for none); other threads keep theirs. Returns 0, or -1 for a tag that is
/// not UTF-8.
///
/// # Safety
/// `tag` is null or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn vmmbuf_set_tag(tag: *const c_char) -> c_int {
    guard("vmmbuf_set_tag", -1, || match tag_of(tag) {
        Some(t) => {
            TAG.with(|tag| *tag.borrow_mut() = t);
            0
        }
        None => -1,
    })
}

/// Moves `tag`'s allocations (null: every tag's) on every device to pinned
/// host memory at the same addresses and gives their device memory back.
/// Waits for the work queued so far on the streams of the tag's live
/// allocations, for the fences of its frees and for the uses recorded on
/// its allocations; never for the whole device. Until `vmmbuf_wake`, new allocations under a
/// sleeping tag are made in host memory. Returns the bytes moved, or -1 on
/// an error (logged; the arena that failed stays as it was).
///
/// # Safety
/// `tag` is null or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn vmmbuf_sleep(tag: *const c_char) -> i64 {
    guard("vmmbuf_sleep", -1, || move_tag(tag, true))
}

/// Brings `tag`'s allocations (null: every tag's) back to their devices, at
/// the same addresses. Returns the bytes moved, or -1 on an error (logged).
///
/// # Safety
/// `tag` is null or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn vmmbuf_wake(tag: *const c_char) -> i64 {
    guard("vmmbuf_wake", -1, || move_tag(tag, false))
}

/// The streams (once each) of the live allocations that lie in `arena`.
fn live_streams(live: &HashMap<usize, CudaAllocation>, arena: &TorchArena) -> Vec<Arc<CudaStream>> {
    let range = arena.base()..arena.base() + RESERVE as u64;
    let mut seen = HashMap::new();
    for a in live.values().filter(|a| range.contains(&a.address())) {
        let s = a.stream();
        let key = <Arc<CudaStream> as ArenaStream<CudaBackend>>::key(s);
        seen.entry(key).or_insert_with(|| s.clone());
    }
    seen.into_values().collect()
}

fn move_tag(tag: *const c_char, sleep: bool) -> i64 {
    let every = tag.is_null();
    let Some(tag) = tag_of(tag) else {
        tracing::warn!("vmmbuf-torch: a tag that is not UTF-8");
        return -1;
    };
    let g = global().lock();
    let mut moved = 0i64;
    for d in g.devices.values() {
        for (t, arena) in &d.arenas {
            if !every && *t != tag {
                continue;
            }
            // The streams of the arena's live allocations: what may still
            // use its memory. Not every stream ever seen: PyTorch may have
            // destroyed one (an ExternalStream) since, and recording on a
            // dead handle fails, or worse. Frees already made carry their
            // own fences, which the arena waits for.
            let streams = live_streams(&g.live, arena);
            let r = if sleep {
                arena.offload(&streams)
            } else {
                arena.restore(&streams)
            };
            match r {
                Ok(report) => moved += report.bytes_moved as i64,
                Err(e) => {
                    tracing::warn!(error = %e, tag = %t, sleep, "vmmbuf-torch: sleep/wake failed");
                    return -1;
                }
            }
        }
    }
    moved
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plug-in's state is the process's: its tests take turns.
    static SERIAL: Mutex<()> = Mutex::new(());

    /// A context on GPU 0, or `None` with the reason printed; with
    /// `VMMBUF_REQUIRE_GPU=1` a missing GPU fails the test instead.
    fn gpu() -> Option<Arc<cudarc::driver::CudaContext>> {
        // CudaBackend::new checks for the driver library before cudarc
        // touches it (cudarc panics without one).
        let why = match CudaBackend::new(0) {
            Ok(b) => return Some(b.context().clone()),
            Err(e) => e.to_string(),
        };
        assert!(
            std::env::var("VMMBUF_REQUIRE_GPU").as_deref() != Ok("1"),
            "VMMBUF_REQUIRE_GPU=1 but no GPU: {why}"
        );
        eprintln!("skipped (needs a GPU): {why}");
        None
    }

    /// Runs `f` with this thread's tag set to `tag`, then back to none.
    fn unsafe_tagged<T>(tag: &str, f: impl FnOnce() -> T) -> T {
        let c = std::ffi::CString::new(tag).unwrap();
        // SAFETY: a NUL-terminated string that lives across the call.
        assert_eq!(unsafe { vmmbuf_set_tag(c.as_ptr()) }, 0);
        let r = f();
        // SAFETY: null is the default tag.
        assert_eq!(unsafe { vmmbuf_set_tag(std::ptr::null()) }, 0);
        r
    }

    /// Issue 19: sleep recorded a fence on every stream ever seen, one that
    /// PyTorch had destroyed since included; now it waits on the streams of
    /// live allocations. And the stats JSON of one thread was freed by the
    /// next call of another: two threads call it 100,000 times each.
    #[test]
    fn gpu_sleep_skips_destroyed_streams_and_stats_json_is_per_thread() {
        let _turn = SERIAL.lock();
        let Some(ctx) = gpu() else { return };
        let raw = |s: &Arc<CudaStream>| s.cu_stream() as *mut c_void;
        // One budget for the device, shared by every tag (was one per tag).
        assert_eq!(vmmbuf_set_budget(0, 64 << 20), 0);
        let st = ctx.new_stream().unwrap();
        let p = unsafe_tagged("a", || vmmbuf_malloc(40 << 20, 0, raw(&st)));
        assert!(!p.is_null());
        let q = unsafe_tagged("b", || vmmbuf_malloc(40 << 20, 0, raw(&st)));
        assert!(q.is_null(), "two tags share the 64 MiB budget");
        vmmbuf_free(p, 40 << 20, 0, raw(&st));
        st.synchronize().unwrap();
        let q = unsafe_tagged("b", || vmmbuf_malloc(40 << 20, 0, raw(&st)));
        assert!(!q.is_null(), "what tag a gave back, tag b may take");
        vmmbuf_free(q, 40 << 20, 0, raw(&st));
        st.synchronize().unwrap();
        // SAFETY: null names every tag.
        assert!(unsafe { vmmbuf_wake(std::ptr::null()) } >= 0);
        // Tags are per thread: another thread's tag does not move this one's
        // allocations, and sleeping that tag moves only its own.
        let st2 = st.clone();
        let other = std::thread::spawn(move || {
            unsafe_tagged("t1", || {
                vmmbuf_malloc(2 << 20, 0, st2.cu_stream() as *mut c_void)
            }) as usize
        })
        .join()
        .unwrap() as *mut c_void;
        let mine = vmmbuf_malloc(2 << 20, 0, raw(&st));
        assert!(!other.is_null() && !mine.is_null());
        st.synchronize().unwrap();
        // SAFETY: a NUL-terminated literal.
        let moved = unsafe { vmmbuf_sleep(c"t1".as_ptr()) };
        assert_eq!(moved, 2 << 20, "only the other thread's tag slept");
        // SAFETY: as above.
        assert_eq!(unsafe { vmmbuf_wake(c"t1".as_ptr()) }, 2 << 20);
        vmmbuf_free(other, 2 << 20, 0, raw(&st));
        vmmbuf_free(mine, 2 << 20, 0, raw(&st));
        st.synchronize().unwrap();
        let keep = ctx.new_stream().unwrap();
        let gone = ctx.new_stream().unwrap();
        let p = vmmbuf_malloc(1 << 20, 0, raw(&gone));
        assert!(!p.is_null());
        vmmbuf_free(p, 1 << 20, 0, raw(&gone));
        gone.synchronize().unwrap();
        drop(gone); // destroyed, as an ExternalStream's may be
        let q = vmmbuf_malloc(4 << 20, 0, raw(&keep));
        assert!(!q.is_null());
        // SAFETY: null names every tag.
        let (slept, woke) = unsafe {
            (
                vmmbuf_sleep(std::ptr::null()),
                vmmbuf_wake(std::ptr::null()),
            )
        };
        assert!(slept >= 0 && woke >= 0, "sleep {slept}, wake {woke}");
        let threads: Vec<_> = (0..2)
            .map(|_| {
                std::thread::spawn(|| {
                    for _ in 0..100_000 {
                        let p = vmmbuf_stats_json(0);
                        assert!(!p.is_null());
                        // SAFETY: valid until this thread's next call.
                        let text = unsafe { CStr::from_ptr(p) }.to_str().unwrap();
                        let v: serde_json::Value = serde_json::from_str(text).unwrap();
                        assert!(v["allocated_bytes.all.current"].as_u64().unwrap() >= 4 << 20);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        vmmbuf_free(q, 4 << 20, 0, raw(&keep));
        keep.synchronize().unwrap();
    }

    #[test]
    fn bad_calls_are_answered_not_crashed() {
        let _turn = SERIAL.lock();
        // No GPU needed: these never reach the driver.
        assert!(vmmbuf_malloc(0, 0, std::ptr::null_mut()).is_null());
        assert!(vmmbuf_malloc(-5, 0, std::ptr::null_mut()).is_null());
        vmmbuf_free(0x1234 as *mut c_void, 16, 0, std::ptr::null_mut());
        assert!(vmmbuf_stats_json(7).is_null(), "no arena on device 7");
        assert_eq!(vmmbuf_set_budget(3, 1 << 30), 0);
        assert_eq!(vmmbuf_empty_cache(3), 0);
        vmmbuf_reset_peak(3);
        // SAFETY: NUL-terminated literals and null.
        unsafe {
            assert_eq!(vmmbuf_set_tag(c"weights".as_ptr()), 0);
            assert_eq!(vmmbuf_set_tag(std::ptr::null()), 0);
            assert_eq!(vmmbuf_set_tag(c"\xff".as_ptr()), -1, "not UTF-8");
            assert_eq!(vmmbuf_sleep(std::ptr::null()), 0, "nothing to move");
            assert_eq!(vmmbuf_wake(c"weights".as_ptr()), 0);
        }
    }
}
