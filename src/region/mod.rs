//! [`Region`]: one reservation and the chunks mapped in it, with the rules
//! every user of mapped memory shares: mapping a batch all or nothing,
//! unmapping, poisoning when an undo fails (the first reason stays; chunks
//! that may still be mapped are quarantined, never pooled), and one way to
//! give everything back, and the shared budget's count of what is mapped
//! (taken before chunks are made, given back as they unmap). Buffers,
//! arenas and importers hold a `Region`; what
//! differs between them (growth, free blocks, generations) stays with them.
#![deny(unsafe_code)]

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::hook::{MapHook, MappedRange};
use crate::location::{AccessDesc, Grants, Location};
use crate::pool::{Budget, BudgetHold};
use crate::table::{ChunkTable, Entry};

mod ghosts;
mod hooks;
mod map;

/// A failed mapping's error, and the chunks that came back unmapped (none
/// if the undo failed too and they were quarantined).
pub(crate) type Failed<C> = (Error, Vec<NewChunk<C>>);

/// A chunk a swap unmapped: its offset and table entry.
#[cfg(unix)]
pub(crate) type Removed<C> = (usize, Entry<C>);

/// A chunk to map a second time ([`Region::move_chunks`]): `(from, to,
/// the mark its old address waits for before it is unmapped)`.
pub(crate) type Move = (usize, usize, Option<(crate::StreamKey, u64)>);

/// A chunk about to be mapped: the chunk, its bytes and where it lives.
pub(crate) struct NewChunk<C> {
    pub(crate) chunk: C,
    pub(crate) bytes: usize,
    pub(crate) placement: Location,
}

/// One reservation of a backend and its chunk table.
pub(crate) struct Region<B: Backend> {
    backend: Arc<B>,
    /// `None` once closed.
    res: Option<B::Reservation>,
    /// The mapped chunks (holes allowed).
    pub(crate) table: ChunkTable<B::Chunk>,
    /// Set when a failure could not be undone: every later call answers
    /// [`Error::Poisoned`] with the first reason.
    poisoned: Option<String>,
    /// Chunks that may still be mapped: released only after the reservation
    /// is gone, never pooled.
    quarantine: Vec<B::Chunk>,
    /// The hook told of mappings, and the ranges it was told are mapped
    /// (offset -> bytes, placement): see [`crate::hook`].
    hook: Option<Arc<dyn MapHook>>,
    spans: BTreeMap<usize, (usize, Location)>,
    /// The budget shared with other regions: a mapping takes from it
    /// ([`hold`](Self::hold), before the chunks are made) and an unmapping
    /// or the close gives back.
    budget: Option<Arc<Budget>>,
    /// Ranges still mapped at the backend whose chunk was moved to another
    /// offset ([`move_chunks`](Self::move_chunks)) while work may still use
    /// the old address: offset -> (bytes, the mark after which they may
    /// go: a stream and a number in its order, `None` once nothing may use
    /// them). Not in the table (their memory is counted once, where it
    /// moved); no mapping goes there until [`unmap_ghosts`](Self::unmap_ghosts).
    ghosts: BTreeMap<usize, (usize, Option<(crate::StreamKey, u64)>)>,
}

impl<B: Backend> Region<B> {
    /// Reserves `bytes` aligned to `align`, with a table of `granularity`.
    pub(crate) fn reserve(
        backend: &Arc<B>,
        bytes: usize,
        align: usize,
        granularity: usize,
    ) -> Result<Self> {
        let table = ChunkTable::new(bytes, granularity)?;
        let res = backend.reserve(bytes, align)?;
        Ok(Self {
            backend: backend.clone(),
            res: Some(res),
            table,
            poisoned: None,
            quarantine: Vec::new(),
            hook: None,
            spans: BTreeMap::new(),
            budget: None,
            ghosts: BTreeMap::new(),
        })
    }

    /// Counts this region's mappings in `budget` from now on (set before
    /// anything is mapped).
    pub(crate) fn set_budget(&mut self, budget: Option<Arc<Budget>>) {
        debug_assert!(self.table.mapped_bytes() == 0, "a budget set after mapping");
        self.budget = budget;
    }

    /// The shared budget this region's mappings count in.
    pub(crate) fn budget(&self) -> Option<&Arc<Budget>> {
        self.budget.as_ref()
    }

    /// Holds `bytes` of the budget for a mapping about to be made (before
    /// its chunks are): `None` if they do not fit. Kept
    /// ([`BudgetHold::keep`]) once the mapping succeeded, they are this
    /// region's, given back as it unmaps them or closes; else the hold
    /// gives them back as it drops. Without a budget, always a hold.
    pub(crate) fn hold(&self, bytes: usize) -> Option<BudgetHold> {
        Budget::hold(self.budget.as_ref(), bytes)
    }

    /// The reservation's first address.
    pub(crate) fn base(&self) -> u64 {
        self.backend.base(self.res_ref())
    }

    pub(crate) fn res(&mut self) -> &mut B::Reservation {
        self.res
            .as_mut()
            .expect("a region's reservation lives until it closes")
    }

    pub(crate) fn res_ref(&self) -> &B::Reservation {
        self.res
            .as_ref()
            .expect("a region's reservation lives until it closes")
    }

    /// The reservation and the table at once (for the mover and CPU grants).
    pub(crate) fn parts(&mut self) -> (&mut B::Reservation, &mut ChunkTable<B::Chunk>) {
        (
            self.res
                .as_mut()
                .expect("a region's reservation lives until it closes"),
            &mut self.table,
        )
    }

    /// [`Error::Poisoned`] once a failure could not be undone.
    pub(crate) fn check_poison(&self) -> Result<()> {
        match &self.poisoned {
            Some(reason) => Err(Error::Poisoned {
                reason: reason.clone(),
            }),
            None => Ok(()),
        }
    }

    /// The one rule for a failed undo: the region answers
    /// [`Error::Poisoned`] from now on (the first reason stays), and `stuck`
    /// (chunks that may still be mapped) is kept out of every pool and
    /// released only after the reservation is gone.
    pub(crate) fn poison(&mut self, what: String, stuck: impl IntoIterator<Item = B::Chunk>) {
        tracing::error!(reason = %what, "vmmbuf: poisoned");
        self.quarantine.extend(stuck);
        self.poisoned.get_or_insert(what);
    }
}

/// Offsets free blocks must not join across, and that no block handed out
/// may straddle: the starts of the chunks of a region whose memory a map
/// hook registers chunk by chunk (an NCCL registration holds one physical
/// allocation; a tensor across two lies in none, and NCCL then treats it
/// as unregistered on that rank alone).
pub(crate) trait Walls {
    /// Whether a wall stands at `offset`.
    fn at(&self, offset: usize) -> bool;
    /// The first wall strictly between `start` and `end`.
    fn first_inside(&self, start: usize, end: usize) -> Option<usize>;
}

/// The walls of [`Region::walls`]: chunk starts, or none.
pub(crate) struct ChunkWalls<'a, C>(Option<&'a ChunkTable<C>>);

impl<C> Walls for ChunkWalls<'_, C> {
    #[inline]
    fn at(&self, offset: usize) -> bool {
        self.0.is_some_and(|t| t.starts_at(offset))
    }
    #[inline]
    fn first_inside(&self, start: usize, end: usize) -> Option<usize> {
        self.0.and_then(|t| t.start_between(start, end))
    }
}

impl<B: Backend> Drop for Region<B> {
    /// A region its owner did not close: nothing is known to have finished
    /// with its memory, so nothing is unmapped by hand or pooled.
    fn drop(&mut self) {
        self.close(false, |_, _, _| {});
    }
}

impl<B: Backend> std::fmt::Debug for Region<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("chunks", &self.table.chunk_count())
            .field("mapped", &self.table.mapped_bytes())
            .field("poisoned", &self.poisoned)
            .finish()
    }
}
