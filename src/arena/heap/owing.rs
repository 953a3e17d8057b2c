//! The heap's deferred frees (see [`owed`](super::owed)): a free numbered on
//! its stream with no fence yet, and the later fence (a cover) that stands
//! for the frees before it; and the waits on fences a free block carries.

use super::owed::{Fences, JOINED_BYTES};
use super::*;

impl<F> Heap<F> {
    /// Counts a free owed on `key` (numbered by the caller).
    pub(in crate::arena) fn owe(&mut self, key: StreamKey) {
        self.owed.owe(key);
    }

    /// Counts a free owed on `key` whose cover is wanted at `key`'s next
    /// call (not only after a batch).
    pub(in crate::arena) fn owe_wanted(&mut self, key: StreamKey) {
        self.owed.owe_wanted(key);
    }

    /// Whether a call on `key` should record a cover now.
    pub(in crate::arena) fn needs_cover(&self, key: StreamKey) -> bool {
        self.owed.needs_cover(key)
    }

    /// Every stream but `key` with frees owed records a cover at its next
    /// call (a miss: their blocks may then settle for the others).
    pub(in crate::arena) fn want_covers_but(&mut self, key: StreamKey) {
        self.owed.want_all_but(key);
    }

    /// A cover recorded on its stream: it stands for the frees owed there
    /// before it.
    pub(in crate::arena) fn cover(&mut self, cover: crate::order::Stamped<F>) {
        self.owed.cover(cover);
    }

    /// A cover recorded and already waited for.
    pub(in crate::arena) fn cover_passed(&mut self, cover: crate::order::Stamped<F>) {
        self.owed.cover_passed(cover);
    }

    /// Whether any free is owed with no cover recorded yet.
    pub(in crate::arena) fn any_uncovered(&self) -> bool {
        self.owed.any_uncovered()
    }

    /// Waits for all the device's work, which stands for every free owed
    /// (refused while a capture may be under way).
    pub(in crate::arena) fn synchronize<B: Fences<Fence = F>>(
        &mut self,
        backend: &B,
    ) -> Result<()> {
        self.owed.synchronize(backend)
    }

    /// Waits until every fence of `fences` has passed (an owed one through
    /// its cover, or a device synchronisation).
    pub(in crate::arena) fn wait_fences<B: Fences<Fence = F>>(
        &mut self,
        backend: &B,
        fences: &FenceSet<Mark<F>>,
    ) -> Result<()> {
        self.owed.wait_set(backend, fences)
    }

    /// Whether the mark `seq` on `key` has passed (`not_yet` keeps the
    /// streams found not passed, for one pass over many marks).
    pub(in crate::arena) fn mark_passed<B: Fences<Fence = F>>(
        &mut self,
        backend: &B,
        key: StreamKey,
        seq: u64,
        not_yet: &mut crate::order::NotYet,
    ) -> bool {
        self.owed.done_in(backend, key, seq, not_yet)
    }

    /// Waits until the mark `seq` on `key` has passed.
    pub(in crate::arena) fn wait_mark<B: Fences<Fence = F>>(
        &mut self,
        backend: &B,
        key: StreamKey,
        seq: u64,
    ) -> Result<()> {
        self.owed.wait(backend, key, seq)
    }

    /// A free owed on `key` just went back at `offset`: whether its cover
    /// should be recorded now, because the block it joined is large (all
    /// of it would otherwise stay `key`'s until `key`'s next call).
    pub(in crate::arena) fn cover_now_after(&self, offset: usize, key: StreamKey) -> bool {
        let z = self.zone_of_offset(offset);
        self.zones[z].size_at(offset) >= JOINED_BYTES && self.owed.needs_any_cover(key)
    }

    /// Instead of growing: waits on the CPU for the fences of a pending
    /// free block of zone `z`, of another stream than `key`, that fits
    /// `size`. Of several, the one whose newest fence has the lowest
    /// number: on one stream, the one that passes first; numbers of
    /// different streams are not comparable, so across streams this is
    /// only a tie-break. A block with a deferred free is a candidate once
    /// a cover stands for that free (the wait is on the cover's event);
    /// before, it is left alone: only a device-wide synchronisation could
    /// wait for it. `None` if there is no such block; else the wait's
    /// outcome (the caller settles the zone and takes a block).
    pub(in crate::arena) fn wait_for_pending<B: Fences<Fence = F>>(
        &mut self,
        backend: &B,
        z: usize,
        size: usize,
        key: StreamKey,
    ) -> Option<Result<()>> {
        let Self { zones, owed, .. } = self;
        let (_, f) = zones[z]
            .iter()
            .filter(|(_, f)| {
                f.size >= size
                    && !f.usable_by(key)
                    && f.fences.iter().all(|x| match x.fence {
                        Mark::Fence(_) => true,
                        Mark::Owed => owed.covered(x.key, x.seq),
                    })
            })
            .min_by_key(|(_, f)| f.fences.iter().map(|x| x.seq).max())?;
        Some(owed.wait_set(backend, &f.fences))
    }

    /// Waits for the fences of every free block still pending, and of the
    /// uses after a capture of every block graphs hold (their streams'
    /// work only: a device synchronisation only for a free owed with no
    /// cover), so that all of them settle.
    pub(in crate::arena) fn wait_pending<B: Fences<Fence = F>>(
        &mut self,
        backend: &B,
    ) -> Result<()> {
        let Self {
            zones,
            graphs,
            owed,
            ..
        } = self;
        for (_, f) in zones.iter().flat_map(|z| z.iter()) {
            owed.wait_set(backend, &f.fences)?;
        }
        for (_, h) in graphs.blocks() {
            owed.wait_set(backend, &h.fences)?;
        }
        Ok(())
    }

    /// Waits for the fences of every free block, each on its own (the
    /// arena's drop, before it unmaps): the failures, if any.
    pub(in crate::arena) fn wait_free_blocks<B: Fences<Fence = F>>(
        &mut self,
        backend: &B,
    ) -> Vec<crate::error::Error> {
        let Self { zones, owed, .. } = self;
        zones
            .iter()
            .flat_map(|z| z.iter())
            .filter_map(|(_, f)| owed.wait_set(backend, &f.fences).err())
            .collect()
    }
}
