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
use crate::location::{Access, Location};
use crate::migration::{MigrationPlan, MigrationPolicy, MigrationReport, Mover};
use crate::pool::Driver;

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
        crate::migration::check_placement(&**self.backend(), self.granularity(), to)
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
    /// while the data and every address stay. The job of an inference
    /// server's sleep mode. The device chunks go to the buffer's pool if it
    /// has one (by default the backend's, which keeps them for a fast
    /// [`restore`](Self::restore)); to hand them to the driver, follow with
    /// `pool.trim_at(Location::Device(d))` or build the buffer with
    /// [`BufferDesc::pooled`](crate::BufferDesc::pooled)`(false)`.
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
        // Chunk offset -> where it goes.
        let mut targets: BTreeMap<usize, Location> = BTreeMap::new();
        {
            let g = self.inner.lock();
            g.check_poison()?;
            for (range, to) in plan.moves() {
                check_range(range)?;
                self.check_placement(*to)?;
                for (o, _) in g.region.table.overlapping(range.clone()) {
                    targets.insert(o, *to);
                }
            }
            targets.retain(|o, to| g.region.table.get(*o).is_some_and(|e| e.placement != *to));
        }
        if targets.is_empty() {
            return Ok(MigrationReport::default());
        }
        let _span = tracing::debug_span!("vmmbuf.migrate", chunks = targets.len()).entered();
        let mut guard = self.inner.lock();
        let g = &mut *guard;

        // The copies read the old chunks, and the old mappings go: recorded
        // uses and deferred releases' fences first.
        self.wait_all(g)?;
        let driver = Driver(&*backend);
        let mover = Mover {
            backend: &*backend,
            granularity: self.granularity(),
            source: self.source(&driver),
            shareable: self.shareable,
            release_old: self.is_published(),
            release_joined: false,
        };
        let report = mover.run(&mut g.region, &targets)?;
        g.debug_check();
        g.stats.chunks_migrated_total += report.chunks_moved as u64;
        tracing::debug!(
            chunks = report.chunks_moved,
            bytes = report.bytes_moved,
            "vmmbuf: migrated"
        );
        Ok(report)
    }
}

pub(super) fn check_range(range: &Range<usize>) -> Result<()> {
    if range.start >= range.end {
        return Err(Error::invalid(format!("empty or reversed range {range:?}")));
    }
    Ok(())
}
