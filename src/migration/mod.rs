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

use crate::table::{driver_access_for, ChunkTable};
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
}

/// A chunk swapped in: its offset, and the old chunk with its old placement
/// and CPU grant, kept until every swap has succeeded.
type Swapped<C> = (usize, C, Location, bool);

impl<B: Backend> Mover<'_, B> {
    /// Hands a chunk that is not mapped back to the source.
    pub(crate) fn dispose(&self, chunk: B::Chunk, bytes: usize, placement: Location) {
        let _ = self.source.give(placement, bytes, chunk); // logged inside
    }

    fn take(&self, to: Location, bytes: usize) -> Result<B::Chunk> {
        self.source.take(self.shareable, to, bytes)
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
        let (res, table) = region.parts();
        match pipeline::run(self, res, table, targets) {
            Ok(report) => Ok(report),
            Err(MoveFailure { error, poison }) => {
                if let Some((why, stuck)) = poison {
                    region.poison(why, stuck);
                }
                Err(error)
            }
        }
    }
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
