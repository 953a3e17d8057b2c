//! The operations both forms of the free-block index share, written once
//! over what each form keeps.

use super::*;

/// What each form keeps and how it finds, lists and takes out a block;
/// the operations built on those are the same for both (provided here).
pub(super) trait Store<F> {
    /// Every block, by offset.
    fn iter<'a>(&'a self) -> impl Iterator<Item = (usize, &'a Free<F>)> + 'a
    where
        F: 'a;

    /// The block with the largest offset at or below `offset`.
    fn at_or_before(&self, offset: usize) -> Option<(usize, &Free<F>)>;

    /// Takes out the block that starts at `offset`.
    fn unlink(&mut self, offset: usize) -> Option<Free<F>>;

    /// Lists `f` at `offset` as it is (no merge; no block holds `offset`).
    fn link(&mut self, offset: usize, f: Free<F>);

    /// Adds a free block (not overlapping any, straddling no wall),
    /// merging it with mergeable neighbours that touch it where no wall
    /// stands between them; with `keep_tag`, what it merges into keeps its
    /// stream as a tag while settled (see [`insert_fresh`](Self::insert_fresh)).
    fn insert_tagged(&mut self, offset: usize, f: Free<F>, keep_tag: bool, walls: &impl Walls);

    /// Whether pending blocks join settled neighbours as they are inserted.
    fn join_settled(&self) -> bool;

    /// No blocks; pending blocks joining settled neighbours as they are
    /// inserted with `join_settled` (see [`Blocks::joining`]).
    fn empty(join_settled: bool) -> Self
    where
        Self: Sized;

    /// How many blocks.
    fn len(&self) -> usize;

    /// Every block, by offset, taken out.
    fn into_blocks(self) -> impl Iterator<Item = (usize, Free<F>)>
    where
        Self: Sized;

    /// Adds a free block (not overlapping any), merging it with mergeable
    /// neighbours that touch it where no wall stands between.
    fn insert(&mut self, offset: usize, f: Free<F>, walls: &impl Walls) {
        self.insert_walled(offset, f, false, walls);
    }

    /// [`insert_tagged`](Self::insert_tagged) for a block that may
    /// straddle walls (memory freed that was handed out before the walls
    /// stood): a settled one goes in as one block between each two walls;
    /// a pending one stays whole, but no stream may take it, nor does it
    /// join any, until its fences pass and it is inserted again, settled
    /// (its fences cannot be split between pieces).
    fn insert_walled(&mut self, offset: usize, mut f: Free<F>, keep_tag: bool, walls: &impl Walls) {
        let end = offset + f.size;
        if walls.first_inside(offset, end).is_none() {
            return self.insert_tagged(offset, f, keep_tag, walls);
        }
        if !f.settled() {
            f.stream = None;
            return self.insert_tagged(offset, f, keep_tag, walls);
        }
        let mut at = offset;
        while at < end {
            let next = walls.first_inside(at, end).unwrap_or(end);
            let piece = Free {
                size: next - at,
                stream: f.stream,
                fences: FenceSet::default(),
            };
            self.insert_tagged(at, piece, keep_tag, walls);
            at = next;
        }
    }

    /// Adds fresh memory mapped for stream `key` (settled, tagged with
    /// `key`): merged with neighbours as [`insert`](Self::insert) does, but
    /// what it merges into stays tagged with `key` while settled, so that it
    /// never joins another stream's pending block and `key` can take it.
    fn insert_fresh(&mut self, offset: usize, size: usize, key: StreamKey, walls: &impl Walls) {
        let f = Free {
            size,
            stream: Some(key),
            fences: FenceSet::default(),
        };
        self.insert_walled(offset, f, true, walls);
    }

    /// True if one free block (a settled one, with `settled`) covers
    /// `[offset, offset + size)`.
    fn covers(&self, offset: usize, size: usize, settled: bool) -> bool {
        self.at_or_before(offset)
            .is_some_and(|(o, f)| o + f.size >= offset + size && (!settled || f.settled()))
    }

    /// The size of the free block that holds `offset`, or 0.
    fn size_at(&self, offset: usize) -> usize {
        self.at_or_before(offset)
            .filter(|(o, f)| o + f.size > offset)
            .map_or(0, |(_, f)| f.size)
    }

    /// Joins each of `key`'s pending blocks with its settled neighbours, so
    /// that `key` may use them as one block at once (other streams once the
    /// fences pass). For when `key` finds no block that fits and blocks are
    /// not [joining](Blocks::joining) as they are inserted: the GPU lags the
    /// CPU, so free blocks settle in patches, and a large request may fit
    /// only across a settled and a pending neighbour (a conv net trained on
    /// one stream on an H100 mapped 4.1 GiB for a 3.1 GiB peak without
    /// this; 3.3 GiB when every fence had passed). Returns how many joined.
    fn coalesce(&mut self, key: StreamKey, walls: &impl Walls) -> usize {
        let joinable = |a: &Free<F>, b: &Free<F>| {
            (a.settled() && b.stream == Some(key) && !b.settled())
                || (b.settled() && a.stream == Some(key) && !a.settled())
        };
        let mut pairs = Vec::new();
        let mut prev: Option<(usize, &Free<F>)> = None;
        for (o, f) in self.iter() {
            if let Some((po, p)) = prev {
                if po + p.size == o && !walls.at(o) && joinable(p, f) {
                    pairs.push(po);
                }
            }
            prev = Some((o, f));
        }
        // Right to left, so each left offset still names a block.
        let mut joined = 0;
        for &left in pairs.iter().rev() {
            let Some(l) = self.unlink(left) else {
                continue;
            };
            let right = left + l.size;
            let Some(r) = self.unlink(right) else {
                unreachable!("both blocks were listed");
            };
            self.link(left, merge(l, r, self.join_settled()));
            joined += 1;
        }
        joined
    }

    /// Marks every block whose fences `done` says have passed as settled,
    /// and merges settled neighbours. Returns how many settled.
    /// Blocks are asked in the order of their fences' numbers, oldest
    /// first, so that once `done` has seen a stream's fence not passed it
    /// need not ask of the later ones (`order::NotYet`).
    fn settle(&mut self, mut done: impl FnMut(&Stamped<F>) -> bool, walls: &impl Walls) -> usize {
        let mut pending: Vec<(u64, usize, &Free<F>)> = self
            .iter()
            .filter(|(_, f)| !f.settled())
            .map(|(o, f)| (f.fences.iter().map(|x| x.seq).max().unwrap_or(0), o, f))
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
            if !self.join_settled() {
                f.stream = None;
            }
            self.insert(o, f, walls);
        }
        ready.len()
    }

    /// Whether one block covers `[offset, offset + size)` that `key` may
    /// take now and whose every use was on `key`'s stream: settled, or
    /// pending with fences on `key` alone.
    fn covers_for(&self, offset: usize, size: usize, key: StreamKey) -> bool {
        self.at_or_before(offset).is_some_and(|(o, f)| {
            o + f.size >= offset + size
                && (f.settled() || (f.stream == Some(key) && f.fences.only_on(key)))
        })
    }

    /// Removes `[offset, offset + size)` from the free space, inside one
    /// block [`covers_for`](Self::covers_for) accepts. The pieces left of a
    /// pending block stay `key`'s, each with `fences()`: marks on `key`
    /// numbered after the block's (a block's fences cannot be split).
    /// Returns whether the block was settled, or `None`, changing nothing,
    /// where no such block covers the range.
    fn carve_for(
        &mut self,
        offset: usize,
        size: usize,
        key: StreamKey,
        mut fences: impl FnMut() -> FenceSet<F>,
    ) -> Option<bool> {
        if !self.covers_for(offset, size, key) {
            return None;
        }
        let (o, f) = self.at_or_before(offset).expect("covered");
        let (settled, tag) = (f.settled(), f.stream);
        self.cut_out(o, offset, size, |size| match settled {
            true => Free {
                size,
                stream: tag,
                fences: FenceSet::default(),
            },
            false => Free {
                size,
                stream: Some(key),
                fences: fences(),
            },
        });
        Some(settled)
    }

    /// Removes `[offset, offset + size)` from the free space: it must lie
    /// within one settled block (the caller unmaps it). Returns false, and
    /// changes nothing, otherwise.
    fn carve(&mut self, offset: usize, size: usize) -> bool {
        let Some((o, f)) = self.at_or_before(offset) else {
            return false;
        };
        if !f.settled() || o + f.size < offset + size {
            return false;
        }
        self.cut_out(o, offset, size, |size| Free {
            size,
            stream: None,
            fences: FenceSet::default(),
        });
        true
    }

    /// Takes the block at `o`, which holds `[offset, offset + size)`, out of
    /// the index, and lists what it keeps on either side of that range as
    /// `piece(bytes)`.
    fn cut_out(
        &mut self,
        o: usize,
        offset: usize,
        size: usize,
        mut piece: impl FnMut(usize) -> Free<F>,
    ) {
        let f = self.unlink(o).expect("found");
        if offset > o {
            self.link(o, piece(offset - o));
        }
        let end = offset + size;
        if o + f.size > end {
            self.link(end, piece(o + f.size - end));
        }
    }
}
