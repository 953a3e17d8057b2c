//! Access control of existing chunks: who may touch them, and how.

use std::ops::Range;
use std::sync::Arc;

use super::migrate::check_range;
use super::GrowableBuffer;
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::location::{Access, AccessDesc, Location};

impl<B: Backend> GrowableBuffer<B> {
    /// Sets `location`'s access to the chunks touching `range` (rounded out
    /// to whole chunks), leaving other locations' access as it is. Waits for
    /// the GPU first, since narrowing access under a running kernel faults it.
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
        self.update_access(range, |list, placement| {
            let mut v: Vec<AccessDesc> = list
                .iter()
                .filter(|d| d.location != location)
                .copied()
                .collect();
            // The driver refuses host descriptors on GPU chunks; there, no
            // entry already means no access.
            if location != Location::Host || placement == Location::Host {
                v.push(AccessDesc::new(location, access));
            }
            v
        })
    }

    /// Undoes [`MigrationPolicy::ReadMostly`](crate::MigrationPolicy::ReadMostly) on the chunks touching `range`:
    /// every location gets back the access the buffer grants.
    pub fn make_writable(&mut self, range: Range<usize>) -> Result<()> {
        check_range(&range)?;
        let grants = self.grants.clone();
        self.update_access(range, |list, placement| {
            // What the buffer grants for this placement, plus any location
            // given access beyond the grants (kept as it is).
            let mut v: Vec<AccessDesc> = grants
                .iter()
                .filter(|d| d.location != Location::Host || placement == Location::Host)
                .copied()
                .collect();
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
        // (offset, bytes, new list) of each chunk touching the range.
        let lists: Vec<(usize, usize, Arc<[AccessDesc]>)> = g
            .table
            .overlapping(range)
            .map(|(o, e)| (o, e.bytes, f(&e.access, e.placement).into()))
            .collect();
        if lists.is_empty() {
            return Ok(());
        }
        backend.synchronize()?;
        let runs = lists.chunk_by(|a, b| a.2 == b.2 && a.0 + a.1 == b.0);
        for run in runs {
            let bytes: usize = run.iter().map(|c| c.1).sum();
            backend.set_access(g.res(), run[0].0, bytes, &run[0].2)?;
            for (o, _, list) in run {
                if let Some(e) = g.table.get_mut(*o) {
                    e.access = list.clone();
                }
            }
        }
        Ok(())
    }

    /// Checks that `[offset, offset + bytes)` is in use and that every chunk
    /// it touches grants `who` at least `need`.
    pub(super) fn check_access(
        &self,
        who: Location,
        need: Access,
        offset: usize,
        bytes: usize,
    ) -> Result<()> {
        let g = self.inner.lock();
        Self::check_span(g.table.len(), offset, bytes)?;
        g.table.check_access(offset, bytes, who, need)
    }
}
