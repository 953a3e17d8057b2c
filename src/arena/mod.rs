//! [`Arena`]: a stream-ordered tensor allocator on one reservation. The
//! design is documented on the type.
#![allow(clippy::new_ret_no_self)]

mod alloc;
mod allocation;
mod desc;
mod heap;
mod host;
use heap::{blocks, graph, owed};
mod mapping;
mod moves;
mod release;
mod sleep;
mod state;
mod stats;
mod trace;

pub use allocation::Allocation;
pub use desc::ArenaDesc;
pub use graph::GraphPoolId;
pub use stats::{ArenaSnapshot, ArenaStats, BlockInfo, StatValue};

pub use trace::{
    parse_trace, replay_trace, replay_trace_with, ReplayReport, TraceEvent, TRACE_HEADER,
};

use std::fmt;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::backend::{Backend, Uses};
use crate::error::{Error, Result};
use crate::location::{Access, AccessDesc, Location};
use crate::plan::round_up;
use crate::pool::{Budget, ChunkPool, PoolDesc};
use crate::region::Region;
use blocks::StreamKey;
use owed::Mark;
use state::State;

/// A queue of work an allocation belongs to: for CUDA an `Arc<CudaStream>`;
/// for the host backend a [`HostStream`].
pub trait ArenaStream<B: Backend>: Clone + Send + Sync + 'static {
    /// Identifies the stream: the same key, the same queue.
    fn key(&self) -> crate::StreamKey;
    /// A fence after everything queued on the stream so far.
    fn fence(&self, backend: &B) -> Result<B::Fence>;
}

/// A stream of the host backend: the number tells streams apart (trace
/// replay keeps their reuse rules). Its fences have passed when made, as the
/// host has no queued work, unless the backend lags
/// ([`HostBackend::with_fence_lag`](crate::HostBackend::with_fence_lag)).
#[cfg(target_os = "linux")]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct HostStream(pub u64);

#[cfg(target_os = "linux")]
impl ArenaStream<crate::HostBackend> for HostStream {
    fn key(&self) -> crate::StreamKey {
        (0, self.0)
    }
    fn fence(&self, backend: &crate::HostBackend) -> Result<crate::host::HostFence> {
        backend.fence_on(self.key())
    }
}

/// The key of no stream: a graph's allocation finds settled blocks only.
const GRAPH_KEY: StreamKey = (u64::MAX, u64::MAX);

/// Who an arena's chunks are mapped for at first: its device (and the
/// host's entry, recorded, which reaches the driver only when a synchronous
/// copy needs it, `migration::grant_cpu`: on host-placed chunks it costs ~40
/// ms per GiB to set, and kernels do not need it), and with `peers` every
/// device that can reach it.
fn initial_access<B: Backend>(backend: &B, peers: bool) -> Result<Vec<AccessDesc>> {
    let mut access = vec![AccessDesc::new(backend.home(), Access::ReadWrite)];
    if backend.home() != Location::Host {
        access.push(AccessDesc::new(Location::Host, Access::ReadWrite));
    }
    if peers {
        for d in backend.peers()? {
            access.push(AccessDesc::new(Location::Device(d), Access::ReadWrite));
        }
    }
    Ok(access)
}

struct Shared<B: Backend> {
    backend: Arc<B>,
    pool: Arc<ChunkPool<B>>,
    base: u64,
    granularity: usize,
    chunk_bytes: usize,
    alignment: usize,
    budget: Option<usize>,
    release_before_map: bool,
    /// [`ArenaDesc::release_over_percent`].
    release_over_percent: Option<u32>,
    defer_free_fences: bool,
    wait_before_grow: bool,
    /// [`ArenaDesc::move_free_chunks`], where the backend can.
    move_free_chunks: bool,
    /// Device bytes to leave free when mapping (0: none; see
    /// [`Arena::set_device_margin`]).
    margin: std::sync::atomic::AtomicUsize,
    /// The stream of the latest alloc or free (a hint for deferring).
    last_stream: [std::sync::atomic::AtomicU64; 2],
    placement: Location,
    syncs_at_start: u64,
    state: Mutex<State<B>>,
    trace: Mutex<Option<trace::TraceSink>>,
    /// Whether `trace` holds a sink: read at every alloc without taking
    /// the trace's lock (one atomic line fewer per call when off).
    tracing: std::sync::atomic::AtomicBool,
}

/// A stream-ordered allocator over one reserved range, for tensors: many
/// allocations of many sizes, freed in any order on any stream. Cloning
/// gives another handle to the same arena; allocations keep it alive.
///
///
/// # Design
/// One address range is reserved per arena (per device and placement). Free
/// bytes inside mapped memory live in a best-fit index of blocks
/// (`blocks.rs`): a request takes the smallest free block that fits and
/// splits it, as PyTorch's caching allocator does for large blocks, and
/// adjacent free blocks merge again. Best fit over one contiguous, growable
/// space was chosen over size classes (or TLSF's two-level classes) because
/// the arena can always *remap* instead of keeping per-class slabs: when no
/// block fits, it maps physical chunks at the lowest unmapped address where
/// the request fits, extending the free block that ends there (PyTorch's
/// expandable segments). So free space is never stranded in a class, and
/// reserved memory tracks allocated memory closely.
///
/// Whole free chunks anywhere in the range are unmapped and handed to the
/// arena's [`ChunkPool`] (not the driver) once their last use has passed:
/// before mapping anything new, when a budget or the device runs out, and on
/// [`Arena::empty_cache`]. New mappings take pooled chunks first.
///
/// # Stream order
/// An [`Allocation`] belongs to the stream it was made for. When it drops,
/// a fence is recorded on that stream (and on every stream named with
/// [`Allocation::record_stream`], and every view's); its block returns to
/// the free index at once, for that stream to reuse (its later work is
/// queued after the free), and for other streams only once the fences have
/// passed. Nothing waits for the whole device, unless
/// [`ArenaDesc::defer_free_fences`] is set: then a free on its own stream
/// records no fence, one recorded at a later call on that stream stands
/// for many (`owed.rs`), and a wait for frees still without one (out of
/// memory, a sleep not given their stream, `empty_cache`, the drop)
/// synchronises the device.
///
/// # Example
///
/// In host memory (the same calls run on a GPU with
/// [`CudaArena`](crate::cuda::CudaArena) and cudarc's streams):
///
/// ```
/// # #[cfg(target_os = "linux")] {
/// use vmmbuf::host::{HostArena, HostStream};
/// use vmmbuf::{ArenaDesc, HostBackend};
///
/// let arena = HostArena::new(HostBackend::new(), ArenaDesc::new(1 << 30))?; // 1 GiB of room, nothing mapped
/// let s = HostStream(1);
/// let mut a = arena.alloc(3 << 20, &s)?;          // maps what it needs
/// a.write(0, b"hello")?;
/// let b = arena.alloc(1 << 20, &s)?;
/// assert!(b.address() >= a.address() + a.capacity() as u64 || b.address() + b.capacity() as u64 <= a.address());
/// let mut back = [0u8; 5];
/// a.read(0, &mut back)?;
/// assert_eq!(&back, b"hello");
/// drop((a, b));                                    // freed in stream order
/// arena.empty_cache()?;                            // the memory goes back
/// assert_eq!(arena.stats().reserved_bytes.current, 0);
/// # }
/// # Ok::<(), vmmbuf::Error>(())
/// ```
pub struct Arena<B: Backend, S: ArenaStream<B>> {
    shared: Arc<Shared<B>>,
    _stream: std::marker::PhantomData<fn(S)>,
}

impl<B: Backend, S: ArenaStream<B>> Clone for Arena<B, S> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
            _stream: std::marker::PhantomData,
        }
    }
}

impl<B: Backend, S: ArenaStream<B>> fmt::Debug for Arena<B, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Arena")
            .field("base", &format_args!("{:#x}", self.shared.base))
            .field("stats", &self.stats())
            .finish()
    }
}

impl<B: Backend, S: ArenaStream<B>> Arena<B, S> {
    /// Reserves the range `desc` describes, with a pool of its own.
    pub fn new(backend: Arc<B>, desc: ArenaDesc) -> Result<Self> {
        let pool = ChunkPool::new(backend.clone(), PoolDesc::default())?;
        Self::with_pool(pool, desc)
    }

    /// Like [`new`](Self::new), sharing `pool` (with other arenas or buffers
    /// of its backend).
    pub fn with_pool(pool: Arc<ChunkPool<B>>, desc: ArenaDesc) -> Result<Self> {
        let backend = pool.backend().clone();
        let placement = desc.placement.unwrap_or(backend.home());
        let g = backend.granularity(placement)?;
        let (reserved, chunk_bytes) = desc.sizes(g)?;
        let access = initial_access(&*backend, desc.peer_access)?;
        let mut region = Region::reserve(&backend, reserved, g, g)?;
        region.set_budget(desc.shared_budget.clone());
        let base = region.base();
        let syncs_at_start = backend.live().device_syncs;
        let move_free_chunks = desc.move_free_chunks && backend.maps_a_chunk_twice();
        Ok(Self {
            shared: Arc::new(Shared {
                backend,
                pool,
                base,
                granularity: g,
                chunk_bytes,
                alignment: desc.alignment,
                budget: desc.max_reserved_bytes,
                release_before_map: desc.release_before_map,
                release_over_percent: desc.release_over_percent,
                defer_free_fences: desc.defer_free_fences,
                wait_before_grow: desc.wait_before_grow,
                move_free_chunks,
                margin: std::sync::atomic::AtomicUsize::new(0),
                last_stream: Default::default(),
                placement,
                syncs_at_start,
                state: Mutex::new(State::new(region, g, &desc, placement, access)),
                trace: Mutex::new(None),
                tracing: std::sync::atomic::AtomicBool::new(false),
            }),
            _stream: std::marker::PhantomData,
        })
    }

    /// The first address of the arena's range.
    pub fn base(&self) -> u64 {
        self.shared.base
    }

    /// Sets the hook told when the arena's memory becomes mapped and before
    /// it stops being mapped (see [`crate::hook`]), `None` to remove it: how
    /// a growing arena stays registered with NCCL. The old hook is told that
    /// every range it knows is unmapping, the new one that every mapped run
    /// is mapped (one range per run and placement), at once.
    ///
    /// With a hook, the arena gives back only whole reported ranges while
    /// running (a range goes once all of it is free and settled), so no
    /// range is unmapped while work the arena knows of may use any byte of
    /// it. Replacing or removing a hook is the caller's to order: do it
    /// when nothing that relies on the old hook's registration is in
    /// flight.
    pub fn set_map_hook(&self, hook: Option<Arc<dyn crate::hook::MapHook>>) -> Result<()> {
        let mut st = self.shared.state.lock();
        st.region.check_poison()?;
        st.region.set_hook(hook);
        // Free blocks listed before the walls stood that straddle one are
        // split at them (or, pending, kept from every stream until settled).
        let st = &mut *st;
        let walls = st.region.walls();
        st.heap.rewall(&walls);
        Ok(())
    }

    /// Leaves at least `bytes` of the device free: a request that would map
    /// device memory while the device reports less than that plus what it
    /// maps is out of memory ([`Error::ArenaOutOfMemory`], after the usual
    /// retry that gives free chunks back). torch_memory_saver's
    /// `memory_margin_bytes`. 0 (the default) turns it off; a backend that
    /// reports no device memory ([`Backend::device_memory`]) is not
    /// limited.
    pub fn set_device_margin(&self, bytes: usize) {
        self.shared
            .margin
            .store(bytes, std::sync::atomic::Ordering::Relaxed);
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<B> {
        &self.shared.backend
    }

    /// The alignment (and size multiple) of every allocation.
    pub fn alignment(&self) -> usize {
        self.shared.alignment
    }

    /// The pool whole free chunks go to.
    pub fn pool(&self) -> &Arc<ChunkPool<B>> {
        &self.shared.pool
    }

    /// Unmaps every whole free chunk whose last use has passed and hands it
    /// to the arena's pool, where the next mapping (of this arena or another
    /// user of the pool) takes it. Returns the bytes handed over.
    pub fn release_cached(&self) -> Result<usize> {
        let mut st = self.shared.state.lock();
        let n = self.shared.release_free_chunks(&mut st)?;
        self.shared.count(&mut st);
        Ok(n)
    }

    /// [`release_cached`](Self::release_cached) after a device
    /// synchronisation, as an out-of-memory path does (PyTorch's cache
    /// synchronises before it frees its cached blocks): every free made so
    /// far has passed, so every whole free chunk goes back, those whose
    /// fence was still pending and, with [deferred free
    /// fences](ArenaDesc::defer_free_fences), those whose fence was not
    /// recorded yet. Without it, memory freed on a stream the arena sees no
    /// call on again (another tag's, another thread's) could never go back.
    /// It waits for all the device's work: not for a hot path; while a
    /// capture may be under way ([`Backend::capture_underway`]) it is
    /// refused with [`Error::CaptureUnderway`], nothing changed. Returns
    /// the bytes handed over.
    pub fn release_all_cached(&self) -> Result<usize> {
        let mut st = self.shared.state.lock();
        st.heap.synchronize(&*self.shared.backend)?;
        let n = self.shared.release_free_chunks(&mut st)?;
        self.shared.count(&mut st);
        Ok(n)
    }

    /// [`release_cached`](Self::release_cached), then gives the pool's
    /// chunks back to the driver: what `torch.cuda.empty_cache()` does. The
    /// host pieces a [`wake`](Self::wake) left in the pool for the next
    /// sleep stay (they hold no device memory, and pinning them again costs
    /// ~300 ms per GiB): `pool().trim_at(Location::Host)` gives them back,
    /// and [`PoolDesc::max_host_bytes`] bounds them. With
    /// [deferred free fences](ArenaDesc::defer_free_fences), frees with no
    /// fence recorded yet are waited for with a device synchronisation,
    /// except while a CUDA graph capture may be under way
    /// ([`Backend::capture_underway`]): then only what has passed goes back.
    pub fn empty_cache(&self) -> Result<()> {
        let mut st = self.shared.state.lock();
        // Frees whose fence is deferred and not yet recorded could never
        // settle here: the device is synchronised instead (as PyTorch's
        // empty_cache does).
        // Not while a capture may be under way: what has passed goes back.
        if st.heap.any_uncovered() && !self.shared.backend.capture_underway() {
            st.heap.synchronize(&*self.shared.backend)?;
        }
        self.shared.release_free_chunks(&mut st)?;
        self.shared.refresh(&mut st);
        drop(st);
        if self.shared.placement == Location::Host {
            self.shared.pool.trim()
        } else {
            self.shared.pool.trim_at(self.shared.placement)
        }
    }

    /// Gives every device that can reach the arena's own (the backend's
    /// [`peers`](crate::Backend::peers)) read and write access to every
    /// chunk mapped now, and maps every later chunk for them too: what
    /// [`ArenaDesc::peer_access`] does from the start, for a caller that
    /// learns only later that another GPU will touch the memory (the
    /// PyTorch plug-in, when a process first allocates on a second GPU).
    /// Work already queued on the chunks is not waited for: access is only
    /// widened. Returns how many chunks it granted (0 when the peers had
    /// access already, or there are none: the host backend has none).
    ///
    /// On an error (the driver refusing one chunk's access) the chunks
    /// before it keep the new access, later mappings include the peers,
    /// and a second call grants the rest.
    pub fn grant_peer_access(&self) -> Result<usize> {
        let peers: Vec<AccessDesc> = self
            .shared
            .backend
            .peers()?
            .into_iter()
            .map(|d| AccessDesc::new(Location::Device(d), Access::ReadWrite))
            .collect();
        let mut st = self.shared.state.lock();
        st.region.check_poison()?;
        st.access = crate::location::with_entries(&st.access, &peers);
        st.region.grant(&peers)
    }

    /// Whether every chunk the arena maps from now on is mapped for its
    /// backend's peers too ([`ArenaDesc::peer_access`], or after
    /// [`grant_peer_access`](Self::grant_peer_access)); false where there
    /// are no peers.
    pub fn grants_peer_access(&self) -> bool {
        let st = self.shared.state.lock();
        st.access.iter().any(|a| {
            matches!(a.location, Location::Device(_)) && a.location != self.shared.backend.home()
        })
    }

    /// Records every alloc and free from now on to `out` as a CSV trace
    /// (see [`parse_trace`]), replacing any trace being recorded.
    pub fn record_trace(&self, mut out: Box<dyn std::io::Write + Send>) -> Result<()> {
        writeln!(out, "{TRACE_HEADER}").map_err(|e| Error::Os {
            call: "write",
            source: e,
        })?;
        let mut t = self.shared.trace.lock();
        *t = Some(trace::TraceSink {
            out,
            start: std::time::Instant::now(),
            next_id: 0,
        });
        self.shared
            .tracing
            .store(true, std::sync::atomic::Ordering::Release);
        Ok(())
    }

    /// Stops recording, flushing the trace.
    pub fn stop_trace(&self) -> Result<()> {
        let taken = {
            let mut t = self.shared.trace.lock();
            self.shared
                .tracing
                .store(false, std::sync::atomic::Ordering::Release);
            t.take()
        };
        if let Some(mut sink) = taken {
            sink.out.flush().map_err(|e| Error::Os {
                call: "flush",
                source: e,
            })?;
        }
        Ok(())
    }

    /// (bytes allocated, bytes taken: mapped plus idle in the pool).
    fn taken(&self) -> (usize, usize) {
        let st = self.shared.state.lock();
        (
            st.heap.allocated().0,
            st.region.table.mapped_bytes() + self.shared.pool.stats().pooled_bytes,
        )
    }

    /// The counters.
    pub fn stats(&self) -> ArenaStats {
        let mut st = self.shared.state.lock();
        self.shared.refresh(&mut st);
        st.stats
    }

    /// Sets every peak to its current value.
    pub fn reset_peak(&self) {
        let mut st = self.shared.state.lock();
        let s = &mut st.stats;
        for v in [
            &mut s.allocated_bytes,
            &mut s.requested_bytes,
            &mut s.reserved_bytes,
            &mut s.active_bytes,
            &mut s.inactive_split_bytes,
        ] {
            v.peak = v.current;
        }
    }

    /// Segments, blocks and counters, printable as a table.
    pub fn snapshot(&self) -> ArenaSnapshot {
        let mut st = self.shared.state.lock();
        self.shared.refresh(&mut st);
        let segments = st.region.table.runs();
        let blocks = st.heap.blocks();
        ArenaSnapshot {
            base: self.shared.base,
            segments,
            blocks,
            stats: st.stats,
        }
    }
}

// They run on the host backend (memfd chunks: Linux).
#[cfg(all(test, target_os = "linux"))]
mod tests;
