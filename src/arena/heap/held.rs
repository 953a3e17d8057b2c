//! The heap's side of CUDA graphs (see [`graph`](super::graph) for the
//! rule): a graph's allocations, the blocks graphs hold once freed, their
//! reuse within a capture, retakes, and a graph's release.

use super::*;
use graph::Held;

/// What a free learns of the allocation it frees ([`Heap::take_live`]).
pub(in crate::arena) struct Freed<F> {
    /// The graph whose pool it came from (if not released since).
    pub(in crate::arena) graph: Option<GraphPoolId>,
    /// The graphs, still known, that keep its block: the one it came from,
    /// and those it was retaken from.
    pub(in crate::arena) keepers: Vec<GraphPoolId>,
    /// The fences of a retaken block's earlier life, carried on.
    pub(in crate::arena) fences: FenceSet<Mark<F>>,
}

/// A block a graph's release lets go of: `(offset, bytes, the fences of
/// the uses made after the capture)`.
pub(in crate::arena) type Released<F> = (usize, usize, FenceSet<Mark<F>>);

impl<F> Heap<F> {
    /// The live allocation at `offset` is freed: it leaves the live set
    /// (nothing is counted off: see [`note_freed`](Heap::note_freed)).
    pub(in crate::arena) fn take_live(&mut self, offset: usize) -> Freed<F> {
        let Some(l) = self.live.remove(&offset) else {
            return Freed {
                graph: None,
                keepers: Vec::new(),
                fences: FenceSet::default(),
            };
        };
        let mut keepers: Vec<GraphPoolId> = l
            .graph
            .filter(|&g| self.graphs.contains(g))
            .into_iter()
            .collect();
        let mut fences = FenceSet::default();
        if let Some(r) = l.retaken {
            keepers.extend(r.graphs.into_iter().filter(|&g| self.graphs.contains(g)));
            fences = r.fences;
        }
        Freed {
            graph: l.graph,
            keepers,
            fences,
        }
    }

    /// The freed block `[offset, offset + size)` is held for `graphs`
    /// until the last of them is released, behind `fences`; `reuse`: the
    /// captured stream that may take it again within its capture.
    pub(in crate::arena) fn hold(
        &mut self,
        offset: usize,
        size: usize,
        graphs: Vec<GraphPoolId>,
        reuse: Option<StreamKey>,
        fences: FenceSet<Mark<F>>,
    ) {
        let zone = self.zone_range(self.zone_of_offset(offset), usize::MAX);
        let held = Held {
            size,
            graphs,
            reuse,
            fences,
        };
        self.graphs.put(offset, held, zone);
    }

    /// The best-fitting block that graph `g`'s capture of stream `key` may
    /// take again (see [`Graphs::take`]).
    pub(in crate::arena) fn take_for_graph(
        &mut self,
        g: GraphPoolId,
        size: usize,
        key: StreamKey,
    ) -> Option<usize> {
        self.graphs.take(g, size, key)
    }

    /// The block graphs hold at exactly `offset`, of at least `size`
    /// bytes, lives again for `requested` bytes on `key`, remembering the
    /// graphs that held it and its fences (see
    /// [`Arena::retake`](crate::Arena::retake)). Its size and its list of
    /// uses; `None`, changing nothing, if no such block is held.
    pub(in crate::arena) fn retake(
        &mut self,
        offset: usize,
        size: usize,
        requested: usize,
        key: StreamKey,
    ) -> Option<(usize, Arc<Uses<F>>)> {
        let h = self.graphs.retake(offset, size)?;
        let uses = self.note_live(offset, h.size, requested, key, None);
        if let Some(l) = self.live.get_mut(&offset) {
            l.retaken = Some(Box::new(Retaken {
                graphs: h.graphs,
                fences: h.fences,
            }));
        }
        Some((h.size, uses))
    }

    /// Graph `g` is gone: its reference leaves every block and live
    /// allocation (those it made are ordinary ones from now on: a new graph
    /// given its id is another graph). The blocks no other graph holds,
    /// `(offset, bytes, fences of uses after the capture)`, for the free
    /// blocks; `None` if `g` was not known.
    pub(in crate::arena) fn release_graph(&mut self, g: GraphPoolId) -> Option<Vec<Released<F>>> {
        let gone = self.graphs.release(g)?;
        for l in self.live.values_mut() {
            if l.graph == Some(g) {
                l.graph = None;
            }
            if let Some(r) = l.retaken.as_mut() {
                r.graphs.retain(|&x| x != g);
            }
        }
        Some(
            gone.into_iter()
                .map(|(o, h)| (o, h.size, h.fences))
                .collect(),
        )
    }

    /// The graph pools alive: each one's id, bytes held free and live
    /// allocations.
    pub(in crate::arena) fn graph_pools(&self) -> Vec<(GraphPoolId, usize, usize)> {
        self.graphs.pools()
    }

    /// The ranges graphs hold free, `(offset, bytes)`: allocated, for
    /// everything but the graph.
    pub(in crate::arena) fn graph_held(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.graphs.ranges()
    }

    /// Every block graphs hold free: `(offset, bytes, a graph holding it)`.
    pub(in crate::arena) fn held_blocks(
        &self,
    ) -> impl Iterator<Item = (usize, usize, Option<GraphPoolId>)> + '_ {
        self.graphs
            .blocks()
            .map(|(o, h)| (o, h.size, h.graphs.first().copied()))
    }

    /// Bytes graphs hold free (each block once).
    pub(in crate::arena) fn held_bytes(&self) -> usize {
        self.graphs.held_bytes()
    }
}
