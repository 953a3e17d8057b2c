//! [`ChunkPool`]: released physical chunks kept for reuse, shareable between
//! buffers, so regrowth skips `cuMemCreate` and shrinking skips `cuMemRelease`.

use std::fmt;
use std::sync::Arc;

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::location::Location;
use crate::plan::PoolOffer;

mod budget;
mod desc;
mod shelf;
mod source;

pub use budget::Budget;
pub(crate) use budget::BudgetHold;
pub use desc::{PoolDesc, PoolStats};
use shelf::PoolInner;
pub(crate) use shelf::Shelf;
pub(crate) use source::*;

/// Physical chunks kept for reuse, keyed by placement and size.
///
/// A backend has a default pool ([`ChunkPool::default_for`]), which
/// [`GrowableBuffer::new`](crate::GrowableBuffer::new) uses unless
/// [`BufferDesc::pooled`](crate::BufferDesc::pooled) says otherwise. A pool of
/// one's own ([`ChunkPool::new`]) is shared between buffers of the same backend
/// (`Arc`) through [`GrowableBuffer::with_pool`](crate::GrowableBuffer::with_pool).
/// Chunks a pooled buffer trims go to the pool; its growth takes pooled
/// chunks before it creates new ones; a growth that runs out of memory empties
/// the pool and tries once more.
///
/// # Example
///
/// Two buffers share a pool: what one gives back, the other maps without a
/// new chunk from the driver.
///
/// ```
/// # #[cfg(target_os = "linux")] {
/// use vmmbuf::{BufferDesc, ChunkPool, GrowableBuffer, HostBackend, PoolDesc};
///
/// let backend = HostBackend::new();
/// let pool = ChunkPool::new(backend.clone(), PoolDesc::default())?;
/// let a = GrowableBuffer::with_pool(&pool, BufferDesc::new(1 << 30))?;
/// let b = GrowableBuffer::with_pool(&pool, BufferDesc::new(1 << 30))?;
/// a.grow_to(8 << 20)?;
/// drop(a);                                   // its chunks go to the pool
/// assert!(pool.stats().pooled_bytes >= 8 << 20);
/// b.grow_to(8 << 20)?;                       // taken from the pool
/// pool.trim()?;                              // what is left goes back to the driver
/// assert_eq!(pool.stats().pooled_bytes, 0);
/// # }
/// # Ok::<(), vmmbuf::Error>(())
/// ```
pub struct ChunkPool<B: Backend> {
    backend: Arc<B>,
    shelf: Arc<Shelf<B::Chunk>>,
}

impl<B: Backend> fmt::Debug for ChunkPool<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChunkPool")
            .field("desc", &self.desc())
            .field("stats", &self.stats())
            .finish()
    }
}

impl<B: Backend> ChunkPool<B> {
    /// An empty pool over `backend`. [`Error::InvalidArgument`] if the low
    /// watermark is above the high one.
    pub fn new(backend: Arc<B>, desc: PoolDesc) -> Result<Arc<Self>> {
        let shelf = Arc::new(Shelf::new(desc)?);
        Ok(Arc::new(Self { backend, shelf }))
    }

    /// The backend's default pool, which [`GrowableBuffer::new`](crate::GrowableBuffer::new)
    /// gives every buffer (unless [`BufferDesc::pooled`](crate::BufferDesc::pooled)
    /// is false), so that regrowth after a shrink, or one buffer's growth
    /// into what another gave up, maps pooled chunks instead of creating
    /// them. Every call returns a handle on the same chunks, bounds and
    /// counters; they live as long as the backend (in its
    /// [`Backend::pool_slot`]). By default it keeps everything, as PyTorch's
    /// and JAX's allocators keep theirs; [`trim`](Self::trim) gives it all
    /// back, [`set_release_threshold`](Self::set_release_threshold) bounds
    /// it, and a growth that runs out of memory empties it first. `None` for
    /// a backend without a slot.
    pub fn default_for(backend: &Arc<B>) -> Option<Arc<Self>> {
        let shelf = backend.pool_slot()?.get_or_init(|| {
            Arc::new(
                Shelf::<B::Chunk>::new(PoolDesc::default()).expect("the default bounds are valid"),
            )
        })?;
        Some(Arc::new(Self {
            backend: backend.clone(),
            shelf: shelf.clone(),
        }))
    }

    fn lock(&self) -> parking_lot::MutexGuard<'_, PoolInner<B::Chunk>> {
        self.shelf.inner.lock()
    }

    /// How the pool bounds what it keeps now.
    pub fn desc(&self) -> PoolDesc {
        self.lock().desc
    }

    /// Changes how the pool bounds what it keeps; if it holds more than the
    /// new high watermark, it gives chunks back at once (largest first)
    /// down to the low one. [`Error::InvalidArgument`] if the low watermark
    /// is above the high one (nothing changes then).
    pub fn set_desc(&self, desc: PoolDesc) -> Result<()> {
        desc.check()?;
        let shed = {
            let mut g = self.lock();
            g.desc = desc;
            g.shed()
        };
        self.release_all(shed)
    }

    /// Keeps at most `bytes` pooled, as `cudaMallocAsync`'s release
    /// threshold does: `set_desc(PoolDesc::release_threshold(bytes))`.
    /// 0 gives every chunk back as soon as it is returned.
    pub fn set_release_threshold(&self, bytes: usize) -> Result<()> {
        self.set_desc(PoolDesc::release_threshold(bytes))
    }

    /// The backend the pool's chunks belong to.
    pub fn backend(&self) -> &Arc<B> {
        &self.backend
    }

    /// The pool's counters.
    pub fn stats(&self) -> PoolStats {
        self.lock().stats
    }

    /// Gives every pooled chunk back to the driver. On error the remaining
    /// chunks are still released through their tokens, and the first error is
    /// returned.
    pub fn trim(&self) -> Result<()> {
        let all = {
            let mut g = self.lock();
            g.stats.pooled_bytes = 0;
            g.stats.pooled_host_bytes = 0;
            g.stats.pooled_chunks = 0;
            std::mem::take(&mut g.free)
        };
        self.release_all(all.into_values().flatten())
    }

    /// Creates chunks of `chunk_bytes` (rounded up to the placement's
    /// granularity) at `placement` until they hold at least `total_bytes`,
    /// and keeps them, whatever the watermarks, until they are taken or
    /// [`trim`](Self::trim)med. Pays the cost of acquiring memory ahead of
    /// time: pinning host pages costs ~300-400 ms per GiB on an H100, which
    /// a first offload into a reserved pool does not pay. Returns the bytes
    /// added. All or nothing: on an error the chunks this call created are
    /// released. A total that overflows is [`Error::InvalidArgument`]; one
    /// past the device's memory is [`Error::OutOfMemory`] before anything is
    /// created; otherwise creation stops at the first failure (out of
    /// memory, or the process's descriptor limit for host-backend chunks).
    pub fn reserve(
        &self,
        placement: Location,
        chunk_bytes: usize,
        total_bytes: usize,
    ) -> Result<usize> {
        let g = self.backend.granularity(placement)?;
        let chunk = crate::plan::round_up(chunk_bytes.max(1), g)
            .ok_or_else(|| Error::invalid(format!("chunk_bytes {chunk_bytes} overflows")))?;
        let n = total_bytes.div_ceil(chunk);
        let total = n.checked_mul(chunk).ok_or_else(|| {
            Error::invalid(format!(
                "{total_bytes} bytes in chunks of {chunk} overflow the address space"
            ))
        })?;
        // More than the device holds can never be created: say so before
        // creating any (and before sizing anything by the request).
        if let (Location::Device(_), Some((_, device_total))) =
            (placement, self.backend.device_memory())
        {
            if total > device_total {
                return Err(Error::OutOfMemory {
                    call: "ChunkPool::reserve (more than the device's memory)",
                    requested_bytes: total,
                });
            }
        }
        let mut made = Vec::new();
        for _ in 0..n {
            match self.backend.create(chunk, placement) {
                Ok(c) => made.push(c),
                Err(e) => {
                    let _ = self.release_all(made); // logged inside
                    return Err(e);
                }
            }
        }
        let mut inner = self.lock();
        for c in made {
            inner.add((placement, false, chunk), c);
        }
        Ok(n * chunk)
    }

    /// Makes sure the pool holds a chunk at `placement` for each size in
    /// `sizes` (one per entry; those it holds already count), creating the
    /// missing ones, host-memory ones on several threads
    /// (`VMMBUF_CREATE_THREADS`, 4 by default); they are kept whatever the watermarks, as
    /// [`reserve`](Self::reserve)'s are. What
    /// [`Arena::prepare_sleep`](crate::Arena::prepare_sleep) runs, ahead of
    /// a first sleep, possibly on a thread of its own. Returns the bytes
    /// created. All or nothing: on an error the chunks this call created are
    /// released.
    pub fn stock(&self, placement: Location, sizes: &[usize]) -> Result<usize> {
        let g = self.backend.granularity(placement)?;
        if let Some(&bad) = sizes.iter().find(|&&b| b == 0 || !b.is_multiple_of(g)) {
            return Err(Error::invalid(format!(
                "stock: {bad} bytes is not a non-zero multiple of {g}"
            )));
        }
        let mut have = self.offer(false);
        let wants: Vec<(Location, usize)> = sizes
            .iter()
            .filter(|&&b| match have.get_mut(&(placement, b)) {
                Some(n) if *n > 0 => {
                    *n -= 1;
                    false
                }
                _ => true,
            })
            .map(|&b| (placement, b))
            .collect();
        let none = wants.iter().map(|_| None).collect();
        let made = fill_by_creating(&*self.backend, false, &wants, none, |_, _, c| {
            let _ = Driver(&*self.backend).release(c);
        })?;
        let mut inner = self.lock();
        let mut added = 0;
        for (c, &(p, b)) in made.into_iter().zip(&wants) {
            inner.add((p, false, b), c);
            added += b;
        }
        Ok(added)
    }

    /// Gives the pooled chunks placed at `placement` back to the driver
    /// and keeps the others, as [`trim`](Self::trim) does for all.
    pub fn trim_at(&self, placement: Location) -> Result<()> {
        let gone: Vec<B::Chunk> = {
            let mut g = self.lock();
            let keys: Vec<(Location, bool, usize)> = g
                .free
                .keys()
                .filter(|k| k.0 == placement)
                .copied()
                .collect();
            let mut gone = Vec::new();
            for k in keys {
                let list = g.free.remove(&k).expect("the key was just listed");
                g.tally(k, list.len(), false);
                gone.extend(list);
            }
            gone
        };
        self.release_all(gone)
    }

    fn release_all(&self, chunks: impl IntoIterator<Item = B::Chunk>) -> Result<()> {
        let mut first = None;
        let mut n = 0;
        for c in chunks {
            n += 1;
            if let Err(e) = self.backend.release(c) {
                tracing::error!(error = %e, "vmmbuf pool: release failed");
                first.get_or_insert(e);
            }
        }
        self.lock().stats.released += n;
        first.map_or(Ok(()), Err)
    }

    /// What the pool holds now of one kind (shareable or not): how many
    /// chunks of each (placement, size), for the growth plan.
    pub(crate) fn offer(&self, shareable: bool) -> PoolOffer {
        let g = self.lock();
        g.free
            .iter()
            .filter(|(k, _)| k.1 == shareable)
            .map(|(&(place, _, bytes), v)| ((place, bytes), v.len()))
            .collect()
    }

    /// A pooled chunk of exactly `bytes` at `placement`, shareable or not,
    /// if there is one.
    pub(crate) fn take_exact(
        &self,
        shareable: bool,
        placement: Location,
        bytes: usize,
    ) -> Option<B::Chunk> {
        let mut g = self.lock();
        let key = (placement, shareable, bytes);
        if !g.free.contains_key(&key) {
            return None;
        }
        g.stats.hits += 1;
        Some(g.pop(key))
    }

    /// A pooled chunk of exactly `bytes` at `placement`, shareable or not,
    /// or a new one.
    pub(crate) fn take_or_create(
        &self,
        shareable: bool,
        placement: Location,
        bytes: usize,
    ) -> Result<B::Chunk> {
        match self.take_exact(shareable, placement, bytes) {
            Some(c) => Ok(c),
            None => crate::backend::create_chunk(&*self.backend, shareable, bytes, placement),
        }
    }

    /// Keeps a chunk of `bytes` at `placement`; past the high watermark, gives
    /// the largest chunks back until at most the low watermark is held.
    pub(crate) fn put(&self, placement: Location, bytes: usize, chunk: B::Chunk) {
        let shed = {
            let kind = self.backend.is_shareable(&chunk);
            let mut g = self.lock();
            g.add((placement, kind, bytes), chunk);
            g.stats.returns += 1;
            g.shed()
        };
        if !shed.is_empty() {
            let _ = self.release_all(shed); // logged inside
        }
    }

    /// Empties the pool to make room after an out-of-memory error. True if
    /// there was anything to give back.
    pub(crate) fn drain_for_oom(&self) -> bool {
        let had = {
            let mut g = self.lock();
            g.stats.oom_drains += 1;
            g.stats.pooled_chunks > 0
        };
        if had {
            let _ = self.trim(); // logged inside
        }
        had
    }
}

impl<B: Backend> Drop for ChunkPool<B> {
    fn drop(&mut self) {
        // The last handle on a pool's own shelf gives its chunks back through
        // the backend (counted, errors logged). A backend's default shelf
        // outlives its handles.
        if Arc::strong_count(&self.shelf) == 1 {
            let _ = self.trim();
        }
    }
}

impl crate::CudaBackend {
    /// The backend's default chunk pool: [`ChunkPool::default_for`].
    pub fn default_pool(self: &Arc<Self>) -> Arc<ChunkPool<Self>> {
        ChunkPool::default_for(self).expect("the CUDA backend lends a pool slot")
    }
}

#[cfg(target_os = "linux")]
impl crate::HostBackend {
    /// The backend's default chunk pool: [`ChunkPool::default_for`].
    pub fn default_pool(self: &Arc<Self>) -> Arc<ChunkPool<Self>> {
        ChunkPool::default_for(self).expect("the host backend lends a pool slot")
    }
}
