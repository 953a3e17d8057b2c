//! How a pool bounds what it keeps ([`PoolDesc`]) and what it counts
//! ([`PoolStats`]).

use std::fmt;

#[cfg(doc)]
use super::ChunkPool;
use crate::error::{Error, Result};
use crate::report::Bytes;

/// How a [`ChunkPool`] bounds what it keeps.
///
/// When the pooled bytes rise above `high_water_bytes`, the pool gives chunks
/// back to the driver (largest first) until it holds at most `low_water_bytes`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PoolDesc {
    /// What the pool shrinks to once it passes the high watermark.
    pub low_water_bytes: usize,
    /// The most the pool keeps before it gives memory back.
    pub high_water_bytes: usize,
    /// The most it keeps in host memory (an arena's sleep pieces, kept from
    /// one sleep to the next so that a sleep pins nothing); past it, host
    /// chunks go back to the driver, largest first. Unbounded by default.
    pub max_host_bytes: usize,
}

impl Default for PoolDesc {
    /// Keep everything until [`ChunkPool::trim`] (or out of memory) says otherwise.
    fn default() -> Self {
        Self {
            low_water_bytes: usize::MAX,
            high_water_bytes: usize::MAX,
            max_host_bytes: usize::MAX,
        }
    }
}

impl PoolDesc {
    /// A pool that keeps at most `bytes`, as `cudaMallocAsync`'s release
    /// threshold bounds its pool: both watermarks at `bytes`. 0 keeps nothing;
    /// `usize::MAX` (the default) keeps everything, as PyTorch and JAX keep
    /// theirs, until [`ChunkPool::trim`].
    pub fn release_threshold(bytes: usize) -> Self {
        Self::watermarks(bytes, bytes)
    }

    pub(super) fn check(&self) -> Result<()> {
        if self.low_water_bytes > self.high_water_bytes {
            return Err(Error::invalid(format!(
                "pool low watermark {} is above the high watermark {}",
                self.low_water_bytes, self.high_water_bytes
            )));
        }
        Ok(())
    }

    /// A pool that keeps up to `high` bytes and sheds down to `low` past it.
    pub fn watermarks(low_water_bytes: usize, high_water_bytes: usize) -> Self {
        Self {
            low_water_bytes,
            high_water_bytes,
            max_host_bytes: usize::MAX,
        }
    }

    /// Sets the most the pool keeps in host memory.
    pub fn max_host_bytes(mut self, bytes: usize) -> Self {
        self.max_host_bytes = bytes;
        self
    }
}

/// A pool's counters, as plain data.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PoolStats {
    /// Bytes held now.
    pub pooled_bytes: usize,
    /// Of those, bytes in host memory.
    pub pooled_host_bytes: usize,
    /// Chunks held now.
    pub pooled_chunks: usize,
    /// Chunks handed out instead of creating new ones.
    pub hits: u64,
    /// Chunks given to the pool.
    pub returns: u64,
    /// Chunks the pool gave back to the driver.
    pub released: u64,
    /// Times the pool was emptied to retry a growth that ran out of memory.
    pub oom_drains: u64,
}

impl fmt::Display for PoolStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "pool holds {} in {} chunks; {} hits, {} returns, {} released, {} out-of-memory drains",
            Bytes(self.pooled_bytes),
            self.pooled_chunks,
            self.hits,
            self.returns,
            self.released,
            self.oom_drains
        )
    }
}
