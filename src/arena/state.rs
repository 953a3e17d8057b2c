//! The arena's state under its lock: its heap, region, counts, placement
//! and access, and what its sleep keeps; and where a freed block goes back.

use super::blocks::{Free, StreamKey};
use super::heap::Heap;
use super::owed::{self, Mark};
use super::stats::{ArenaStats, SplitCount};
use super::{allocation, ArenaDesc};
use crate::backend::Backend;
use crate::location::{AccessDesc, Location};
use crate::plan::round_up;
use crate::region::Region;
use crate::sleep::SleepState;

pub(super) struct State<B: Backend> {
    /// What is free, live and held: bookkeeping only (see [`heap`]).
    pub(super) heap: Heap<B::Fence>,
    /// The reservation, its chunks, poison and quarantine.
    pub(super) region: Region<B>,
    /// Allocated bytes per chunk: the inactive split, kept per operation.
    pub(super) split: SplitCount,
    pub(super) stats: ArenaStats,
    /// Where new chunks go now: the arena's placement, or the host while
    /// asleep keeping the data.
    pub(super) placement: Location,
    /// Who new chunks are mapped for: the home device, the host (granted
    /// to the driver only where a copy needs it) and, with
    /// [`ArenaDesc::peer_access`] or after [`Arena::grant_peer_access`],
    /// the peers.
    pub(super) access: Vec<AccessDesc>,
    /// What the sleep keeps: what is asleep, the stash, the backups kept
    /// past a wake (see [`crate::sleep`]).
    pub(super) sleep: SleepState<B, Mark<B::Fence>>,
}

impl<B: Backend> State<B> {
    /// A new arena's state over `region` (granularity `g`): an empty heap
    /// whose small zone is the reservation's first eighth.
    pub(super) fn new(
        region: Region<B>,
        g: usize,
        desc: &ArenaDesc,
        placement: Location,
        access: Vec<AccessDesc>,
    ) -> Self {
        let reserved = region.table.reserved();
        let small_end = round_up(reserved / 8, g).unwrap_or(reserved).min(reserved);
        Self {
            heap: Heap::new(small_end, !desc.release_before_map),
            region,
            split: SplitCount::default(),
            stats: ArenaStats::default(),
            placement,
            access,
            sleep: SleepState::default(),
        }
    }
    /// Bookkeeping of a free of `[offset, offset + size)`.
    pub(super) fn note_free(&mut self, offset: usize, size: usize) {
        self.split.change(&self.region.table, offset, size, false);
    }

    /// The freed block `[offset, offset + size)` goes back behind `fences`
    /// (only `stream` may take it before they pass): into the free index,
    /// or, where a sleep gave its memory back, to the free bytes of the
    /// wake. A block over both (a sleep cut short between its chunks) is
    /// cut there: its awake parts join the free index with the fences; the
    /// discarded parts need none (the sleep waited for the work queued
    /// before it, and nothing reaches unmapped bytes since).
    pub(super) fn give_back_block(
        &mut self,
        offset: usize,
        size: usize,
        stream: Option<StreamKey>,
        fences: crate::order::FenceSet<Mark<B::Fence>>,
    ) {
        self.note_free(offset, size);
        let awake = self.sleep.awake_parts(offset, size);
        if awake
            .as_ref()
            .is_none_or(|a| a.len() == 1 && a[0] == (offset..offset + size))
        {
            let State { heap, region, .. } = self;
            heap.insert_free(
                offset,
                Free {
                    size,
                    stream,
                    fences,
                },
                &region.walls(),
            );
            return;
        }
        let awake = awake.expect("asleep");
        let mut fences = Some(fences);
        if awake.is_empty() {
            self.sleep.note_free(offset, size, fences.take());
        } else {
            self.sleep.note_free(offset, size, Some(Default::default()));
        }
        for (i, r) in awake.iter().enumerate() {
            let f = if i + 1 == awake.len() {
                fences.take().unwrap_or_default()
            } else {
                // The fences go with the last part; an earlier one waits
                // for a device synchronisation instead (owed on a key no
                // stream has), which covers the same work.
                let gone = allocation::GONE_KEY;
                self.heap.owe_wanted(gone);
                let mut f = crate::order::FenceSet::default();
                f.add(owed::owed_at(gone, crate::order::stamp(gone)));
                f
            };
            let State { heap, region, .. } = &mut *self;
            heap.insert_free(
                r.start,
                Free {
                    size: r.end - r.start,
                    stream,
                    fences: f,
                },
                &region.walls(),
            );
        }
    }
}
