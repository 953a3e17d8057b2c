//! [`Arena`]: a stream-ordered tensor allocator on one reservation. The
//! design is documented on the type.
#![allow(clippy::new_ret_no_self)]

mod blocks;
mod cuda_view;
mod trace;

pub use cuda_view::CudaAllocation;

pub use trace::{parse_trace, replay_trace, ReplayReport, TraceEvent, TRACE_HEADER};

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::backend::{Backend, Uses};
use crate::error::{Error, Result};
use crate::location::{Access, AccessDesc, Location};
use crate::plan::round_up;
use crate::pool::{ChunkPool, PoolDesc};
use crate::stats::Bytes;
use crate::table::{driver_access, ChunkTable, Entry};
use blocks::{Blocks, Free, StreamKey};

/// A queue of work an allocation belongs to: for CUDA an `Arc<CudaStream>`;
/// for the host backend a [`HostStream`].
pub trait ArenaStream<B: Backend>: Clone + Send + Sync + 'static {
    /// Identifies the stream: the same key, the same queue.
    fn key(&self) -> (u64, u64);
    /// A fence after everything queued on the stream so far.
    fn fence(&self, backend: &B) -> Result<B::Fence>;
}

impl ArenaStream<crate::CudaBackend> for Arc<cudarc::driver::CudaStream> {
    fn key(&self) -> (u64, u64) {
        crate::backend::cuda::stream_key(self)
    }
    fn fence(&self, backend: &crate::CudaBackend) -> Result<crate::CudaFence> {
        backend.fence(self)
    }
}

/// A stream of the host backend: the host has no queued work, so its fences
/// have always passed; the number tells streams apart (trace replay keeps
/// their reuse rules).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct HostStream(pub u64);

#[cfg(target_os = "linux")]
impl ArenaStream<crate::HostBackend> for HostStream {
    fn key(&self) -> (u64, u64) {
        (0, self.0)
    }
    fn fence(&self, _backend: &crate::HostBackend) -> Result<crate::HostFence> {
        Ok(crate::HostFence)
    }
}

/// How to create an [`Arena`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ArenaDesc {
    /// Address space to reserve (costs no memory): the most the arena can
    /// ever map.
    pub max_bytes: usize,
    /// Where chunks are placed; `None` for the backend's home.
    pub placement: Option<Location>,
    /// Alignment (and size multiple) of every allocation: a power of two up
    /// to the granularity, 256 by default.
    pub alignment: usize,
    /// The largest chunk one mapping uses: bigger requests map several. The
    /// unit in which free memory goes back to the pool. 2 MiB by default
    /// (rounded up to the granularity). Replaying a PyTorch Transformer
    /// trace, memory taken over memory allocated peaked at 1.010x with 2 MiB,
    /// 1.031x with 4 MiB and 1.077x with 8 MiB: bigger chunks mean fewer
    /// mappings when the arena grows, and more memory held.
    pub max_chunk_bytes: usize,
    /// A budget: the arena never maps more than this many bytes.
    pub max_reserved_bytes: Option<usize>,
}

impl ArenaDesc {
    /// A description reserving `max_bytes`, with the defaults.
    pub fn new(max_bytes: usize) -> Self {
        Self {
            max_bytes,
            placement: None,
            alignment: 256,
            max_chunk_bytes: 2 << 20,
            max_reserved_bytes: None,
        }
    }

    /// Sets the budget.
    pub fn max_reserved_bytes(mut self, bytes: usize) -> Self {
        self.max_reserved_bytes = Some(bytes);
        self
    }

    /// Sets the largest chunk one mapping uses.
    pub fn max_chunk_bytes(mut self, bytes: usize) -> Self {
        self.max_chunk_bytes = bytes;
        self
    }

    /// Sets the alignment of allocations.
    pub fn alignment(mut self, alignment: usize) -> Self {
        self.alignment = alignment;
        self
    }
}

/// A figure with its current value and its peak since creation (or the last
/// [`Arena::reset_peak`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatValue {
    /// Now.
    pub current: usize,
    /// The most since the last reset.
    pub peak: usize,
}

impl StatValue {
    fn set(&mut self, v: usize) {
        self.current = v;
        self.peak = self.peak.max(v);
    }
}

/// An arena's counters, named as PyTorch's `torch.cuda.memory_stats` names
/// them.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct ArenaStats {
    /// Bytes of live allocations (rounded to the alignment).
    pub allocated_bytes: StatValue,
    /// Bytes callers asked for.
    pub requested_bytes: StatValue,
    /// Bytes mapped (device memory taken by this arena, pool not counted).
    pub reserved_bytes: StatValue,
    /// Allocated bytes plus freed bytes whose stream uses have not passed.
    pub active_bytes: StatValue,
    /// Free bytes inside chunks that also hold allocations: memory the arena
    /// cannot give back as it is.
    pub inactive_split_bytes: StatValue,
    /// Allocations that succeeded only after giving cached memory back.
    pub num_alloc_retries: u64,
    /// Allocations that failed for lack of memory or budget.
    pub num_ooms: u64,
    /// Device-wide synchronisations the backend made meanwhile (0 in the
    /// steady state).
    pub num_device_syncs: u64,
    /// Allocations and frees so far.
    pub num_allocs: u64,
    /// Frees so far.
    pub num_frees: u64,
    /// `1 - largest free block / free bytes` (0 without free bytes).
    pub fragmentation: f64,
    /// Bytes this arena's pool holds for reuse.
    pub pooled_bytes: usize,
}

impl fmt::Display for ArenaStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let row = |f: &mut fmt::Formatter<'_>, name: &str, v: StatValue| {
            writeln!(
                f,
                "  {name:<22} {:>12} {:>12}",
                Bytes(v.current).to_string(),
                Bytes(v.peak).to_string()
            )
        };
        writeln!(f, "  {:<22} {:>12} {:>12}", "", "current", "peak")?;
        row(f, "allocated_bytes", self.allocated_bytes)?;
        row(f, "requested_bytes", self.requested_bytes)?;
        row(f, "reserved_bytes", self.reserved_bytes)?;
        row(f, "active_bytes", self.active_bytes)?;
        row(f, "inactive_split_bytes", self.inactive_split_bytes)?;
        writeln!(
            f,
            "  allocs {}, frees {}, alloc retries {}, OOMs {}, device syncs {}, fragmentation {:.3}, pooled {}",
            self.num_allocs,
            self.num_frees,
            self.num_alloc_retries,
            self.num_ooms,
            self.num_device_syncs,
            self.fragmentation,
            Bytes(self.pooled_bytes)
        )
    }
}

/// One block of an [`ArenaSnapshot`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct BlockInfo {
    /// Offset from the arena's base.
    pub offset: usize,
    /// Size in bytes.
    pub bytes: usize,
    /// True for a live allocation.
    pub allocated: bool,
    /// Bytes asked for (allocations only).
    pub requested_bytes: usize,
    /// The stream that owns it (`None`: free for any stream).
    pub stream: Option<(u64, u64)>,
}

/// The arena at one moment: mapped segments and the blocks in them.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ArenaSnapshot {
    /// The arena's base address.
    pub base: u64,
    /// Mapped runs `(offset, bytes)` (holes between them are unmapped).
    pub segments: Vec<(usize, usize)>,
    /// Every block, allocated or free, in address order.
    pub blocks: Vec<BlockInfo>,
    /// The counters.
    pub stats: ArenaStats,
}

impl fmt::Display for ArenaSnapshot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "arena at {:#x}: {} segment(s)",
            self.base,
            self.segments.len()
        )?;
        write!(f, "{}", self.stats)?;
        writeln!(
            f,
            "  {:>14} {:>12}  {:<10} stream",
            "offset", "size", "state"
        )?;
        for b in &self.blocks {
            let stream = b
                .stream
                .map_or("any".to_string(), |(c, s)| format!("{c:#x}/{s:#x}"));
            writeln!(
                f,
                "  {:>#14x} {:>12}  {:<10} {}",
                b.offset,
                Bytes(b.bytes).to_string(),
                if b.allocated { "allocated" } else { "free" },
                stream
            )?;
        }
        Ok(())
    }
}

/// Requests up to this size go to the small zone, so that small, long-lived
/// blocks do not pin the chunks that large frees would give back (PyTorch
/// keeps a small pool apart for the same reason).
const SMALL: usize = 1 << 20;

impl<B: Backend> State<B> {
    fn zone_of_size(size: usize) -> usize {
        usize::from(size > SMALL)
    }

    fn zone_of_offset(&self, offset: usize) -> usize {
        usize::from(offset >= self.small_end)
    }

    /// Every free block of both zones.
    fn free_blocks(&self) -> impl Iterator<Item = (usize, &Free<B::Fence>)> + '_ {
        self.zones.iter().flat_map(|z| z.iter())
    }
}

struct Live {
    size: usize,
    requested: usize,
    stream: StreamKey,
}

struct State<B: Backend> {
    /// Bytes of live allocations, and what was asked for them.
    allocated: usize,
    requested: usize,
    res: Option<B::Reservation>,
    table: ChunkTable<B::Chunk>,
    /// Free blocks of the small zone (requests up to [`SMALL`]) and of the
    /// large zone.
    zones: [Blocks<B::Fence>; 2],
    /// Where the large zone starts: the small one is `[0, small_end)`.
    small_end: usize,
    live: BTreeMap<usize, Live>,
    stats: ArenaStats,
    poisoned: Option<String>,
}

struct Shared<B: Backend> {
    backend: Arc<B>,
    pool: Arc<ChunkPool<B>>,
    base: u64,
    granularity: usize,
    chunk_bytes: usize,
    alignment: usize,
    budget: Option<usize>,
    placement: Location,
    access: Vec<AccessDesc>,
    syncs_at_start: u64,
    state: Mutex<State<B>>,
    trace: Mutex<Option<trace::TraceSink>>,
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
/// passed. Nothing waits for the whole device.
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
        if desc.max_bytes == 0 {
            return Err(Error::invalid("max_bytes is 0"));
        }
        if !desc.alignment.is_power_of_two() || desc.alignment > g {
            return Err(Error::invalid(format!(
                "alignment {} is not a power of two up to the granularity {g}",
                desc.alignment
            )));
        }
        let reserved = round_up(desc.max_bytes, g)
            .ok_or_else(|| Error::invalid(format!("max_bytes {} overflows", desc.max_bytes)))?;
        let chunk_bytes = round_up(desc.max_chunk_bytes.max(1), g)
            .ok_or_else(|| Error::invalid("max_chunk_bytes overflows"))?;
        let mut access = vec![AccessDesc::new(backend.home(), Access::ReadWrite)];
        if backend.home() != Location::Host {
            access.push(AccessDesc::new(Location::Host, Access::ReadWrite));
        }
        let table = ChunkTable::new(reserved, g)?;
        let res = backend.reserve(reserved, g)?;
        let base = backend.base(&res);
        let syncs_at_start = backend.live().device_syncs;
        Ok(Self {
            shared: Arc::new(Shared {
                backend,
                pool,
                base,
                granularity: g,
                chunk_bytes,
                alignment: desc.alignment,
                budget: desc.max_reserved_bytes,
                placement,
                access,
                syncs_at_start,
                state: Mutex::new(State {
                    allocated: 0,
                    requested: 0,
                    res: Some(res),
                    table,
                    zones: [Blocks::default(), Blocks::default()],
                    small_end: round_up(reserved / 8, g).unwrap_or(reserved).min(reserved),
                    live: BTreeMap::new(),
                    stats: ArenaStats::default(),
                    poisoned: None,
                }),
                trace: Mutex::new(None),
            }),
            _stream: std::marker::PhantomData,
        })
    }

    /// The first address of the arena's range.
    pub fn base(&self) -> u64 {
        self.shared.base
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<B> {
        &self.shared.backend
    }

    /// The pool whole free chunks go to.
    pub fn pool(&self) -> &Arc<ChunkPool<B>> {
        &self.shared.pool
    }

    /// Allocates `bytes` (rounded up to the alignment) for work on `stream`.
    ///
    /// When no free block fits, maps chunks at the lowest unmapped address
    /// that fits (pooled ones first). Out of memory or over the budget, it
    /// gives back whole free chunks and cached pool memory and tries once
    /// more; then [`Error::ArenaOutOfMemory`]. Existing allocations are
    /// never touched by a failure.
    pub fn alloc(&self, bytes: usize, stream: &S) -> Result<Allocation<B, S>> {
        if bytes == 0 {
            return Err(Error::invalid("an allocation of 0 bytes"));
        }
        let size = round_up(bytes, self.shared.alignment)
            .ok_or_else(|| Error::invalid(format!("{bytes} bytes overflow")))?;
        let key = stream.key();
        let mut st = self.shared.state.lock();
        if let Some(reason) = &st.poisoned {
            return Err(Error::Poisoned {
                reason: reason.clone(),
            });
        }
        let offset = match self.shared.find(&mut st, size, key) {
            Ok(o) => o,
            Err(e) if e.is_transient() || matches!(e, Error::ArenaOutOfMemory { .. }) => {
                // Give everything cached back and try once more.
                st.stats.num_alloc_retries += 1;
                self.shared.release_free_chunks(&mut st)?;
                let _ = self.shared.pool.trim();
                match self.shared.find(&mut st, size, key) {
                    Ok(o) => o,
                    Err(e) => {
                        st.stats.num_alloc_retries -= 1;
                        st.stats.num_ooms += 1;
                        return Err(match e {
                            Error::OutOfMemory { .. } | Error::ArenaOutOfMemory { .. } => {
                                self.shared.oom(&st, bytes)
                            }
                            e => e,
                        });
                    }
                }
            }
            Err(e) => return Err(e),
        };
        st.live.insert(
            offset,
            Live {
                size,
                requested: bytes,
                stream: key,
            },
        );
        st.stats.num_allocs += 1;
        st.allocated += size;
        st.requested += bytes;
        self.shared.count(&mut st);
        drop(st);
        let id = match self.shared.trace.lock().as_mut() {
            Some(sink) => {
                sink.next_id += 1;
                sink.line("alloc", sink.next_id, bytes, key);
                sink.next_id
            }
            None => 0,
        };
        Ok(Allocation {
            id,
            arena: self.shared.clone(),
            offset,
            size,
            requested: bytes,
            stream: stream.clone(),
            extra: Mutex::new(Vec::new()),
            uses: Uses::default(),
        })
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

    /// [`release_cached`](Self::release_cached), then gives the pool's
    /// chunks back to the driver: what `torch.cuda.empty_cache()` does.
    pub fn empty_cache(&self) -> Result<()> {
        let mut st = self.shared.state.lock();
        self.shared.release_free_chunks(&mut st)?;
        self.shared.refresh(&mut st);
        drop(st);
        self.shared.pool.trim()
    }

    /// Records every alloc and free from now on to `out` as a CSV trace
    /// (see [`parse_trace`]), replacing any trace being recorded.
    pub fn record_trace(&self, mut out: Box<dyn std::io::Write + Send>) -> Result<()> {
        writeln!(out, "{TRACE_HEADER}").map_err(|e| Error::Os {
            call: "write",
            source: e,
        })?;
        *self.shared.trace.lock() = Some(trace::TraceSink {
            out,
            start: std::time::Instant::now(),
            next_id: 0,
        });
        Ok(())
    }

    /// Stops recording, flushing the trace.
    pub fn stop_trace(&self) -> Result<()> {
        if let Some(mut sink) = self.shared.trace.lock().take() {
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
            st.allocated,
            st.table.mapped_bytes() + self.shared.pool.stats().pooled_bytes,
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
        let mut segments: Vec<(usize, usize)> = Vec::new();
        for (o, e) in st.table.iter() {
            match segments.last_mut() {
                Some(s) if s.0 + s.1 == o => s.1 += e.bytes,
                _ => segments.push((o, e.bytes)),
            }
        }
        let mut blocks: Vec<BlockInfo> = st
            .live
            .iter()
            .map(|(&o, l)| BlockInfo {
                offset: o,
                bytes: l.size,
                allocated: true,
                requested_bytes: l.requested,
                stream: Some(l.stream),
            })
            .chain(st.free_blocks().map(|(o, f)| BlockInfo {
                offset: o,
                bytes: f.size,
                allocated: false,
                requested_bytes: 0,
                stream: if f.settled() { None } else { f.stream },
            }))
            .collect();
        blocks.sort_by_key(|b| b.offset);
        ArenaSnapshot {
            base: self.shared.base,
            segments,
            blocks,
            stats: st.stats,
        }
    }
}

impl<B: Backend> Shared<B> {
    /// A free block of `size` for `key`: from the index, after settling
    /// passed frees, or from newly mapped memory.
    fn find(&self, st: &mut State<B>, size: usize, key: StreamKey) -> Result<usize> {
        let z = State::<B>::zone_of_size(size);
        if let Some(o) = st.zones[z].take(size, key) {
            return Ok(o);
        }
        let backend = &*self.backend;
        st.zones[z].settle(|f| backend.fence_done(f).unwrap_or(false));
        if let Some(o) = st.zones[z].take(size, key) {
            return Ok(o);
        }
        self.map_for(st, z, size, key)?;
        st.zones[z]
            .take(size, key)
            .ok_or_else(|| Error::invalid("mapped memory did not make a block (a bug)"))
    }

    /// Maps chunks at the lowest unmapped address of zone `z` where `size`
    /// fits, counting the free block `key` may use that ends there.
    fn map_for(&self, st: &mut State<B>, z: usize, size: usize, key: StreamKey) -> Result<()> {
        // Whole free chunks first go to the pool, which the mapping below
        // takes from: memory taken follows memory allocated.
        self.release_free_chunks(st)?;
        let g = self.granularity;
        let reserved = st.table.reserved();
        let zone = if z == 0 {
            0..st.small_end
        } else {
            st.small_end..reserved
        };
        // The unmapped gaps of the zone, in address order.
        let mut regions: Vec<std::ops::Range<usize>> = Vec::new();
        let mut at = zone.start;
        for (o, e) in st.table.iter() {
            if o + e.bytes <= zone.start || o >= zone.end {
                continue;
            }
            if o > at {
                regions.push(at..o);
            }
            at = o + e.bytes;
        }
        if at < zone.end {
            regions.push(at..zone.end);
        }
        let (at, need) = regions
            .into_iter()
            .find_map(|h| {
                let before = st.zones[z]
                    .ending_at(h.start)
                    .filter(|(_, f)| f.settled() || f.stream == Some(key))
                    .map_or(0, |(_, f)| f.size);
                let need = round_up(size.saturating_sub(before), g)?;
                (need <= h.end - h.start).then_some((h.start, need))
            })
            .ok_or(Error::ArenaOutOfMemory {
                requested_bytes: size,
                free_bytes: None,
                total_bytes: None,
                reserved_bytes: st.table.mapped_bytes(),
            })?;
        let mapped = st.table.mapped_bytes();
        if self.budget.is_some_and(|budget| mapped + need > budget) {
            return Err(Error::ArenaOutOfMemory {
                requested_bytes: size,
                free_bytes: None,
                total_bytes: None,
                reserved_bytes: mapped,
            });
        }
        // Chunks of at most `chunk_bytes`, pooled ones first.
        let mut chunks: Vec<(B::Chunk, usize)> = Vec::new();
        let mut mapped_now = 0usize;
        let attempt = (|| -> Result<()> {
            let mut left = need;
            while left > 0 {
                let bytes = left.min(self.chunk_bytes);
                let chunk = match self.pool.take_exact(self.placement, bytes) {
                    Some(c) => c,
                    None => self.backend.create(bytes, self.placement)?,
                };
                chunks.push((chunk, bytes));
                left -= bytes;
            }
            let res = st.res.as_mut().expect("the reservation lives until drop");
            for (c, bytes) in &chunks {
                self.backend.map(res, at + mapped_now, c)?;
                mapped_now += bytes;
            }
            let list = driver_access(&self.access, self.placement);
            self.backend.set_access(res, at, need, &list)
        })();
        if let Err(e) = attempt {
            let res = st.res.as_mut().expect("the reservation lives until drop");
            if mapped_now > 0 {
                if let Err(u) = self.backend.unmap(res, at, mapped_now) {
                    st.poisoned = Some(format!("undoing a failed mapping: {u}"));
                    for (c, _) in chunks {
                        let _ = self.backend.release(c); // still mapped: never pooled
                    }
                    return Err(e);
                }
            }
            for (c, bytes) in chunks {
                self.pool.put(self.placement, bytes, c);
            }
            return Err(e);
        }
        let mut o = at;
        for (c, bytes) in chunks {
            let mut entry = Entry::new(c, bytes, self.placement);
            entry.access = self.access.as_slice().into();
            st.table
                .insert(o, entry)
                .expect("mapped where the table had a hole");
            o += bytes;
        }
        // Fresh memory: any stream may use it; tagged with `key` so it merges
        // with `key`'s pending block before it.
        st.zones[z].insert(
            at,
            Free {
                size: need,
                stream: Some(key),
                fences: Vec::new(),
            },
        );
        Ok(())
    }

    /// Unmaps every chunk that lies wholly inside a settled free block and
    /// hands it to the pool. Returns the bytes released.
    fn release_free_chunks(&self, st: &mut State<B>) -> Result<usize> {
        let backend = &*self.backend;
        for z in &mut st.zones {
            z.settle(|f| backend.fence_done(f).unwrap_or(false));
        }
        let whole: Vec<(usize, usize)> = st
            .table
            .iter()
            .map(|(o, e)| (o, e.bytes))
            .filter(|&(o, b)| st.zones[st.zone_of_offset(o)].covers(o, b, true))
            .collect();
        let mut released = 0;
        for (o, b) in whole {
            let res = st.res.as_mut().expect("the reservation lives until drop");
            // Settled: the uses of these bytes have passed, no wait needed.
            backend.unmap(res, o, b)?;
            let z = st.zone_of_offset(o);
            st.zones[z].carve(o, b);
            if let Some(e) = st.table.remove(o) {
                self.pool.put(e.placement, e.bytes, e.chunk);
            }
            released += b;
        }
        Ok(released)
    }

    /// The error for a request that could not be served.
    fn oom(&self, st: &State<B>, requested: usize) -> Error {
        let info = self.backend.device_memory();
        Error::ArenaOutOfMemory {
            requested_bytes: requested,
            free_bytes: info.map(|i| i.0),
            total_bytes: info.map(|i| i.1),
            reserved_bytes: st.table.mapped_bytes(),
        }
    }

    /// Updates the counters every operation keeps (constant time).
    fn count(&self, st: &mut State<B>) {
        let (allocated, requested) = (st.allocated, st.requested);
        let mapped = st.table.mapped_bytes();
        let s = &mut st.stats;
        s.allocated_bytes.set(allocated);
        s.requested_bytes.set(requested);
        s.reserved_bytes.set(mapped);
    }

    /// Recomputes every counter, the derived ones included (active,
    /// inactive split, fragmentation: their peaks are over the times the
    /// counters were read).
    fn refresh(&self, st: &mut State<B>) {
        self.count(st);
        let (allocated, mapped) = (st.allocated, st.table.mapped_bytes());
        let pending: usize = st
            .free_blocks()
            .filter(|(_, f)| !f.settled())
            .map(|(_, f)| f.size)
            .sum();
        // Free bytes in chunks that are not wholly free.
        let whole_free: usize = st
            .table
            .iter()
            .filter(|&(o, e)| st.zones[st.zone_of_offset(o)].covers(o, e.bytes, false))
            .map(|(_, e)| e.bytes)
            .sum();
        let s = &mut st.stats;
        s.active_bytes.set(allocated + pending);
        s.inactive_split_bytes
            .set(mapped.saturating_sub(allocated + whole_free));
        let free: usize = st.zones.iter().map(|z| z.free_bytes()).sum();
        let largest = st.zones.iter().map(|z| z.largest()).max().unwrap_or(0);
        let s = &mut st.stats;
        s.fragmentation = if free == 0 {
            0.0
        } else {
            1.0 - largest as f64 / free as f64
        };
        s.num_device_syncs = self.backend.live().device_syncs - self.syncs_at_start;
        s.pooled_bytes = self.pool.stats().pooled_bytes;
    }
}

impl<B: Backend> Drop for Shared<B> {
    fn drop(&mut self) {
        // Every allocation holds the arena: nothing is allocated now, and
        // every free block's fences are waited for before unmapping.
        let st = self.state.get_mut();
        let backend = &*self.backend;
        for (_, f) in st.free_blocks() {
            for (_, fence) in &f.fences {
                let _ = backend.wait(fence);
            }
        }
        let Some(mut res) = st.res.take() else { return };
        let keys: Vec<(usize, usize)> = st.table.iter().map(|(o, e)| (o, e.bytes)).collect();
        let mut ok = st.poisoned.is_none();
        for &(o, b) in &keys {
            ok &= backend.unmap(&mut res, o, b).is_ok();
        }
        for (o, _) in keys {
            if let Some(e) = st.table.remove(o) {
                if ok {
                    self.pool.put(e.placement, e.bytes, e.chunk);
                } else {
                    let _ = backend.release(e.chunk);
                }
            }
        }
        if ok {
            let _ = backend.free(res);
        }
    }
}

/// Memory from an [`Arena`]: the owned handle a tensor stores. Holds the
/// arena alive; `Send + Sync`; freed on drop in stream order (see
/// [`Arena`]).
pub struct Allocation<B: Backend, S: ArenaStream<B>> {
    /// Its id in the trace being recorded (0 without one).
    id: u64,
    arena: Arc<Shared<B>>,
    offset: usize,
    size: usize,
    requested: usize,
    stream: S,
    extra: Mutex<Vec<S>>,
    uses: Uses<B::Fence>,
}

impl<B: Backend, S: ArenaStream<B>> fmt::Debug for Allocation<B, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Allocation")
            .field("address", &format_args!("{:#x}", self.address()))
            .field("bytes", &self.requested)
            .finish()
    }
}

impl<B: Backend, S: ArenaStream<B>> Allocation<B, S> {
    /// The device address of the first byte (aligned to the arena's alignment).
    pub fn address(&self) -> u64 {
        self.arena.base + self.offset as u64
    }

    /// Bytes asked for.
    pub fn len(&self) -> usize {
        self.requested
    }

    /// Never true: allocations are at least one byte.
    pub fn is_empty(&self) -> bool {
        self.requested == 0
    }

    /// Bytes the block holds (the request rounded up to the alignment).
    pub fn capacity(&self) -> usize {
        self.size
    }

    /// The stream it was allocated for.
    pub fn stream(&self) -> &S {
        &self.stream
    }

    /// Copies `src` into the allocation at `at` (synchronous; ordered after
    /// nothing on the device: use it before queueing work, or after
    /// synchronising the allocation's stream).
    pub fn write(&mut self, at: usize, src: &[u8]) -> Result<()> {
        self.check(at, src.len())?;
        let mut st = self.arena.state.lock();
        let res = st.res.as_mut().expect("the reservation lives until drop");
        self.arena.backend.write(res, self.offset + at, src)
    }

    /// Copies bytes of the allocation from `at` into `dst` (synchronous, as
    /// [`write`](Self::write)).
    pub fn read(&self, at: usize, dst: &mut [u8]) -> Result<()> {
        self.check(at, dst.len())?;
        let st = self.arena.state.lock();
        let res = st.res.as_ref().expect("the reservation lives until drop");
        self.arena.backend.read(res, self.offset + at, dst)
    }

    fn check(&self, at: usize, n: usize) -> Result<()> {
        match at.checked_add(n) {
            Some(end) if end <= self.requested => Ok(()),
            _ => Err(Error::invalid(format!(
                "bytes {at}+{n} are outside the {}-byte allocation",
                self.requested
            ))),
        }
    }

    /// Records that work on `stream` uses this allocation: its free waits
    /// for that stream's work queued up to the free, as PyTorch's
    /// `Tensor.record_stream`.
    pub fn record_stream(&self, stream: &S) {
        let mut v = self.extra.lock();
        if stream.key() != self.stream.key() && !v.iter().any(|s| s.key() == stream.key()) {
            v.push(stream.clone());
        }
    }
}

impl<B: Backend, S: ArenaStream<B>> Drop for Allocation<B, S> {
    fn drop(&mut self) {
        let backend = &*self.arena.backend;
        let mut fences = Vec::new();
        let mut ok = true;
        for s in std::iter::once(&self.stream).chain(self.extra.get_mut().iter()) {
            match s.fence(backend) {
                Ok(f) => fences.push((s.key(), f)),
                Err(e) => {
                    tracing::error!(error = %e, "vmmbuf arena: recording a free's fence failed; the block is never reused");
                    ok = false;
                }
            }
        }
        if self.id != 0 {
            if let Some(sink) = self.arena.trace.lock().as_mut() {
                sink.line("free", self.id, self.requested, self.stream.key());
            }
        }
        // Views on other streams recorded their own fences.
        let view_fences = std::mem::take(&mut self.uses);
        let mut st = self.arena.state.lock();
        st.live.remove(&self.offset);
        st.stats.num_frees += 1;
        st.allocated -= self.size;
        st.requested -= self.requested;
        self.arena.count(&mut st);
        if ok {
            fences.extend(view_fences.into_fences());
            let stream = self.extra.get_mut().is_empty().then(|| self.stream.key());
            let z = st.zone_of_offset(self.offset);
            st.zones[z].insert(
                self.offset,
                Free {
                    size: self.size,
                    stream,
                    fences,
                },
            );
        }
    }
}

#[cfg(test)]
mod tests;
