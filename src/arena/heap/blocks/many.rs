//! Free blocks in two trees, each block's record inline in the offset
//! tree: for a zone of many blocks, where the arrays of [`Few`](super::few::Few)
//! would shift too much at every call (see [`Blocks`](super::Blocks)).

use std::collections::{BTreeMap, BTreeSet};

use super::{first_fit, Free, Join, StreamKey, Walls};

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
    /// inserted (see [`Blocks::joining`](super::Blocks::joining)).
    join_settled: bool,
}

impl<F> Many<F> {
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
        loop {
            let mut merged = false;
            if let Some((lo, left)) = self.ending_at(offset) {
                if !walls.at(offset) && left.mergeable(&f, self.join_settled) {
                    let left = self.unlink(lo).expect("just found");
                    offset = lo;
                    f = join.merge(left, f);
                    merged = true;
                }
            }
            let end = offset + f.size;
            if !walls.at(end)
                && self
                    .by_offset
                    .get(&end)
                    .is_some_and(|r| f.mergeable(r, self.join_settled))
            {
                let right = self.unlink(end).expect("just found");
                f = join.merge(f, right);
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
        let usable = (self.by_size.range((size, 0)..))
            .filter(|&&(_, o)| self.by_offset[&o].usable_by(key))
            .map(|&(s, o)| (o, o + s));
        let offset = first_fit(usable, spare)?;
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

    /// Takes out every block that starts in `range` (a settled one whose
    /// memory was given back).
    pub(crate) fn remove_within(&mut self, range: std::ops::Range<usize>) {
        let keys: Vec<usize> = self.by_offset.range(range).map(|(&o, _)| o).collect();
        for k in keys {
            self.unlink(k);
        }
    }

    /// Checks the indexes agree and no blocks overlap or could have merged.
    #[cfg(test)]
    pub(crate) fn check(&self, walls: &impl Walls) -> Result<(), String> {
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
                if po + p.size == o && !walls.at(o) && p.mergeable(f, self.join_settled) {
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

impl<F> super::Store<F> for Many<F> {
    fn iter<'a>(&'a self) -> impl Iterator<Item = (usize, &'a Free<F>)> + 'a
    where
        F: 'a,
    {
        Many::iter(self)
    }

    fn at_or_before(&self, offset: usize) -> Option<(usize, &Free<F>)> {
        self.by_offset
            .range(..=offset)
            .next_back()
            .map(|(&o, f)| (o, f))
    }

    fn unlink(&mut self, offset: usize) -> Option<Free<F>> {
        Many::unlink(self, offset)
    }

    fn link(&mut self, offset: usize, f: Free<F>) {
        Many::link(self, offset, f);
    }

    fn insert_tagged(&mut self, offset: usize, f: Free<F>, keep_tag: bool, walls: &impl Walls) {
        Many::insert_tagged(self, offset, f, keep_tag, walls);
    }

    fn join_settled(&self) -> bool {
        self.join_settled
    }

    fn empty(join_settled: bool) -> Self {
        Self {
            by_offset: BTreeMap::new(),
            by_size: BTreeSet::new(),
            free_bytes: 0,
            pending_bytes: 0,
            join_settled,
        }
    }

    fn len(&self) -> usize {
        self.by_offset.len()
    }

    fn into_blocks(self) -> impl Iterator<Item = (usize, Free<F>)> {
        self.by_offset.into_iter()
    }
}
