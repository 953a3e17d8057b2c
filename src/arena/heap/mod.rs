//! The arena's heap: what is free, what is live and who holds what. Free
//! blocks per zone ([`blocks`]), live allocations, the blocks CUDA graphs
//! hold ([`graph`]), the frees whose fence is deferred ([`owed`]) and the
//! bytes allocated; generic over the fence, with no mapping. Its fields are
//! its own: the arena asks it through its verbs (here: the zones, live
//! allocations and free blocks; `owing.rs`: deferred frees and their
//! covers; `held.rs`: the graphs' blocks), maps and unmaps through its
//! `Region`, and hands the heap the ranges it mapped. Where a block may not
//! join its neighbour (a chunk's start under a map hook) the caller passes
//! those walls in; where fences must be asked about, a [`owed::Fences`].

use std::sync::Arc;

pub(super) mod blocks;
pub(super) mod graph;
mod held;
mod moves;
pub(super) mod owed;
mod owing;

use crate::backend::Uses;
use crate::error::Result;
use crate::order::FenceSet;
use crate::region::Walls;

use blocks::{Blocks, Free, StreamKey};
use graph::{GraphPoolId, Graphs};
use owed::{Fences, Mark, Owed};

/// Requests up to this size go to the small zone, so that small, long-lived
/// blocks do not pin the chunks that large frees would give back (PyTorch
/// keeps a small pool apart for the same reason).
pub(super) const SMALL: usize = 1 << 20;

/// The most empty use lists a heap keeps for reuse.
const SPARE_USES: usize = 64;

/// See the module's documentation.
pub(super) struct Heap<F> {
    /// Bytes of live allocations, and what was asked for them.
    allocated: usize,
    requested: usize,
    /// Free blocks of the small zone (requests up to [`SMALL`]) and of the
    /// large zone.
    zones: [Blocks<Mark<F>>; 2],
    /// Where the large zone starts: the small one is `[0, small_end)`.
    small_end: usize,
    /// Live allocations by offset: a hash map, consulted at every alloc
    /// and free (with cold caches a tree costs several misses a call).
    live: crate::hash::QuickMap<usize, Live<F>>,
    /// The blocks CUDA graphs hold, each with the graphs that reference
    /// it (see [`graph`] for the rule).
    graphs: Graphs<Mark<F>>,
    /// Frees whose fence is deferred, per stream (see [`owed`]).
    owed: Owed<F>,
    /// Empty use lists of freed allocations, for the next ones: one heap
    /// allocation (and with cold caches a few misses) fewer a call.
    spare_uses: Vec<Arc<Uses<F>>>,
}

/// A live allocation.
struct Live<F> {
    size: usize,
    requested: usize,
    stream: StreamKey,
    /// The allocation's recorded uses (views, `record_use`): offload and
    /// restore wait for them.
    uses: Arc<Uses<F>>,
    /// The graph whose pool it came from: its block stays the graph's when
    /// freed.
    graph: Option<GraphPoolId>,
    /// Taken again from the graphs that held it
    /// ([`Arena::retake`](crate::Arena::retake)): those graphs, and the
    /// fences its earlier life left on the block. Its free keeps the block
    /// for them again (those still alive) and carries the fences on.
    retaken: Option<Box<Retaken<F>>>,
}

/// What a retaken block brings from its earlier life (see [`Live::retaken`]).
struct Retaken<F> {
    graphs: Vec<GraphPoolId>,
    fences: FenceSet<Mark<F>>,
}

impl<F> Heap<F> {
    /// An empty heap whose small zone ends at `small_end`; free blocks join
    /// their settled neighbours where `joining` (else they stay as freed).
    pub(super) fn new(small_end: usize, joining: bool) -> Self {
        Self {
            allocated: 0,
            requested: 0,
            zones: if joining {
                [Blocks::joining(), Blocks::joining()]
            } else {
                [Blocks::default(), Blocks::default()]
            },
            small_end,
            live: Default::default(),
            graphs: Graphs::default(),
            owed: Owed::default(),
            spare_uses: Vec::with_capacity(SPARE_USES),
        }
    }

    // ---- The zones.

    /// The zone of a request of `size` bytes.
    pub(super) fn zone_of_size(size: usize) -> usize {
        usize::from(size > SMALL)
    }

    /// The zone `offset` lies in.
    pub(super) fn zone_of_offset(&self, offset: usize) -> usize {
        usize::from(offset >= self.small_end)
    }

    /// Where the large zone starts: a block, a mapping's piece or a sleep's
    /// group never crosses it.
    pub(super) fn zone_border(&self) -> usize {
        self.small_end
    }

    /// The offsets of zone `z` in a reservation of `reserved` bytes.
    pub(super) fn zone_range(&self, z: usize, reserved: usize) -> std::ops::Range<usize> {
        if z == 0 {
            0..self.small_end
        } else {
            self.small_end..reserved
        }
    }

    /// `[offset, offset + size)` split at the zones' border, as
    /// `(zone, offset, bytes)` pieces (one unless it crosses the border).
    pub(super) fn zone_pieces(
        &self,
        offset: usize,
        size: usize,
    ) -> impl Iterator<Item = (usize, usize, usize)> {
        let mid = self.small_end.clamp(offset, offset + size);
        [(0, offset, mid - offset), (1, mid, offset + size - mid)]
            .into_iter()
            .filter(|p| p.2 > 0)
    }

    // ---- What is counted.

    /// Bytes of live allocations (rounded), and what was asked for them.
    pub(super) fn allocated(&self) -> (usize, usize) {
        (self.allocated, self.requested)
    }

    /// Bytes of free blocks whose frees have not passed.
    pub(super) fn pending_bytes(&self) -> usize {
        self.zones.iter().map(|z| z.pending_bytes()).sum()
    }

    /// Whether zone `z` has a free block whose frees have not passed.
    pub(super) fn any_pending(&self, z: usize) -> bool {
        self.zones[z].any_pending()
    }

    // ---- Live allocations.

    /// Records a live allocation of `size` bytes (`requested` asked for)
    /// at `offset`, made on `stream` (for `graph`, counted in its pool);
    /// returns its list of uses, an empty one kept from a freed allocation
    /// where there is one.
    pub(super) fn note_live(
        &mut self,
        offset: usize,
        size: usize,
        requested: usize,
        stream: StreamKey,
        graph: Option<GraphPoolId>,
    ) -> Arc<Uses<F>> {
        let uses = self.spare_uses.pop().unwrap_or_default();
        self.live.insert(
            offset,
            Live {
                size,
                requested,
                stream,
                uses: uses.clone(),
                graph,
                retaken: None,
            },
        );
        if let Some(g) = graph {
            self.graphs.note_live(g);
        }
        self.allocated += size;
        self.requested += requested;
        uses
    }

    /// Counts off a freed allocation of `size` bytes (`requested` asked
    /// for), from `graph`'s pool if it came from one; its list of `uses`,
    /// emptied and held by nothing else, is kept for the next allocation
    /// (up to [`SPARE_USES`]).
    pub(super) fn note_freed(
        &mut self,
        size: usize,
        requested: usize,
        graph: Option<GraphPoolId>,
        uses: &Arc<Uses<F>>,
    ) {
        if Arc::strong_count(uses) == 1
            && Arc::weak_count(uses) == 0
            && self.spare_uses.len() < SPARE_USES
            && uses.is_empty()
        {
            self.spare_uses.push(uses.clone());
        }
        self.allocated -= size;
        self.requested -= requested;
        if let Some(g) = graph {
            self.graphs.note_freed(g);
        }
    }

    /// The graph whose pool the live allocation at `offset` came from, if
    /// that graph has not been released since.
    pub(super) fn graph_of(&self, offset: usize) -> Option<GraphPoolId> {
        self.live.get(&offset).and_then(|l| l.graph)
    }

    /// Every live allocation, `(offset, bytes)`, in no order.
    pub(super) fn live_ranges(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.live.iter().map(|(&o, l)| (o, l.size))
    }

    /// Waits for the uses recorded on live allocations (views,
    /// `record_use`) and, for one retaken from graphs, for the uses its
    /// block's earlier life left: before their chunks move.
    pub(super) fn wait_live_uses<B: Fences<Fence = F>>(&mut self, backend: &B) -> Result<()> {
        for l in self.live.values() {
            l.uses.each(|fence| backend.wait(fence))?;
            if let Some(r) = &l.retaken {
                self.owed.wait_set(backend, &r.fences)?;
            }
        }
        Ok(())
    }

    /// Every block, live, free or held by graphs, in address order.
    pub(super) fn blocks(&self) -> Vec<super::BlockInfo> {
        use super::BlockInfo;
        let live = self.live.iter().map(|(&o, l)| BlockInfo {
            offset: o,
            bytes: l.size,
            allocated: true,
            requested_bytes: l.requested,
            stream: Some(l.stream),
            graph: l.graph,
        });
        let free = self.free_blocks().map(|(o, f)| BlockInfo {
            offset: o,
            bytes: f.size,
            allocated: false,
            requested_bytes: 0,
            stream: if f.settled() { None } else { f.stream },
            graph: None,
        });
        let held = self.held_blocks().map(|(o, size, g)| BlockInfo {
            offset: o,
            bytes: size,
            allocated: false,
            requested_bytes: 0,
            stream: None,
            graph: g,
        });
        let mut blocks: Vec<BlockInfo> = live.chain(free).chain(held).collect();
        blocks.sort_by_key(|b| b.offset);
        blocks
    }

    // ---- Free blocks.

    /// Every free block of both zones.
    pub(super) fn free_blocks(&self) -> impl Iterator<Item = (usize, &Free<Mark<F>>)> + '_ {
        self.zones.iter().flat_map(|z| z.iter())
    }

    /// `free` becomes a free block at `offset`, in its zone, joining its
    /// neighbours where no wall of `walls` stands between.
    pub(super) fn insert_free(&mut self, offset: usize, free: Free<Mark<F>>, walls: &impl Walls) {
        let z = self.zone_of_offset(offset);
        self.zones[z].insert_in(offset, free, walls);
    }

    /// Fresh free bytes `[offset, offset + size)` with no fence, split at
    /// the zones' border, each piece a free block.
    pub(super) fn insert_fresh(&mut self, offset: usize, size: usize, walls: &impl Walls) {
        for (z, at, n) in self.zone_pieces(offset, size).collect::<Vec<_>>() {
            self.zones[z].insert_in(
                at,
                Free {
                    size: n,
                    stream: None,
                    fences: Default::default(),
                },
                walls,
            );
        }
    }

    /// Fresh free bytes `[offset, offset + size)` of zone `z` just mapped
    /// for `key`: any stream may use them, and they join `key`'s pending
    /// block before them.
    pub(super) fn insert_fresh_for(
        &mut self,
        z: usize,
        offset: usize,
        size: usize,
        key: StreamKey,
        walls: &impl Walls,
    ) {
        self.zones[z].insert_fresh_in(offset, size, key, walls);
    }

    /// The best-fitting free block of zone `z` that `key` may use now,
    /// taken out for `size` bytes (its remainder stays free).
    pub(super) fn take(&mut self, z: usize, size: usize, key: StreamKey) -> Option<usize> {
        self.zones[z].take(size, key)
    }

    /// [`take`](Self::take), sparing a block whose end `spare` names
    /// (kept to grow into) while another fits.
    pub(super) fn take_sparing(
        &mut self,
        z: usize,
        size: usize,
        key: StreamKey,
        spare: impl Fn(usize) -> bool,
    ) -> Option<usize> {
        self.zones[z].take_sparing(size, key, spare)
    }

    /// Joins `key`'s pending blocks of zone `z` with their settled
    /// neighbours (no wall between); how many joined.
    pub(super) fn coalesce(&mut self, z: usize, key: StreamKey, walls: &impl Walls) -> usize {
        self.zones[z].coalesce_in(key, walls)
    }

    /// Settles zone `z`'s frees whose fences (recorded or owed) have
    /// passed. Returns how many settled.
    pub(super) fn settle<B: Fences<Fence = F>>(
        &mut self,
        z: usize,
        backend: &B,
        walls: &impl Walls,
    ) -> usize {
        let Self { zones, owed, .. } = self;
        let mut not_yet = crate::order::NotYet::default();
        zones[z].settle_in(|x| owed.stamp_done(backend, x, &mut not_yet), walls)
    }

    /// Whether zone `z` has a free block of at least `size` that only
    /// another stream than `key` may use for now.
    pub(super) fn pending_fits(&self, z: usize, size: usize, key: StreamKey) -> bool {
        self.zones[z]
            .iter()
            .any(|(_, f)| f.size >= size && !f.usable_by(key))
    }

    /// The free block of zone `z` that ends at `end`, if any.
    pub(super) fn free_ending_at(&self, z: usize, end: usize) -> Option<(usize, &Free<Mark<F>>)> {
        self.zones[z].ending_at(end)
    }

    /// Whether `[offset, offset + size)` lies in one free block (`settled`:
    /// a settled one).
    pub(super) fn covers(&self, offset: usize, size: usize, settled: bool) -> bool {
        self.zone_pieces(offset, size)
            .all(|(z, at, n)| self.zones[z].covers(at, n, settled))
    }

    /// Whether `[offset, offset + size)` lies in one free block that `key`
    /// may take, marked as `key`'s pending block would be.
    pub(super) fn covers_for(&self, offset: usize, size: usize, key: StreamKey) -> bool {
        self.zones[self.zone_of_offset(offset)].covers_for(offset, size, key)
    }

    /// Cuts `[offset, offset + size)` out of the free block of zone `z`
    /// that `key` may take (see [`blocks::Blocks::carve_for`]).
    pub(super) fn carve_for(
        &mut self,
        z: usize,
        offset: usize,
        size: usize,
        key: StreamKey,
        fences: impl FnMut() -> FenceSet<Mark<F>>,
    ) -> Option<bool> {
        self.zones[z].carve_for(offset, size, key, fences)
    }

    /// Cuts `[offset, offset + size)` out of the free blocks (it goes
    /// unmapped), split at the zones' border.
    pub(super) fn carve(&mut self, offset: usize, size: usize) {
        for (z, at, n) in self.zone_pieces(offset, size).collect::<Vec<_>>() {
            self.zones[z].carve(at, n);
        }
    }

    /// Drops every free block, or part of one, inside `range` (its memory
    /// went back).
    pub(super) fn remove_free_within(&mut self, range: std::ops::Range<usize>) {
        for z in &mut self.zones {
            z.remove_within(range.clone());
        }
    }

    /// Checks every zone's free index against its own invariants (the
    /// host backend's tests).
    #[cfg(all(test, target_os = "linux"))]
    pub(super) fn check(&self) -> std::result::Result<(), String> {
        self.zones.iter().try_for_each(|z| z.check())
    }

    /// Splits free blocks at the `walls` now standing (see
    /// [`blocks::Blocks::rewall`]).
    pub(super) fn rewall(&mut self, walls: &impl Walls) {
        for z in &mut self.zones {
            z.rewall(walls);
        }
    }
}

#[cfg(test)]
mod tests;
