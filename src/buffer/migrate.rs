//! Placement and migration of existing chunks.
//!
//! On VMM memory `cuMemAdvise` and `cuMemPrefetchAsync` do not work (they
//! answer INVALID_VALUE): where a chunk lives is fixed when it is created. So
//! vmmbuf migrates by itself: create the chunk at the new place, copy the data
//! through a temporary mapping (stream-ordered), wait for users of the old
//! chunk, remap the new one at the same address, set access, release the old
//! one. Every address stays valid throughout.

use std::collections::BTreeMap;
use std::ops::Range;

use super::GrowableBuffer;
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::location::{Access, AccessDesc, Location};
use crate::table::driver_access;

/// Where chunks should live, in VMM terms (the counterpart of unified
/// memory's advice, which VMM memory does not take).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum MigrationPolicy {
    /// On the buffer's own device (the backend's home).
    Default,
    /// On GPU `d`.
    PreferDevice(u32),
    /// In pinned host memory, reachable by kernels at the same address.
    PreferHost,
    /// Read-only for every location that has access, once written: applied to
    /// a range it seals those chunks (writes then fail: a kernel write faults,
    /// a copy into them is an error) until [`GrowableBuffer::make_writable`].
    /// New chunks are created writable on the buffer's device.
    ReadMostly,
}

/// Several moves, executed together: all copies are issued on one stream and
/// waited for once. The VMM counterpart of a prefetch plan.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MigrationPlan {
    moves: Vec<(Range<usize>, Location)>,
}

impl MigrationPlan {
    /// An empty plan.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a move of the chunks touching `range` (bytes) to `to`. Later moves
    /// of the same chunk win.
    pub fn add(&mut self, range: Range<usize>, to: Location) -> &mut Self {
        self.moves.push((range, to));
        self
    }

    /// The recorded moves.
    pub fn moves(&self) -> &[(Range<usize>, Location)] {
        &self.moves
    }

    /// True without moves.
    pub fn is_empty(&self) -> bool {
        self.moves.is_empty()
    }
}

/// What a migration did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct MigrationReport {
    /// Chunks that changed placement.
    pub chunks_moved: usize,
    /// Bytes copied.
    pub bytes_moved: usize,
}

/// A chunk swapped during a migration: its offset, and the old chunk with its
/// old placement, kept until the whole plan has succeeded.
type Swapped<C> = (usize, C, Location);

pub(super) fn check_range(range: &Range<usize>) -> Result<()> {
    if range.start >= range.end {
        return Err(Error::invalid(format!("empty or reversed range {range:?}")));
    }
    Ok(())
}

impl<B: Backend> GrowableBuffer<B> {
    fn placement_of(&self, policy: MigrationPolicy) -> Location {
        match policy {
            MigrationPolicy::Default | MigrationPolicy::ReadMostly => self.backend().home(),
            MigrationPolicy::PreferDevice(d) => Location::Device(d),
            MigrationPolicy::PreferHost => Location::Host,
        }
    }

    /// Checks that chunks of this buffer can be placed at `to`.
    fn check_placement(&self, to: Location) -> Result<()> {
        let g = self.backend().granularity(to)?;
        if !self.granularity().is_multiple_of(g) {
            return Err(Error::Unsupported {
                what: format!(
                    "placement {to}: its granularity {g} does not divide {}",
                    self.granularity()
                ),
            });
        }
        Ok(())
    }

    /// The migration policy set for the whole buffer: where new chunks go.
    pub fn migration_policy(&self) -> MigrationPolicy {
        self.migration_policy
    }

    /// Sets the migration policy for chunks created from now on, everywhere
    /// in the buffer (existing chunks stay where they are: see
    /// [`apply_migration_policy`](Self::apply_migration_policy)).
    pub fn set_migration_policy(&mut self, policy: MigrationPolicy) -> Result<()> {
        let to = self.placement_of(policy);
        self.check_placement(to)?;
        self.placement = to;
        self.migration_policy = policy;
        self.range_placements.clear();
        Ok(())
    }

    /// Applies `policy` to the chunks touching `range` (rounded out to whole
    /// chunks: a chunk is the unit of placement and access) and to chunks
    /// created there later: migrates them, or for
    /// [`MigrationPolicy::ReadMostly`], seals them read-only.
    pub fn apply_migration_policy(
        &mut self,
        range: Range<usize>,
        policy: MigrationPolicy,
    ) -> Result<MigrationReport> {
        check_range(&range)?;
        let to = self.placement_of(policy);
        self.check_placement(to)?;
        let report = if policy == MigrationPolicy::ReadMostly {
            self.restrict(range.clone(), |a| a.min(Access::Read))?;
            MigrationReport::default()
        } else {
            self.migrate(range.clone(), to)?
        };
        // Only once the chunks there have the policy: a failed call changes
        // where nothing goes.
        self.range_placements.set(range, to);
        Ok(report)
    }

    /// Moves the chunks touching `range` (rounded out to whole chunks) to
    /// `to`, keeping their data and their addresses. See [`execute`](Self::execute).
    pub fn migrate(&mut self, range: Range<usize>, to: Location) -> Result<MigrationReport> {
        let mut plan = MigrationPlan::new();
        plan.add(range, to);
        self.execute(&plan)
    }

    /// Moves every chunk to host memory: the device memory is given back
    /// (to the pool, if the buffer has one) while the data and every address
    /// stay. The job of an inference server's sleep mode.
    pub fn offload(&mut self) -> Result<MigrationReport> {
        self.migrate_all(Location::Host)
    }

    /// Moves every chunk back to the buffer's device.
    pub fn restore(&mut self) -> Result<MigrationReport> {
        let home = self.backend().home();
        self.migrate_all(home)
    }

    fn migrate_all(&mut self, to: Location) -> Result<MigrationReport> {
        let cap = self.capacity();
        if cap == 0 {
            return Ok(MigrationReport::default());
        }
        self.migrate(0..cap, to)
    }

    /// Executes a plan. Chunks already in place are skipped.
    ///
    /// First the recorded uses of the buffer are waited for (their streams'
    /// work only). Then every moving chunk gets its new chunk, mapped at a
    /// temporary address, and its data is copied there on the backend's
    /// stream, and the backend waits for its copies. Then each
    /// chunk is swapped at its own address (unmap the old, map the new, set
    /// access); the old chunks are released only once every swap succeeded.
    ///
    /// All or nothing: if any driver call fails, every chunk is swapped back
    /// and the buffer's placement, access and data are as before (barring a
    /// second failure while undoing, which is logged).
    ///
    /// Work that is not recorded (raw addresses without
    /// [`record_use`](Self::record_use)) is not waited for: do not run such
    /// work on the moving range concurrently with this call.
    pub fn execute(&mut self, plan: &MigrationPlan) -> Result<MigrationReport> {
        let backend = self.backend().clone();
        let home = backend.home();
        // Chunk offset -> where it goes.
        let mut targets: BTreeMap<usize, Location> = BTreeMap::new();
        {
            let g = self.inner.lock();
            g.check_poison()?;
            for (range, to) in plan.moves() {
                check_range(range)?;
                self.check_placement(*to)?;
                for (o, _) in g.table.overlapping(range.clone()) {
                    targets.insert(o, *to);
                }
            }
            targets.retain(|o, to| g.table.get(*o).is_some_and(|e| e.placement != *to));
        }
        if targets.is_empty() {
            return Ok(MigrationReport::default());
        }
        let _span = tracing::debug_span!("vmmbuf.migrate", chunks = targets.len()).entered();
        let mut guard = self.inner.lock();
        let g = &mut *guard;
        let size_of = |g: &super::Inner<B>, o: usize| g.table.get(o).map_or(0, |e| e.bytes);
        let total: usize = targets.keys().map(|&o| size_of(g, o)).sum();

        // The copies read the old chunks: recorded writers first.
        self.wait_uses()?;
        // Phase A: new chunks at a temporary address, data copied there.
        let mut tmp = backend.reserve(total, self.granularity())?;
        let mut staged: Vec<(usize, usize, B::Chunk, Location)> = Vec::with_capacity(targets.len());
        let mut tmp_mapped = 0usize;
        let staging = (|| {
            for (&offset, &to) in &targets {
                let bytes = size_of(g, offset);
                // A pooled chunk of the size, at the target, if there is one.
                let pooled = self.pool().and_then(|p| p.take_exact(to, bytes));
                let chunk = match pooled {
                    Some(c) => c,
                    None => backend.create(bytes, to)?,
                };
                backend.map(&mut tmp, tmp_mapped, &chunk)?;
                staged.push((offset, bytes, chunk, to));
                let at = tmp_mapped;
                tmp_mapped += bytes;
                backend.set_access(
                    &mut tmp,
                    at,
                    bytes,
                    &[AccessDesc::new(home, Access::ReadWrite)],
                )?;
                backend.copy(&mut tmp, at, g.res(), offset, bytes)?;
            }
            // The copies (recorded users were waited for above).
            backend.wait_copies()?;
            backend.unmap(&mut tmp, 0, tmp_mapped)?;
            tmp_mapped = 0;
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
                    let _ = self.dispose(chunk, bytes, to); // logged inside
                } else {
                    // Perhaps still mapped: released, never pooled.
                    let _ = backend.release(chunk);
                }
            }
            tracing::debug!(error = %e, "vmmbuf: migration staging failed; nothing moved");
            return Err(e);
        }
        if let Err(e) = backend.free(tmp) {
            tracing::warn!(error = %e, "vmmbuf: freeing the temporary reservation failed");
        }

        // Phase B: swap each chunk at its own address. The old chunks are
        // kept until every swap has succeeded, so a failure can swap back.
        // Each chunk keeps its own access list; the driver gets what the new
        // placement takes of it.
        let mut report = MigrationReport::default();
        let mut done: Vec<Swapped<B::Chunk>> = Vec::new();
        let mut staged = staged.into_iter();
        while let Some((offset, bytes, new, to)) = staged.next() {
            let entry = g.table.get(offset).expect("a staged chunk is in the table");
            let list = driver_access(&entry.access, to);
            let Err((e, stage)) = Self::swap_in(&*backend, g.res(), offset, bytes, &new, &list)
            else {
                let entry = g
                    .table
                    .get_mut(offset)
                    .expect("a staged chunk is in the table");
                let old = std::mem::replace(&mut entry.chunk, new);
                let old_place = entry.placement;
                g.table.set_placement(offset, to);
                done.push((offset, old, old_place));
                report.chunks_moved += 1;
                report.bytes_moved += bytes;
                continue;
            };
            // Undo: this chunk, then the swapped ones in reverse. A chunk
            // that cannot be put back poisons the buffer, and every token
            // that may still be mapped, or holds data, stays out of the pool.
            let mut stuck: Vec<B::Chunk> = Vec::new();
            let mut why = None;
            let entry = g.table.get(offset).expect("a staged chunk is in the table");
            let old_list = entry.driver_access();
            let res = g.res.as_mut().expect("the reservation lives until drop");
            match Self::undo_swap(
                &*backend,
                res,
                offset,
                bytes,
                &entry.chunk,
                &old_list,
                stage,
            ) {
                Ok(()) => drop(self.dispose(new, bytes, to)),
                Err(u) => {
                    why = Some(format!("undoing a failed migration at {offset:#x}: {u}"));
                    stuck.push(new);
                }
            }
            for (_, b, c, t) in staged {
                let _ = self.dispose(c, b, t); // unmapped since staging
            }
            for (o, old, old_place) in done.into_iter().rev() {
                let bytes = size_of(g, o);
                let entry = g.table.get(o).expect("a swapped chunk is in the table");
                let old_list = driver_access(&entry.access, old_place);
                let res = g.res.as_mut().expect("the reservation lives until drop");
                match Self::undo_swap(&*backend, res, o, bytes, &old, &old_list, 2) {
                    Ok(()) => {
                        g.table.set_placement(o, old_place);
                        let entry = g.table.get_mut(o).expect("a swapped chunk is in the table");
                        let new = std::mem::replace(&mut entry.chunk, old);
                        let new_place = *targets.get(&o).expect("a swapped chunk had a target");
                        let _ = self.dispose(new, bytes, new_place);
                    }
                    Err(u) => {
                        why.get_or_insert(format!("undoing a failed migration at {o:#x}: {u}"));
                        stuck.push(old);
                    }
                }
            }
            if let Some(why) = why {
                g.poison(why, stuck);
            }
            tracing::debug!(error = %e, "vmmbuf: migration failed and was undone");
            return Err(e);
        }
        // Every swap succeeded: the old chunks go (to the pool, if any).
        for (o, old, old_place) in done {
            let _ = self.dispose(old, size_of(g, o), old_place); // logged inside
        }
        g.debug_check();
        g.stats.chunks_migrated_total += report.chunks_moved as u64;
        tracing::debug!(
            chunks = report.chunks_moved,
            bytes = report.bytes_moved,
            "vmmbuf: migrated"
        );
        Ok(report)
    }

    /// Unmaps the chunk at `offset` and maps `new` there with `access`. On
    /// error, also says how far it got: 0 = old still mapped, 1 = nothing
    /// mapped, 2 = new mapped.
    fn swap_in(
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
    fn undo_swap(
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
}
