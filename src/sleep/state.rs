//! What an arena's sleep keeps: what is asleep (the runs given back, the
//! frees made meanwhile, a pageable sleep's copies), the stash, the backups
//! a wake kept, and the spill settings; with the verbs the arena asks by.

use super::plan::pages_bytes;
use super::SleepMode;
#[cfg(doc)]
use super::WakeDesc;
use crate::backend::pages::PageableBuf;
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::location::Location;
use crate::order::FenceSet;
use crate::pool::{ChunkPool, ChunkSource};
use crate::region::Region;

/// An arena asleep.
#[derive(Debug)]
pub(crate) struct Asleep<F> {
    pub(super) mode: SleepMode,
    /// The piece size of the sleep, for the wake.
    pub(super) piece: usize,
    /// Discard and stash: the runs given back, `(offset, bytes)` in address
    /// order. Nothing is mapped there until the wake, and nothing else may
    /// be.
    pub(super) runs: Vec<(usize, usize)>,
    /// Discard and stash: fences of the allocations in those runs freed
    /// while asleep.
    pub(super) frees: Vec<FenceSet<F>>,
    /// Discard and stash: blocks freed while asleep whose fence could not be
    /// recorded, `(offset, bytes)`: never handed out again.
    pub(super) lost: Vec<(usize, usize)>,
    /// Pageable: each run's data, `(offset, buffer)` in address order (one
    /// per run, as long as the run), until the wake.
    pub(super) paged: Vec<(usize, PageableBuf)>,
    /// The whole free chunks the sleeps gave back, `(offset, bytes)`, for
    /// a wake that maps them again ([`WakeDesc::restore_free`]).
    pub(super) freed: Vec<(usize, usize)>,
}

impl<F> Asleep<F> {
    pub(super) fn new(mode: SleepMode, piece: usize) -> Self {
        Self {
            mode,
            piece,
            runs: Vec::new(),
            frees: Vec::new(),
            lost: Vec::new(),
            paged: Vec::new(),
            freed: Vec::new(),
        }
    }

    /// Bytes of the discarded runs.
    pub(super) fn discarded_bytes(&self) -> usize {
        self.runs.iter().map(|r| r.1).sum()
    }

    /// Bytes of the pageable copies.
    pub(super) fn pageable_bytes(&self) -> usize {
        pages_bytes(&self.paged)
    }

    /// Whether `offset` lies in a discarded run.
    pub(super) fn discarded(&self, offset: usize) -> bool {
        let i = self.runs.partition_point(|&(o, _)| o <= offset);
        i > 0 && {
            let (o, b) = self.runs[i - 1];
            offset < o + b
        }
    }

    /// The parts of `[offset, offset + size)` in no discarded run (a block
    /// over both, after a sleep cut short between its chunks), in order.
    pub(super) fn awake_parts(&self, offset: usize, size: usize) -> Vec<std::ops::Range<usize>> {
        self.exclude(std::iter::once(offset..offset + size).collect())
    }

    /// Keeps a free's fences of a block in a discarded run: the wake waits
    /// for them before the bytes are handed out again.
    pub(super) fn note_free(&mut self, offset: usize, size: usize, fences: Option<FenceSet<F>>) {
        match fences {
            Some(f) => self.frees.push(f),
            None => self.lost.push((offset, size)),
        }
    }

    /// `gaps` without the discarded runs.
    pub(super) fn exclude(&self, gaps: Vec<std::ops::Range<usize>>) -> Vec<std::ops::Range<usize>> {
        crate::ranges::subtract(gaps, self.runs.iter().copied())
    }
}

/// What an arena's sleep keeps, owned here: the arena asks through its
/// verbs (is it asleep, which free bytes are awake, what it holds where);
/// `F` is the fence a free made while asleep carries.
pub(crate) struct SleepState<B: Backend, F> {
    /// Set while the arena sleeps.
    pub(super) asleep: Option<Asleep<F>>,
    /// Where [`SleepMode::Stash`] keeps the data: host pieces mapped at the
    /// arena's own offsets in a reservation of their own, kept from one
    /// sleep to the next.
    pub(super) stash: Option<Region<B>>,
    /// A pageable sleep's copies kept past its wake
    /// ([`WakeDesc::keep_backup`]), `(offset, buffer)` in address order:
    /// readable until the next sleep, which writes into them again.
    pub(super) kept_pages: Vec<(usize, PageableBuf)>,
    /// Whether the last wake kept the host copy (the stash or
    /// `kept_pages`) readable ([`WakeDesc::keep_backup`]).
    pub(super) backup_kept: bool,
    /// Where a [`SleepMode::Disk`] sleep writes its files
    /// ([`Arena::set_spill_dir`](crate::Arena::set_spill_dir)).
    pub(super) spill_dir: Option<std::path::PathBuf>,
    /// The most bytes one file of a disk sleep holds; 0: a file per chunk
    /// ([`Arena::set_spill_file_bytes`](crate::Arena::set_spill_file_bytes)).
    pub(super) spill_file_bytes: usize,
}

impl<B: Backend, F> Default for SleepState<B, F> {
    fn default() -> Self {
        Self {
            asleep: None,
            stash: None,
            kept_pages: Vec::new(),
            backup_kept: false,
            spill_dir: None,
            spill_file_bytes: 0,
        }
    }
}

impl<B: Backend, F> SleepState<B, F> {
    /// Whether the arena sleeps.
    pub(crate) fn is_asleep(&self) -> bool {
        self.asleep.is_some()
    }

    /// Refuses a sleep in `mode` while the arena sleeps in another (a sleep
    /// in the same mode takes what was woken or made since).
    pub(crate) fn check_mode(&self, mode: SleepMode) -> Result<()> {
        match &self.asleep {
            Some(a) if a.mode != mode => Err(Error::invalid(format!(
                "the arena sleeps in {} mode: wake it before a {} sleep",
                a.mode, mode
            ))),
            _ => Ok(()),
        }
    }

    /// The unmapped `regions` where growth may map: a discarded range stays
    /// unmapped until the wake.
    pub(crate) fn exclude(
        &self,
        regions: Vec<std::ops::Range<usize>>,
    ) -> Vec<std::ops::Range<usize>> {
        match &self.asleep {
            Some(a) => a.exclude(regions),
            None => regions,
        }
    }

    /// While asleep, the parts of a freed block `[offset, offset + size)`
    /// that are mapped (the rest was given back by the sleep); `None`
    /// awake.
    pub(crate) fn awake_parts(
        &self,
        offset: usize,
        size: usize,
    ) -> Option<Vec<std::ops::Range<usize>>> {
        self.asleep.as_ref().map(|a| a.awake_parts(offset, size))
    }

    /// A free made while asleep, of a block whose memory the sleep gave
    /// back (in part): its fences, waited for before the wake.
    pub(crate) fn note_free(&mut self, offset: usize, size: usize, fences: Option<FenceSet<F>>) {
        if let Some(a) = self.asleep.as_mut() {
            a.note_free(offset, size, fences);
        }
    }

    /// `(discarded, stash, pageable)` bytes: given back while asleep, in
    /// the stash's pinned pieces, and in pageable copies.
    pub(crate) fn held_bytes(&self) -> (usize, usize, usize) {
        let discarded = self.asleep.as_ref().map_or(0, |a| a.discarded_bytes());
        let stash = self.stash.as_ref().map_or(0, |x| x.table.mapped_bytes());
        let pageable =
            self.asleep.as_ref().map_or(0, |a| a.pageable_bytes()) + pages_bytes(&self.kept_pages);
        (discarded, stash, pageable)
    }

    /// The stash's pieces go to `give` (the arena's drop: their copies were
    /// waited for when they were made).
    pub(crate) fn close(&mut self, give: impl FnMut(B::Chunk, usize, Location)) {
        if let Some(stash) = self.stash.as_mut() {
            stash.close(true, give);
        }
    }

    /// How the arena sleeps; `None` while awake.
    pub(crate) fn mode(&self) -> Option<SleepMode> {
        self.asleep.as_ref().map(|a| a.mode)
    }

    /// Where a disk sleep writes its files (None: a disk sleep is refused).
    pub(crate) fn set_spill_dir(&mut self, dir: Option<std::path::PathBuf>) {
        self.spill_dir = dir;
    }

    /// The most bytes one file of a disk sleep holds (0: a file per chunk).
    pub(crate) fn set_spill_file_bytes(&mut self, bytes: usize) {
        self.spill_file_bytes = bytes;
    }

    /// Gives the stash's pinned pieces to `pool`, and a pageable copy a
    /// wake kept to the system; refused while asleep stashed (the stash
    /// holds the data). Returns the bytes.
    pub(crate) fn release(&mut self, pool: &ChunkPool<B>) -> Result<usize> {
        if self.mode() == Some(SleepMode::Stash) {
            return Err(Error::invalid(
                "the arena sleeps stashed: its stash holds the data until the wake",
            ));
        }
        // A pageable copy kept past a wake goes back to the system too.
        let kept = pages_bytes(&std::mem::take(&mut self.kept_pages));
        self.backup_kept = false;
        Ok(kept + self.drop_stash(pool)?)
    }

    /// Gives the stash's pieces to `pool` (the caller has made sure the
    /// arena does not sleep stashed).
    pub(super) fn drop_stash(&mut self, pool: &ChunkPool<B>) -> Result<usize> {
        let Some(stash) = self.stash.as_mut() else {
            return Ok(0);
        };
        let mut gone = 0;
        for (o, b) in stash.table.runs() {
            for (_, e) in stash.unmap(o, b)? {
                gone += e.bytes;
                let _ = pool.give(e.placement, e.bytes, e.chunk);
            }
        }
        Ok(gone)
    }

    /// The stash's chunk count (tests).
    #[cfg(all(test, target_os = "linux"))]
    pub(crate) fn stash_pieces(&self) -> usize {
        self.stash.as_ref().map_or(0, |x| x.table.chunk_count())
    }
}
