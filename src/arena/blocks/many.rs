//! Free blocks in two trees, each block's record inline in the offset
//! tree: for a zone of many blocks, where the arrays of [`Few`](super::few::Few)
//! would shift too much at every call (see [`Blocks`](super::Blocks)).

use std::collections::{BTreeMap, BTreeSet};

use super::{merge, Free, StreamKey};
use crate::order::{FenceSet, Stamped};

/// The free blocks, by offset and by size.
#[derive(Debug)]
pub(crate) struct Many<F> {
    by_offset: BTreeMap<usize, Free<F>>,
    by_size: BTreeSet<(usize, usize)>,
    free_bytes: usize,
    /// Bytes of blocks whose fences have not all passed (PyTorch's active
    /// but not allocated).
    pending_bytes: usize,
    /// Whether a stream's pending block joins settled neighbours as it is
    /// inserted (see [`Many::joining`]).
    join_settled: bool,
}

impl<F> Default for Many<F> {
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

impl<F> Many<F> {
    /// Blocks where a stream's pending block joins its settled neighbours
    /// as it is inserted (as PyTorch's per-stream blocks merge on free): the
    /// stream may use the whole at once, other streams once the fences pass.
    /// Less fragmentation for memory that stays mapped; but the settled part
    /// cannot be unmapped until then, so an arena that gives free chunks
    /// back before mapping keeps the two apart (and joins them only on a
    /// miss, [`Many::coalesce`]).
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

    /// The size of the free block that holds `offset`, or 0.
    pub(crate) fn size_at(&self, offset: usize) -> usize {
        self.by_offset
            .range(..=offset)
            .next_back()
            .filter(|(&o, f)| o + f.size > offset)
            .map_or(0, |(_, f)| f.size)
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
        // Until neither neighbour merges: a merge of two settled blocks
        // may change the tag, and with it whether the block joins the
        // pending neighbour on its other side.
        loop {
            let mut merged = false;
            if let Some((lo, left)) = self.ending_at(offset) {
                if left.mergeable(&f, self.join_settled) {
                    let left = self.unlink(lo).expect("just found");
                    offset = lo;
                    f = merge(left, f, self.join_settled);
                    retag(&mut f);
                    merged = true;
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
                merged = true;
            }
            if !merged {
                break;
            }
        }
        self.link(offset, f);
    }

    /// The best-fitting block of at least `size` bytes that stream `key` may
    /// use now, taken out (its remainder past `size` kept free); but a block
    /// for which `spare(end)` holds (one that ends where more memory can be
    /// mapped) is taken only if no other fits: it is kept to grow into.
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
    /// Blocks are asked in the order of their fences' numbers, oldest
    /// first, so that once `done` has seen a stream's fence not passed it
    /// need not ask of the later ones (`order::NotYet`).
    pub(crate) fn settle(&mut self, mut done: impl FnMut(&Stamped<F>) -> bool) -> usize {
        let mut pending: Vec<(u64, usize, &Free<F>)> = self
            .by_offset
            .iter()
            .filter(|(_, f)| !f.settled())
            .map(|(&o, f)| (f.fences.iter().map(|x| x.seq).max().unwrap_or(0), o, f))
            .collect();
        pending.sort_unstable_by_key(|&(seq, o, _)| (seq, o));
        let ready: Vec<usize> = pending
            .into_iter()
            .filter(|(_, _, f)| f.fences.iter().all(&mut done))
            .map(|(_, o, _)| o)
            .collect();
        // All out first: inserting one may merge it with a neighbour that
        // is also ready.
        let unlinked: Vec<(usize, Free<F>)> = ready
            .iter()
            .map(|&o| (o, self.unlink(o).expect("listed")))
            .collect();
        for (o, mut f) in unlinked {
            f.fences.clear();
            // Where pending blocks join settled neighbours as they are
            // inserted, a settled block keeps its stream as a tag (as fresh
            // memory does): that stream's next pending block joins it,
            // another stream's does not take it over. Any stream may still
            // take it (it is settled). Without the tag, FSDP's all-gather
            // stream, freeing its unsharded parameters while the GPU ran a
            // step behind, swallowed the compute stream's settled memory
            // into blocks only it could use until its fences passed, and the
            // compute stream mapped more: 1.36x the peak instead of 1.03x
            // (`lag::two_streams_with_a_lagging_gpu_cost_little`).
            if !self.join_settled {
                f.stream = None;
            }
            self.insert(o, f);
        }
        ready.len()
    }

    /// Takes out every block that starts in `range` (a settled one whose
    /// memory was given back).
    pub(crate) fn remove_within(&mut self, range: std::ops::Range<usize>) {
        let keys: Vec<usize> = self.by_offset.range(range).map(|(&o, _)| o).collect();
        for k in keys {
            self.unlink(k);
        }
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

impl<F> Many<F> {
    /// How many blocks.
    pub(super) fn len(&self) -> usize {
        self.by_offset.len()
    }

    /// Every block, by offset, taken out.
    pub(super) fn into_blocks(self) -> impl Iterator<Item = (usize, Free<F>)> {
        self.by_offset.into_iter()
    }

    /// Lists a block as it is (no merge): one of a valid set, moved here.
    pub(super) fn push(&mut self, offset: usize, f: Free<F>) {
        self.link(offset, f);
    }
}
