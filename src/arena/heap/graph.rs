//! Memory kept for CUDA graphs: what a capture allocates, and what is freed
//! while a capture runs, belongs to the captured graphs until they are
//! gone, because every replay uses those addresses again.
//!
//! # The rule: graph references per block
//! Every block a graph may replay over carries the set of those graphs
//! (its *references*):
//! - an allocation made in graph g's capture is g's (`Live::graph`), and
//!   freed, its block keeps g's reference while g lives;
//! - a block freed while graph h's capture runs on a stream that used it
//!   (the caller says so with `Allocation::free_into_graph(h)`) gains h's
//!   reference, whichever graph (if any) it came from.
//!
//! A held block returns to circulation (the free index, with the fences of
//! the uses made outside any capture) only when its last reference goes:
//! every graph that held it released with
//! [`Arena::release_graph`](crate::Arena::release_graph), which the caller
//! makes once the graph and every executable made from it are destroyed and
//! their launches have finished. Until then nothing else takes it: not
//! another stream, not the free index, not an unmap, not the pool, not a
//! sleep.
//!
//! Within a capture, a block that only graph h references, freed on the
//! stream being captured with nothing else queued on it, may be taken
//! again by h's later allocations on that stream (the graph orders them as
//! the stream did). A block two graphs reference is never retaken: the
//! other graph's replays write it too.
//!
//! # One pool, several graphs
//! A [`GraphPoolId`] may name several graphs captured one after another,
//! as a PyTorch private pool shared by captures does (`pool=` in
//! `torch.cuda.graph`, CUDA graph trees): to the arena they are one graph
//! whose captures came in turns, so a later capture on a stream takes the
//! blocks an earlier one freed there. That is sound only under PyTorch's
//! contract for a shared pool, which the caller takes on by sharing an id:
//! the graphs are replayed in the order they were captured and never
//! concurrently. The memory stays held until the id's release, which the
//! caller makes once the last of its graphs is gone.
#![deny(unsafe_code)]

use std::collections::BTreeMap;

use crate::order::{FenceSet, StreamKey};

pub use crate::graph_id::GraphPoolId;

/// One block graphs hold, freed by its user.
#[derive(Debug)]
pub(in crate::arena) struct Held<F> {
    pub(in crate::arena) size: usize,
    /// The graphs that may replay over it: sorted, never empty.
    pub(in crate::arena) graphs: Vec<GraphPoolId>,
    /// The captured stream that may take it again within the capture: set
    /// for a block freed while its one stream was being captured (and no
    /// fence recorded) into the one graph that references it; `None` once
    /// anything else used it.
    pub(in crate::arena) reuse: Option<StreamKey>,
    /// Fences of uses made outside the capture (a graph's output freed
    /// after the capture): passed on to the free index at the release.
    pub(in crate::arena) fences: FenceSet<F>,
}

impl<F> Held<F> {
    /// Whether `other` may join it into one block: the same references,
    /// retakable by the same capture, neither fenced.
    fn joins(&self, other: &Held<F>) -> bool {
        self.reuse.is_some()
            && self.reuse == other.reuse
            && self.graphs == other.graphs
            && self.fences.is_empty()
            && other.fences.is_empty()
    }
}

/// The blocks graphs hold, and the graphs known: see the module's rule.
#[derive(Debug)]
pub(in crate::arena) struct Graphs<F> {
    /// Held blocks by offset; each lists the graphs that reference it.
    held: BTreeMap<usize, Held<F>>,
    /// Every graph known (allocated for, or freed into, and not released):
    /// how many of its allocations live.
    live: BTreeMap<GraphPoolId, usize>,
}

impl<F> Default for Graphs<F> {
    fn default() -> Self {
        Self {
            held: BTreeMap::new(),
            live: BTreeMap::new(),
        }
    }
}

impl<F> Graphs<F> {
    /// Whether no graph is known.
    #[cfg(test)]
    pub(in crate::arena) fn is_empty(&self) -> bool {
        self.live.is_empty()
    }

    /// Whether graph `g` is known (not released since it was last used).
    pub(in crate::arena) fn contains(&self, g: GraphPoolId) -> bool {
        self.live.contains_key(&g)
    }

    /// An allocation of `g`'s capture lives.
    pub(in crate::arena) fn note_live(&mut self, g: GraphPoolId) {
        *self.live.entry(g).or_default() += 1;
    }

    /// An allocation of `g`'s capture was freed.
    pub(in crate::arena) fn note_freed(&mut self, g: GraphPoolId) {
        if let Some(n) = self.live.get_mut(&g) {
            *n -= 1;
        }
    }

    /// Live allocations of `g`'s capture.
    #[cfg(test)]
    pub(in crate::arena) fn live_of(&self, g: GraphPoolId) -> usize {
        self.live.get(&g).copied().unwrap_or(0)
    }

    /// Bytes held free for the graphs (each block once).
    pub(in crate::arena) fn held_bytes(&self) -> usize {
        self.held.values().map(|h| h.size).sum()
    }

    /// The graphs known: each one's id, the bytes of the blocks it
    /// references and its live allocations.
    pub(in crate::arena) fn pools(&self) -> Vec<(GraphPoolId, usize, usize)> {
        self.live
            .iter()
            .map(|(&g, &live)| {
                let bytes = self
                    .held
                    .values()
                    .filter(|h| h.graphs.contains(&g))
                    .map(|h| h.size)
                    .sum();
                (g, bytes, live)
            })
            .collect()
    }

    /// Every held block, `(offset, block)`.
    pub(in crate::arena) fn blocks(&self) -> impl Iterator<Item = (usize, &Held<F>)> + '_ {
        self.held.iter().map(|(&o, h)| (o, h))
    }

    /// The ranges held, `(offset, bytes)`.
    pub(in crate::arena) fn ranges(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.held.iter().map(|(&o, h)| (o, h.size))
    }

    /// The best-fitting block of at least `size` bytes that the capture of
    /// stream `key` into `g` may take again (only `g` references it); its
    /// remainder stays held.
    pub(in crate::arena) fn take(
        &mut self,
        g: GraphPoolId,
        size: usize,
        key: StreamKey,
    ) -> Option<usize> {
        let (&o, _) = self
            .held
            .iter()
            .filter(|(_, h)| {
                h.reuse == Some(key) && h.graphs == [g] && h.fences.is_empty() && h.size >= size
            })
            .min_by_key(|(&o, h)| (h.size, o))?;
        let h = self.held.remove(&o).expect("found");
        if h.size > size {
            self.held.insert(
                o + size,
                Held {
                    size: h.size - size,
                    ..h
                },
            );
        }
        Some(o)
    }

    /// The block held at exactly `offset`, of at least `size` bytes, taken
    /// out to live again (see [`Arena::retake`](crate::Arena::retake)): the
    /// graphs that held it and its fences come with it. A larger unfenced
    /// block (blocks of one capture joined) leaves its remainder held; a
    /// fenced one comes whole. `None` if no block starts there or it is
    /// too small.
    pub(in crate::arena) fn retake(&mut self, offset: usize, size: usize) -> Option<Held<F>> {
        if self.held.get(&offset)?.size < size {
            return None;
        }
        let mut h = self.held.remove(&offset).expect("found");
        if h.size > size && h.fences.is_empty() {
            self.held.insert(
                offset + size,
                Held {
                    size: h.size - size,
                    graphs: h.graphs.clone(),
                    reuse: h.reuse,
                    fences: FenceSet::default(),
                },
            );
            h.size = size;
        }
        Some(h)
    }

    /// Holds `h` at `offset` (its graphs become known), joined with
    /// touching blocks it [joins](Held::joins), within `zone` (the free
    /// index's zones never share a block).
    pub(in crate::arena) fn put(
        &mut self,
        mut offset: usize,
        mut h: Held<F>,
        zone: std::ops::Range<usize>,
    ) {
        debug_assert!(!h.graphs.is_empty(), "a held block names its graphs");
        h.graphs.sort_unstable();
        h.graphs.dedup();
        if h.graphs.len() > 1 {
            // Another graph's replays write it: never retaken.
            h.reuse = None;
        }
        for &g in &h.graphs {
            self.live.entry(g).or_default();
        }
        if let Some((&lo, left)) = self.held.range(..offset).next_back() {
            if lo + left.size == offset && lo >= zone.start && left.joins(&h) {
                let left = self.held.remove(&lo).expect("found");
                offset = lo;
                h.size += left.size;
            }
        }
        let end = offset + h.size;
        if let Some(right) = self.held.get(&end) {
            if end + right.size <= zone.end && h.joins(right) {
                let right = self.held.remove(&end).expect("found");
                h.size += right.size;
            }
        }
        self.held.insert(offset, h);
    }

    /// Graph `g` is gone: its reference leaves every block; the blocks no
    /// other graph references are returned, `(offset, block)`, for the
    /// free index. `None` if `g` was not known.
    pub(in crate::arena) fn release(&mut self, g: GraphPoolId) -> Option<Vec<(usize, Held<F>)>> {
        self.live.remove(&g)?;
        let mut gone = Vec::new();
        let touched: Vec<usize> = self
            .held
            .iter()
            .filter(|(_, h)| h.graphs.contains(&g))
            .map(|(&o, _)| o)
            .collect();
        for o in touched {
            let h = self.held.get_mut(&o).expect("listed");
            h.graphs.retain(|&x| x != g);
            if h.graphs.is_empty() {
                gone.push((o, self.held.remove(&o).expect("listed")));
            }
        }
        Some(gone)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G1: GraphPoolId = GraphPoolId(1);
    const G2: GraphPoolId = GraphPoolId(2);

    fn held(size: usize, graphs: &[GraphPoolId], reuse: Option<StreamKey>) -> Held<u32> {
        Held {
            size,
            graphs: graphs.to_vec(),
            reuse,
            fences: FenceSet::default(),
        }
    }

    #[test]
    fn a_capture_takes_back_only_its_own_streams_unfenced_blocks() {
        let (s, t) = ((1, 1), (1, 2));
        let mut p = Graphs::<u32>::default();
        p.put(0, held(256, &[G1], Some(s)), 0..1 << 20);
        p.put(256, held(256, &[G1], Some(s)), 0..1 << 20);
        assert_eq!(p.held.len(), 1, "touching blocks of one stream join");
        p.put(4096, held(512, &[G1], Some(t)), 0..1 << 20);
        p.put(8192, held(512, &[G1], None), 0..1 << 20);
        assert_eq!(
            p.take(G1, 100, (9, 9)),
            None,
            "another stream takes nothing"
        );
        assert_eq!(p.take(G2, 100, s), None, "another graph takes nothing");
        assert_eq!(p.take(G1, 512, s), Some(0));
        assert_eq!(p.held_bytes(), 1024, "the whole 512 of s went");
        assert_eq!(p.take(G1, 600, t), None, "too small");
        assert_eq!(p.take(G1, 256, t), Some(4096));
        assert_eq!(
            p.held.get(&4352).map(|h| h.size),
            Some(256),
            "the rest stays held"
        );
        assert_eq!(
            p.take(G1, 1, s),
            None,
            "a block freed outside the capture is never retaken"
        );
        // Blocks on both sides of a zone's end never join.
        let mut q = Graphs::<u32>::default();
        q.put(0, held(256, &[G1], Some(s)), 0..256);
        q.put(256, held(256, &[G1], Some(s)), 256..1024);
        assert_eq!(q.held.len(), 2);
    }

    #[test]
    fn a_block_two_graphs_reference_goes_back_with_the_last_of_them() {
        let s = (1, 1);
        for first in [G1, G2] {
            let mut p = Graphs::<u32>::default();
            // Made in G1's capture, freed in G2's: both replay over it.
            p.put(0, held(4096, &[G2, G1], Some(s)), 0..1 << 20);
            // G2's own block beside it does not join (other references).
            p.put(4096, held(4096, &[G2], Some(s)), 0..1 << 20);
            assert_eq!(p.held.len(), 2);
            assert_eq!(p.take(G2, 4096, s), Some(4096), "G2's own block");
            assert_eq!(p.take(G2, 1, s), None, "the shared block is never retaken");
            assert_eq!(p.take(G1, 1, s), None);
            let gone = p.release(first).expect("known");
            assert!(gone.is_empty(), "the other graph still replays over it");
            assert_eq!(p.held_bytes(), 4096);
            let other = if first == G1 { G2 } else { G1 };
            assert_eq!(p.pools(), vec![(other, 4096, 0)]);
            let gone = p.release(other).expect("known");
            assert_eq!(gone.len(), 1, "the last reference went");
            assert_eq!((gone[0].0, gone[0].1.size), (0, 4096));
            assert!(p.is_empty() && p.held_bytes() == 0);
            assert!(p.release(other).is_none(), "released twice: unknown");
        }
    }
}
