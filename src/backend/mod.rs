//! The few driver operations a buffer needs, behind one trait, and its two
//! real implementations: [`CudaBackend`](crate::CudaBackend) (CUDA VMM) and
//! [`HostBackend`](crate::HostBackend) (the host's own virtual memory, Linux).
//!
//! The trait is safe: a backend hands out owned tokens for what it creates
//! (an address reservation, a physical chunk), and every call names the token
//! it acts on, so no call can reach memory the caller does not own. Tokens
//! that are dropped instead of being given back free their resource in their
//! own `Drop` (errors are logged, never panicked).
//!
//! Semantics follow CUDA's: a fresh mapping has *no* access until
//! [`Backend::set_access`]; a chunk maps whole; an unmap covers whole mappings;
//! a reservation can be freed only when nothing in it is mapped.

use crate::error::Result;
use crate::location::{AccessDesc, Location};
use crate::order::{FenceSet, StreamKey};

pub(crate) mod cuda;
#[cfg(unix)]
pub(crate) mod handle;
#[cfg(target_os = "linux")]
pub(crate) mod host;
#[cfg(target_os = "linux")]
pub(crate) mod host_capture;
#[cfg(target_os = "linux")]
pub(crate) mod host_lag;
pub(crate) mod pages;

/// Counts of what a backend has live now, for leak checks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LiveCounts {
    /// Address reservations not yet freed.
    pub reservations: usize,
    /// Bytes in those reservations.
    pub reserved_bytes: usize,
    /// Physical chunks not yet released.
    pub chunks: usize,
    /// Bytes in those chunks.
    pub chunk_bytes: usize,
    /// Bytes mapped into reservations.
    pub mapped_bytes: usize,
    /// Device-wide synchronisations (`cuCtxSynchronize`) the backend has made
    /// so far: a count over its life, not a live figure. Buffers wait on
    /// recorded uses instead; this stays 0 in the steady state.
    pub device_syncs: u64,
    /// Fence queries ([`Backend::fence_done`]: `cuEventQuery`) made so far,
    /// a count over the backend's life: each is a driver call, made when
    /// frees settle.
    pub fence_queries: u64,
}

/// The operations a [`GrowableBuffer`](crate::GrowableBuffer) needs from a
/// memory system.
pub trait Backend: Send + Sync + 'static {
    /// An owned range of reserved address space.
    type Reservation: Send + Sync + 'static;
    /// An owned physical chunk, mappable whole into a reservation.
    type Chunk: Send + Sync + 'static;
    /// A point in the device's work: everything submitted before it has
    /// finished once [`Backend::fence_done`] says so. See
    /// [`GrowableBuffer::shrink_to_fit_after`](crate::GrowableBuffer::shrink_to_fit_after).
    type Fence: Send + Sync + 'static;

    /// A short name for messages: `"cuda"`, `"host"`.
    fn name(&self) -> &'static str;

    /// Where memory goes when nothing else is asked for: the backend's GPU, or
    /// the host for the host backend.
    fn home(&self) -> Location;

    /// The mapping granularity for chunks placed at `placement`: every chunk
    /// size and every mapping offset is a multiple of it. A power of two.
    fn granularity(&self, placement: Location) -> Result<usize>;

    /// Reserves `bytes` (a multiple of the granularity) of address space,
    /// aligned to at least `align` bytes; no physical memory is used.
    fn reserve(&self, bytes: usize, align: usize) -> Result<Self::Reservation>;

    /// The first address of a reservation.
    fn base(&self, res: &Self::Reservation) -> u64;

    /// Frees a reservation. Fails, and drops the token (which tries again and
    /// logs), if anything in it is still mapped.
    fn free(&self, res: Self::Reservation) -> Result<()>;

    /// Creates a physical chunk of `bytes` (a multiple of the granularity) at
    /// `placement`.
    fn create(&self, bytes: usize, placement: Location) -> Result<Self::Chunk>;

    /// Releases a chunk. Its memory goes back once it is no longer mapped.
    fn release(&self, chunk: Self::Chunk) -> Result<()>;

    /// Maps `chunk`, whole, at `offset` into `res`. The mapping starts with no
    /// access for anyone.
    fn map(&self, res: &mut Self::Reservation, offset: usize, chunk: &Self::Chunk) -> Result<()>;

    /// Unmaps `[offset, offset + bytes)` of `res`, which must cover whole
    /// mappings. Does not wait for the GPU: see [`Backend::synchronize`].
    fn unmap(&self, res: &mut Self::Reservation, offset: usize, bytes: usize) -> Result<()>;

    /// Sets access for `[offset, offset + bytes)` of `res`, which must be
    /// mapped, to exactly the listed locations (one call for all of them).
    fn set_access(
        &self,
        res: &mut Self::Reservation,
        offset: usize,
        bytes: usize,
        access: &[AccessDesc],
    ) -> Result<()>;

    /// Whether a CUDA graph capture may be under way on the backend's
    /// device: a device-wide synchronisation would then fail and invalidate
    /// it, so vmmbuf makes none (see [`Error::CaptureUnderway`](crate::Error::CaptureUnderway)).
    /// CUDA: captures announced with [`cuda::capture_begins`](crate::cuda::capture_begins);
    /// the host backend: its own simulated captures
    /// ([`HostBackend::begin_capture`](crate::HostBackend::begin_capture)).
    fn capture_underway(&self) -> bool {
        false
    }

    /// Waits until no work the backend's device has been given is still
    /// running. Buffers never need it: they wait on the uses recorded with
    /// them ([`Backend::wait`]); it is there for callers who want it.
    fn synchronize(&self) -> Result<()>;

    /// Blocks until all work before `fence` has finished (only that stream's
    /// work, never the whole device).
    fn wait(&self, fence: &Self::Fence) -> Result<()>;

    /// Which queue `fence` orders: of two fences with the same key, the later
    /// one covers the earlier (CUDA: the context and the stream; two
    /// contexts' default streams share the null handle).
    fn fence_key(&self, fence: &Self::Fence) -> crate::StreamKey;

    /// Blocks until the copies this backend issued itself ([`Backend::copy`])
    /// have finished.
    fn wait_copies(&self) -> Result<()>;

    /// A fence after the copies this backend has issued so far: wait on it
    /// for those, while later copies run on.
    fn copies_fence(&self) -> Result<Self::Fence>;

    /// Whether one chunk may be mapped at two addresses at once (CUDA: yes;
    /// the host backend only if made with
    /// [`HostBackend::mapping_chunks_twice`](crate::HostBackend::mapping_chunks_twice)). Migration then stages the old chunk instead
    /// of the new one where that is cheaper, and an arena may move a free
    /// chunk's memory to where it grows while work may still use the old
    /// address ([`ArenaDesc::move_free_chunks`](crate::ArenaDesc::move_free_chunks)).
    fn maps_a_chunk_twice(&self) -> bool {
        false
    }

    /// Copies `bytes` from `src` at `src_offset` to `dst` at `dst_offset`,
    /// ordered on the backend's own stream: complete once
    /// [`Backend::wait_copies`] returns. Both ranges must be mapped; the
    /// backend's device needs access to both.
    fn copy(
        &self,
        dst: &mut Self::Reservation,
        dst_offset: usize,
        src: &Self::Reservation,
        src_offset: usize,
        bytes: usize,
    ) -> Result<()>;

    /// Sets `bytes` at `offset` of `res` to zero, ordered on the backend's
    /// own stream as [`Backend::copy`] is: complete once
    /// [`Backend::wait_copies`] returns. The range must be mapped writable
    /// by the backend's device. The default writes zeros synchronously.
    fn zero(&self, res: &mut Self::Reservation, offset: usize, bytes: usize) -> Result<()> {
        const STEP: usize = 1 << 20;
        let zeros = vec![0u8; STEP.min(bytes)];
        let mut at = 0;
        while at < bytes {
            let n = STEP.min(bytes - at);
            self.write(res, offset + at, &zeros[..n])?;
            at += n;
        }
        Ok(())
    }

    /// Whether `device` can be given access to memory placed on `peer`.
    fn can_access_peer(&self, device: u32, peer: u32) -> Result<bool>;

    /// The other devices that can be given access to memory placed at the
    /// backend's home (none for the host backend): what a mapping lists
    /// for [`ArenaDesc::peer_access`](crate::ArenaDesc::peer_access).
    fn peers(&self) -> Result<Vec<u32>> {
        Ok(Vec::new())
    }

    /// True once all work before `fence` has finished. Never blocks.
    fn fence_done(&self, fence: &Self::Fence) -> Result<bool>;

    /// Copies `dst.len()` bytes from `res` at `offset` to host memory.
    fn read(&self, res: &Self::Reservation, offset: usize, dst: &mut [u8]) -> Result<()>;

    /// Copies `src` into `res` at `offset`.
    fn write(&self, res: &mut Self::Reservation, offset: usize, src: &[u8]) -> Result<()>;

    /// What this backend has live now.
    fn live(&self) -> LiveCounts;

    /// `(free, total)` bytes of the backend's device, where it can tell.
    fn device_memory(&self) -> Option<(usize, usize)> {
        None
    }

    /// Creates a chunk as [`Backend::create`] does, but exportable to another
    /// process as a file descriptor ([`Backend::export`]). CUDA asks for a
    /// POSIX-fd handle type at creation (it cannot be added later). The
    /// default: [`Error::Unsupported`](crate::Error::Unsupported).
    fn create_shareable(&self, bytes: usize, placement: Location) -> Result<Self::Chunk> {
        let _ = (bytes, placement);
        Err(crate::Error::Unsupported {
            what: format!("shareable chunks with the {} backend", self.name()),
        })
    }

    /// Whether `chunk` can be exported ([`Backend::create_shareable`] made it,
    /// or it was imported).
    fn is_shareable(&self, chunk: &Self::Chunk) -> bool {
        let _ = chunk;
        false
    }

    /// A new file descriptor for `chunk`, which another process imports
    /// with [`Backend::import`]. The memory stays alive while any process
    /// holds the chunk, a descriptor of it, or a mapping.
    #[cfg(unix)]
    fn export(&self, chunk: &Self::Chunk) -> Result<std::os::fd::OwnedFd> {
        let _ = chunk;
        Err(crate::Error::Unsupported {
            what: format!("exporting chunks with the {} backend", self.name()),
        })
    }

    /// The chunk behind a descriptor that another process exported, said to
    /// hold `bytes` at `placement`. [`Error::Protocol`](crate::Error::Protocol)
    /// when the descriptor is not such a chunk. The descriptor is consumed
    /// (closed) either way.
    #[cfg(unix)]
    fn import(
        &self,
        fd: std::os::fd::OwnedFd,
        bytes: usize,
        placement: Location,
    ) -> Result<Self::Chunk> {
        let _ = (fd, bytes, placement);
        Err(crate::Error::Unsupported {
            what: format!("importing chunks with the {} backend", self.name()),
        })
    }

    /// A new handle of `kind` for `chunk`, which another process imports
    /// with [`Backend::import_handle`]. The default: [`Backend::export`] for
    /// a POSIX descriptor; [`Error::Unsupported`](crate::Error::Unsupported)
    /// for a fabric handle.
    #[cfg(unix)]
    fn export_handle(
        &self,
        chunk: &Self::Chunk,
        kind: handle::HandleKind,
    ) -> Result<handle::ChunkHandle> {
        match kind {
            handle::HandleKind::PosixFd => self.export(chunk).map(handle::ChunkHandle::PosixFd),
            handle::HandleKind::Fabric => Err(crate::Error::Unsupported {
                what: format!("fabric handles with the {} backend", self.name()),
            }),
        }
    }

    /// The chunk behind a handle another process exported, said to hold
    /// `bytes` at `placement` (see [`Backend::import`]; the handle is
    /// consumed either way). The default: [`Backend::import`] for a POSIX
    /// descriptor; [`Error::Unsupported`](crate::Error::Unsupported) for a
    /// fabric handle.
    #[cfg(unix)]
    fn import_handle(
        &self,
        handle: handle::ChunkHandle,
        bytes: usize,
        placement: Location,
    ) -> Result<Self::Chunk> {
        match handle {
            handle::ChunkHandle::PosixFd(fd) => self.import(fd, bytes, placement),
            handle::ChunkHandle::Fabric(_) => Err(crate::Error::Unsupported {
                what: format!("fabric handles with the {} backend", self.name()),
            }),
        }
    }

    /// A number that tells `chunk` apart from every other chunk this process
    /// has created or imported, alive or gone: never reused (a shared
    /// buffer's exporter uses it to send each chunk once; a driver handle or
    /// an inode number, reused after a release, would let an importer keep
    /// an old chunk in place of a new one).
    fn chunk_id(&self, chunk: &Self::Chunk) -> u64 {
        let _ = chunk;
        0
    }

    /// Where vmmbuf keeps this backend's default chunk pool
    /// ([`ChunkPool::default_for`](crate::ChunkPool::default_for)), which
    /// [`GrowableBuffer::new`](crate::GrowableBuffer::new) gives every buffer:
    /// the pool lives as long as the backend. `None` (the default): no
    /// default pool. A backend that wants one holds a [`PoolSlot`] and
    /// returns it.
    fn pool_slot(&self) -> Option<&PoolSlot> {
        None
    }
}

/// A place a backend lends for its default chunk pool: the pool module
/// keeps it there (type-erased), so that the pool lives as long as the
/// backend and the backend knows nothing of pools.
#[derive(Default)]
pub struct PoolSlot(std::sync::OnceLock<Box<dyn std::any::Any + Send + Sync>>);

impl PoolSlot {
    /// The value kept here, made with `init` on first use; `None` if a value
    /// of another type is kept.
    pub(crate) fn get_or_init<T: std::any::Any + Send + Sync>(
        &self,
        init: impl FnOnce() -> T,
    ) -> Option<&T> {
        self.0.get_or_init(|| Box::new(init())).downcast_ref()
    }
}

impl std::fmt::Debug for PoolSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.get().is_some() {
            "PoolSlot(in use)"
        } else {
            "PoolSlot(empty)"
        })
    }
}

/// The last recorded use of a buffer per queue (stream): what must finish
/// before its memory may be unmapped. Bounded by the number of streams that
/// ever used the buffer. Each fence carries its stream's sequence number
/// ([`crate::order`]): of two on one stream, the later stays.
#[derive(Debug)]
pub(crate) struct Uses<F> {
    fences: parking_lot::Mutex<FenceSet<F>>,
}

impl<F> Default for Uses<F> {
    fn default() -> Self {
        Self {
            fences: parking_lot::Mutex::new(FenceSet::default()),
        }
    }
}

impl<F> Uses<F> {
    /// Records `fence`, which the caller recorded on queue `key`, as the
    /// last use there (a caller hands one queue's fences over in the order
    /// it recorded them).
    pub(crate) fn put(&self, key: StreamKey, fence: F) {
        let mut v = self.fences.lock();
        v.add(crate::order::given(key, fence));
    }

    /// Records a use on `key` now: re-records the fence held for `key` with
    /// `rerecord` if there is one, else records a new one with `record`.
    pub(crate) fn record(
        &self,
        key: StreamKey,
        rerecord: impl FnOnce(&F) -> Result<()>,
        record: impl FnOnce() -> Result<F>,
    ) -> Result<()> {
        let mut v = self.fences.lock();
        if let Some(slot) = v.iter_mut().find(|s| s.key == key) {
            return crate::order::rerecord(slot, rerecord);
        }
        v.add(crate::order::record(key, record)?);
        Ok(())
    }

    /// Calls `f` on every recorded fence, stopping at the first error.
    pub(crate) fn each(&self, f: impl FnMut(&F) -> Result<()>) -> Result<()> {
        self.fences.lock().each(f)
    }

    /// Whether no fence is recorded.
    pub(crate) fn is_empty(&self) -> bool {
        self.fences.lock().is_empty()
    }

    /// Every recorded fence, taken out, leaving none.
    pub(crate) fn take(&self) -> FenceSet<F> {
        std::mem::take(&mut *self.fences.lock())
    }

    /// True if `done` says so of every recorded fence.
    pub(crate) fn all(&self, done: impl FnMut(&F) -> Result<bool>) -> Result<bool> {
        self.fences.lock().all(done)
    }
}

/// A chunk id never handed out before in this process.
pub(crate) fn next_chunk_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// A new chunk of `bytes` at `placement`, exportable if `shareable`: the one
/// place that chooses between [`Backend::create`] and
/// [`Backend::create_shareable`].
pub(crate) fn create_chunk<B: Backend>(
    backend: &B,
    shareable: bool,
    bytes: usize,
    placement: Location,
) -> Result<B::Chunk> {
    if shareable {
        backend.create_shareable(bytes, placement)
    } else {
        backend.create(bytes, placement)
    }
}

/// Checks a reservation request: a non-zero multiple of the granularity,
/// aligned to a power of two.
pub(crate) fn check_reserve(bytes: usize, align: usize, granularity: usize) -> Result<()> {
    if bytes == 0 || !bytes.is_multiple_of(granularity) || !align.is_power_of_two() {
        return Err(crate::Error::invalid(format!(
            "reserve {bytes} bytes aligned {align}: size must be a non-zero multiple of {granularity}"
        )));
    }
    Ok(())
}

/// Checks a chunk size: a non-zero multiple of the granularity.
pub(crate) fn check_chunk(bytes: usize, granularity: usize) -> Result<()> {
    if bytes == 0 || !bytes.is_multiple_of(granularity) {
        return Err(crate::Error::invalid(format!(
            "chunk of {bytes} bytes is not a non-zero multiple of {granularity}"
        )));
    }
    Ok(())
}

/// Freeing a reservation with mappings left is refused (the token is dropped
/// instead, which unmaps first).
pub(crate) fn check_free<C>(table: &crate::table::ChunkTable<C>) -> Result<()> {
    if !table.is_empty() {
        return Err(crate::Error::invalid(
            "freeing a reservation that still has mappings (dropped instead)",
        ));
    }
    Ok(())
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for crate::CudaBackend {}
    #[cfg(target_os = "linux")]
    impl Sealed for crate::HostBackend {}
}

/// A backend whose mappings live in this process's address space, so that
/// chunks granting the host access can be read by the CPU at the buffer's own
/// addresses: what [`GrowableBuffer::host_slice`](crate::GrowableBuffer::host_slice)
/// needs. Sealed: implemented by the crate's two backends, whose tokens keep
/// the promise.
pub trait HostMapped: Backend + sealed::Sealed {}
impl HostMapped for crate::CudaBackend {}
#[cfg(target_os = "linux")]
impl HostMapped for crate::HostBackend {}

/// Live counters shared by the real backends.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    inner: parking_lot::Mutex<LiveCounts>,
}

impl Counters {
    pub(crate) fn get(&self) -> LiveCounts {
        *self.inner.lock()
    }
    pub(crate) fn update(&self, f: impl FnOnce(&mut LiveCounts)) {
        f(&mut self.inner.lock())
    }
}
