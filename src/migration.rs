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
use crate::table::{driver_access_for, ChunkTable};

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
    /// Mapping them at the temporary address and granting the GPU access.
    pub stage_time: Duration,
    /// The copies, issued and waited for.
    pub copy_time: Duration,
    /// Unmapping the temporary address, then swapping each chunk in at its
    /// own address (unmap, map, access).
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
        match self.pool.and_then(|p| p.take_exact(to, bytes)) {
            Some(c) => Ok(c),
            None => self.backend.create(bytes, to),
        }
    }

    /// Moves the chunk at each offset of `targets` to its location, keeping
    /// data and addresses. The users of those chunks must have finished.
    ///
    /// First every new chunk is mapped into one temporary reservation (one
    /// access call for all), the data copied there in as few copies as
    /// possible (one per run of adjacent chunks with one source and one
    /// target placement: a copy never spans a host and a device chunk), and
    /// the copies waited for. Then each chunk is swapped at its own address;
    /// the old chunks go only once every swap has succeeded.
    ///
    /// All or nothing: on error every chunk is swapped back and the table
    /// is as before, unless undoing fails too (see [`MoveFailure`]).
    pub(crate) fn run(
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

        // Phase A: new chunks at a temporary address, data copied there.
        let mut report = MigrationReport::default();
        let mut tmp = backend.reserve(total, self.granularity)?;
        // (offset, bytes, new chunk, target)
        let mut staged: Vec<(usize, usize, B::Chunk, Location)> = Vec::with_capacity(targets.len());
        let mut tmp_mapped = 0usize;
        let staging = (|| -> Result<()> {
            let t = Instant::now();
            for (&offset, &to) in targets {
                let bytes = size_of(table, offset);
                staged.push((offset, bytes, self.take(to, bytes)?, to));
            }
            report.acquire_time = t.elapsed();
            let t = Instant::now();
            for (_, bytes, chunk, _) in &staged {
                backend.map(&mut tmp, tmp_mapped, chunk)?;
                tmp_mapped += bytes;
            }
            backend.set_access(
                &mut tmp,
                0,
                total,
                &[AccessDesc::new(home, Access::ReadWrite)],
            )?;
            report.stage_time = t.elapsed();
            let t = Instant::now();
            let mut at = 0usize;
            let mut run: Option<(usize, usize, usize, Location, Location)> = None; // (src, dst, bytes, from, to)
            for &(offset, bytes, _, to) in &staged {
                let from = table.get(offset).map_or(to, |e| e.placement);
                match &mut run {
                    Some((src, _, n, f, t)) if *src + *n == offset && *f == from && *t == to => {
                        *n += bytes;
                    }
                    _ => {
                        if let Some((src, dst, n, _, _)) = run.take() {
                            backend.copy(&mut tmp, dst, res, src, n)?;
                        }
                        run = Some((offset, at, bytes, from, to));
                    }
                }
                at += bytes;
            }
            if let Some((src, dst, n, _, _)) = run {
                backend.copy(&mut tmp, dst, res, src, n)?;
            }
            backend.wait_copies()?;
            report.copy_time = t.elapsed();
            let t = Instant::now();
            backend.unmap(&mut tmp, 0, tmp_mapped)?;
            tmp_mapped = 0;
            report.swap_time = t.elapsed();
            Ok(())
        })();
        if let Err(e) = staging {
            let mut unmapped = true;
            if tmp_mapped > 0 {
                // Copies may still be in flight into the temporary mapping.
                let _ = backend.wait_copies();
                unmapped = backend.unmap(&mut tmp, 0, tmp_mapped).is_ok();
            }
            // If the unmap failed, the token unmaps what it holds as it drops.
            let _ = backend.free(tmp);
            for (_, bytes, chunk, to) in staged {
                if unmapped {
                    self.dispose(chunk, bytes, to);
                } else {
                    // Perhaps still mapped: released, never pooled.
                    let _ = backend.release(chunk);
                }
            }
            tracing::debug!(error = %e, "vmmbuf: migration staging failed; nothing moved");
            return Err(e.into());
        }
        if let Err(e) = backend.free(tmp) {
            tracing::warn!(error = %e, "vmmbuf: freeing the temporary reservation failed");
        }

        // Phase B: swap each chunk at its own address. Each chunk keeps its
        // own access list; the driver gets what the new placement takes.
        let t = Instant::now();
        let mut done: Vec<Swapped<B::Chunk>> = Vec::new();
        let mut staged = staged.into_iter();
        while let Some((offset, bytes, new, to)) = staged.next() {
            let entry = table.get(offset).expect("a staged chunk is in the table");
            // Chunks moved to the host get the GPUs' access only; a CPU view
            // asks for the host's when it needs it.
            let cpu = to != Location::Host || home == Location::Host;
            let list = driver_access_for(&entry.access, to, cpu);
            let Err((e, stage)) = swap_in(backend, res, offset, bytes, &new, &list) else {
                let entry = table
                    .get_mut(offset)
                    .expect("a staged chunk is in the table");
                let old = std::mem::replace(&mut entry.chunk, new);
                let old_place = entry.placement;
                let old_cpu = std::mem::replace(&mut entry.cpu, cpu);
                table.set_placement(offset, to);
                done.push((offset, old, old_place, old_cpu));
                report.chunks_moved += 1;
                report.bytes_moved += bytes;
                continue;
            };
            // Undo: this chunk, then the swapped ones in reverse. A chunk
            // that cannot be put back, and every token that may still be
            // mapped, stays out of the pool.
            let mut stuck: Vec<B::Chunk> = Vec::new();
            let mut why = None;
            let entry = table.get(offset).expect("a staged chunk is in the table");
            let old_list = entry.driver_access();
            match undo_swap(backend, res, offset, bytes, &entry.chunk, &old_list, stage) {
                Ok(()) => self.dispose(new, bytes, to),
                Err(u) => {
                    why = Some(format!("undoing a failed migration at {offset:#x}: {u}"));
                    stuck.push(new);
                }
            }
            for (_, b, c, t) in staged {
                self.dispose(c, b, t); // unmapped since staging
            }
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
            tracing::debug!(error = %e, "vmmbuf: migration failed and was undone");
            return Err(MoveFailure {
                error: e,
                poison: why.map(|w| (w, stuck)),
            });
        }
        report.swap_time += t.elapsed();
        // Every swap succeeded: the old chunks go (to the pool, if any).
        let t = Instant::now();
        for (o, old, old_place, _) in done {
            self.dispose(old, size_of(table, o), old_place);
        }
        report.dispose_time = t.elapsed();
        Ok(report)
    }
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
