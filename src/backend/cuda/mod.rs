//! The CUDA backend: CUDA's virtual memory management API on one device.
//!
//! Laid out as cudarc is: [`driver`] is the thin layer (one function per
//! driver call, the only code that calls the driver), this module the safe
//! one ([`CudaBackend`] and its owned tokens, checked against each token's
//! own chunk table before any call), [`probe`] reads what the machine
//! supports, and [`interop`] holds the typed views cudarc accepts.
//!
//! Before the first driver call, [`CudaBackend::new`] checks that the driver
//! library can be loaded, that the device exists and that it supports VMM,
//! and answers with a typed error otherwise: cudarc never gets the chance to
//! panic for a missing library.
#![allow(unsafe_code)]

pub(crate) mod capture;
mod desc;
pub(crate) mod driver;
mod fence;
pub(crate) mod interop;
pub(crate) mod nccl;
pub(crate) mod probe;
mod setup;
mod tokens;

use desc::NcclChunks;
pub use desc::{ChunkKind, CudaBackendDesc};
pub(crate) use fence::stream_key;
pub use fence::CudaFence;
pub use tokens::{CudaChunk, CudaReservation};

use std::collections::BTreeMap;
use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaEvent, CudaStream};
use parking_lot::Mutex;

#[cfg(unix)]
use super::handle::{ChunkHandle, FabricHandle, HandleKind};
use super::{Backend, Counters, LiveCounts};
use crate::error::{Error, Result};
use crate::location::{AccessDesc, Location};
use crate::table::{ChunkTable, Entry};

/// CUDA VMM on one device's primary context.
#[derive(Debug)]
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    device: u32,
    device_count: u32,
    /// Minimum granularity per placement, queried once each.
    granularity: Mutex<BTreeMap<Location, usize>>,
    /// The host NUMA node for host placement, where the device supports it.
    host_numa: Option<i32>,
    /// Where the backend's own copies (migration) are ordered.
    stream: Arc<CudaStream>,
    /// Events of dropped fences, recorded again by the next ones.
    spare_events: Arc<Mutex<Vec<(u64, CudaEvent)>>>,
    counters: Arc<Counters>,
    /// Where its default pool lives (see [`Backend::pool_slot`]).
    pool_slot: super::PoolSlot,
    /// Chunks made as `ncclMemAlloc` makes them (see
    /// [`CudaBackendDesc::nccl_ready`]), `None` otherwise.
    nccl: Option<NcclChunks>,
}

impl Backend for CudaBackend {
    type Reservation = CudaReservation;
    type Chunk = CudaChunk;
    type Fence = CudaFence;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn home(&self) -> Location {
        Location::Device(self.device)
    }

    fn granularity(&self, placement: Location) -> Result<usize> {
        if let Some(&g) = self.granularity.lock().get(&placement) {
            return Ok(g);
        }
        use sys::CUmemAllocationGranularity_flags as F;
        // NCCL-ready device chunks: the recommended granularity, as
        // ncclMemAlloc uses.
        let flag = match self.nccl_for(placement) {
            Some(_) => F::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
            None => F::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        };
        let g = self.query_granularity(placement, flag)?;
        self.granularity.lock().insert(placement, g);
        Ok(g)
    }

    fn reserve(&self, bytes: usize, align: usize) -> Result<CudaReservation> {
        let g = self.granularity(self.home())?;
        super::check_reserve(bytes, align, g)?;
        let table = ChunkTable::new(bytes, g)?;
        driver::bind(&self.ctx)?;
        let ptr = driver::address_reserve(bytes, align).map_err(|e| match e {
            Error::OutOfMemory { .. } => Error::ReservationExhausted {
                requested_bytes: bytes,
                reserved_bytes: 0,
            },
            e => e,
        })?;
        self.counters.update(|c| {
            c.reservations += 1;
            c.reserved_bytes += bytes;
        });
        Ok(CudaReservation {
            ptr,
            table,
            ctx: self.ctx.clone(),
            counters: self.counters.clone(),
        })
    }

    fn base(&self, res: &CudaReservation) -> u64 {
        res.ptr
    }

    fn free(&self, mut res: CudaReservation) -> Result<()> {
        super::check_free(&res.table)?;
        driver::bind(&self.ctx)?;
        // SAFETY: (ptr, bytes) is exactly this token's reservation, nothing in
        // it is mapped (checked above), and the token is consumed.
        unsafe { driver::address_free(res.ptr, res.table.reserved()) }?;
        let bytes = res.table.reserved();
        self.counters.update(|c| {
            c.reservations -= 1;
            c.reserved_bytes -= bytes;
        });
        res.ptr = 0;
        Ok(())
    }

    fn create(&self, bytes: usize, placement: Location) -> Result<CudaChunk> {
        self.create_with(bytes, placement, false)
    }

    fn create_shareable(&self, bytes: usize, placement: Location) -> Result<CudaChunk> {
        self.create_with(bytes, placement, true)
    }

    fn is_shareable(&self, chunk: &CudaChunk) -> bool {
        chunk.shareable
    }

    #[cfg(unix)]
    fn export(&self, chunk: &CudaChunk) -> Result<std::os::fd::OwnedFd> {
        if !chunk.exportable {
            return Err(Error::invalid("exporting a chunk not created shareable"));
        }
        driver::bind(&self.ctx)?;
        // SAFETY: the chunk's handle is live while the token is.
        unsafe { driver::mem_export_fd(chunk.handle) }
    }

    #[cfg(unix)]
    fn import(
        &self,
        fd: std::os::fd::OwnedFd,
        bytes: usize,
        placement: Location,
    ) -> Result<CudaChunk> {
        self.import_handle(ChunkHandle::PosixFd(fd), bytes, placement)
    }

    #[cfg(unix)]
    fn export_handle(&self, chunk: &CudaChunk, kind: HandleKind) -> Result<ChunkHandle> {
        match kind {
            HandleKind::PosixFd => self.export(chunk).map(ChunkHandle::PosixFd),
            HandleKind::Fabric => {
                if !chunk.fabric {
                    let why = self.chunk_kind().ok().and_then(|k| k.no_fabric);
                    return Err(Error::Unsupported {
                        what: format!(
                            "a fabric handle for a chunk made without the fabric handle type \
                             (NCCL-ready chunks ask for it where the device supports it and the \
                             driver permits it{})",
                            why.map_or(String::new(), |w| format!("; here: {w}"))
                        ),
                    });
                }
                driver::bind(&self.ctx)?;
                // SAFETY: the chunk's handle is live while the token is.
                unsafe { driver::mem_export_fabric(chunk.handle) }
                    .map(|h| ChunkHandle::Fabric(FabricHandle(h)))
            }
        }
    }

    #[cfg(unix)]
    fn import_handle(
        &self,
        handle: ChunkHandle,
        bytes: usize,
        placement: Location,
    ) -> Result<CudaChunk> {
        use std::os::fd::AsFd;
        let granularity = self.granularity(placement)?;
        super::check_chunk(bytes, granularity).map_err(|e| Error::protocol(e.to_string()))?;
        let want = self.placement(placement)?;
        driver::bind(&self.ctx)?;
        let kind = handle.kind();
        let raw = match handle {
            ChunkHandle::PosixFd(fd) => driver::mem_import_fd(fd.as_fd()),
            // The handle's bytes are plain data; the driver checks them.
            ChunkHandle::Fabric(FabricHandle(h)) => driver::mem_import_fabric(&h),
        }
        .map_err(|e| Error::protocol(format!("a received {kind} is not a CUDA chunk: {e}")))?;
        // (A descriptor is closed here: the handle holds the memory now.)
        self.counters.update(|c| {
            c.chunks += 1;
            c.chunk_bytes += bytes;
        });
        let mut chunk = CudaChunk {
            handle: raw,
            id: super::next_chunk_id(),
            bytes,
            placement,
            shareable: true,
            // Both set below from the types the allocation was made with.
            exportable: false,
            fabric: false,
            released: false,
            ctx: self.ctx.clone(),
            counters: self.counters.clone(),
        };
        // SAFETY: the handle was just imported and is live.
        let prop = unsafe { driver::mem_properties(raw) }?;
        if driver::location_parts(prop.location) != driver::location_parts(want) {
            // Dropping the token releases the handle.
            return Err(Error::protocol(format!(
                "a chunk described as placed at {placement} is placed elsewhere ({:?})",
                driver::location_parts(prop.location)
            )));
        }
        // What it can be exported as again: the types it was created with.
        let types = prop.requestedHandleTypes.0;
        chunk.exportable = types & driver::HANDLE_POSIX_FD != 0;
        chunk.fabric = types & driver::HANDLE_FABRIC != 0;
        Ok(chunk)
    }

    fn chunk_id(&self, chunk: &CudaChunk) -> u64 {
        chunk.id
    }

    fn release(&self, mut chunk: CudaChunk) -> Result<()> {
        driver::bind(&self.ctx)?;
        chunk.release_now()
    }

    fn map(&self, res: &mut CudaReservation, offset: usize, chunk: &CudaChunk) -> Result<()> {
        res.table.check_insert(offset, chunk.bytes)?;
        driver::bind(&self.ctx)?;
        // SAFETY: the range lies inside this token's reservation and holds no
        // mapping (checked above); the handle is live and of `bytes`.
        unsafe { driver::mem_map(res.addr(offset), chunk.bytes, chunk.handle) }?;
        res.table
            .insert(offset, Entry::new((), chunk.bytes, chunk.placement))?;
        self.counters.update(|c| c.mapped_bytes += chunk.bytes);
        Ok(())
    }

    fn unmap(&self, res: &mut CudaReservation, offset: usize, bytes: usize) -> Result<()> {
        let keys = res.table.covering(offset, bytes, true)?;
        driver::bind(&self.ctx)?;
        // SAFETY: the range is made of whole live mappings of this token
        // (checked above). The caller has waited for GPU work using it, and
        // `&mut` to the token excludes references into it.
        unsafe { driver::mem_unmap(res.addr(offset), bytes) }?;
        for k in keys {
            res.table.remove(k);
        }
        self.counters.update(|c| c.mapped_bytes -= bytes);
        Ok(())
    }

    fn set_access(
        &self,
        res: &mut CudaReservation,
        offset: usize,
        bytes: usize,
        access: &[AccessDesc],
    ) -> Result<()> {
        if access.is_empty() {
            return Err(Error::invalid("an empty access list"));
        }
        let keys = res.table.covering(offset, bytes, true)?;
        // NCCL-ready: device mappings the home device may write are granted
        // to its peers too, as ncclMemAlloc maps them.
        let mut widened;
        let mut access = access;
        if let Some(n) = self.nccl.as_ref().filter(|n| !n.peers.is_empty()) {
            let home = Location::Device(self.device);
            let on_device = keys
                .iter()
                .all(|k| res.table.get(*k).is_some_and(|e| e.placement == home));
            let home_writes = access
                .iter()
                .any(|d| d.location == home && d.access == crate::Access::ReadWrite);
            if on_device && home_writes {
                widened = access.to_vec();
                for &p in &n.peers {
                    if !widened.iter().any(|d| d.location == Location::Device(p)) {
                        widened.push(AccessDesc::new(
                            Location::Device(p),
                            crate::Access::ReadWrite,
                        ));
                    }
                }
                access = &widened;
            }
        }
        let descs = access
            .iter()
            .map(|d| {
                Ok(sys::CUmemAccessDesc {
                    location: self.access_location(d.location)?,
                    flags: driver::access_flags(d.access),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        driver::bind(&self.ctx)?;
        // SAFETY: the range is made of whole live mappings of this token
        // (checked above); `&mut` to the token excludes references into it.
        unsafe { driver::mem_set_access(res.addr(offset), bytes, &descs) }?;
        res.table.set_access(&keys, access);
        Ok(())
    }

    fn capture_underway(&self) -> bool {
        capture::captures_underway() > 0
    }

    fn synchronize(&self) -> Result<()> {
        self.counters.update(|c| c.device_syncs += 1);
        driver::synchronize(&self.ctx)
    }

    fn wait(&self, fence: &CudaFence) -> Result<()> {
        driver::event_wait(fence.event())
    }

    fn fence_key(&self, fence: &CudaFence) -> crate::StreamKey {
        fence.key
    }

    fn wait_copies(&self) -> Result<()> {
        driver::stream_synchronize(&self.stream)
    }

    fn copies_fence(&self) -> Result<CudaFence> {
        self.fence(&self.stream)
    }

    fn maps_a_chunk_twice(&self) -> bool {
        true
    }

    fn copy(
        &self,
        dst: &mut CudaReservation,
        dst_offset: usize,
        src: &CudaReservation,
        src_offset: usize,
        bytes: usize,
    ) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        src.table.covering(src_offset, bytes, false)?;
        dst.table.covering(dst_offset, bytes, false)?;
        driver::bind(&self.ctx)?;
        // SAFETY: both ranges are mapped in their tokens (checked above), in
        // two distinct reservations; the copy is ordered on our own stream,
        // and everything that unmaps synchronises the context first.
        unsafe {
            driver::memcpy_dtod_async(
                dst.addr(dst_offset),
                src.addr(src_offset),
                bytes,
                &self.stream,
            )
        }
    }

    fn zero(&self, res: &mut CudaReservation, offset: usize, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        res.table.covering(offset, bytes, false)?;
        driver::bind(&self.ctx)?;
        // SAFETY: the range is mapped in the token (checked above), and the
        // caller granted our device write access; the memset is ordered on
        // our own stream, which every unmap of ours waits for.
        unsafe { driver::memset_zeros_async(res.addr(offset), bytes, &self.stream) }
    }

    fn can_access_peer(&self, device: u32, peer: u32) -> Result<bool> {
        for d in [device, peer] {
            self.check_location(Location::Device(d))?;
        }
        if device == peer {
            return Ok(true);
        }
        let (a, b) = (driver::device_get(device)?, driver::device_get(peer)?);
        // SAFETY: both handles come from cuDeviceGet.
        unsafe { driver::can_access_peer(a, b) }
    }

    fn peers(&self) -> Result<Vec<u32>> {
        let Location::Device(home) = self.home() else {
            return Ok(Vec::new());
        };
        let mut out = Vec::new();
        for d in (0..self.device_count).filter(|&d| d != home) {
            if self.can_access_peer(d, home)? {
                out.push(d);
            }
        }
        Ok(out)
    }

    fn fence_done(&self, fence: &CudaFence) -> Result<bool> {
        self.counters.update(|c| c.fence_queries += 1);
        driver::event_done(fence.event())
    }

    fn read(&self, res: &CudaReservation, offset: usize, dst: &mut [u8]) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        res.table.covering(offset, dst.len(), false)?;
        driver::bind(&self.ctx)?;
        // One copy per run of equal placement: a copy that spans a GPU chunk
        // and a host-NUMA chunk segfaults inside driver 580.159.04.
        for (at, n, _) in res.table.placement_runs(offset, dst.len()) {
            let d = &mut dst[at - offset..at - offset + n];
            // SAFETY: the run is mapped in this token (checked above) and of
            // one placement. The copy is synchronous.
            unsafe { driver::memcpy_dtoh(d, res.addr(at)) }?;
        }
        Ok(())
    }

    fn write(&self, res: &mut CudaReservation, offset: usize, src: &[u8]) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        res.table.covering(offset, src.len(), false)?;
        driver::bind(&self.ctx)?;
        // One copy per run of equal placement, as in `read`.
        for (at, n, _) in res.table.placement_runs(offset, src.len()) {
            let s = &src[at - offset..at - offset + n];
            // SAFETY: the run is mapped in this token (checked above) and of
            // one placement; `&mut` to the token excludes references into it.
            unsafe { driver::memcpy_htod(res.addr(at), s) }?;
        }
        Ok(())
    }

    fn pool_slot(&self) -> Option<&super::PoolSlot> {
        Some(&self.pool_slot)
    }

    fn live(&self) -> LiveCounts {
        self.counters.get()
    }

    fn device_memory(&self) -> Option<(usize, usize)> {
        self.mem_info().ok()
    }
}
