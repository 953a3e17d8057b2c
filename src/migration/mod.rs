//! Moving chunks to another placement at the same addresses: the engine
//! behind [`GrowableBuffer::execute`](crate::GrowableBuffer::execute) and
//! [`Arena::offload`](crate::Arena::offload). Safe code over the backend
//! trait; the callers own the locking and the waiting for users.
//!
//! On VMM memory a chunk's placement is fixed when it is created, so a move
//! is: create the new chunk, map it at a temporary address, copy, then swap
//! it in at the old address (unmap, map, set access) and release the old one.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::location::{AccessDesc, Location};
use crate::pool::ChunkSource;
use crate::region::Region;

mod pipeline;
mod plan;

use crate::location::driver_access_for;
use crate::table::ChunkTable;
pub use plan::{MigrationPlan, MigrationPolicy};

/// What a migration did, and where its time went.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct MigrationReport {
    /// Chunks that changed placement.
    pub chunks_moved: usize,
    /// Bytes copied.
    pub bytes_moved: usize,
    /// Getting the new chunks: from the pool, or created (pinning host
    /// pages is the slow part of that).
    pub acquire_time: Duration,
    /// Mapping them at a temporary address, granting the GPU access and
    /// queueing their copies.
    pub stage_time: Duration,
    /// Waiting for the copies: the part of the copying that the driver
    /// calls of the other phases did not hide (they overlap it).
    pub copy_time: Duration,
    /// Unmapping each new chunk from the temporary address and swapping it
    /// in at its own (unmap the old, map, access).
    pub swap_time: Duration,
    /// Handing the old chunks to the pool or releasing them.
    pub dispose_time: Duration,
}

impl MigrationReport {
    /// The time of all phases.
    pub fn total_time(&self) -> Duration {
        self.acquire_time + self.stage_time + self.copy_time + self.swap_time + self.dispose_time
    }
}

/// Checks that chunks of a reservation of `granularity` can be placed at
/// `to`: its granularity must divide theirs.
pub(crate) fn check_placement<B: Backend>(
    backend: &B,
    granularity: usize,
    to: Location,
) -> Result<()> {
    let g = backend.granularity(to)?;
    if !granularity.is_multiple_of(g) {
        return Err(Error::Unsupported {
            what: format!("placement {to}: its granularity {g} does not divide {granularity}"),
        });
    }
    Ok(())
}

/// A failed move: the error, and, when undoing it failed too, why and the
/// chunks that may still be mapped (never to be pooled or released while
/// the reservation lives). The caller poisons itself with them.
pub(crate) struct MoveFailure<C> {
    pub(crate) error: Error,
    pub(crate) poison: Option<(String, Vec<C>)>,
}

impl<C> From<Error> for MoveFailure<C> {
    fn from(error: Error) -> Self {
        Self {
            error,
            poison: None,
        }
    }
}

/// Moves chunks of one reservation.
pub(crate) struct Mover<'a, B: Backend> {
    pub(crate) backend: &'a B,
    /// Alignment of the temporary reservation.
    pub(crate) granularity: usize,
    /// Where new chunks come from and old ones go (a pool, or the driver).
    pub(crate) source: &'a dyn ChunkSource<B>,
    /// New chunks are created exportable (a shareable buffer's).
    pub(crate) shareable: bool,
    /// The old chunks may be mapped by another process (the buffer was
    /// shared): they are released, never pooled, so no other buffer here
    /// gets memory a peer still reads.
    pub(crate) release_old: bool,
    /// Old chunks that were joined with others into one new chunk are
    /// released, not pooled: their sizes will not come back (an arena's
    /// sleep keeps only its pieces for the next one).
    pub(crate) release_joined: bool,
}

/// A group swapped in: its offset and bytes, and the old chunks' entries,
/// kept until every swap has succeeded.
type Swapped<C> = (usize, usize, Vec<(usize, crate::table::Entry<C>)>);

/// A range that one new chunk at `to` replaces: whole old chunks of one
/// placement and one access list, adjacent, tiling `[offset, offset +
/// bytes)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Group {
    pub(crate) offset: usize,
    pub(crate) bytes: usize,
    pub(crate) to: Location,
}

impl<B: Backend> Mover<'_, B> {
    /// Hands a chunk that is not mapped back to the source.
    pub(crate) fn dispose(&self, chunk: B::Chunk, bytes: usize, placement: Location) {
        let _ = self.source.give(placement, bytes, chunk); // logged inside
    }

    /// Disposes of an old chunk once its move has succeeded.
    fn dispose_old(&self, chunk: B::Chunk, bytes: usize, placement: Location) {
        if self.release_old {
            let _ = self.source.release(chunk); // logged inside
        } else {
            self.dispose(chunk, bytes, placement);
        }
    }

    /// Moves the chunk at each offset of `targets` to its location, keeping
    /// data and addresses. The users of those chunks must have finished.
    ///
    /// First every new chunk is acquired (the step that may run out of
    /// memory). Then a pipeline: chunk i is mapped at a temporary address
    /// and its copy queued (one chunk per copy: a copy never spans a host
    /// and a device chunk), while chunk i-1, whose copy has finished, is
    /// swapped in at its own address; so the CPU's driver calls overlap the
    /// copy engine's work. The old chunks go only once every swap has
    /// succeeded.
    ///
    /// All or nothing: on error every chunk is swapped back and the table
    /// is as before, unless undoing fails too, which poisons the region
    /// (the one rule for a failed undo: see [`Region::poison`]). The steps
    /// are `pipeline.rs`'s.
    pub(crate) fn run(
        &self,
        region: &mut Region<B>,
        targets: &BTreeMap<usize, Location>,
    ) -> Result<MigrationReport> {
        let groups: Vec<Group> = targets
            .iter()
            .filter_map(|(&offset, &to)| {
                let bytes = region.table.get(offset)?.bytes;
                Some(Group { offset, bytes, to })
            })
            .collect();
        self.run_groups(region, &groups)
    }

    /// Moves each group's chunks into one new chunk at its location,
    /// keeping data and addresses: [`run`](Self::run) where several small
    /// chunks become one. Each group must tile its range with whole chunks
    /// of one placement, one access list and one CPU grant
    /// ([`Error::InvalidArgument`] otherwise, before anything moves).
    pub(crate) fn run_groups(
        &self,
        region: &mut Region<B>,
        groups: &[Group],
    ) -> Result<MigrationReport> {
        check_groups(&region.table, groups)?;
        // A map hook hears that each moving range is going before its
        // chunks change, and of what is mapped there afterwards (moved or,
        // after a failure, put back).
        let ranges: Vec<(usize, usize)> = groups.iter().map(|g| (g.offset, g.bytes)).collect();
        region.with_spans_cut(&ranges, |region| {
            let (res, table) = region.parts();
            match pipeline::run(self, res, table, groups) {
                Ok(report) => Ok(report),
                Err(MoveFailure { error, poison }) => {
                    if let Some((why, stuck)) = poison {
                        region.poison(why, stuck);
                    }
                    Err(error)
                }
            }
        })
    }
}

/// Checks that each group tiles its range with whole chunks of one
/// placement, access list and CPU grant, and that groups do not overlap.
fn check_groups<C>(table: &ChunkTable<C>, groups: &[Group]) -> Result<()> {
    let mut last_end = 0usize;
    for (i, g) in groups.iter().enumerate() {
        let bad = |why: &str| {
            Err(Error::invalid(format!(
                "move group {:#x}+{:#x}: {why} (a bug)",
                g.offset, g.bytes
            )))
        };
        if g.bytes == 0 || (i > 0 && g.offset < last_end) {
            return bad("empty, or overlapping the one before");
        }
        last_end = g.offset + g.bytes;
        let Some(first) = table.get(g.offset) else {
            return bad("no chunk starts there");
        };
        let mut at = g.offset;
        for (o, e) in table.overlapping(g.offset..last_end) {
            if o != at
                || e.placement != first.placement
                || e.cpu != first.cpu
                || e.access[..] != first.access[..]
            {
                return bad("not tiled by chunks of one placement and access");
            }
            at += e.bytes;
        }
        if at != last_end {
            return bad("its last chunk ends elsewhere");
        }
    }
    Ok(())
}

/// Gives the driver the host's access entry for every host-placed chunk in
/// `[offset, offset + bytes)` that was left without one (see
/// `Entry::cpu`): before a CPU view, and before a synchronous copy to or
/// from host memory, which the driver does with the CPU (without the entry
/// it faults inside libcuda).
pub(crate) fn grant_cpu<B: Backend>(
    backend: &B,
    res: &mut B::Reservation,
    table: &mut ChunkTable<B::Chunk>,
    offset: usize,
    bytes: usize,
) -> Result<()> {
    let lazy: Vec<(usize, usize, Vec<AccessDesc>)> = table
        .overlapping(offset..offset.saturating_add(bytes))
        .filter(|(_, e)| e.placement == Location::Host && !e.cpu)
        .map(|(o, e)| (o, e.bytes, driver_access_for(&e.access, e.placement, true)))
        .collect();
    for (o, b, list) in lazy {
        backend.set_access(res, o, b, &list)?;
        if let Some(e) = table.get_mut(o) {
            e.cpu = true;
        }
    }
    Ok(())
}
