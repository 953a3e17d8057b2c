//! Access control of existing chunks: who may touch them, and how.

use std::ops::Range;
use std::sync::Arc;

use super::migrate::check_range;
use super::GrowableBuffer;
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::location::driver_access;
use crate::location::{Access, AccessDesc, Location};

impl<B: Backend> GrowableBuffer<B> {
    /// Sets `location`'s access to the chunks touching `range` (rounded out
    /// to whole chunks), leaving other locations' access as it is. Waits for
    /// the recorded uses first, since narrowing access under a running kernel
    /// faults it.
    ///
    /// [`Error::Unsupported`] for host access to GPU-placed chunks (the driver
    /// refuses it). On error, the chunks before the failing one have the new
    /// access and the rest the old.
    pub fn set_access(
        &mut self,
        range: Range<usize>,
        location: Location,
        access: Access,
    ) -> Result<()> {
        check_range(&range)?;
        if location == Location::Host && access != Access::None {
            let g = self.inner.lock();
            let on_gpu = g
                .region
                .table
                .overlapping(range.clone())
                .find(|(_, e)| e.placement != Location::Host);
            if let Some((o, e)) = on_gpu {
                return Err(Error::Unsupported {
                    what: format!(
                        "host access to the chunk at {o:#x}, placed on {}",
                        e.placement
                    ),
                });
            }
        }
        self.update_access(range, |list, _| {
            let mut v: Vec<AccessDesc> = list
                .iter()
                .filter(|d| d.location != location)
                .copied()
                .collect();
            // Kept on GPU chunks too: it takes effect if they move to the host.
            v.push(AccessDesc::new(location, access));
            v
        })
    }

    /// Undoes [`MigrationPolicy::ReadMostly`](crate::migration::MigrationPolicy::ReadMostly) on the chunks touching `range`:
    /// every location gets back the access the buffer grants.
    pub fn make_writable(&mut self, range: Range<usize>) -> Result<()> {
        check_range(&range)?;
        let grants = self.grants.clone();
        self.update_access(range, |list, _| {
            // What the buffer grants, plus any location given access beyond
            // the grants (kept as it is).
            let mut v: Vec<AccessDesc> = grants.clone();
            v.extend(
                list.iter()
                    .filter(|d| !grants.iter().any(|g| g.location == d.location)),
            );
            v
        })
    }

    pub(super) fn restrict(
        &mut self,
        range: Range<usize>,
        f: impl Fn(Access) -> Access,
    ) -> Result<()> {
        self.update_access(range, |list, _| {
            list.iter()
                .map(|d| AccessDesc::new(d.location, f(d.access)))
                .collect()
        })
    }

    /// Gives GPU `device` read-write access to every chunk, now and for new
    /// chunks, after checking that it can reach this buffer's device.
    pub fn add_peer(&mut self, device: u32) -> Result<()> {
        let backend = self.backend().clone();
        let Location::Device(home) = backend.home() else {
            return backend.can_access_peer(device, device).map(|_| ());
        };
        if !backend.can_access_peer(device, home)? {
            return Err(Error::Unsupported {
                what: format!("gpu{device} cannot access gpu{home}'s memory"),
            });
        }
        if self
            .grants
            .iter()
            .any(|d| d.location == Location::Device(device))
        {
            return Ok(());
        }
        self.grants
            .push(AccessDesc::new(Location::Device(device), Access::ReadWrite));
        let cap = self.capacity();
        if cap == 0 {
            return Ok(());
        }
        let r = self.update_access(0..cap, |list, _| {
            let mut v: Vec<AccessDesc> = list
                .iter()
                .filter(|d| d.location != Location::Device(device))
                .copied()
                .collect();
            v.push(AccessDesc::new(Location::Device(device), Access::ReadWrite));
            v
        });
        if r.is_err() {
            self.grants.pop();
        }
        r
    }

    /// Rewrites the access list of every chunk touching `range` with `f`, one
    /// driver call per run of adjacent chunks with equal new lists. Waits for
    /// the GPU first.
    fn update_access(
        &mut self,
        range: Range<usize>,
        f: impl Fn(&[AccessDesc], Location) -> Vec<AccessDesc>,
    ) -> Result<()> {
        let backend = self.backend().clone();
        let mut guard = self.inner.lock();
        let g = &mut *guard;
        g.check_poison()?;
        // (offset, bytes, new list, what the driver gets) of each chunk
        // touching the range.
        type Change = (usize, usize, Arc<[AccessDesc]>, Vec<AccessDesc>);
        let changes: Vec<Change> = g
            .region
            .table
            .overlapping(range)
            .map(|(o, e)| {
                let list = f(&e.access, e.placement);
                let driver = driver_access(&list, e.placement);
                (o, e.bytes, list.into(), driver)
            })
            .collect();
        if changes.is_empty() {
            return Ok(());
        }
        self.wait_all(g)?;
        for run in changes.chunk_by(|a, b| a.3 == b.3 && a.0 + a.1 == b.0) {
            let bytes: usize = run.iter().map(|c| c.1).sum();
            backend.set_access(g.region.res(), run[0].0, bytes, &run[0].3)?;
            for (o, _, list, _) in run {
                if let Some(e) = g.region.table.get_mut(*o) {
                    e.access = list.clone();
                    e.cpu = true;
                }
            }
        }
        Ok(())
    }

    /// Gives the driver the host's access entry for the host-placed chunks
    /// in `[offset, offset + bytes)` that migration left without one, so
    /// that the CPU may touch them: what a CPU view does first.
    pub(crate) fn grant_cpu(&self, offset: usize, bytes: usize) -> Result<()> {
        let backend = self.backend().clone();
        let mut guard = self.inner.lock();
        let g = &mut *guard;
        let (res, table) = g.region.parts();
        crate::migration::grant_cpu(&*backend, res, table, offset, bytes)
    }

    /// Checks that `[offset, offset + bytes)` is in use and that every chunk
    /// it touches grants `who` at least `need`.
    pub(crate) fn check_access(
        &self,
        who: Location,
        need: Access,
        offset: usize,
        bytes: usize,
    ) -> Result<()> {
        let g = self.inner.lock();
        g.check_poison()?;
        g.region.table.check_in_use(offset, bytes)?;
        g.region.table.check_access(offset, bytes, who, need)
    }

    /// The runs of one placement `[offset, offset + bytes)` spans:
    /// `(offset, bytes, placement)` each, clipped to the range.
    pub(crate) fn placement_runs(
        &self,
        offset: usize,
        bytes: usize,
    ) -> Vec<(usize, usize, Location)> {
        self.inner.lock().region.table.placement_runs(offset, bytes)
    }

    /// The list views record their uses in.
    pub(crate) fn uses_ref(&self) -> &crate::backend::Uses<B::Fence> {
        &self.uses
    }
}
