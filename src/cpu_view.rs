//! The CPU's borrowed views of a buffer: slices
//! ([`host_slice`](crate::GrowableBuffer::host_slice),
//! [`host_slice_mut`](crate::GrowableBuffer::host_slice_mut)) of the chunks
//! the host may touch, on backends that map memory in this process
//! ([`HostMapped`]). The device's views are in `src/cuda/`; the copies in
//! and out, on every backend, in `buffer/host_view.rs`.

#![allow(unsafe_code)]

use std::ops::RangeBounds;

use crate::backend::HostMapped;
use crate::error::Result;
use crate::location::{Access, Location};
#[cfg(doc)]
use crate::Error;
use crate::GrowableBuffer;

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
            std::slice::from_raw_parts((self.base() + r.start as u64) as *const u8, r.len())
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
            std::slice::from_raw_parts_mut((self.base() + r.start as u64) as *mut u8, r.len())
        })
    }
}
