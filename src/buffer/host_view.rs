//! The CPU's copies in and out of a buffer ([`read`](GrowableBuffer::read),
//! [`write`](GrowableBuffer::write)) on every backend; its borrowed slices
//! are in `src/cpu_view.rs`, beside the device's views in `src/cuda/`.

use std::ops::{Range, RangeBounds};

use super::GrowableBuffer;
use crate::backend::Backend;
use crate::error::{Error, Result};

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
    pub(crate) fn refuse_if_shareable(&self) -> Result<()> {
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
    pub(crate) fn in_use(&self, range: impl RangeBounds<usize>) -> Result<Range<usize>> {
        let len = self.len();
        crate::ranges::within(&range, len).ok_or_else(|| {
            Error::invalid(format!(
                "bytes {} are not within the {len} bytes in use",
                crate::ranges::words(&range)
            ))
        })
    }
}
