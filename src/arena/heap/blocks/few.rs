//! Free blocks in two sorted arrays and a slab: for the few blocks a zone
//! holds in practice (see [`Few`]).

use super::{first_fit, Free, Join, StreamKey, Walls};

/// Who may take a free block now, kept in the size index so that the
/// best-fit search reads no block: any stream (settled), one stream (its
/// own pending block), or none (pending on several).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Taker {
    Any,
    Only(StreamKey),
    Nobody,
}

impl Taker {
    fn of<F>(f: &Free<F>) -> Self {
        match (f.settled(), f.stream) {
            (true, _) => Self::Any,
            (false, Some(k)) => Self::Only(k),
            (false, None) => Self::Nobody,
        }
    }

    fn allows(self, key: StreamKey) -> bool {
        match self {
            Self::Any => true,
            Self::Only(k) => k == key,
            Self::Nobody => false,
        }
    }
}

/// A block in the size index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct BySize {
    size: usize,
    offset: usize,
    taker: Taker,
}

/// The free blocks: two sorted arrays (by offset, and by size for the best
/// fit) and a slab of their records.
///
/// Laid out for an allocator call made with cold caches, where every cache
/// line touched is a miss. A zone holds few free blocks (replaying
/// PyTorch's traces: 11 on average, 28-63 at most), so a binary search of a
/// few contiguous lines and a short shift beat the nodes of two trees,
/// each search of which walked several nodes and each update of which
/// shifted blocks' records inside them (about 35 misses a free). The
/// records stay in their slots: only 16- and 40-byte entries move. Costs
/// grow with the count (a shift of the arrays' tails), so a zone of many
/// thousand free blocks pays microseconds a call.
#[derive(Debug)]
pub(crate) struct Few<F> {
    /// `(offset, slot)` of every block, by offset.
    by_offset: Vec<(usize, u32)>,
    /// Every block by `(size, offset)`, with who may take it.
    by_size: Vec<BySize>,
    /// The blocks' records; `None` in a vacant slot.
    slots: Vec<Option<Free<F>>>,
    /// Vacant slots, reused first.
    vacant: Vec<u32>,
    free_bytes: usize,
    /// Bytes of blocks whose fences have not all passed (PyTorch's active
    /// but not allocated).
    pending_bytes: usize,
    /// Whether a stream's pending block joins settled neighbours as it is
    /// inserted (see [`Blocks::joining`](super::Blocks::joining)).
    join_settled: bool,
}

impl<F> Few<F> {
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

    /// The record of the `i`th block by offset.
    fn rec(&self, i: usize) -> &Free<F> {
        self.slots[self.by_offset[i].1 as usize]
            .as_ref()
            .expect("a listed slot holds a block")
    }

    /// The `i`th block by offset.
    fn nth(&self, i: usize) -> (usize, &Free<F>) {
        (self.by_offset[i].0, self.rec(i))
    }

    /// How many blocks start below `offset`.
    fn below(&self, offset: usize) -> usize {
        self.by_offset.partition_point(|&(o, _)| o < offset)
    }

    /// Every block, by offset.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (usize, &Free<F>)> + '_ {
        (0..self.by_offset.len()).map(|i| self.nth(i))
    }

    /// The free block that ends exactly at `end`, if any.
    pub(crate) fn ending_at(&self, end: usize) -> Option<(usize, &Free<F>)> {
        self.below(end)
            .checked_sub(1)
            .map(|i| self.nth(i))
            .filter(|(o, f)| o + f.size == end)
    }

    /// Counts `f`'s bytes in (`add`) or out of the totals.
    fn count(&mut self, f: &Free<F>, add: bool) {
        let pending = if f.settled() { 0 } else { f.size };
        if add {
            self.free_bytes += f.size;
            self.pending_bytes += pending;
        } else {
            self.free_bytes -= f.size;
            self.pending_bytes -= pending;
        }
    }

    /// Where `(size, offset)` is, or would go, in the size index.
    fn size_pos(&self, size: usize, offset: usize) -> std::result::Result<usize, usize> {
        self.by_size
            .binary_search_by(|e| (e.size, e.offset).cmp(&(size, offset)))
    }

    fn unindex_size(&mut self, size: usize, offset: usize) {
        let i = self
            .size_pos(size, offset)
            .expect("a block is in the size index");
        self.by_size.remove(i);
    }

    /// Takes out the `i`th block by offset.
    fn unlink_at(&mut self, i: usize) -> (usize, Free<F>) {
        let (o, s) = self.by_offset.remove(i);
        let f = self.slots[s as usize]
            .take()
            .expect("a listed slot holds a block");
        self.vacant.push(s);
        self.unindex_size(f.size, o);
        self.count(&f, false);
        (o, f)
    }

    /// Takes out the block that starts at `offset`.
    fn unlink(&mut self, offset: usize) -> Option<Free<F>> {
        let i = self.below(offset);
        (self.by_offset.get(i)?.0 == offset).then(|| self.unlink_at(i).1)
    }

    /// Lists `f` at `offset` (which no block holds).
    fn link(&mut self, offset: usize, f: Free<F>) {
        let s = match self.vacant.pop() {
            Some(s) => s,
            None => {
                self.slots.push(None);
                u32::try_from(self.slots.len() - 1).expect("fewer than 2^32 free blocks")
            }
        };
        let i = self.below(offset);
        self.by_offset.insert(i, (offset, s));
        let j = self.size_pos(f.size, offset).expect_err("a new block");
        self.by_size.insert(
            j,
            BySize {
                size: f.size,
                offset,
                taker: Taker::of(&f),
            },
        );
        self.count(&f, true);
        self.slots[s as usize] = Some(f);
    }

    fn insert_tagged(
        &mut self,
        mut offset: usize,
        mut f: Free<F>,
        keep_tag: bool,
        walls: &impl Walls,
    ) {
        debug_assert!(f.size > 0);
        let join = Join::new(&f, keep_tag, self.join_settled);
        // Until neither neighbour merges: a merge of two settled blocks
        // may change the tag, and with it whether the block joins the
        // pending neighbour on its other side.
        let mut i = self.below(offset);
        loop {
            let mut merged = false;
            // The block before: the `i - 1`th, if it ends at `offset`.
            if let Some(l) = i.checked_sub(1) {
                let (lo, left) = self.nth(l);
                if lo + left.size == offset
                    && !walls.at(offset)
                    && left.mergeable(&f, self.join_settled)
                {
                    let (lo, left) = self.unlink_at(l);
                    offset = lo;
                    i = l;
                    f = join.merge(left, f);
                    merged = true;
                }
            }
            // The block after: the `i`th, if it starts at the end.
            if i < self.by_offset.len() {
                let (ro, right) = self.nth(i);
                if ro == offset + f.size && !walls.at(ro) && f.mergeable(right, self.join_settled) {
                    let (_, right) = self.unlink_at(i);
                    f = join.merge(f, right);
                    merged = true;
                }
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
        let start = self.by_size.partition_point(|e| e.size < size);
        let usable = (self.by_size.iter().enumerate().skip(start))
            .filter(|(_, e)| e.taker.allows(key))
            .map(|(j, e)| (j, e.offset + e.size));
        let j = first_fit(usable, spare)?;
        let e = self.by_size[j];
        let i = self.below(e.offset);
        if e.size == size {
            self.unlink_at(i);
            return Some(e.offset);
        }
        // The rest keeps the block's slot, stream and fences: its offset
        // and size change, and it moves down the size index (to `k`).
        let rest = BySize {
            size: e.size - size,
            offset: e.offset + size,
            ..e
        };
        let k =
            self.by_size[..j].partition_point(|x| (x.size, x.offset) < (rest.size, rest.offset));
        self.by_size.copy_within(k..j, k + 1);
        self.by_size[k] = rest;
        self.by_offset[i].0 = rest.offset;
        let s = self.by_offset[i].1 as usize;
        let f = self.slots[s].as_mut().expect("a listed slot holds a block");
        f.size = rest.size;
        let settled = f.settled();
        self.free_bytes -= size;
        if !settled {
            self.pending_bytes -= size;
        }
        Some(e.offset)
    }

    /// Takes out every block that starts in `range` (a settled one whose
    /// memory was given back).
    pub(crate) fn remove_within(&mut self, range: std::ops::Range<usize>) {
        let (a, b) = (self.below(range.start), self.below(range.end));
        for i in (a..b).rev() {
            self.unlink_at(i);
        }
    }

    /// Checks the indexes agree and no blocks overlap or could have merged
    /// (the last reported only if all else holds).
    #[cfg(test)]
    pub(crate) fn check(&self, walls: &impl Walls) -> Result<(), String> {
        let mut end = 0;
        let mut total = 0;
        let mut prev: Option<(usize, &Free<F>)> = None;
        let mut unmerged = None;
        let mut sizes = Vec::new();
        for &(o, s) in &self.by_offset {
            let Some(f) = self.slots.get(s as usize).and_then(Option::as_ref) else {
                return Err(format!("block at {o:#x} names an empty slot {s}"));
            };
            if o < end || f.size == 0 {
                return Err(format!("block at {o:#x} overlaps or is empty"));
            }
            sizes.push(BySize {
                size: f.size,
                offset: o,
                taker: Taker::of(f),
            });
            if let Some((po, p)) = prev {
                if po + p.size == o
                    && !walls.at(o)
                    && p.mergeable(f, self.join_settled)
                    && unmerged.is_none()
                {
                    unmerged = Some(format!("blocks at {po:#x} and {o:#x} should have merged"));
                }
            }
            end = o + f.size;
            total += f.size;
            prev = Some((o, f));
        }
        sizes.sort_by_key(|e| (e.size, e.offset));
        if sizes != self.by_size {
            return Err("the size index disagrees with the blocks".into());
        }
        let held = self.slots.iter().filter(|s| s.is_some()).count();
        if held != self.by_offset.len() || held + self.vacant.len() != self.slots.len() {
            return Err("a slot is neither listed nor vacant".into());
        }
        if total != self.free_bytes {
            return Err("the byte count disagrees".into());
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
        unmerged.map_or(Ok(()), Err)
    }
}

impl<F> super::Store<F> for Few<F> {
    fn iter<'a>(&'a self) -> impl Iterator<Item = (usize, &'a Free<F>)> + 'a
    where
        F: 'a,
    {
        Few::iter(self)
    }

    fn at_or_before(&self, offset: usize) -> Option<(usize, &Free<F>)> {
        let n = self.by_offset.partition_point(|&(o, _)| o <= offset);
        n.checked_sub(1).map(|i| self.nth(i))
    }

    fn unlink(&mut self, offset: usize) -> Option<Free<F>> {
        Few::unlink(self, offset)
    }

    fn link(&mut self, offset: usize, f: Free<F>) {
        Few::link(self, offset, f);
    }

    fn insert_tagged(&mut self, offset: usize, f: Free<F>, keep_tag: bool, walls: &impl Walls) {
        Few::insert_tagged(self, offset, f, keep_tag, walls);
    }

    fn join_settled(&self) -> bool {
        self.join_settled
    }

    fn empty(join_settled: bool) -> Self {
        Self {
            by_offset: Vec::new(),
            by_size: Vec::new(),
            slots: Vec::new(),
            vacant: Vec::new(),
            free_bytes: 0,
            pending_bytes: 0,
            join_settled,
        }
    }

    fn len(&self) -> usize {
        self.by_offset.len()
    }

    fn into_blocks(mut self) -> impl Iterator<Item = (usize, Free<F>)> {
        let order = std::mem::take(&mut self.by_offset);
        order.into_iter().map(move |(o, s)| {
            let f = self.slots[s as usize]
                .take()
                .expect("a listed slot holds a block");
            (o, f)
        })
    }
}
