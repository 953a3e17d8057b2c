//! How to create a [`GrowableBuffer`](super::GrowableBuffer): [`BufferDesc`].

use std::sync::Arc;

use crate::error::Result;
use crate::location::{Access, Location};
use crate::plan::GrowthPolicy;
#[cfg(doc)]
use crate::{ChunkPool, Error, GrowableBuffer};

/// How to create a [`GrowableBuffer`].
///
/// ```
/// use vmmbuf::{BufferDesc, GrowthPolicy};
/// let desc = BufferDesc::new(1 << 30).growth(GrowthPolicy::Exact);
/// assert_eq!(desc.max_bytes, 1 << 30);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct BufferDesc {
    /// Bytes of address space to reserve, rounded up to the granularity. The
    /// buffer can never grow past it. Costs no physical memory.
    pub max_bytes: usize,
    /// Where new chunks are placed; `None` for the backend's home (its GPU,
    /// or the host for the host backend).
    pub placement: Option<Location>,
    /// How chunk sizes follow the buffer's size.
    pub growth: GrowthPolicy,
    /// The access that the placement's device (and the host, for host-placed
    /// chunks) gets to every new chunk.
    pub access: Access,
    /// Alignment of the sub-ranges [`GrowableBuffer::claim`] hands out: a power
    /// of two, 256 by default (what cuBLAS, cuDNN and vectorised kernels want).
    pub alignment: usize,
    /// Whether [`GrowableBuffer::new`] gives the buffer the backend's default
    /// pool ([`ChunkPool::default_for`](crate::ChunkPool::default_for)): true by
    /// default. Chunks a pooled buffer gives up (shrinking, migrating, drop)
    /// stay in the pool for the next growth, of this buffer or another, until
    /// the pool's release threshold or [`ChunkPool::trim`] gives them back to the
    /// driver. False: they go back to the driver at once.
    pub pooled: bool,
    /// Whether every chunk is created exportable, so that the buffer can be
    /// shared with other processes ([`GrowableBuffer::publish`]). False by
    /// default: CUDA must be asked at creation, and the backend must support
    /// it ([`Error::Unsupported`] at the first growth otherwise).
    pub shareable: bool,
    /// A budget shared with other buffers and arenas (see
    /// [`Budget`](crate::Budget)): growth past its limit fails with
    /// [`Error::OutOfMemory`] and changes nothing; shrinking and drop give
    /// back.
    pub budget: Option<Arc<crate::Budget>>,
}

impl BufferDesc {
    /// The reservation in bytes rounded to the granularity `g`
    /// ([`reservation`](crate::plan::reservation)'s checks), and the growth
    /// policy resolved for it.
    pub(super) fn sizes(&self, g: usize) -> Result<(usize, GrowthPolicy)> {
        let reserved = crate::plan::reservation(self.max_bytes, self.alignment, g)?;
        let growth = self.growth.resolve(g)?;
        Ok((reserved, growth))
    }

    /// A description reserving `max_bytes`, with the default growth policy,
    /// home placement and read-write access.
    pub fn new(max_bytes: usize) -> Self {
        Self {
            max_bytes,
            placement: None,
            growth: GrowthPolicy::default(),
            access: Access::ReadWrite,
            alignment: 256,
            pooled: true,
            shareable: false,
            budget: None,
        }
    }

    /// Whether every chunk is created exportable (see
    /// [`BufferDesc::shareable`](Self::shareable)).
    pub fn shareable(mut self, shareable: bool) -> Self {
        self.shareable = shareable;
        self
    }

    /// Shares `budget` with the other buffers and arenas given it.
    pub fn budget(mut self, budget: Arc<crate::Budget>) -> Self {
        self.budget = Some(budget);
        self
    }

    /// Whether [`GrowableBuffer::new`] uses the backend's default pool (see
    /// [`BufferDesc::pooled`](Self::pooled)).
    pub fn pooled(mut self, pooled: bool) -> Self {
        self.pooled = pooled;
        self
    }

    /// Sets the alignment of sub-ranges handed out by `claim`.
    pub fn alignment(mut self, alignment: usize) -> Self {
        self.alignment = alignment;
        self
    }

    /// Sets the growth policy.
    pub fn growth(mut self, growth: GrowthPolicy) -> Self {
        self.growth = growth;
        self
    }

    /// Sets the placement of new chunks.
    pub fn placement(mut self, placement: Location) -> Self {
        self.placement = Some(placement);
        self
    }

    /// Sets the initial access to new chunks.
    pub fn access(mut self, access: Access) -> Self {
        self.access = access;
        self
    }
}
