//! The CPU's access to a buffer: copies in and out ([`read`](GrowableBuffer::read),
//! [`write`](GrowableBuffer::write)) on every backend, and borrowed slices
//! ([`host_slice`](GrowableBuffer::host_slice)) of chunks the host may touch
//! on the crate's own backends.

#![allow(unsafe_code)]

use std::ops::{Range, RangeBounds};

use super::GrowableBuffer;
use crate::backend::{Backend, HostMapped};
use crate::error::{Error, Result};
use crate::location::{Access, Location};

impl<B: Backend> GrowableBuffer<B> {
    /// Copies bytes in use, from `offset`, into `dst`. Synchronous, and
    /// ordered after every recorded use (it waits for them first).
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.wait_uses()?;
        let mut guard = self.inner.lock();
        let g = &mut *guard;
        g.check_poison()?;
        g.region.table.check_in_use(offset, dst.len())?;
        let (res, table) = g.region.parts();
        // The driver copies host memory with the CPU.
        crate::migration::grant_cpu(&*self.backend, res, table, offset, dst.len())?;
        self.backend.read(res, offset, dst)
    }

    /// Copies `src` into the bytes in use, from `offset`. Synchronous, and
    /// ordered after every recorded use (it waits for them first).
    pub fn write(&mut self, offset: usize, src: &[u8]) -> Result<()> {
        self.wait_uses()?;
        let g = self.inner.get_mut();
        g.check_poison()?;
        g.region.table.check_in_use(offset, src.len())?;
        let (res, table) = g.region.parts();
        crate::migration::grant_cpu(&*self.backend, res, table, offset, src.len())?;
        self.backend.write(res, offset, src)
    }

    /// Slices of a shareable buffer would alias memory an importer writes.
    fn refuse_if_shareable(&self) -> Result<()> {
        if self.shareable {
            return Err(Error::Unsupported {
                what: "host slices of a shareable buffer (an importer may write it at any time): \
                       use read and write"
                    .into(),
            });
        }
        Ok(())
    }

    /// The byte range `range` names within the bytes in use.
    fn in_use(&self, range: impl RangeBounds<usize>) -> Result<Range<usize>> {
        let len = self.len();
        crate::ranges::within(&range, len).ok_or_else(|| {
            Error::invalid(format!(
                "bytes {} are not within the {len} bytes in use",
                crate::ranges::words(&range)
            ))
        })
    }
}

impl<B: HostMapped> GrowableBuffer<B> {
    /// The CPU's view of the bytes in use in `range` (`..` for all of them),
    /// after waiting for every recorded use. Every chunk in the range must grant the host
    /// read access: host-backend chunks, or CUDA chunks placed in host memory
    /// (see [`MigrationPolicy::PreferHost`](crate::migration::MigrationPolicy) and
    /// [`offload`](Self::offload)); otherwise [`Error::InvalidArgument`].
    ///
    /// Sound because: every chunk in the range is memory the host may read
    /// (checked); it stays mapped and readable while `&self` lives
    /// (migration, access changes and shrinking take `&mut self`, growing
    /// never touches mapped bytes); the wait means no recorded work is still
    /// writing it, and no safe API writes it while `&self` is
    /// borrowed (writes need `&mut self`). Kernels launched meanwhile (an
    /// `unsafe` act) must not write it.
    ///
    /// A [shareable](crate::BufferDesc::shareable) buffer gives no slices
    /// ([`Error::Unsupported`]): an importer, in another process or in this
    /// one, may write its pages at any time ([`SharedBuffer::write`](crate::ipc::SharedBuffer::write)
    /// is safe), which would change bytes under a `&[u8]`; and a `&mut [u8]`
    /// would be read under. Use [`read`](Self::read) and
    /// [`write`](Self::write), which copy.
    pub fn host_slice(&self, range: impl RangeBounds<usize>) -> Result<&[u8]> {
        self.refuse_if_shareable()?;
        let r = self.in_use(range)?;
        self.check_access(Location::Host, Access::Read, r.start, r.len())?;
        self.grant_cpu(r.start, r.len())?;
        self.wait_uses()?;
        if r.is_empty() {
            return Ok(&[]);
        }
        // SAFETY: see the doc comment above; `HostMapped` backends map the
        // buffer at `base` in this process's address space.
        Ok(unsafe {
            std::slice::from_raw_parts((self.base + r.start as u64) as *const u8, r.len())
        })
    }

    /// The CPU's mutable view of the bytes in use in `range`; see
    /// [`host_slice`](Self::host_slice). Needs read-write host access.
    pub fn host_slice_mut(&mut self, range: impl RangeBounds<usize>) -> Result<&mut [u8]> {
        self.refuse_if_shareable()?;
        let r = self.in_use(range)?;
        self.check_access(Location::Host, Access::ReadWrite, r.start, r.len())?;
        self.grant_cpu(r.start, r.len())?;
        self.wait_uses()?;
        if r.is_empty() {
            return Ok(&mut []);
        }
        // SAFETY: as in `host_slice`; `&mut self` makes the view exclusive.
        Ok(unsafe {
            std::slice::from_raw_parts_mut((self.base + r.start as u64) as *mut u8, r.len())
        })
    }
}
