//! What an arena's sleep keeps: what is asleep (the runs given back, the
//! frees made meanwhile, a pageable sleep's copies), the stash, the backups
//! a wake kept, and the spill settings; with the verbs the arena asks by.

use super::backup::Backup;
use super::SleepMode;
#[cfg(doc)]
use super::WakeDesc;
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::location::Location;
use crate::order::FenceSet;
use crate::pool::ChunkPool;

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
            freed: Vec::new(),
        }
    }

    /// Bytes of the discarded runs.
    pub(super) fn discarded_bytes(&self) -> usize {
        self.runs.iter().map(|r| r.1).sum()
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
    /// The copy of the data a stashing, pageable or disk sleep keeps, and
    /// which of its stores holds the readable one now.
    pub(super) backup: Backup<B>,
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
            backup: Backup::default(),
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
        (
            discarded,
            self.backup.stash_bytes(),
            self.backup.pages_bytes(),
        )
    }

    /// The stash's pieces go to `give` (the arena's drop: their copies were
    /// waited for when they were made).
    pub(crate) fn close(&mut self, give: impl FnMut(B::Chunk, usize, Location)) {
        if let Some(stash) = self.backup.stash.as_mut() {
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
        // Pageable copies kept past a wake go back to the system too; a
        // pageable sleep's own copies hold its data until the wake.
        let asleep_paged = self.mode().is_some_and(|m| m.pages());
        let kept = match asleep_paged {
            true => 0,
            false => self.backup.drop_pages(),
        };
        Ok(kept + self.backup.drop_stash(pool)?)
    }

    /// The stash's chunk count (tests).
    #[cfg(all(test, target_os = "linux"))]
    pub(crate) fn stash_pieces(&self) -> usize {
        self.backup
            .stash
            .as_ref()
            .map_or(0, |x| x.table.chunk_count())
    }
}
