//! The arena's free blocks: pure, safe bookkeeping of the free bytes inside
//! mapped memory, with best-fit search and stream-ordered reuse.
//!
//! A block freed on stream S carries S's key and the fences recorded when it
//! was freed. S may reuse it at once (its later work is queued after the
//! free); any other stream only once every fence has passed ("settled").
//! Adjacent free blocks merge when both are settled, or both belong to the
//! same stream; [`Blocks::joining`] blocks also merge a stream's pending
//! block with settled neighbours. When a stream finds no block,
//! [`Blocks::coalesce`] joins those too. Generic over the fence type, so it is tested with plain
//! values.

use std::collections::{BTreeMap, BTreeSet};

use crate::order::FenceSet;
pub(crate) use crate::order::StreamKey;

/// One free block.
#[derive(Debug)]
pub(crate) struct Free<F> {
    pub(crate) size: usize,
    /// The one stream that may reuse it before its fences pass; `None` when
    /// settled, or when several streams used it (then none may).
    pub(crate) stream: Option<StreamKey>,
    /// What must pass before another stream may reuse it: at most one
    /// fence per stream, the latest by the stream's sequence number (it
    /// covers the earlier ones).
    pub(crate) fences: FenceSet<F>,
}

impl<F> Free<F> {
    pub(crate) fn settled(&self) -> bool {
        self.fences.is_empty()
    }

    /// May `key`'s stream take this block now?
    fn usable_by(&self, key: StreamKey) -> bool {
        self.settled() || self.stream == Some(key)
    }

    /// Whether two touching blocks become one as they are inserted: both
    /// settled, or both pending on the same stream; with `join_settled`,
    /// also a settled one and a stream's pending one.
    ///
    /// A settled block tagged with a stream (fresh memory mapped for it)
    /// joins only that stream's pending blocks: joined with another
    /// stream's, it would become that stream's alone until the fences pass,
    /// and the stream it was mapped for could not take it.
    fn mergeable(&self, other: &Free<F>, join_settled: bool) -> bool {
        let same_stream = self.stream.is_some() && self.stream == other.stream;
        let joins = |settled: &Free<F>, pending: &Free<F>| {
            join_settled && pending.stream.is_some() && settled.stream.is_none()
        };
        match (self.settled(), other.settled()) {
            (true, true) => true,
            (false, false) => same_stream,
            (true, false) => same_stream || joins(self, other),
            (false, true) => same_stream || joins(other, self),
        }
    }
}

/// The free blocks, by offset and by size.
#[derive(Debug)]
pub(crate) struct Blocks<F> {
    by_offset: BTreeMap<usize, Free<F>>,
    by_size: BTreeSet<(usize, usize)>,
    free_bytes: usize,
    /// Bytes of blocks whose fences have not all passed (PyTorch's active
    /// but not allocated).
    pending_bytes: usize,
    /// Whether a stream's pending block joins settled neighbours as it is
    /// inserted (see [`Blocks::joining`]).
    join_settled: bool,
}

impl<F> Default for Blocks<F> {
    fn default() -> Self {
        Self {
            by_offset: BTreeMap::new(),
            by_size: BTreeSet::new(),
            free_bytes: 0,
            pending_bytes: 0,
            join_settled: false,
        }
    }
}

impl<F> Blocks<F> {
    /// Blocks where a stream's pending block joins its settled neighbours
    /// as it is inserted (as PyTorch's per-stream blocks merge on free): the
    /// stream may use the whole at once, other streams once the fences pass.
    /// Less fragmentation for memory that stays mapped; but the settled part
    /// cannot be unmapped until then, so an arena that gives free chunks
    /// back before mapping keeps the two apart (and joins them only on a
    /// miss, [`Blocks::coalesce`]).
    pub(crate) fn joining() -> Self {
        Self {
            join_settled: true,
            ..Self::default()
        }
    }

    #[cfg(test)]
    pub(crate) fn free_bytes(&self) -> usize {
        self.free_bytes
    }

    /// Bytes of free blocks whose fences have not all passed.
    pub(crate) fn pending_bytes(&self) -> usize {
        self.pending_bytes
    }

    /// Whether any block waits for a fence.
    pub(crate) fn any_pending(&self) -> bool {
        self.pending_bytes > 0
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (usize, &Free<F>)> + '_ {
        self.by_offset.iter().map(|(&o, f)| (o, f))
    }

    /// True if one free block (a settled one, with `settled`) covers
    /// `[offset, offset + size)`.
    pub(crate) fn covers(&self, offset: usize, size: usize, settled: bool) -> bool {
        self.by_offset
            .range(..=offset)
            .next_back()
            .is_some_and(|(&o, f)| o + f.size >= offset + size && (!settled || f.settled()))
    }

    /// The free block that ends exactly at `end`, if any.
    pub(crate) fn ending_at(&self, end: usize) -> Option<(usize, &Free<F>)> {
        self.by_offset
            .range(..end)
            .next_back()
            .filter(|(&o, f)| o + f.size == end)
            .map(|(&o, f)| (o, f))
    }

    fn unlink(&mut self, offset: usize) -> Option<Free<F>> {
        let f = self.by_offset.remove(&offset)?;
        self.by_size.remove(&(f.size, offset));
        self.free_bytes -= f.size;
        if !f.settled() {
            self.pending_bytes -= f.size;
        }
        Some(f)
    }

    fn link(&mut self, offset: usize, f: Free<F>) {
        self.by_size.insert((f.size, offset));
        self.free_bytes += f.size;
        if !f.settled() {
            self.pending_bytes += f.size;
        }
        self.by_offset.insert(offset, f);
    }

    /// Adds a free block (not overlapping any), merging it with mergeable
    /// neighbours that touch it.
    pub(crate) fn insert(&mut self, offset: usize, f: Free<F>) {
        self.insert_tagged(offset, f, false);
    }

    /// Adds fresh memory mapped for stream `key` (settled, tagged with
    /// `key`): merged with neighbours as [`insert`](Self::insert) does, but
    /// what it merges into stays tagged with `key` while settled, so that it
    /// never joins another stream's pending block and `key` can take it.
    pub(crate) fn insert_fresh(&mut self, offset: usize, size: usize, key: StreamKey) {
        let f = Free {
            size,
            stream: Some(key),
            fences: FenceSet::default(),
        };
        self.insert_tagged(offset, f, true);
    }

    fn insert_tagged(&mut self, mut offset: usize, mut f: Free<F>, keep_tag: bool) {
        debug_assert!(f.size > 0);
        let tag = f.stream;
        // Tags matter only where settled blocks join pending ones as they
        // are inserted; elsewhere merges drop them (see `merge`).
        let keep_tag = keep_tag && self.join_settled;
        let retag = |m: &mut Free<F>| {
            if keep_tag && m.settled() {
                m.stream = tag;
            }
        };
        if let Some((lo, left)) = self.ending_at(offset) {
            if left.mergeable(&f, self.join_settled) {
                let left = self.unlink(lo).expect("just found");
                offset = lo;
                f = merge(left, f, self.join_settled);
                retag(&mut f);
            }
        }
        let end = offset + f.size;
        if self
            .by_offset
            .get(&end)
            .is_some_and(|r| f.mergeable(r, self.join_settled))
        {
            let right = self.unlink(end).expect("just found");
            f = merge(f, right, self.join_settled);
            retag(&mut f);
        }
        self.link(offset, f);
    }

    /// The best-fitting block of at least `size` bytes that stream `key` may
    /// use now; taken out, its remainder (past `size`) kept free.
    pub(crate) fn take(&mut self, size: usize, key: StreamKey) -> Option<usize> {
        self.take_sparing(size, key, |_| false)
    }

    /// [`take`](Self::take), but a block for which `spare(end)` holds (one
    /// that ends where more memory can be mapped) is taken only if no other
    /// fits: it is kept to grow into.
    pub(crate) fn take_sparing(
        &mut self,
        size: usize,
        key: StreamKey,
        spare: impl Fn(usize) -> bool,
    ) -> Option<usize> {
        let mut fallback = None;
        let mut found = None;
        for &(s, o) in self.by_size.range((size, 0)..) {
            if !self.by_offset[&o].usable_by(key) {
                continue;
            }
            if spare(o + s) {
                fallback.get_or_insert(o);
            } else {
                found = Some(o);
                break;
            }
        }
        let offset = found.or(fallback)?;
        let f = self.unlink(offset).expect("indexed");
        if f.size > size {
            let rest = Free {
                size: f.size - size,
                stream: f.stream,
                fences: f.fences,
            };
            self.link(offset + size, rest);
        }
        Some(offset)
    }

    /// Joins each of `key`'s pending blocks with its settled neighbours, so
    /// that `key` may use them as one block at once (other streams once the
    /// fences pass). For when `key` finds no block that fits and blocks are
    /// not [joining](Self::joining) as they are inserted: the GPU lags the
    /// CPU, so free blocks settle in patches, and a large request may fit
    /// only across a settled and a pending neighbour (a conv net trained on
    /// one stream on an H100 mapped 4.1 GiB for a 3.1 GiB peak without
    /// this; 3.3 GiB when every fence had passed). Returns how many joined.
    pub(crate) fn coalesce(&mut self, key: StreamKey) -> usize {
        let joinable = |a: &Free<F>, b: &Free<F>| {
            (a.settled() && b.stream == Some(key) && !b.settled())
                || (b.settled() && a.stream == Some(key) && !a.settled())
        };
        let mut pairs = Vec::new();
        let mut prev: Option<(usize, &Free<F>)> = None;
        for (&o, f) in &self.by_offset {
            if let Some((po, p)) = prev {
                if po + p.size == o && joinable(p, f) {
                    pairs.push(po);
                }
            }
            prev = Some((o, f));
        }
        // Right to left, so each left offset still names a block.
        let mut joined = 0;
        for &left in pairs.iter().rev() {
            let Some(l) = self.by_offset.get(&left) else {
                continue;
            };
            let right = left + l.size;
            let (Some(l), Some(r)) = (self.unlink(left), self.unlink(right)) else {
                unreachable!("both blocks were listed");
            };
            self.link(left, merge(l, r, self.join_settled));
            joined += 1;
        }
        joined
    }

    /// Marks every block whose fences `done` says have passed as settled,
    /// and merges settled neighbours. Returns how many settled.
    pub(crate) fn settle(&mut self, mut done: impl FnMut(&F) -> bool) -> usize {
        let ready: Vec<usize> = self
            .by_offset
            .iter()
            .filter(|(_, f)| !f.settled() && f.fences.iter().all(|x| done(&x.fence)))
            .map(|(&o, _)| o)
            .collect();
        // All out first: inserting one may merge it with a neighbour that
        // is also ready.
        let unlinked: Vec<(usize, Free<F>)> = ready
            .iter()
            .map(|&o| (o, self.unlink(o).expect("listed")))
            .collect();
        for (o, mut f) in unlinked {
            f.fences.clear();
            f.stream = None;
            self.insert(o, f);
        }
        ready.len()
    }

    /// Removes `[offset, offset + size)` from the free space: it must lie
    /// within one settled block (the caller unmaps it). Returns false, and
    /// changes nothing, otherwise.
    pub(crate) fn carve(&mut self, offset: usize, size: usize) -> bool {
        let Some((&o, f)) = self.by_offset.range(..=offset).next_back() else {
            return false;
        };
        if !f.settled() || o + f.size < offset + size {
            return false;
        }
        let f = self.unlink(o).expect("found");
        if offset > o {
            self.link(
                o,
                Free {
                    size: offset - o,
                    stream: None,
                    fences: FenceSet::default(),
                },
            );
        }
        let end = offset + size;
        if o + f.size > end {
            self.link(
                end,
                Free {
                    size: o + f.size - end,
                    stream: None,
                    fences: FenceSet::default(),
                },
            );
        }
        true
    }

    /// Checks the indexes agree and no blocks overlap or could have merged.
    #[cfg(test)]
    pub(crate) fn check(&self) -> Result<(), String> {
        let mut end = 0;
        let mut total = 0;
        let mut prev: Option<(usize, &Free<F>)> = None;
        for (&o, f) in &self.by_offset {
            if o < end || f.size == 0 {
                return Err(format!("block at {o:#x} overlaps or is empty"));
            }
            if !self.by_size.contains(&(f.size, o)) {
                return Err(format!("block at {o:#x} missing from the size index"));
            }
            if let Some((po, p)) = prev {
                if po + p.size == o && p.mergeable(f, self.join_settled) {
                    return Err(format!("blocks at {po:#x} and {o:#x} should have merged"));
                }
            }
            end = o + f.size;
            total += f.size;
            prev = Some((o, f));
        }
        if self.by_size.len() != self.by_offset.len() || total != self.free_bytes {
            return Err("index sizes or the byte count disagree".into());
        }
        let pending: usize = self
            .iter()
            .filter(|(_, f)| !f.settled())
            .map(|(_, f)| f.size)
            .sum();
        if pending != self.pending_bytes {
            return Err(format!(
                "pending bytes {} counted as {}",
                pending, self.pending_bytes
            ));
        }
        Ok(())
    }
}

/// `left` and `right` as one block, with one fence per stream: the later
/// by sequence number, whichever block it came from. The stream that may
/// reuse the whole before its fences pass is the one every pending part
/// allows (a settled part restricts nothing); none if they differ.
fn merge<F>(mut left: Free<F>, right: Free<F>, keep_tags: bool) -> Free<F> {
    let stream = match (left.settled(), right.settled()) {
        (false, false) if left.stream == right.stream => left.stream,
        (false, false) => None,
        (false, true) => left.stream,
        (true, false) => right.stream,
        // Settled: usable by any stream. The tag (fresh memory's stream)
        // says which pending neighbour it joins: kept where settled blocks
        // join pending ones as they are inserted, so that fresh memory is
        // not taken over by another stream's pending block; dropped
        // otherwise, where a tag would only keep settled memory from going
        // back to the pool.
        (true, true) if keep_tags => left.stream.or(right.stream),
        (true, true) => None,
    };
    left.size += right.size;
    left.fences.merge(right.fences);
    left.stream = stream;
    left
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const S1: StreamKey = (1, 1);
    const S2: StreamKey = (1, 2);

    /// Fences whose value is also their sequence number.
    fn fs(v: &[(StreamKey, u32)]) -> FenceSet<u32> {
        v.iter()
            .map(|&(key, x)| crate::order::Stamped {
                key,
                seq: u64::from(x),
                fence: x,
            })
            .collect()
    }

    fn listed(f: &FenceSet<u32>) -> Vec<(StreamKey, u32)> {
        f.iter().map(|s| (s.key, s.fence)).collect()
    }

    fn settled(size: usize) -> Free<u32> {
        Free {
            size,
            stream: None,
            fences: FenceSet::default(),
        }
    }

    /// The block freed last carries the fence that covers the merged block,
    /// whichever side it merges on: keeping the older one would let the
    /// block settle (and its chunk be unmapped) while the newer free's work
    /// still runs.
    #[test]
    fn a_merge_keeps_the_newest_fence_on_either_side() {
        for (first, second) in [(0usize, 16usize), (16, 0)] {
            let mut b = Blocks::<u32>::default();
            b.insert(
                first,
                Free {
                    size: 16,
                    stream: Some(S1),
                    fences: fs(&[(S1, 1)]),
                },
            );
            b.insert(
                second,
                Free {
                    size: 16,
                    stream: Some(S1),
                    fences: fs(&[(S1, 2)]),
                },
            );
            let (_, f) = b.iter().next().unwrap();
            assert_eq!(f.size, 32);
            assert_eq!(listed(&f.fences), vec![(S1, 2)], "freed second at {second}");
            assert_eq!(
                b.settle(|&x| x == 1),
                0,
                "the older fence passing settles nothing"
            );
        }
    }

    /// The GPU lags the CPU: of two neighbours freed on S1, one has settled
    /// and one not. Coalesced, S1 gets both as one block (before, it could
    /// not: a conv net mapped 1.3x its peak), other streams only once the
    /// fence passes.
    #[test]
    fn a_settled_block_joins_a_streams_pending_neighbour() {
        for settled_first in [true, false] {
            let mut b = Blocks::<u32>::default();
            let pending = || Free {
                size: 16,
                stream: Some(S1),
                fences: fs(&[(S1, 7)]),
            };
            let (s_at, p_at) = if settled_first { (0, 16) } else { (16, 0) };
            b.insert(s_at, settled(16));
            b.insert(p_at, pending());
            assert_eq!(b.check(), Ok(()));
            assert_eq!(b.take(32, S1), None, "two blocks as inserted");
            assert_eq!(b.coalesce(S2), 0, "nothing of S2's to join");
            assert_eq!(b.coalesce(S1), 1);
            assert_eq!(b.iter().count(), 1, "one block");
            assert_eq!(b.take(32, S2), None, "S2 waits for S1's fence");
            assert_eq!(b.take(32, S1), Some(0), "S1 takes both at once");
            b.insert(s_at, settled(16));
            b.insert(p_at, pending());
            b.coalesce(S1);
            assert_eq!(b.settle(|&x| x == 7), 1);
            assert_eq!(b.take(32, S2), Some(0), "then anyone may");
        }
    }

    /// RT-3: pending(S1, older) | settled | pending(S1, newer), coalesced
    /// for S1: the joined block keeps S1's newer fence, so the older one
    /// passing settles nothing (before, it kept the older and handed the
    /// newer free's bytes to S2).
    #[test]
    fn coalesce_keeps_the_newest_fence_of_the_stream() {
        let mut b = Blocks::<u32>::default();
        let pending = |x| Free {
            size: 16,
            stream: Some(S1),
            fences: fs(&[(S1, x)]),
        };
        b.insert(0, pending(1));
        b.insert(16, settled(16));
        b.insert(32, pending(3));
        assert_eq!(b.coalesce(S1), 2);
        let (_, f) = b.iter().next().unwrap();
        assert_eq!((f.size, listed(&f.fences)), (48, vec![(S1, 3)]));
        assert_eq!(b.settle(|&x| x == 1), 0);
        assert_eq!(b.take(48, S2), None, "S2 waits for S1's newer free");
        assert_eq!(b.settle(|&x| x <= 3), 1);
        assert_eq!(b.take(48, S2), Some(0));
    }

    /// RT-4: the block freed later on the stream may be inserted first (two
    /// threads); the merge still keeps the later fence, by number.
    #[test]
    fn insertion_order_does_not_decide_which_fence_stays() {
        for (first, second) in [((16, 5), (0, 4)), ((0, 5), (16, 4))] {
            let mut b = Blocks::<u32>::default();
            for (at, x) in [first, second] {
                b.insert(
                    at,
                    Free {
                        size: 16,
                        stream: Some(S1),
                        fences: fs(&[(S1, x)]),
                    },
                );
            }
            let (_, f) = b.iter().next().unwrap();
            assert_eq!(listed(&f.fences), vec![(S1, 5)]);
        }
    }

    /// Joining blocks merge a stream's pending free with settled neighbours
    /// at once; plain blocks keep them apart.
    #[test]
    fn joining_blocks_merge_pending_with_settled() {
        for (mut b, pieces) in [(Blocks::<u32>::joining(), 1), (Blocks::default(), 2)] {
            b.insert(0, settled(16));
            b.insert(
                16,
                Free {
                    size: 16,
                    stream: Some(S1),
                    fences: fs(&[(S1, 3)]),
                },
            );
            assert_eq!(b.check(), Ok(()));
            assert_eq!(b.iter().count(), pieces);
            assert_eq!(b.take(32, S2), None, "S2 waits for S1's fence either way");
        }
    }

    /// The spared block (one that can grow) goes only when nothing else fits.
    #[test]
    fn take_sparing_keeps_the_growing_block() {
        let mut b = Blocks::<u32>::default();
        b.insert(0, settled(40)); // ends at 40: the "tail"
        b.insert(100, settled(64));
        let tail = |end: usize| end == 40;
        assert_eq!(
            b.take_sparing(32, S1, tail),
            Some(100),
            "the bigger one, not the tail"
        );
        assert_eq!(b.take_sparing(32, S1, tail), Some(132), "its rest");
        assert_eq!(
            b.take_sparing(32, S1, tail),
            Some(0),
            "then the tail: nothing else fits"
        );
        assert_eq!(b.take_sparing(32, S1, tail), None);
        assert_eq!(b.check(), Ok(()));
    }

    #[test]
    fn merged_blocks_keep_one_fence_per_stream() {
        let mut b = Blocks::<u32>::default();
        for i in 0..1000 {
            b.insert(
                i * 16,
                Free {
                    size: 16,
                    stream: Some(S1),
                    fences: fs(&[(S1, i as u32)]),
                },
            );
        }
        let (o, f) = b.iter().next().unwrap();
        assert_eq!((o, f.size, b.iter().count()), (0, 16_000, 1));
        assert_eq!(
            listed(&f.fences),
            vec![(S1, 999)],
            "the latest fence covers the rest"
        );
    }

    #[test]
    fn best_fit_split_merge_and_streams() {
        let mut b = Blocks::<u32>::default();
        b.insert(0, settled(100));
        b.insert(200, settled(50));
        b.check().unwrap();
        assert_eq!(b.take(40, S1), Some(200), "best fit, not first fit");
        assert_eq!(b.take(10, S1), Some(240));
        b.insert(
            200,
            Free {
                size: 50,
                stream: Some(S1),
                fences: fs(&[(S1, 7)]),
            },
        );
        b.check().unwrap();
        assert_eq!(b.take(50, S2), Some(0), "S1's pending block is not S2's");
        assert_eq!(b.take(50, S2), Some(50), "the settled rest is");
        assert_eq!(b.take(50, S2), None, "only S1's pending block is left");
        assert_eq!(b.take(50, S1), Some(200), "S1 reuses its own at once");
        b.insert(
            200,
            Free {
                size: 50,
                stream: Some(S1),
                fences: fs(&[(S1, 8)]),
            },
        );
        assert_eq!(b.settle(|&f| f == 8), 1);
        assert_eq!(b.take(40, S2), Some(200), "settled: anyone's");
        b.check().unwrap();
        b.insert(0, settled(50));
        assert!(b.carve(10, 20), "inside a settled block");
        assert!(!b.carve(240, 20), "partly outside a block");
        b.check().unwrap();
        assert_eq!(b.free_bytes(), 10 + 20 + 10);
    }

    /// Free/alloc sequences against a byte model: blocks never overlap,
    /// never cover an allocated byte, merge whenever they can, and a stream
    /// never gets another stream's unsettled block.
    #[derive(Clone, Debug)]
    enum Op {
        Alloc(usize, bool),
        Free(usize, bool, bool),
        Settle,
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        #[test]
        fn blocks_match_a_byte_model(ops in prop::collection::vec(prop_oneof![
            3 => (1..64usize, any::<bool>()).prop_map(|(n, s)| Op::Alloc(n * 16, s)),
            3 => (0..32usize, any::<bool>(), any::<bool>()).prop_map(|(i, s, p)| Op::Free(i, s, p)),
            1 => Just(Op::Settle),
        ], 1..80)) {
            const SPACE: usize = 4096;
            let mut b = Blocks::<u32>::default();
            b.insert(0, settled(SPACE));
            // byte -> None free settled / Some(stream) pending on it / allocated marker
            let mut owner: Vec<Option<u8>> = vec![None; SPACE];
            let mut live: Vec<(usize, usize)> = Vec::new();
            let key = |s: bool| if s { S1 } else { S2 };
            for op in ops {
                match op {
                    Op::Alloc(n, s) => {
                        if let Some(at) = b.take(n, key(s)) {
                            for x in &mut owner[at..at + n] {
                                prop_assert!(x.is_none_or(|o| o == s as u8), "took another stream's pending bytes");
                                *x = Some(9);
                            }
                            live.push((at, n));
                        }
                    }
                    Op::Free(i, s, p) => {
                        if !live.is_empty() {
                            let (at, n) = live.swap_remove(i % live.len());
                            let fences = if p { fs(&[(key(s), 1)]) } else { FenceSet::default() };
                            let stream = if p { Some(key(s)) } else { None };
                            for x in &mut owner[at..at + n] {
                                *x = if p { Some(s as u8) } else { None };
                            }
                            b.insert(at, Free { size: n, stream, fences });
                        }
                    }
                    Op::Settle => {
                        b.settle(|_| true);
                        for x in owner.iter_mut().filter(|x| **x != Some(9)) {
                            *x = None;
                        }
                    }
                }
                b.check().map_err(TestCaseError::fail)?;
                let allocated: usize = live.iter().map(|l| l.1).sum();
                prop_assert_eq!(b.free_bytes() + allocated, SPACE);
                for (o, f) in b.iter() {
                    for x in &owner[o..o + f.size] {
                        prop_assert!(*x != Some(9), "a free block covers allocated bytes");
                    }
                }
            }
        }
    }
}
