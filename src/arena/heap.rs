//! The arena's heap: what is free, what is live and who holds what, as
//! bookkeeping only. Free blocks per zone, live allocations, the blocks
//! CUDA graphs hold, the frees whose fence is deferred, and the bytes
//! allocated; generic over the fence, with no backend and no mapping. The
//! arena's other half (`mapping.rs`, `sleep/`) maps and unmaps through its
//! `Region` and hands this heap the ranges it mapped; where a block may
//! not join its neighbour (a chunk's start under a map hook) the caller
//! passes those walls in.

use std::sync::Arc;

use super::blocks::{Blocks, Free, StreamKey};
use super::graph::{GraphPoolId, Graphs};
use super::owed::{Mark, Owed};
use super::Live;
use crate::backend::Uses;
use crate::region::Walls;

/// Requests up to this size go to the small zone, so that small, long-lived
/// blocks do not pin the chunks that large frees would give back (PyTorch
/// keeps a small pool apart for the same reason).
pub(super) const SMALL: usize = 1 << 20;

/// The most empty use lists a heap keeps for reuse.
const SPARE_USES: usize = 64;

/// See the module's documentation.
pub(super) struct Heap<F> {
    /// Bytes of live allocations, and what was asked for them.
    pub(super) allocated: usize,
    pub(super) requested: usize,
    /// Free blocks of the small zone (requests up to [`SMALL`]) and of the
    /// large zone.
    pub(super) zones: [Blocks<Mark<F>>; 2],
    /// Where the large zone starts: the small one is `[0, small_end)`.
    pub(super) small_end: usize,
    /// Live allocations by offset: a hash map, consulted at every alloc
    /// and free (with cold caches a tree costs several misses a call).
    pub(super) live: crate::hash::QuickMap<usize, Live<F>>,
    /// The blocks CUDA graphs hold, each with the graphs that reference
    /// it (see [`graph`](super::graph) for the rule).
    pub(super) graphs: Graphs<Mark<F>>,
    /// Frees whose fence is deferred, per stream (see [`owed`](super::owed)).
    pub(super) owed: Owed<F>,
    /// Empty use lists of freed allocations, for the next ones: one heap
    /// allocation (and with cold caches a few misses) fewer a call.
    pub(super) spare_uses: Vec<Arc<Uses<F>>>,
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

    /// The zone of a request of `size` bytes.
    pub(super) fn zone_of_size(size: usize) -> usize {
        usize::from(size > SMALL)
    }

    /// The zone `offset` lies in.
    pub(super) fn zone_of_offset(&self, offset: usize) -> usize {
        usize::from(offset >= self.small_end)
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

    /// The ranges graphs hold free, `(offset, bytes)`: allocated, for
    /// everything but the graph.
    pub(super) fn graph_held(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.graphs.ranges()
    }

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
}

#[cfg(test)]
mod tests {
    //! The heap alone, against a model of who holds each unit of memory:
    //! no backend, no mapping, the calls the arena makes.

    use proptest::prelude::*;

    use super::*;
    use crate::arena::blocks::NoWalls;
    use crate::order::FenceSet;

    /// The unit of the model: every size and offset is a multiple of it.
    const UNIT: usize = 64 << 10;
    /// 32 MiB: the small zone is its first eighth (4 MiB), as in an arena.
    const UNITS: usize = 512;

    #[derive(Clone, Debug)]
    enum Op {
        /// Fresh memory of `units` in zone `zone` (the lowest unmapped
        /// range there that fits), as growth maps it.
        Map { zone: usize, units: usize },
        /// A request of `units` (less `short` bytes asked for) on stream
        /// `s`, for graph `g` (0: none).
        Alloc {
            units: usize,
            short: usize,
            s: u64,
            g: u64,
        },
        /// Free the `i`th live allocation (modulo the count); `pending`:
        /// the block stays its stream's until settled.
        Free { i: usize, pending: bool },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0usize..2, 1usize..48).prop_map(|(zone, units)| Op::Map { zone, units }),
            (1usize..40, 0usize..1000, 0u64..3, 0u64..3)
                .prop_map(|(units, short, s, g)| Op::Alloc { units, short, s, g }),
            (any::<usize>(), any::<bool>()).prop_map(|(i, pending)| Op::Free { i, pending }),
        ]
    }

    /// Who holds a unit.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    enum Unit {
        Unmapped,
        Free,
        Live,
    }

    struct Model {
        units: Vec<Unit>,
        /// Live allocations: offset, size, requested, stream, graph.
        live: Vec<(usize, usize, usize, u64, u64)>,
    }

    impl Model {
        fn mark(&mut self, o: usize, n: usize, from: Unit, to: Unit) -> Result<(), String> {
            for u in &mut self.units[o / UNIT..(o + n) / UNIT] {
                if *u != from {
                    return Err(format!(
                        "unit at {o:#x}+{n:#x} was {u:?}, expected {from:?}"
                    ));
                }
                *u = to;
            }
            Ok(())
        }

        /// The lowest run of `units` unmapped units in `zone`.
        fn hole(&self, zone: usize, units: usize, small_end: usize) -> Option<usize> {
            let (lo, hi) = if zone == 0 {
                (0, small_end / UNIT)
            } else {
                (small_end / UNIT, UNITS)
            };
            (lo..hi.saturating_sub(units) + 1)
                .find(|&k| {
                    self.units[k..k + units]
                        .iter()
                        .all(|&u| u == Unit::Unmapped)
                })
                .map(|k| k * UNIT)
        }
    }

    fn check(heap: &Heap<u32>, model: &Model) -> Result<(), String> {
        let live: usize = model.live.iter().map(|l| l.1).sum();
        let requested: usize = model.live.iter().map(|l| l.2).sum();
        if (heap.allocated, heap.requested) != (live, requested) {
            return Err(format!(
                "allocated {} / requested {}, the model {live} / {requested}",
                heap.allocated, heap.requested
            ));
        }
        if heap.live.len() != model.live.len()
            || model
                .live
                .iter()
                .any(|l| heap.live.get(&l.0).map(|x| x.size) != Some(l.1))
        {
            return Err("the live allocations differ from the model's".into());
        }
        for g in 1..3u64 {
            let want = model.live.iter().filter(|l| l.4 == g).count();
            let got = heap.graphs.live_of(GraphPoolId(g));
            if got != want {
                return Err(format!("graph {g}: {got} live, the model {want}"));
            }
        }
        // Every free block lies in its zone, over units the model has free,
        // and together they are all of them: nothing lost, nothing twice.
        let mut seen = vec![false; UNITS];
        for (z, zone) in heap.zones.iter().enumerate() {
            for (o, f) in zone.iter() {
                let in_zone = if z == 0 {
                    o + f.size <= heap.small_end
                } else {
                    o >= heap.small_end
                };
                if !in_zone || o % UNIT != 0 || f.size % UNIT != 0 {
                    return Err(format!("zone {z}: block {o:#x}+{:#x}", f.size));
                }
                let units = o / UNIT..(o + f.size) / UNIT;
                for (k, s) in units.clone().zip(&mut seen[units]) {
                    if model.units[k] != Unit::Free || *s {
                        return Err(format!("block {o:#x}+{:#x} over unit {k}", f.size));
                    }
                    *s = true;
                }
            }
        }
        match (0..UNITS).find(|&k| (model.units[k] == Unit::Free) != seen[k]) {
            Some(k) => Err(format!("unit {k} is free in the model, in no block")),
            None if heap.spare_uses.len() > SPARE_USES => Err("too many spare use lists".into()),
            None => Ok(()),
        }
    }

    fn run(ops: Vec<Op>) -> Result<(), String> {
        let small_end = UNITS * UNIT / 8;
        let mut heap: Heap<u32> = Heap::new(small_end, true);
        let mut model = Model {
            units: vec![Unit::Unmapped; UNITS],
            live: Vec::new(),
        };
        for op in ops {
            match op {
                Op::Map { zone, units } => {
                    if let Some(at) = model.hole(zone, units, small_end) {
                        model.mark(at, units * UNIT, Unit::Unmapped, Unit::Free)?;
                        heap.insert_fresh(at, units * UNIT, &NoWalls);
                    }
                }
                Op::Alloc { units, short, s, g } => {
                    let size = units * UNIT;
                    let key = (0, s);
                    let z = Heap::<u32>::zone_of_size(size);
                    if let Some(o) = heap.zones[z].take(size, key) {
                        let graph = (g > 0).then_some(GraphPoolId(g));
                        model.mark(o, size, Unit::Free, Unit::Live)?;
                        let requested = size - short.min(size - 1);
                        heap.note_live(o, size, requested, key, graph);
                        model.live.push((o, size, requested, s, g));
                    }
                }
                Op::Free { i, pending } => {
                    if model.live.is_empty() {
                        continue;
                    }
                    let (o, size, requested, s, g) = model.live.swap_remove(i % model.live.len());
                    let l = heap
                        .live
                        .remove(&o)
                        .ok_or("freed an allocation the heap lost")?;
                    let graph = (g > 0).then_some(GraphPoolId(g));
                    heap.note_freed(size, requested, graph, &l.uses);
                    drop(l);
                    let free = Free {
                        size,
                        stream: pending.then_some((0, s)),
                        fences: FenceSet::default(),
                    };
                    heap.insert_free(o, free, &NoWalls);
                    model.mark(o, size, Unit::Live, Unit::Free)?;
                }
            }
            check(&heap, &model)?;
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(if cfg!(miri) { crate::miri_cases() } else { 256 }))]

        /// Hand-outs, frees and fresh memory keep the heap's free blocks,
        /// live allocations, graph counts and byte counts what the model
        /// says, in both zones.
        #[test]
        fn the_heap_matches_a_model_of_who_holds_each_unit(
            ops in proptest::collection::vec(op(), 1..if cfg!(miri) { 24 } else { 120 })
        ) {
            run(ops).map_err(TestCaseError::fail)?;
        }
    }
}
