//! [`GrowableBuffer`]: reserve once, map as it grows, never move.
//!
//! This file holds the type, its construction, getters and drop; each job
//! has its own child file: `desc.rs` (how to create one), `grow.rs`, `shrink.rs`, `migrate.rs`,
//! `access.rs`, `host_view.rs` (CPU reads, writes and slices) and
//! `share.rs` (publishing to other processes); its cudarc views are in
//! `cuda/buffer_view.rs`. The chunk table, the growth plan and the
//! pool are separate, pure modules; only the backend touches memory.

mod access;
mod desc;
mod grow;
mod host_view;
mod migrate;
#[cfg(target_os = "linux")]
mod share;
mod shrink;
mod uses;

use std::ops::Range;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::backend::{Backend, Uses};
use crate::error::{Error, Result};
use crate::location::{AccessDesc, Location};
use crate::migration::MigrationPolicy;
use crate::plan::GrowthPolicy;
use crate::pool::{ChunkPool, ChunkSource, Driver};
use crate::ranges::PlacementRanges;
use crate::region::Region;
use crate::report::{BufferStats, Report};

pub use desc::BufferDesc;

/// A deferred release: chunks wholly past `high_water` (the most bytes in
/// use since the fence was given) may go once `fence` has passed.
struct Pending<F> {
    fence: F,
    /// The largest length (or capacity reserved ahead) since the deferred
    /// release before this one: the fence's work may use bytes below it,
    /// none above (bytes past the length are not in use). Raised by later
    /// growth and `reserve`, which the release must spare.
    window: usize,
}

/// What the lock guards: the reservation, its chunk table and the counters.
struct Inner<B: Backend> {
    /// The reservation and its chunks (for a buffer they tile
    /// `[0, capacity)`), poison and quarantine.
    region: Region<B>,
    stats: BufferStats,
    pending: Vec<Pending<B::Fence>>,
    /// The largest length (or capacity reserved ahead) since the last
    /// deferred release: the window of the next one.
    window: usize,
}

impl<B: Backend> Inner<B> {
    /// In debug builds, checks the chunk table's invariants and that a
    /// buffer's chunks tile `[0, capacity)` without a hole.
    fn debug_check(&self) {
        debug_assert_eq!(self.region.table.check(), Ok(()));
        debug_assert_eq!(
            self.region.table.mapped_prefix(),
            self.capacity(),
            "a buffer has no holes"
        );
    }

    /// [`Error::Poisoned`] once a failure could not be undone.
    fn check_poison(&self) -> Result<()> {
        self.region.check_poison()
    }

    /// Bytes mapped: the end of the last chunk.
    fn capacity(&self) -> usize {
        self.region.table.span_end()
    }
}

/// A byte buffer in GPU (or host) memory that grows in place.
///
/// # Guarantees
/// - **The base never moves.** [`base`](Self::base) returns the same address
///   for the buffer's whole life. Growing maps new physical chunks after the
///   existing ones in an address range reserved once at creation; no byte is
///   ever copied, and every pointer into the buffer stays valid while the
///   bytes it points to are in use.
/// - **Growing is `&self`.** [`grow_to`](Self::grow_to) takes a shared
///   reference (calls are serialised by a lock), so many threads can grow one
///   buffer while others read `base()`/`len()` or use existing bytes: growth
///   never touches mapped memory. Everything that unmaps or remaps
///   ([`shrink_to_fit`](Self::shrink_to_fit), [`shrink_to`](Self::shrink_to),
///   migration, access changes, drop) takes `&mut self`.
/// - **Growth is all or nothing.** If any driver call fails (out of memory
///   included), everything the call did is undone: the length, the data and
///   the chunks are as before, and nothing leaks.
/// - **Unmapping waits for recorded uses, in stream order.** `cuMemUnmap`
///   does not wait for kernels, so giving memory back, migrating, changing
///   access and drop first wait for every use recorded with the buffer: one
///   event per stream, never the whole device. Views record their use on
///   their stream when they drop; work that reaches the buffer through raw
///   addresses must be recorded with [`record_stream`](GrowableBuffer::record_stream)
///   or [`record_use`](Self::record_use) (as PyTorch's `record_stream`).
///   [`shrink_to_fit_after`](Self::shrink_to_fit_after) releases once both
///   its fence and the recorded uses have passed, without blocking.
/// - Growing past the reservation is [`Error::ReservationExhausted`], never a
///   silent move.
///
/// Names follow `Vec`: the length (bytes in use) is at most the capacity
/// (bytes mapped), which is at most the reservation;
/// [`truncate`](Self::truncate) keeps memory, [`shrink_to_fit`](Self::shrink_to_fit)
/// gives it back (to the pool the buffer has, by default its backend's, or to
/// the driver). New bytes are not zeroed by contract.
pub struct GrowableBuffer<B: Backend> {
    backend: Arc<B>,
    base: u64,
    reserved: usize,
    granularity: usize,
    growth_policy: GrowthPolicy,
    migration_policy: MigrationPolicy,
    /// Where new chunks go unless a range placement says otherwise.
    placement: Location,
    /// Placements for new chunks starting in these ranges.
    range_placements: PlacementRanges,
    alignment: usize,
    /// Who gets which access to new chunks. Every chunk keeps its own list;
    /// a host entry takes effect only while the chunk is in host memory (the
    /// driver refuses it on device chunks).
    grants: Vec<AccessDesc>,
    pool: Option<Arc<ChunkPool<B>>>,
    /// Chunks are created exportable.
    shareable: bool,
    /// Set once a chunk was sent to another process: from then on chunks the
    /// buffer gives up are released, never pooled (a peer may still map them).
    published: std::sync::atomic::AtomicBool,
    /// The last recorded use per stream (its own lock: views record as they
    /// drop, whatever else holds the buffer's lock).
    uses: Uses<B::Fence>,
    inner: Mutex<Inner<B>>,
}

impl<B: Backend> std::fmt::Debug for GrowableBuffer<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrowableBuffer")
            .field("backend", &self.backend.name())
            .field("base", &format_args!("{:#x}", self.base))
            .field("stats", &self.stats())
            .finish()
    }
}

impl<B: Backend> GrowableBuffer<B> {
    /// Reserves the address range described by `desc`. No physical memory is
    /// mapped until the buffer grows. The buffer uses the backend's default
    /// pool ([`ChunkPool::default_for`](crate::ChunkPool::default_for)) unless
    /// [`desc.pooled`](BufferDesc::pooled) is false: chunks it gives up are
    /// kept for the next growth until the pool is trimmed.
    pub fn new(backend: Arc<B>, desc: BufferDesc) -> Result<Self> {
        let pool = if desc.pooled {
            ChunkPool::default_for(&backend)
        } else {
            None
        };
        Self::build(backend, desc, pool)
    }

    /// Like [`new`](Self::new), in `pool`'s backend: growth takes pooled
    /// chunks before creating new ones, and chunks given back (and, at drop,
    /// all of them) go to `pool` instead of back to the driver. `desc.pooled`
    /// is not read.
    pub fn with_pool(pool: &Arc<ChunkPool<B>>, desc: BufferDesc) -> Result<Self> {
        Self::build(pool.backend().clone(), desc, Some(pool.clone()))
    }

    fn build(backend: Arc<B>, desc: BufferDesc, pool: Option<Arc<ChunkPool<B>>>) -> Result<Self> {
        let home = backend.home();
        let placement = desc.placement.unwrap_or(home);
        let granularity = backend.granularity(placement)?;
        let (reserved, growth_policy) = desc.sizes(granularity)?;
        let mut grants = vec![AccessDesc::new(home, desc.access)];
        if home != Location::Host {
            grants.push(AccessDesc::new(Location::Host, desc.access));
        }
        let mut region =
            Region::reserve(&backend, reserved, granularity, granularity).map_err(|e| match e {
                Error::ReservationExhausted { .. } => Error::ReservationExhausted {
                    requested_bytes: reserved,
                    reserved_bytes: 0,
                },
                e => e,
            })?;
        region.set_budget(desc.budget.clone());
        let base = region.base();
        tracing::debug!(
            backend = backend.name(),
            base,
            reserved,
            granularity,
            "vmmbuf: reserved"
        );
        let migration_policy = MigrationPolicy::placing_at(placement, home);
        Ok(Self {
            backend,
            base,
            reserved,
            granularity,
            growth_policy,
            migration_policy,
            placement,
            range_placements: PlacementRanges::default(),
            alignment: desc.alignment,
            grants,
            pool,
            shareable: desc.shareable,
            published: std::sync::atomic::AtomicBool::new(false),
            uses: Uses::default(),
            inner: Mutex::new(Inner {
                region,
                stats: BufferStats {
                    reserved_bytes: reserved,
                    ..BufferStats::default()
                },
                pending: Vec::new(),
                window: 0,
            }),
        })
    }

    /// The first address of the buffer; the same for its whole life.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// Sets the hook told when the buffer's chunks become mapped and before
    /// they stop being mapped (see [`crate::hook`]), `None` to remove it:
    /// how a growing buffer stays registered with NCCL. The old hook is
    /// told that every range it knows is unmapping, the new one that the
    /// mapped chunks are mapped (one range per placement), at once. Each
    /// growth is then one more range.
    ///
    /// With a hook, a shrink gives back only whole reported ranges: the
    /// range holding the new length stays mapped until the length falls to
    /// its start. Replacing or removing a hook is the caller's to order: do
    /// it when nothing that relies on the old hook's registration is in
    /// flight.
    pub fn set_map_hook(&self, hook: Option<Arc<dyn crate::hook::MapHook>>) -> Result<()> {
        let mut g = self.inner.lock();
        g.region.check_poison()?;
        g.region.set_hook(hook);
        Ok(())
    }

    /// Bytes in use.
    pub fn len(&self) -> usize {
        self.inner.lock().region.table.len()
    }

    /// True when no bytes are in use.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes mapped (at least [`len`](Self::len)).
    pub fn capacity(&self) -> usize {
        self.inner.lock().capacity()
    }

    /// Bytes of address space reserved: the most the buffer can ever hold.
    pub fn reserved(&self) -> usize {
        self.reserved
    }

    /// The backend's mapping granularity for this buffer's placement.
    pub fn granularity(&self) -> usize {
        self.granularity
    }

    /// Number of chunks mapped.
    pub fn chunk_count(&self) -> usize {
        self.inner.lock().region.table.chunk_count()
    }

    /// The growth policy in force (a fixed size already rounded to the
    /// granularity).
    pub fn growth_policy(&self) -> GrowthPolicy {
        self.growth_policy
    }

    /// Sets the growth policy for growths from now on (checked and rounded as
    /// in [`BufferDesc::growth`]).
    pub fn set_growth_policy(&mut self, policy: GrowthPolicy) -> Result<()> {
        self.growth_policy = policy.resolve(self.granularity)?;
        Ok(())
    }

    /// Where new chunks are placed (unless a range policy says otherwise).
    pub fn placement(&self) -> Location {
        self.placement
    }

    /// The backend this buffer lives in.
    pub fn backend(&self) -> &Arc<B> {
        &self.backend
    }

    /// The pool this buffer takes chunks from and gives them to, if any.
    pub fn pool(&self) -> Option<&Arc<ChunkPool<B>>> {
        self.pool.as_ref()
    }

    /// The buffer's counters.
    pub fn stats(&self) -> BufferStats {
        Self::stats_of(&self.inner.lock())
    }

    fn stats_of(g: &Inner<B>) -> BufferStats {
        let t = g.region.table.stats();
        BufferStats {
            in_use_bytes: g.region.table.len(),
            mapped_bytes: t.mapped_bytes,
            chunks: t.chunks,
            host_bytes: t.host_bytes,
            device_bytes: t.mapped_bytes - t.host_bytes,
            ..g.stats
        }
    }

    /// Every chunk with its placement and access, and the counters.
    pub fn report(&self) -> Report {
        let g = self.inner.lock();
        Report {
            base: self.base,
            stats: Self::stats_of(&g),
            chunks: g.region.table.report(),
        }
    }

    /// Where a new chunk starting at `offset` goes.
    fn placement_at(&self, offset: usize) -> Location {
        self.range_placements.get(offset).unwrap_or(self.placement)
    }

    /// The placements set for ranges by
    /// [`apply_migration_policy`](Self::apply_migration_policy): where new
    /// chunks starting in them go. Non-overlapping, in address order; a later
    /// setting replaces what it covers.
    pub fn placement_ranges(&self) -> Vec<(Range<usize>, Location)> {
        self.range_placements.to_vec()
    }

    /// Whether a chunk of this buffer was ever sent to another process.
    pub(crate) fn is_published(&self) -> bool {
        self.published.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Gives an unmapped chunk to the pool, or back to the driver (always
    /// once the buffer was shared: a peer may still map it).
    fn dispose(&self, chunk: B::Chunk, bytes: usize, placement: Location) -> Result<()> {
        let driver = Driver(&*self.backend);
        dispose(
            self.source(&driver),
            self.is_published(),
            chunk,
            bytes,
            placement,
        )
    }

    /// Where this buffer's chunks come from and go: its pool, or `driver`.
    pub(super) fn source<'s>(&'s self, driver: &'s Driver<'s, B>) -> &'s dyn ChunkSource<B> {
        match &self.pool {
            Some(pool) => &**pool,
            None => driver,
        }
    }
}

/// Gives an unmapped chunk back to `source`, or to the driver once the
/// buffer was published (a peer may still map it).
fn dispose<B: Backend>(
    source: &dyn ChunkSource<B>,
    published: bool,
    chunk: B::Chunk,
    bytes: usize,
    placement: Location,
) -> Result<()> {
    if published {
        source.release(chunk)
    } else {
        source.give(placement, bytes, chunk)
    }
}

impl<B: Backend> Drop for GrowableBuffer<B> {
    fn drop(&mut self) {
        // Work may still use the memory: wait for its recorded uses and the
        // fences of deferred releases (work on the tail). Unmapped by hand,
        // and the chunks pooled, only if that wait succeeded; else the
        // region releases them and the reservation's token unmaps.
        let mut g = self.inner.lock();
        let busy = !g.region.table.is_empty() && g.region.check_poison().is_ok();
        let waited = if busy { self.wait_all(&g) } else { Ok(()) };
        if let Err(e) = &waited {
            tracing::error!(error = %e, "vmmbuf: waiting for recorded uses before drop failed");
        }
        let driver = Driver(&*self.backend);
        let (source, published) = (self.source(&driver), self.is_published());
        g.region.close(waited.is_ok(), |chunk, bytes, placement| {
            let _ = dispose(source, published, chunk, bytes, placement); // logged inside
        });
    }
}
