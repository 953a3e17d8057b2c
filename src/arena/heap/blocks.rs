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

pub(crate) use crate::order::StreamKey;
use crate::order::{FenceSet, Stamped};

pub(crate) use crate::region::Walls;

mod few;
mod many;
mod store;
#[cfg(test)]
pub(crate) use checks::NoWalls;

use store::Store;

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
    pub(crate) fn usable_by(&self, key: StreamKey) -> bool {
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

/// The free blocks of a zone, by offset and by size: best fit, merging
/// with neighbours, stream-ordered reuse.
///
/// Kept in one of two forms, switched by the count. A zone holds few
/// blocks in practice (replaying PyTorch's traces: 11 on average, 28-63 at
/// most), and for those sorted arrays ([`few::Few`]) touch a few contiguous
/// cache lines where trees walk and shift several nodes (with cold caches,
/// FSDP's trace: a quarter fewer simulated misses an alloc, a tenth fewer
/// a free; issue 24, seventh pass). But each array update
/// shifts the tail, so past [`TO_MANY`] blocks the zone moves to two trees
/// ([`many::Many`], O(log n) a call), and back below [`TO_FEW`]. Both
/// answer every call alike (`blocks_agree_with_each_other`); a move keeps
/// every block, stream and fence.
#[derive(Debug)]
pub(crate) struct Blocks<F> {
    form: Form<F>,
    join_settled: bool,
    to_many: usize,
    to_few: usize,
}

#[derive(Debug)]
enum Form<F> {
    Few(few::Few<F>),
    Many(many::Many<F>),
}

/// Blocks past which a zone moves to trees: with more, a shift of the
/// arrays costs more than a tree's walk. Warm alloc/free pairs of 4 KiB on
/// a zone of free blocks that cannot merge (`benches/fragmented.rs`'s
/// pattern), arrays alone against trees alone: 32 blocks 252 against 408
/// ns, 128 blocks 346 against 364, 256 blocks 452 against 366, 500 blocks
/// 567 against 402.
const TO_MANY: usize = 128;

/// Blocks below which a zone in trees moves back to arrays (apart from
/// [`TO_MANY`], so that a count around one bound does not move it back and
/// forth).
const TO_FEW: usize = 64;

impl<F> Default for Blocks<F> {
    fn default() -> Self {
        Self::new(false)
    }
}

/// Calls `$call` on whichever form the blocks are in.
macro_rules! on_form {
    ($self:expr, $b:ident => $call:expr) => {
        match &$self.form {
            Form::Few($b) => $call,
            Form::Many($b) => $call,
        }
    };
    (mut $self:expr, $b:ident => $call:expr) => {
        match &mut $self.form {
            Form::Few($b) => $call,
            Form::Many($b) => $call,
        }
    };
}

/// Either form's iterator.
enum Either<A, B> {
    A(A),
    B(B),
}

impl<T, A: Iterator<Item = T>, B: Iterator<Item = T>> Iterator for Either<A, B> {
    type Item = T;

    fn next(&mut self) -> Option<T> {
        match self {
            Self::A(a) => a.next(),
            Self::B(b) => b.next(),
        }
    }
}

impl<F> Blocks<F> {
    fn new(join_settled: bool) -> Self {
        Self {
            form: Form::Few(few::Few::empty(join_settled)),
            join_settled,
            to_many: TO_MANY,
            to_few: TO_FEW,
        }
    }

    /// Blocks where a stream's pending block joins its settled neighbours
    /// as it is inserted (as PyTorch's per-stream blocks merge on free): the
    /// stream may use the whole at once, other streams once the fences pass.
    /// Less fragmentation for memory that stays mapped; but the settled part
    /// cannot be unmapped until then, so an arena that gives free chunks
    /// back before mapping keeps the two apart (and joins them only on a
    /// miss, [`Blocks::coalesce`]).
    #[inline]
    pub(crate) fn joining() -> Self {
        Self::new(true)
    }

    /// Moves the blocks to the form their count calls for.
    #[inline]
    fn reform(&mut self) {
        let move_now = match &self.form {
            Form::Few(b) => b.len() > self.to_many,
            Form::Many(b) => b.len() < self.to_few,
        };
        if !move_now {
            return;
        }
        // Every block as it is, stream and fences kept: no merge.
        fn moved<F, A: Store<F>, B: Store<F>>(from: A, join_settled: bool) -> B {
            let mut to = B::empty(join_settled);
            for (o, f) in from.into_blocks() {
                to.link(o, f);
            }
            to
        }
        let placeholder = Form::Few(few::Few::empty(false));
        self.form = match std::mem::replace(&mut self.form, placeholder) {
            Form::Few(b) => Form::Many(moved(b, self.join_settled)),
            Form::Many(b) => Form::Few(moved(b, self.join_settled)),
        };
    }

    #[cfg(test)]
    #[inline]
    pub(crate) fn free_bytes(&self) -> usize {
        on_form!(self, b => b.free_bytes())
    }

    /// Bytes of free blocks whose fences have not all passed.
    #[inline]
    pub(crate) fn pending_bytes(&self) -> usize {
        on_form!(self, b => b.pending_bytes())
    }

    /// Whether any block waits for a fence.
    #[inline]
    pub(crate) fn any_pending(&self) -> bool {
        on_form!(self, b => b.any_pending())
    }

    /// Every block, by offset.
    #[inline]
    pub(crate) fn iter(&self) -> impl Iterator<Item = (usize, &Free<F>)> + '_ {
        match &self.form {
            Form::Few(b) => Either::A(b.iter()),
            Form::Many(b) => Either::B(b.iter()),
        }
    }

    /// True if one free block (a settled one, with `settled`) covers
    /// `[offset, offset + size)`.
    #[inline]
    pub(crate) fn covers(&self, offset: usize, size: usize, settled: bool) -> bool {
        on_form!(self, b => b.covers(offset, size, settled))
    }

    /// The size of the free block that holds `offset`, or 0.
    #[inline]
    pub(crate) fn size_at(&self, offset: usize) -> usize {
        on_form!(self, b => b.size_at(offset))
    }

    /// The free block that ends exactly at `end`, if any.
    #[inline]
    pub(crate) fn ending_at(&self, end: usize) -> Option<(usize, &Free<F>)> {
        on_form!(self, b => b.ending_at(end))
    }

    /// Adds a free block (not overlapping any), merging it with mergeable
    /// neighbours that touch it (no walls: for tests).
    #[cfg(test)]
    #[inline]
    pub(crate) fn insert(&mut self, offset: usize, f: Free<F>) {
        self.insert_in(offset, f, &NoWalls);
    }

    /// Adds a free block (not overlapping any), merging it with mergeable
    /// neighbours that touch it where no wall stands between; one that
    /// straddles walls is kept apart as [`Store::insert_walled`] says.
    #[inline]
    pub(crate) fn insert_in(&mut self, offset: usize, f: Free<F>, walls: &impl Walls) {
        on_form!(mut self, b => b.insert(offset, f, walls));
        self.reform();
    }

    /// Adds fresh memory mapped for stream `key` (no walls: for tests).
    #[cfg(test)]
    #[inline]
    pub(crate) fn insert_fresh(&mut self, offset: usize, size: usize, key: StreamKey) {
        self.insert_fresh_in(offset, size, key, &NoWalls);
    }

    /// Adds fresh memory mapped for stream `key` (settled, tagged with
    /// `key`): merged with neighbours as [`insert_in`](Self::insert_in)
    /// does, but what it merges into stays tagged with `key` while settled,
    /// so that it never joins another stream's pending block and `key` can
    /// take it.
    #[inline]
    pub(crate) fn insert_fresh_in(
        &mut self,
        offset: usize,
        size: usize,
        key: StreamKey,
        walls: &impl Walls,
    ) {
        on_form!(mut self, b => b.insert_fresh(offset, size, key, walls));
        self.reform();
    }

    /// Puts up `walls` among blocks listed before they stood: every block
    /// that straddles one is inserted again ([`Store::insert_walled`]).
    /// Returns how many were.
    pub(crate) fn rewall(&mut self, walls: &impl Walls) -> usize {
        let straddling: Vec<usize> = self
            .iter()
            .filter(|(o, f)| walls.first_inside(*o, o + f.size).is_some())
            .map(|(o, _)| o)
            .collect();
        for &o in &straddling {
            let f = on_form!(mut self, b => b.unlink(o)).expect("listed");
            on_form!(mut self, b => b.insert_walled(o, f, false, walls));
        }
        self.reform();
        straddling.len()
    }

    /// The best-fitting block of at least `size` bytes that stream `key` may
    /// use now; taken out, its remainder (past `size`) kept free.
    #[inline]
    pub(crate) fn take(&mut self, size: usize, key: StreamKey) -> Option<usize> {
        self.take_sparing(size, key, |_| false)
    }

    /// [`take`](Self::take), but a block for which `spare(end)` holds (one
    /// that ends where more memory can be mapped) is taken only if no other
    /// fits: it is kept to grow into.
    #[inline]
    pub(crate) fn take_sparing(
        &mut self,
        size: usize,
        key: StreamKey,
        spare: impl Fn(usize) -> bool,
    ) -> Option<usize> {
        let got = on_form!(mut self, b => b.take_sparing(size, key, spare));
        self.reform();
        got
    }

    /// Joins each of `key`'s pending blocks with its settled neighbours, so
    /// that `key` may use them as one block at once (other streams once the
    /// fences pass). For when `key` finds no block that fits and blocks are
    /// not [joining](Self::joining) as they are inserted: the GPU lags the
    /// CPU, so free blocks settle in patches, and a large request may fit
    /// only across a settled and a pending neighbour (a conv net trained on
    /// one stream on an H100 mapped 4.1 GiB for a 3.1 GiB peak without
    /// this; 3.3 GiB when every fence had passed). Returns how many joined.
    #[cfg(test)]
    #[inline]
    pub(crate) fn coalesce(&mut self, key: StreamKey) -> usize {
        self.coalesce_in(key, &NoWalls)
    }

    /// [`coalesce`](Self::coalesce), joining no two blocks across a wall.
    #[inline]
    pub(crate) fn coalesce_in(&mut self, key: StreamKey, walls: &impl Walls) -> usize {
        let n = on_form!(mut self, b => b.coalesce(key, walls));
        self.reform();
        n
    }

    /// Marks every block whose fences `done` says have passed as settled,
    /// and merges settled neighbours. Returns how many settled.
    /// Blocks are asked in the order of their fences' numbers, oldest
    /// first, so that once `done` has seen a stream's fence not passed it
    /// need not ask of the later ones (`order::NotYet`).
    #[cfg(test)]
    #[inline]
    pub(crate) fn settle(&mut self, done: impl FnMut(&Stamped<F>) -> bool) -> usize {
        self.settle_in(done, &NoWalls)
    }

    /// [`settle`](Self::settle), merging no two blocks across a wall (and
    /// splitting at the walls a block that straddled them while pending).
    #[inline]
    pub(crate) fn settle_in(
        &mut self,
        done: impl FnMut(&Stamped<F>) -> bool,
        walls: &impl Walls,
    ) -> usize {
        let n = on_form!(mut self, b => b.settle(done, walls));
        self.reform();
        n
    }

    /// Takes out every block that starts in `range` (a settled one whose
    /// memory was given back).
    #[inline]
    pub(crate) fn remove_within(&mut self, range: std::ops::Range<usize>) {
        on_form!(mut self, b => b.remove_within(range));
        self.reform();
    }

    /// Whether one block covers `[offset, offset + size)` that `key` may
    /// take now and whose every use was on `key`'s stream (see
    /// [`carve_for`](Self::carve_for)).
    #[inline]
    pub(crate) fn covers_for(&self, offset: usize, size: usize, key: StreamKey) -> bool {
        on_form!(self, b => b.covers_for(offset, size, key))
    }

    /// Removes `[offset, offset + size)` from the free space, inside one
    /// block `key` may take now whose every use was on `key`'s stream; the
    /// pieces left of a pending one stay `key`'s with `fences()` (marks on
    /// `key` numbered after the block's). Returns whether that block was
    /// settled, or `None`, changing nothing, where none covers the range.
    #[inline]
    pub(crate) fn carve_for(
        &mut self,
        offset: usize,
        size: usize,
        key: StreamKey,
        fences: impl FnMut() -> FenceSet<F>,
    ) -> Option<bool> {
        let done = on_form!(mut self, b => b.carve_for(offset, size, key, fences));
        self.reform();
        done
    }

    /// Removes `[offset, offset + size)` from the free space: it must lie
    /// within one settled block (the caller unmaps it). Returns false, and
    /// changes nothing, otherwise.
    #[inline]
    pub(crate) fn carve(&mut self, offset: usize, size: usize) -> bool {
        let done = on_form!(mut self, b => b.carve(offset, size));
        self.reform();
        done
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

/// How a block being inserted joins its neighbours ([`Store::insert_tagged`]
/// of both forms): [`merge`], and where tags are kept (joining mode, and
/// asked for), a settled result takes the inserted block's tag again.
#[derive(Clone, Copy)]
struct Join {
    join_settled: bool,
    /// The inserted block's tag, where tags are kept.
    tag: Option<Option<StreamKey>>,
}

impl Join {
    fn new<F>(inserted: &Free<F>, keep_tag: bool, join_settled: bool) -> Self {
        // Tags matter only where settled blocks join pending ones as they
        // are inserted; elsewhere merges drop them (see `merge`).
        Self {
            join_settled,
            tag: (keep_tag && join_settled).then_some(inserted.stream),
        }
    }

    #[inline]
    fn merge<F>(self, left: Free<F>, right: Free<F>) -> Free<F> {
        let mut m = merge(left, right, self.join_settled);
        if let Some(tag) = self.tag.filter(|_| m.settled()) {
            m.stream = tag;
        }
        m
    }
}

/// The best fit among `usable` (blocks a stream may take, each with where
/// it ends, in the size index's order, the smallest fitting first): the
/// first one `spare` does not hold for, or else the first one (a block
/// kept to grow into is taken only if no other fits). Both forms'
/// `take_sparing`.
#[inline]
fn first_fit<T>(
    usable: impl Iterator<Item = (T, usize)>,
    spare: impl Fn(usize) -> bool,
) -> Option<T> {
    let mut fallback = None;
    for (t, end) in usable {
        if !spare(end) {
            return Some(t);
        }
        if fallback.is_none() {
            fallback = Some(t);
        }
    }
    fallback
}

// After `on_form!`, which the checks use.
#[cfg(test)]
mod checks;
#[cfg(test)]
mod tests;
