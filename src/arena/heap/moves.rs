//! The heap's side of the moves experiment (see `arena/moves.rs`): which
//! whole free chunks a growth may take from elsewhere (a plan, their bytes
//! carved out of the free blocks), and the free blocks once the region has
//! moved some of them (the plan's commit).

use super::*;

/// Free chunks carved out for a growth, to be moved by the region (see
/// [`Heap::plan_moves`]).
pub(in crate::arena) struct MovePlan {
    /// The stream the growth is for, and the one number of the move on it:
    /// every use of a pending donor was queued on it before.
    key: StreamKey,
    seq: u64,
    /// The donors, in order: `(offset, bytes, zone, settled)`.
    donors: Vec<(usize, usize, usize, bool)>,
}

use crate::region::Move;

impl MovePlan {
    /// Whether nothing is to move.
    pub(in crate::arena) fn is_empty(&self) -> bool {
        self.donors.is_empty()
    }

    /// The moves, to `[at, ...)` in order: adjacent destinations share
    /// their access call, adjacent settled donors their unmap.
    pub(in crate::arena) fn moves(&self, at: usize) -> Vec<Move> {
        let mut to = at;
        self.donors
            .iter()
            .map(|&(o, b, _, settled)| {
                let m = (o, to, (!settled).then_some((self.key, self.seq)));
                to += b;
                m
            })
            .collect()
    }

    /// The old addresses of the first `n` donors that nothing may still
    /// use (settled ones): unmapped at once.
    pub(in crate::arena) fn settled_of(&self, n: usize) -> Vec<usize> {
        self.donors[..n]
            .iter()
            .filter(|p| p.3)
            .map(|p| p.0)
            .collect()
    }
}

impl<F> Heap<F> {
    /// Carves out of the free blocks up to `need` bytes of whole chunks
    /// that `key` may take now (settled, or freed on `key` alone), none
    /// inside `keep` (the free block the growth extends) nor across the
    /// zones' border. `chunks(offset, bytes)` lists the whole chunks of the
    /// right placement inside a free block, `(offset, bytes)`.
    pub(in crate::arena) fn plan_moves(
        &mut self,
        key: StreamKey,
        need: usize,
        keep: &std::ops::Range<usize>,
        chunks: impl Fn(usize, usize) -> Vec<(usize, usize)>,
    ) -> MovePlan {
        // Pending memory moved after the free block the request extends
        // joins it only as `key`'s pending block too: that block is marked
        // as the moved memory is, which it must allow.
        let pending_ok = keep.is_empty() || self.covers_for(keep.start, keep.len(), key);
        let mut donors: Vec<(usize, usize)> = Vec::new();
        for (o, f) in self.free_blocks() {
            if f.settled() || (pending_ok && f.stream == Some(key) && f.fences.only_on(key)) {
                let outside = |&(co, b): &(usize, usize)| co + b <= keep.start || co >= keep.end;
                donors.extend(chunks(o, f.size).into_iter().filter(outside));
            }
        }
        let mut plan = MovePlan {
            key,
            seq: 0,
            donors: Vec::new(),
        };
        if donors.is_empty() {
            return plan;
        }
        plan.seq = crate::order::stamp(key);
        let seq = plan.seq;
        let mut planned = 0;
        for (o, b) in donors {
            let z = self.zone_of_offset(o);
            if planned + b > need || self.zone_of_offset(o + b - 1) != z {
                continue;
            }
            if let Some(settled) = self.carve_for(z, o, b, key, || marks(key, seq)) {
                plan.donors.push((o, b, z, settled));
                planned += b;
                if planned == need {
                    break;
                }
            }
        }
        plan
    }

    /// The region moved the first `n` donors of `plan` to zone `z` from
    /// `at` on: they are free there, the others free where they were. A
    /// settled donor is free for any stream; a pending one is `key`'s alone
    /// until the move's mark has passed (owed on `key`, whose next call
    /// covers it), and so is then the block the growth extends (`keep`),
    /// so that it joins the moved memory. The bytes moved.
    pub(in crate::arena) fn commit_moves(
        &mut self,
        plan: MovePlan,
        n: usize,
        z: usize,
        at: usize,
        keep: &std::ops::Range<usize>,
        walls: &impl Walls,
    ) -> usize {
        let MovePlan { key, seq, donors } = plan;
        // Those not moved first, back where they were; then the moved ones
        // at their new place, in order.
        let mut owed = false;
        for &(o, b, zz, settled) in &donors[n..] {
            owed |= self.put_donor(zz, o, b, settled, (key, seq), walls);
        }
        let mut to = at;
        for &(_, b, _, settled) in &donors[..n] {
            owed |= self.put_donor(z, to, b, settled, (key, seq), walls);
            to += b;
        }
        if owed {
            self.owe_wanted(key);
            let zk = self.zone_of_offset(keep.start);
            if !keep.is_empty()
                && self
                    .carve_for(zk, keep.start, keep.len(), key, || marks(key, seq))
                    .is_some()
            {
                self.insert_free(keep.start, pending(key, seq, keep.len()), walls);
            }
        }
        to - at
    }

    /// A donor's `bytes` free at `offset` of zone `z`: fresh if it was
    /// `settled`, else the move's stream's alone until its mark (`(key,
    /// seq)`) has passed. Whether it is owed.
    fn put_donor(
        &mut self,
        z: usize,
        offset: usize,
        bytes: usize,
        settled: bool,
        (key, seq): (StreamKey, u64),
        walls: &impl Walls,
    ) -> bool {
        if settled {
            self.insert_fresh_for(z, offset, bytes, key, walls);
            return false;
        }
        self.insert_free(offset, pending(key, seq, bytes), walls);
        true
    }
}

/// `size` free bytes that are `key`'s alone until the move's mark (`seq`
/// on `key`) has passed.
fn pending<F>(key: StreamKey, seq: u64, size: usize) -> Free<Mark<F>> {
    Free {
        size,
        stream: Some(key),
        fences: marks(key, seq),
    }
}

/// The move's mark on `key`: owed, numbered `seq`.
fn marks<F>(key: StreamKey, seq: u64) -> FenceSet<Mark<F>> {
    let mut set = FenceSet::default();
    set.add(owed::owed_at(key, seq));
    set
}
