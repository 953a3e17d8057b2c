//! Reading what a stashing or pageable sleep kept: while the arena is
//! asleep, and after a wake that kept it (`WakeDesc::keep_backup`).

use super::plan::pages_bytes;
use super::SleepState;
use crate::backend::pages::PageableBuf;
use crate::backend::Backend;
use crate::error::Result;
use crate::pool::{ChunkPool, ChunkSource};
use crate::region::Region;

/// The copy of an arena's data that a stashing, pageable or disk sleep
/// keeps away from the device: one type behind the three modes. The stash
/// (pinned host pieces mapped at the arena's own offsets in a reservation
/// of their own) stays from one sleep to the next; pageable or file copies
/// hold a sleep's data until its wake, stay readable after a wake that
/// keeps them, and serve the next pageable sleep again. `holds` says which
/// store has the copy a reader may see now: the last sleep's, never an
/// older one.
pub(crate) struct Backup<B: Backend> {
    /// The stash, made on the first stashing sleep.
    pub(super) stash: Option<Region<B>>,
    /// Pageable or file copies, `(offset, buffer)` in address order.
    pub(super) pages: Vec<(usize, PageableBuf)>,
    /// Which store holds the readable copy.
    pub(super) holds: Holds,
}

/// Which store of a [`Backup`] holds the readable copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Holds {
    /// None: awake without a kept copy, asleep keeping or discarding.
    Nothing,
    /// The stash (asleep stashed, or its wake kept it).
    Stash,
    /// The pages (asleep pageable or on disk, or its wake kept them).
    Pages,
}

impl<B: Backend> Default for Backup<B> {
    fn default() -> Self {
        Self {
            stash: None,
            pages: Vec::new(),
            holds: Holds::Nothing,
        }
    }
}

impl<B: Backend> Backup<B> {
    /// Bytes of the stash's pinned pieces.
    pub(super) fn stash_bytes(&self) -> usize {
        self.stash.as_ref().map_or(0, |x| x.table.mapped_bytes())
    }

    /// Bytes of the pageable or file copies.
    pub(super) fn pages_bytes(&self) -> usize {
        pages_bytes(&self.pages)
    }

    /// The pageable or file copies go back to the system; what they held
    /// is no longer readable. Returns their bytes.
    pub(super) fn drop_pages(&mut self) -> usize {
        if self.holds == Holds::Pages {
            self.holds = Holds::Nothing;
        }
        pages_bytes(&std::mem::take(&mut self.pages))
    }

    /// Gives the stash's pieces to `pool` (the caller has made sure the
    /// arena does not sleep stashed); what it held is no longer readable.
    pub(super) fn drop_stash(&mut self, pool: &ChunkPool<B>) -> Result<usize> {
        if self.holds == Holds::Stash {
            self.holds = Holds::Nothing;
        }
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

    /// The readable copy now.
    fn source(&mut self) -> Option<Source<'_, B>> {
        match self.holds {
            Holds::Nothing => None,
            Holds::Stash => self.stash.as_mut().map(Source::Stash),
            Holds::Pages => Some(Source::Pages(&self.pages)),
        }
    }
}

/// Where the backup of an arena lies now.
enum Source<'a, B: Backend> {
    /// A pageable sleep's copies, `(offset, buffer)` in address order.
    Pages(&'a [(usize, PageableBuf)]),
    /// The stash.
    Stash(&'a mut Region<B>),
}

impl<B: Backend, F> SleepState<B, F> {
    /// Copies the backup of `[offset, offset + dst.len())` into `dst`:
    /// true; false, with `dst` untouched, when no backup readable now holds
    /// every byte of it (see [`Arena::read_backup`](crate::Arena::read_backup)).
    pub(crate) fn read_backup(
        &mut self,
        backend: &B,
        offset: usize,
        dst: &mut [u8],
    ) -> Result<bool> {
        let end = offset + dst.len();
        match self.backup.source() {
            None => Ok(false),
            Some(Source::Pages(paged)) => Ok(read_pages(paged, offset, dst)),
            Some(Source::Stash(stash)) => {
                if !grant_stash(backend, stash, offset, end)? {
                    return Ok(false);
                }
                if !dst.is_empty() {
                    backend.read(stash.res(), offset, dst)?;
                }
                Ok(true)
            }
        }
    }

    /// The host address of the backup of `offset..end` (not empty), whole
    /// and readable by the CPU, or `None` (see
    /// [`Arena::backup_address`](crate::Arena::backup_address)).
    pub(crate) fn backup_address(
        &mut self,
        backend: &B,
        offset: usize,
        end: usize,
    ) -> Result<Option<u64>> {
        match self.backup.source() {
            None => Ok(None),
            Some(Source::Pages(paged)) => {
                let i = paged.partition_point(|(o, b)| o + b.len() <= offset);
                Ok(paged
                    .get(i)
                    .filter(|(o, b)| *o <= offset && end <= o + b.len())
                    .map(|(o, b)| b.address() + (offset - o) as u64))
            }
            Some(Source::Stash(stash)) => {
                Ok(grant_stash(backend, stash, offset, end)?.then(|| stash.base() + offset as u64))
            }
        }
    }

    /// Whether a backup readable now holds every byte of `offset..end`.
    pub(crate) fn holds_backup(&mut self, offset: usize, end: usize) -> bool {
        match self.backup.source() {
            None => false,
            Some(Source::Pages(paged)) => pages_hold(paged, offset, end),
            Some(Source::Stash(stash)) => stash_holds(stash, offset, end),
        }
    }
}

/// Whether the stash holds every byte of `offset..end`; if so (and the
/// range is not empty), the host's access to the pieces that hold them is
/// given first (the stash is mapped
/// for the device; the CPU, and the driver's synchronous copies, fault
/// reading it otherwise).
fn grant_stash<B: Backend>(
    backend: &B,
    stash: &mut Region<B>,
    offset: usize,
    end: usize,
) -> Result<bool> {
    if !stash_holds(stash, offset, end) {
        return Ok(false);
    }
    if end > offset {
        let (res, table) = stash.parts();
        crate::migration::grant_cpu(backend, res, table, offset, end - offset)?;
    }
    Ok(true)
}

/// Whether the stash holds every byte of `offset..end`.
fn stash_holds<B: Backend>(stash: &Region<B>, offset: usize, end: usize) -> bool {
    let held: usize = stash
        .table
        .overlapping(offset..end)
        .map(|(o, e)| (o + e.bytes).min(end) - o.max(offset))
        .sum();
    held == end - offset
}

/// Whether a pageable sleep's copies hold every byte of `offset..end`.
fn pages_hold(paged: &[(usize, PageableBuf)], offset: usize, end: usize) -> bool {
    let first = paged.partition_point(|(o, b)| o + b.len() <= offset);
    let mut at = offset;
    for (o, b) in &paged[first..] {
        if at >= end || *o > at {
            break;
        }
        at = (o + b.len()).min(end);
    }
    at >= end
}

/// Copies `[offset, offset + dst.len())` out of a pageable sleep's copies
/// (`(offset, buffer)` in address order, side by side where runs of two
/// sleeps meet): true if they hold every byte of it, else false with `dst`
/// untouched.
fn read_pages(paged: &[(usize, PageableBuf)], offset: usize, dst: &mut [u8]) -> bool {
    let end = offset + dst.len();
    // The copies that overlap the range, in order, must tile it.
    let first = paged.partition_point(|(o, b)| o + b.len() <= offset);
    let mut at = offset;
    let mut parts = Vec::new();
    for (o, b) in &paged[first..] {
        if at >= end || *o > at {
            break;
        }
        let to = (o + b.len()).min(end);
        parts.push((at, &b.as_slice()[at - o..to - o]));
        at = to;
    }
    if at < end {
        return false;
    }
    for (from, src) in parts {
        dst[from - offset..from - offset + src.len()].copy_from_slice(src);
    }
    true
}
