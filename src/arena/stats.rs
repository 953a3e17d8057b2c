//! The arena's counters and snapshots, as plain data with tables for people.

use std::fmt;

use super::{Shared, State};
use crate::backend::Backend;
use crate::report::Bytes;
use crate::table::ChunkTable;

/// Allocated bytes per mapped chunk, kept at every alloc and free, so that
/// the free bytes of chunks that also hold allocations (PyTorch's inactive
/// split) are known at every operation. Chunk boundaries are the arena's
/// table's. Only chunks allocated in part are listed: a chunk missing from
/// the list holds no allocated byte or is allocated whole, and neither
/// counts. Which of the two an operation tells: a freed range's chunks held
/// its bytes, an allocated range's chunks did not. So an operation costs
/// two chunk lookups (one word each in the table's flat index, a tree
/// search in tables too large for one) and two map updates, whatever its
/// size (issue 24: walking each chunk of a 70 MiB tensor at every alloc
/// and free was half of the allocator's time under FSDP).
#[derive(Debug, Default)]
pub(super) struct SplitCount {
    /// Chunk offset -> allocated bytes in it, for chunks allocated in part
    /// (never 0, never the whole chunk).
    allocated: crate::hash::QuickMap<usize, usize>,
    /// Sum over chunks holding allocated bytes of their free bytes.
    inactive_split: usize,
}

impl SplitCount {
    pub(super) fn inactive_split(&self) -> usize {
        self.inactive_split
    }

    /// Counts afresh from the live allocations `(offset, size)`: after the
    /// chunks under them changed (a sleep joins small chunks, a discard
    /// unmaps them).
    pub(super) fn rebuild<C>(
        table: &ChunkTable<C>,
        live: impl Iterator<Item = (usize, usize)>,
    ) -> Self {
        let mut s = Self::default();
        for (o, size) in live {
            s.change(table, o, size, true);
        }
        s
    }

    /// `[offset, offset + size)` allocated (`add`) or freed, in the chunks
    /// of `table` it spans (mapped: allocations never outlive their chunks).
    /// Only the first and the last chunk are looked up: a chunk in between
    /// lies wholly inside the range, so it was empty before an allocation
    /// (or whole before a free) and is whole after (or empty): unlisted
    /// before and after, counting 0. That holds for a range accounted in
    /// pieces too (a graph's held blocks), since a chunk is listed only
    /// while allocated in part.
    pub(super) fn change<C>(
        &mut self,
        table: &ChunkTable<C>,
        offset: usize,
        size: usize,
        add: bool,
    ) {
        if size == 0 {
            return;
        }
        let end = offset + size;
        // The first chunk the range overlaps and the chunk holding its last
        // byte. Most ranges lie in mapped chunks: one search each. A range
        // partly unmapped (a sleep discarded under a live allocation) may
        // start in a hole: then the first mapped chunk after it.
        let first = table.chunk_at(offset).or_else(|| {
            table
                .overlapping(offset..end)
                .next()
                .map(|(o, e)| (o, e.bytes))
        });
        let (Some(first), Some(last)) = (first, table.chunk_at(end - 1)) else {
            return; // not mapped: nothing counts
        };
        self.one(first, offset, end, add);
        if last.0 != first.0 {
            self.one(last, offset, end, add);
        }
    }

    /// The change to the chunk `(o, bytes)` of the range `[offset, end)`.
    fn one(&mut self, (o, bytes): (usize, usize), offset: usize, end: usize, add: bool) {
        let overlap = (o + bytes).min(end) - o.max(offset);
        // Missing: empty before an allocation, whole before a free.
        let a = self
            .allocated
            .get(&o)
            .copied()
            .unwrap_or(if add { 0 } else { bytes });
        let counts = |a: usize| if a > 0 { bytes - a } else { 0 };
        let now = if add { a + overlap } else { a - overlap };
        self.inactive_split = self.inactive_split + counts(now) - counts(a);
        if now == 0 || now == bytes {
            self.allocated.remove(&o);
        } else {
            self.allocated.insert(o, now);
        }
    }
}

/// A figure with its current value and its peak since creation (or the last
/// [`Arena::reset_peak`](crate::Arena::reset_peak)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatValue {
    /// Now.
    pub current: usize,
    /// The most since the last reset.
    pub peak: usize,
}

impl StatValue {
    pub(super) fn set(&mut self, v: usize) {
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
    /// Allocated bytes plus freed bytes whose stream uses have not passed
    /// (free blocks that CUDA graphs hold are not active, as in PyTorch,
    /// where they are a private pool's free blocks: see `graph_bytes`).
    /// At every operation, and for the peaks too: allocated <= active <=
    /// reserved (plus the discarded bytes while asleep). A read settles the frees that have passed, so after every
    /// allocation is freed and its streams are synchronised it reads 0.
    pub active_bytes: StatValue,
    /// Free bytes inside chunks that also hold allocations: memory the arena
    /// cannot give back as it is. 0 when nothing is allocated.
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
    /// Bytes allocated so far, all allocations together (PyTorch's
    /// `allocated_bytes.all.allocated`); `allocated_bytes.current` is this
    /// less [`freed_bytes_total`](Self::freed_bytes_total).
    pub allocated_bytes_total: u64,
    /// Bytes freed so far (PyTorch's `allocated_bytes.all.freed`).
    pub freed_bytes_total: u64,
    /// Bytes requested so far (PyTorch's `requested_bytes.all.allocated`).
    pub requested_bytes_total: u64,
    /// Requested bytes freed so far (PyTorch's `requested_bytes.all.freed`).
    pub requested_freed_total: u64,
    /// Chunks mapped so far for allocations (PyTorch's name: its count of
    /// `cuMemMap` and `cudaMalloc` calls). Flat in a steady state; each is a
    /// driver call an allocation waited for.
    pub num_device_alloc: u64,
    /// Ranges unmapped so far when cached memory went back (PyTorch's
    /// name: its count of `cuMemUnmap` and `cudaFree` calls).
    pub num_device_free: u64,
    /// Growths (each mapping one or more chunks) made while a free block of
    /// another stream, large enough for the request, was still pending: its
    /// fences had not passed, so the request could not take it. Memory the
    /// GPU's lag behind the CPU made the arena map.
    pub num_grows_past_pending: u64,
    /// Bytes those growths mapped.
    pub grown_past_pending_bytes: u64,
    /// Requests that waited for another stream's pending free block
    /// instead of growing ([`ArenaDesc::wait_before_grow`](crate::ArenaDesc::wait_before_grow)).
    pub num_waits_before_grow: u64,
    /// Free chunks moved to where the arena grew instead of mapping new
    /// memory ([`ArenaDesc::move_free_chunks`](crate::ArenaDesc::move_free_chunks)):
    /// each a mapping, and later an unmapping of its old address.
    pub num_chunks_moved: u64,
    /// Growths that moved free chunks: `num_chunks_moved` over this is how
    /// many a growth moved (each growth's moves share access calls).
    pub num_moving_growths: u64,
    /// Nanoseconds those moves spent in the backend: mapping each chunk
    /// at its new address and unmapping its old one, timed as they ran.
    pub move_ns: u64,
    /// Inactive split bytes over reserved bytes (0 when nothing is
    /// reserved): the share of mapped memory that is free but pinned by
    /// allocations in the same chunks. 0 when nothing is allocated.
    pub fragmentation: f64,
    /// Bytes this arena's pool holds for reuse.
    pub pooled_bytes: usize,
    /// Of the mapped bytes, those in pinned host memory (all of them while
    /// [offloaded](crate::Arena::offload)).
    pub host_bytes: usize,
    /// Of the mapped bytes, those on a GPU.
    pub device_bytes: usize,
    /// Bytes of the ranges a discarding or stashing
    /// [sleep](crate::Arena::sleep) unmapped until the wake. Allocations
    /// there still count as allocated, not as reserved: allocated <= active
    /// <= reserved + discarded.
    pub discarded_bytes: usize,
    /// Pinned host bytes in the arena's stash ([`SleepMode::Stash`](crate::SleepMode::Stash)),
    /// kept from one sleep to the next (not counted as reserved).
    pub stash_bytes: usize,
    /// Pageable host bytes holding the data of a
    /// [`SleepMode::Pageable`](crate::SleepMode::Pageable) sleep, until the
    /// wake gives them back to the system.
    pub pageable_bytes: usize,
    /// Freed bytes CUDA graphs hold until they are released
    /// ([`Arena::alloc_in_graph`](crate::Arena::alloc_in_graph)): counted
    /// as active, not allocated.
    pub graph_bytes: usize,
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
            "  allocs {}, frees {}, chunks mapped {}, ranges unmapped {}, chunks moved {} in {} growths, alloc retries {}, OOMs {}, device syncs {}, fragmentation {:.3}, pooled {}, on GPUs {}, in host memory {}",
            self.num_allocs,
            self.num_frees,
            self.num_device_alloc,
            self.num_device_free,
            self.num_chunks_moved,
            self.num_moving_growths,
            self.num_alloc_retries,
            self.num_ooms,
            self.num_device_syncs,
            self.fragmentation,
            Bytes(self.pooled_bytes),
            Bytes(self.device_bytes),
            Bytes(self.host_bytes)
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
    pub stream: Option<crate::StreamKey>,
    /// The CUDA graph whose pool holds it (an allocation made in the graph,
    /// or a free block the graph keeps).
    pub graph: Option<crate::GraphPoolId>,
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

impl<B: Backend> Shared<B> {
    /// Updates the counters that keep a peak, at every operation (constant
    /// time), so allocated <= active <= reserved holds for current values
    /// and peaks alike. What has no peak is counted when read
    /// ([`refresh`](Self::refresh)): an allocator call under a training
    /// step's cold caches then touches fewer lines.
    pub(super) fn count(&self, st: &mut State<B>) {
        let (allocated, requested) = st.heap.allocated();
        let mapped = st.region.table.mapped_bytes();
        let pending = st.heap.pending_bytes();
        let split = st.split.inactive_split();
        let s = &mut st.stats;
        s.allocated_bytes.set(allocated);
        s.requested_bytes.set(requested);
        s.reserved_bytes.set(mapped);
        // Blocks graphs hold free are not active: a private pool's free
        // blocks are not in PyTorch's count either.
        s.active_bytes.set(allocated + pending);
        s.inactive_split_bytes.set(split);
    }

    /// The counters without a peak: current values only, set when read.
    fn count_current(&self, st: &mut State<B>) {
        let mapped = st.region.table.mapped_bytes();
        let split = st.split.inactive_split();
        let s = &mut st.stats;
        s.graph_bytes = st.heap.held_bytes();
        (s.discarded_bytes, s.stash_bytes, s.pageable_bytes) = st.sleep.held_bytes();
        s.fragmentation = if mapped == 0 {
            0.0
        } else {
            split as f64 / mapped as f64
        };
    }

    /// Settles the frees whose fences have passed, then counts; and reads
    /// what only a read needs (pool, placement, device syncs).
    pub(super) fn refresh(&self, st: &mut State<B>) {
        for z in 0..2 {
            if st.heap.any_pending(z) {
                self.settle_zone(st, z);
            }
        }
        self.count(st);
        self.count_current(st);
        let mapped = st.region.table.mapped_bytes();
        let s = &mut st.stats;
        s.num_device_syncs = self.backend.live().device_syncs - self.syncs_at_start;
        s.pooled_bytes = self.pool.stats().pooled_bytes;
        let host = st.region.table.host_bytes();
        st.stats.host_bytes = host;
        st.stats.device_bytes = mapped - host;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::location::Location;
    use crate::table::Entry;
    use proptest::prelude::*;

    const UNIT: usize = 64;
    const UNITS: usize = 256;

    /// The inactive split counted the slow way: each chunk's allocated bytes
    /// from the accounted units.
    fn brute(table: &ChunkTable<()>, accounted: &[bool]) -> usize {
        table
            .iter()
            .map(|(o, e)| {
                let a = (o / UNIT..(o + e.bytes) / UNIT)
                    .filter(|&u| accounted[u])
                    .count()
                    * UNIT;
                if a > 0 {
                    e.bytes - a
                } else {
                    0
                }
            })
            .sum()
    }

    /// The maximal runs of units equal to `want`.
    fn runs(accounted: &[bool], want: bool) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        let mut at = 0;
        while at < accounted.len() {
            if accounted[at] == want {
                let start = at;
                while at < accounted.len() && accounted[at] == want {
                    at += 1;
                }
                out.push((start, at));
            } else {
                at += 1;
            }
        }
        out
    }

    proptest! {
        /// Allocations and frees of any range of free or accounted bytes
        /// (so a range freed whole may have been accounted in pieces, as a
        /// graph's held blocks are, and the reverse), over chunks of mixed
        /// sizes: the count always equals the slow one.
        #[test]
        fn the_split_count_equals_a_count_chunk_by_chunk(
            sizes in proptest::collection::vec(1usize..=12, 1..40),
            ops in proptest::collection::vec((any::<bool>(), any::<u32>(), any::<u32>(), any::<u32>()), 1..200),
        ) {
            let mut table = ChunkTable::new(UNITS * UNIT, UNIT).unwrap();
            let mut o = 0;
            for s in sizes {
                let bytes = s * 4 * UNIT;
                if o + bytes > UNITS * UNIT {
                    break;
                }
                table.insert(o, Entry::new((), bytes, Location::Device(0))).unwrap();
                o += bytes;
            }
            let mapped = o / UNIT;
            let mut accounted = vec![false; UNITS];
            let mut split = SplitCount::default();
            for (add, pick, a, b) in ops {
                let candidates: Vec<_> = runs(&accounted[..mapped], !add);
                if candidates.is_empty() {
                    continue;
                }
                let (lo, hi) = candidates[pick as usize % candidates.len()];
                let x = lo + a as usize % (hi - lo);
                let y = x + 1 + b as usize % (hi - x);
                split.change(&table, x * UNIT, (y - x) * UNIT, add);
                for u in &mut accounted[x..y] {
                    *u = add;
                }
                prop_assert_eq!(split.inactive_split(), brute(&table, &accounted));
            }
        }
    }
}
