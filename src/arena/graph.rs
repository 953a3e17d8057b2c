//! Memory kept for CUDA graphs: what a capture allocates, and what is freed
//! while a capture runs, belongs to the captured graph until the graph is
//! gone, because every replay uses those addresses again.
//!
//! A graph pool holds the blocks its graph's allocations free. Within the
//! capture, a block freed on a stream being captured is reused by the same
//! capture's later allocations on that stream (the graph orders them as the
//! stream did). Nothing else takes a graph's blocks: not another stream, not
//! the arena's free index, not an unmap, not the pool, until
//! [`Arena::release_graph`](crate::Arena::release_graph) says the graph and
//! every executable made from it are destroyed and their launches have
//! finished. Then the blocks join the free index, with the fences of the
//! uses made after the capture.
#![deny(unsafe_code)]

use std::collections::BTreeMap;

use crate::order::{FenceSet, StreamKey};

pub use crate::graph_id::GraphPoolId;

/// One block a graph holds, freed by its user.
#[derive(Debug)]
pub(super) struct Held<F> {
    pub(super) size: usize,
    /// The captured stream that may take it again within the capture: set
    /// for a block freed while its one stream was being captured (and no
    /// fence recorded); `None` once anything else used it.
    pub(super) reuse: Option<StreamKey>,
    /// Fences of uses made outside the capture (a graph's output freed
    /// after the capture): passed on to the free index at the release.
    pub(super) fences: FenceSet<F>,
}

/// The blocks one graph holds, and how many of its allocations live.
#[derive(Debug)]
pub(super) struct GraphPool<F> {
    pub(super) held: BTreeMap<usize, Held<F>>,
    pub(super) live: usize,
}

impl<F> Default for GraphPool<F> {
    fn default() -> Self {
        Self {
            held: BTreeMap::new(),
            live: 0,
        }
    }
}

impl<F> GraphPool<F> {
    /// Bytes held free for the graph.
    pub(super) fn held_bytes(&self) -> usize {
        self.held.values().map(|h| h.size).sum()
    }

    /// The best-fitting block of at least `size` bytes that the capture of
    /// stream `key` may take again; its remainder stays held.
    pub(super) fn take(&mut self, size: usize, key: StreamKey) -> Option<usize> {
        let (&o, _) = self
            .held
            .iter()
            .filter(|(_, h)| h.reuse == Some(key) && h.fences.is_empty() && h.size >= size)
            .min_by_key(|(&o, h)| (h.size, o))?;
        let h = self.held.remove(&o).expect("found");
        if h.size > size {
            self.held.insert(
                o + size,
                Held {
                    size: h.size - size,
                    reuse: h.reuse,
                    fences: h.fences,
                },
            );
        }
        Some(o)
    }

    /// Holds `h` at `offset`, joined with touching blocks the same capture
    /// may reuse on the same stream (none of them fenced), within `zone`
    /// (the free index's zones never share a block).
    pub(super) fn put(&mut self, mut offset: usize, mut h: Held<F>, zone: std::ops::Range<usize>) {
        let joins = |a: &Held<F>, b: &Held<F>| {
            a.reuse.is_some() && a.reuse == b.reuse && a.fences.is_empty() && b.fences.is_empty()
        };
        if let Some((&lo, left)) = self.held.range(..offset).next_back() {
            if lo + left.size == offset && lo >= zone.start && joins(left, &h) {
                let left = self.held.remove(&lo).expect("found");
                offset = lo;
                h.size += left.size;
            }
        }
        let end = offset + h.size;
        if let Some(right) = self.held.get(&end) {
            if end + right.size <= zone.end && joins(&h, right) {
                let right = self.held.remove(&end).expect("found");
                h.size += right.size;
            }
        }
        self.held.insert(offset, h);
    }

    /// The ranges held, `(offset, bytes)`.
    pub(super) fn ranges(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.held.iter().map(|(&o, h)| (o, h.size))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(size: usize, reuse: Option<StreamKey>) -> Held<u32> {
        Held {
            size,
            reuse,
            fences: FenceSet::default(),
        }
    }

    #[test]
    fn a_capture_takes_back_only_its_own_streams_unfenced_blocks() {
        let (s, t) = ((1, 1), (1, 2));
        let mut p = GraphPool::<u32>::default();
        p.put(0, held(256, Some(s)), 0..1 << 20);
        p.put(256, held(256, Some(s)), 0..1 << 20);
        assert_eq!(p.held.len(), 1, "touching blocks of one stream join");
        p.put(4096, held(512, Some(t)), 0..1 << 20);
        p.put(8192, held(512, None), 0..1 << 20);
        assert_eq!(p.take(100, (9, 9)), None, "another stream takes nothing");
        assert_eq!(p.take(512, s), Some(0));
        assert_eq!(p.held_bytes(), 1024, "the whole 512 of s went");
        assert_eq!(p.take(600, t), None, "too small");
        assert_eq!(p.take(256, t), Some(4096));
        assert_eq!(
            p.held.get(&4352).map(|h| h.size),
            Some(256),
            "the rest stays held"
        );
        assert_eq!(
            p.take(1, s),
            None,
            "a block freed outside the capture is never retaken"
        );
        // Blocks on both sides of a zone's end never join.
        let mut q = GraphPool::<u32>::default();
        q.put(0, held(256, Some(s)), 0..256);
        q.put(256, held(256, Some(s)), 256..1024);
        assert_eq!(q.held.len(), 2);
    }
}
