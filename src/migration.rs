//! Moving chunks to another placement at the same addresses: the engine
//! behind [`GrowableBuffer::execute`](crate::GrowableBuffer::execute) and
//! [`Arena::offload`](crate::Arena::offload). Safe code over the backend
//! trait; the callers own the locking and the waiting for users.
//!
//! On VMM memory a chunk's placement is fixed when it is created, so a move
//! is: create the new chunk, map it at a temporary address, copy, then swap
//! it in at the old address (unmap, map, set access) and release the old one.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::location::{Access, AccessDesc, Location};
use crate::pool::ChunkPool;
use crate::region::Region;
use crate::table::{cpu_at_once, driver_access_for, ChunkTable};

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
    /// Where new chunks come from first and old ones go; without a pool they
    /// are created and released.
    pub(crate) pool: Option<&'a ChunkPool<B>>,
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
    /// Hands a chunk that is not mapped to the pool, or releases it.
    pub(crate) fn dispose(&self, chunk: B::Chunk, bytes: usize, placement: Location) {
        match self.pool {
            Some(pool) => pool.put(placement, bytes, chunk),
            None => {
                if let Err(e) = self.backend.release(chunk) {
                    tracing::error!(error = %e, "vmmbuf: releasing a chunk failed");
                }
            }
        }
    }

    fn take(&self, to: Location, bytes: usize) -> Result<B::Chunk> {
        match self.pool {
            Some(pool) => pool.take_or_create(self.shareable, to, bytes),
            None => crate::backend::create_chunk(self.backend, self.shareable, bytes, to),
        }
    }

    /// Disposes of an old chunk once its move has succeeded.
    fn dispose_old(&self, chunk: B::Chunk, bytes: usize, placement: Location) {
        if self.release_old {
            if let Err(e) = self.backend.release(chunk) {
                tracing::error!(error = %e, "vmmbuf: releasing a chunk failed");
            }
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
    /// is as before, unless undoing fails too (see [`MoveFailure`]).
    /// Moves the chunks of `region` at the offsets `targets` names to their
    /// placements, at the same addresses, with their data. All or nothing:
    /// on error nothing moved, unless undoing failed too, which poisons the
    /// region (the one rule for a failed undo: see [`Region::poison`]).
    pub(crate) fn run(
        &self,
        region: &mut Region<B>,
        targets: &BTreeMap<usize, Location>,
    ) -> Result<MigrationReport> {
        let (res, table) = region.parts();
        match self.run_parts(res, table, targets) {
            Ok(report) => Ok(report),
            Err(MoveFailure { error, poison }) => {
                if let Some((why, stuck)) = poison {
                    region.poison(why, stuck);
                }
                Err(error)
            }
        }
    }

    fn run_parts(
        &self,
        res: &mut B::Reservation,
        table: &mut ChunkTable<B::Chunk>,
        targets: &BTreeMap<usize, Location>,
    ) -> std::result::Result<MigrationReport, MoveFailure<B::Chunk>> {
        let backend = self.backend;
        let home = backend.home();
        let size_of = |t: &ChunkTable<B::Chunk>, o: usize| t.get(o).map_or(0, |e| e.bytes);
        let total: usize = targets.keys().map(|&o| size_of(table, o)).sum();
        if total == 0 {
            return Ok(MigrationReport::default());
        }
        let mut report = MigrationReport::default();
        let mut tmp = backend.reserve(total, self.granularity)?;

        // Every new chunk first: failing here changes nothing.
        let t = Instant::now();
        let mut staged: Vec<Option<Staged<B::Chunk>>> = Vec::with_capacity(targets.len());
        let mut at = 0usize;
        for (&offset, &to) in targets {
            let bytes = size_of(table, offset);
            match self.take(to, bytes) {
                Ok(chunk) => staged.push(Some(Staged {
                    offset,
                    bytes,
                    chunk,
                    to,
                    at,
                })),
                Err(e) => {
                    for c in staged.into_iter().flatten() {
                        self.dispose(c.chunk, c.bytes, c.to);
                    }
                    let _ = backend.free(tmp);
                    return Err(e.into());
                }
            }
            at += bytes;
        }
        report.acquire_time = t.elapsed();

        // To the host from a GPU, the *old* (device) chunk is staged at the
        // temporary address, the new one swapped in at once and the copy runs
        // across: access on a device chunk is cheap to set, on a host chunk it
        // is not, and this sets it once, not twice.
        let n = staged.len();
        let source: Vec<bool> = staged
            .iter()
            .map(|c| {
                let c = c.as_ref().expect("nothing swapped yet");
                let from = table.get(c.offset).map_or(c.to, |e| e.placement);
                c.to == Location::Host
                    && from != Location::Host
                    && home != Location::Host
                    && backend.maps_a_chunk_twice()
            })
            .collect();
        // Which staged chunks' temporary ranges are mapped now, and where.
        let mut tmp_mapped = vec![false; n];
        let staged_span: Vec<(usize, usize)> = staged
            .iter()
            .map(|c| c.as_ref().map_or((0, 0), |c| (c.at, c.bytes)))
            .collect();
        let rw = [AccessDesc::new(home, Access::ReadWrite)];
        let mut failure: Option<Failed<B::Chunk>> = None;
        // Every old chunk to stage goes to the temporary range before any copy
        // is queued: setting access on device memory waits for the copies in
        // flight (H100: 0.6 ms per GiB idle, 17 with a copy running).
        let t = Instant::now();
        let mut i = 0;
        while i < n && failure.is_none() {
            let j = (i..n).find(|&j| !source[j]).unwrap_or(n);
            if i == j {
                i += 1;
                continue;
            }
            // Chunks i..j are sources, contiguous in the temporary range.
            let r = (i..j)
                .try_for_each(|k| {
                    let c = staged[k].as_ref().expect("nothing swapped yet");
                    let old = &table
                        .get(c.offset)
                        .expect("a staged chunk is in the table")
                        .chunk;
                    backend.map(&mut tmp, c.at, old)?;
                    tmp_mapped[k] = true;
                    Ok(())
                })
                .and_then(|()| {
                    let at = staged[i].as_ref().expect("staged").at;
                    let last = staged[j - 1].as_ref().expect("staged");
                    backend.set_access(&mut tmp, at, last.at + last.bytes - at, &rw)
                });
            if let Err(e) = r {
                failure = Some(Failed::Before(e));
            }
            i = j;
        }
        report.stage_time += t.elapsed();

        // The pipeline: chunk i's copy is queued while chunk i-1, whose copy
        // has finished, is finished.
        let mut done: Vec<Swapped<B::Chunk>> = Vec::new();
        let mut in_flight: Option<InFlight<B::Fence>> = None;
        for i in 0..=n {
            if failure.is_some() {
                break;
            }
            let prev = if i < n {
                let c = staged[i].as_ref().expect("not swapped yet");
                let (at, bytes, offset) = (c.at, c.bytes, c.offset);
                let r = if source[i] {
                    // Staged already: swap the new chunk in, copy into it.
                    let t = Instant::now();
                    let c = staged[i].take().expect("not swapped yet");
                    if let Err(f) = self.swap_in_place(c, res, table, &mut done, &mut report) {
                        failure = Some(f);
                        break;
                    }
                    report.swap_time += t.elapsed();
                    backend.copy(res, offset, &tmp, at, bytes)
                } else {
                    // Stage the new chunk and copy into it.
                    let t = Instant::now();
                    let r = backend
                        .map(&mut tmp, at, &c.chunk)
                        .inspect(|_| tmp_mapped[i] = true)
                        .and_then(|_| backend.set_access(&mut tmp, at, bytes, &rw))
                        .and_then(|_| backend.copy(&mut tmp, at, res, offset, bytes));
                    report.stage_time += t.elapsed();
                    r
                };
                match r.and_then(|_| backend.copies_fence()) {
                    Ok(f) => in_flight.replace((i, f, source[i], at, bytes)),
                    Err(e) => {
                        failure = Some(Failed::Before(e));
                        break;
                    }
                }
            } else {
                in_flight.take()
            };
            // The previous chunk's copy ran meanwhile: finish it.
            if let Some(prev) = prev {
                if let Err(f) = self.finish(
                    prev,
                    &mut staged,
                    &mut tmp,
                    &mut tmp_mapped,
                    res,
                    table,
                    &mut done,
                    &mut report,
                ) {
                    failure = Some(f);
                    break;
                }
            }
        }

        let Some(failure) = failure else {
            if let Err(e) = backend.free(tmp) {
                tracing::warn!(error = %e, "vmmbuf: freeing the temporary reservation failed");
            }
            // Every swap succeeded: the old chunks go (to the pool, if any).
            let t = Instant::now();
            for (o, old, old_place, _) in done {
                self.dispose_old(old, size_of(table, o), old_place);
            }
            report.dispose_time = t.elapsed();
            return Ok(report);
        };

        // Undo. Copies may still be in flight into the temporary mapping.
        let _ = backend.wait_copies();
        let mut stuck: Vec<B::Chunk> = Vec::new();
        let mut why: Option<String> = None;
        let error = match failure {
            Failed::Before(e) => e,
            Failed::Swap { error, stage, c } => {
                // This chunk: put its old chunk back.
                let entry = table.get(c.offset).expect("a staged chunk is in the table");
                let old_list = entry.driver_access();
                match undo_swap(
                    backend,
                    res,
                    c.offset,
                    c.bytes,
                    &entry.chunk,
                    &old_list,
                    stage,
                ) {
                    Ok(()) => self.dispose(c.chunk, c.bytes, c.to),
                    Err(u) => {
                        why = Some(format!(
                            "undoing a failed migration at {:#x}: {u}",
                            c.offset
                        ));
                        stuck.push(c.chunk);
                    }
                }
                error
            }
        };
        // The temporary range is unmapped chunk by chunk. A new chunk staged
        // there and not swapped is then pooled; if its unmap fails, released
        // (never pooled). An old chunk staged there (a source) stays in the
        // table, and the temporary token unmaps it as it drops.
        let mut stuck_at_tmp = vec![false; n];
        for (k, mapped) in tmp_mapped.iter().enumerate() {
            if *mapped {
                let (at, bytes) = staged_span[k];
                stuck_at_tmp[k] = backend.unmap(&mut tmp, at, bytes).is_err();
            }
        }
        for (k, c) in staged.into_iter().enumerate() {
            let Some(c) = c else { continue };
            if stuck_at_tmp[k] && !source[k] {
                let _ = backend.release(c.chunk);
            } else {
                self.dispose(c.chunk, c.bytes, c.to);
            }
        }
        // If an unmap failed, the token unmaps what it holds as it drops.
        let _ = backend.free(tmp);
        for (o, old, old_place, old_cpu) in done.into_iter().rev() {
            let bytes = size_of(table, o);
            let entry = table.get(o).expect("a swapped chunk is in the table");
            let old_list = driver_access_for(&entry.access, old_place, old_cpu);
            match undo_swap(backend, res, o, bytes, &old, &old_list, 2) {
                Ok(()) => {
                    table.set_placement(o, old_place);
                    let entry = table.get_mut(o).expect("a swapped chunk is in the table");
                    entry.cpu = old_cpu;
                    let new = std::mem::replace(&mut entry.chunk, old);
                    let new_place = *targets.get(&o).expect("a swapped chunk had a target");
                    self.dispose(new, bytes, new_place);
                }
                Err(u) => {
                    why.get_or_insert(format!("undoing a failed migration at {o:#x}: {u}"));
                    stuck.push(old);
                }
            }
        }
        tracing::debug!(error = %error, "vmmbuf: migration failed and was undone");
        Err(MoveFailure {
            error,
            poison: why.map(|w| (w, stuck)),
        })
    }

    /// Finishes chunk `i` once its copy is done: unmaps what sits at its
    /// temporary address, and (unless the old chunk was staged there and the
    /// new one is in place already) swaps the new chunk in at its own.
    #[allow(clippy::too_many_arguments)]
    fn finish(
        &self,
        (i, fence, source, at, bytes): InFlight<B::Fence>,
        staged: &mut [Option<Staged<B::Chunk>>],
        tmp: &mut B::Reservation,
        tmp_mapped: &mut [bool],
        res: &mut B::Reservation,
        table: &mut ChunkTable<B::Chunk>,
        done: &mut Vec<Swapped<B::Chunk>>,
        report: &mut MigrationReport,
    ) -> std::result::Result<(), Failed<B::Chunk>> {
        let backend = self.backend;
        let t = Instant::now();
        backend.wait(&fence).map_err(Failed::Before)?;
        report.copy_time += t.elapsed();
        let t = Instant::now();
        backend.unmap(tmp, at, bytes).map_err(Failed::Before)?;
        tmp_mapped[i] = false;
        if !source {
            let c = staged[i].take().expect("finished once");
            self.swap_in_place(c, res, table, done, report)?;
        }
        report.swap_time += t.elapsed();
        Ok(())
    }

    /// Swaps `c`'s new chunk in at its own address (unmap the old, map,
    /// access) and records the old one in `done`.
    fn swap_in_place(
        &self,
        c: Staged<B::Chunk>,
        res: &mut B::Reservation,
        table: &mut ChunkTable<B::Chunk>,
        done: &mut Vec<Swapped<B::Chunk>>,
        report: &mut MigrationReport,
    ) -> std::result::Result<(), Failed<B::Chunk>> {
        let backend = self.backend;
        let entry = table.get(c.offset).expect("a staged chunk is in the table");
        let cpu = cpu_at_once(backend.home(), c.to);
        let list = driver_access_for(&entry.access, c.to, cpu);
        if let Err((error, stage)) = swap_in(backend, res, c.offset, c.bytes, &c.chunk, &list) {
            return Err(Failed::Swap { error, stage, c });
        }
        let entry = table
            .get_mut(c.offset)
            .expect("a staged chunk is in the table");
        let old = std::mem::replace(&mut entry.chunk, c.chunk);
        let old_place = entry.placement;
        let old_cpu = std::mem::replace(&mut entry.cpu, cpu);
        table.set_placement(c.offset, c.to);
        done.push((c.offset, old, old_place, old_cpu));
        report.chunks_moved += 1;
        report.bytes_moved += c.bytes;
        Ok(())
    }
}

/// A chunk whose copy is queued: its index, the fence after the copy,
/// whether its old chunk was staged (source) or its new one, and its place
/// in the temporary range.
type InFlight<F> = (usize, F, bool, usize, usize);

/// A new chunk on its way: where it goes (`offset`, `to`) and where it sits
/// in the temporary range (`at`).
struct Staged<C> {
    offset: usize,
    bytes: usize,
    chunk: C,
    to: Location,
    at: usize,
}

/// Why the pipeline stopped: before chunk `c` was unmapped from its own
/// address (nothing of it to undo), or in its swap at `stage`.
enum Failed<C> {
    Before(Error),
    Swap {
        error: Error,
        stage: u8,
        c: Staged<C>,
    },
}

/// Unmaps the chunk at `offset` and maps `new` there with `access`. On
/// error, also says how far it got: 0 = old still mapped, 1 = nothing
/// mapped, 2 = new mapped.
fn swap_in<B: Backend>(
    backend: &B,
    res: &mut B::Reservation,
    offset: usize,
    bytes: usize,
    new: &B::Chunk,
    access: &[AccessDesc],
) -> std::result::Result<(), (Error, u8)> {
    backend.unmap(res, offset, bytes).map_err(|e| (e, 0))?;
    backend.map(res, offset, new).map_err(|e| (e, 1))?;
    backend
        .set_access(res, offset, bytes, access)
        .map_err(|e| (e, 2))
}

/// Puts `old` back at `offset` after a swap that got to `stage`.
fn undo_swap<B: Backend>(
    backend: &B,
    res: &mut B::Reservation,
    offset: usize,
    bytes: usize,
    old: &B::Chunk,
    old_access: &[AccessDesc],
    stage: u8,
) -> Result<()> {
    if stage == 2 {
        backend.unmap(res, offset, bytes)?;
    }
    if stage >= 1 {
        backend.map(res, offset, old)?;
        backend.set_access(res, offset, bytes, old_access)?;
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
