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
pub(crate) mod driver;
mod fence;
pub(crate) mod interop;
pub(crate) mod nccl;
pub(crate) mod probe;
pub(crate) mod tensor;
mod tokens;

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

/// How a [`CudaBackend`] makes its chunks.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CudaBackendDesc {
    /// Make device chunks as NCCL's `ncclMemAlloc` does, so that NCCL can
    /// register them (`ncclCommRegister`, zero-copy collectives) and peers
    /// can reach them:
    /// - exportable as a POSIX file descriptor, and as a fabric handle where
    ///   the device supports one (`CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED`;
    ///   if creating such a chunk is refused, as without an IMEX channel,
    ///   the backend goes on with POSIX_FD alone, as NCCL does);
    /// - GPUDirect RDMA capable where the device supports it with VMM;
    /// - the recommended granularity instead of the minimum;
    /// - every mapping of a device chunk that grants the home device
    ///   read-write also grants it to every GPU that can access the home
    ///   device as a peer.
    ///
    /// Host-placed chunks are made as usual (NCCL does not register them).
    /// False by default.
    pub nccl_ready: bool,
}

impl CudaBackendDesc {
    /// Chunks as `ncclMemAlloc` makes them (see [`Self::nccl_ready`]).
    pub fn nccl_ready() -> Self {
        Self { nccl_ready: true }
    }
}

/// What [`CudaBackendDesc::nccl_ready`] settled for a backend.
#[derive(Debug)]
struct NcclChunks {
    /// The handle types asked for: POSIX_FD, and FABRIC until the driver
    /// refuses it once.
    handle_types: std::sync::atomic::AtomicU32,
    /// GPUDirect RDMA with VMM is supported.
    rdma: bool,
    /// Why fabric handles are not asked for: the device's attribute, or
    /// the driver's refusal of the first chunk that asked.
    no_fabric: Mutex<Option<String>>,
    /// Devices that can access the home device as peers.
    peers: Vec<u32>,
}

/// What a backend's chunks are like, as [`CudaBackend::chunk_kind`] reports.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ChunkKind {
    /// Device chunks are made as `ncclMemAlloc` makes them.
    pub nccl_ready: bool,
    /// They export as POSIX file descriptors.
    pub posix_fd: bool,
    /// They export as fabric handles too (asked for while the driver has not
    /// refused it).
    pub fabric: bool,
    /// Why they do not, where they do not (no NCCL-ready chunks, the
    /// device's attribute, or the driver's refusal in its words).
    pub no_fabric: Option<String>,
    /// They are created GPUDirect RDMA capable.
    pub gpu_direct_rdma: bool,
    /// The devices every device mapping is also granted to.
    pub peers: Vec<u32>,
    /// The granularity of device chunks.
    pub granularity: usize,
}

impl CudaBackend {
    /// A backend on GPU `ordinal`'s primary context.
    ///
    /// Errors: [`Error::DriverUnavailable`] without a loadable driver or when
    /// it fails to initialise, [`Error::InvalidDevice`] for an ordinal the
    /// machine lacks, [`Error::VmmUnsupported`] where the device has no VMM.
    pub fn new(ordinal: u32) -> Result<Arc<Self>> {
        Self::with_desc(ordinal, &CudaBackendDesc::default())
    }

    /// A backend on GPU `ordinal`'s primary context whose chunks are made as
    /// `desc` says (see [`CudaBackendDesc::nccl_ready`]). Errors as
    /// [`new`](Self::new).
    pub fn with_desc(ordinal: u32, desc: &CudaBackendDesc) -> Result<Arc<Self>> {
        Self::check_driver()?;
        let unavailable = |e: Error| Error::DriverUnavailable {
            reason: e.to_string(),
        };
        driver::init().map_err(unavailable)?;
        let count = driver::device_count().map_err(unavailable)?;
        if ordinal >= count {
            return Err(Error::InvalidDevice {
                device: ordinal,
                count,
            });
        }
        Self::from_context_with(driver::context(ordinal).map_err(unavailable)?, desc)
    }

    /// A backend on an existing cudarc context (its device is the home).
    pub fn from_context(ctx: Arc<CudaContext>) -> Result<Arc<Self>> {
        Self::from_context_with(ctx, &CudaBackendDesc::default())
    }

    /// [`from_context`](Self::from_context), with chunks made as `desc`
    /// says.
    pub fn from_context_with(ctx: Arc<CudaContext>, desc: &CudaBackendDesc) -> Result<Arc<Self>> {
        let device = ctx.ordinal() as u32;
        let attr = |a| driver::context_attribute(&ctx, a);
        use sys::CUdevice_attribute as A;
        if attr(A::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)? == 0 {
            return Err(Error::VmmUnsupported { device });
        }
        let host_numa =
            if attr(A::CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)? != 0 {
                Some(attr(A::CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID)?.max(0))
            } else {
                None
            };
        let device_count = driver::device_count()?;
        let nccl = if desc.nccl_ready {
            let fabric =
                attr(A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED).unwrap_or(0) != 0;
            let rdma = attr(A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED)
                .unwrap_or(0)
                != 0;
            let home = driver::device_get(device)?;
            let mut peers = Vec::new();
            for p in (0..device_count).filter(|&p| p != device) {
                // SAFETY: both handles come from cuDeviceGet.
                if unsafe { driver::can_access_peer(driver::device_get(p)?, home) }? {
                    peers.push(p);
                }
            }
            Some(NcclChunks {
                handle_types: std::sync::atomic::AtomicU32::new(
                    driver::HANDLE_POSIX_FD | if fabric { driver::HANDLE_FABRIC } else { 0 },
                ),
                rdma,
                peers,
                no_fabric: Mutex::new((!fabric).then(|| {
                    "the device does not support them (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED is 0)"
                        .to_owned()
                })),
            })
        } else {
            None
        };
        let this = Self {
            stream: driver::new_stream(&ctx)?,
            ctx,
            device,
            nccl,
            device_count,
            granularity: Mutex::default(),
            spare_events: Arc::default(),
            host_numa,
            counters: Arc::default(),
            pool_slot: Default::default(),
        };
        this.granularity(Location::Device(device))?;
        Ok(Arc::new(this))
    }

    /// Returns `Ok` if the CUDA driver library can be loaded here.
    pub fn check_driver() -> Result<()> {
        if driver::driver_present() {
            Ok(())
        } else {
            Err(Error::DriverUnavailable {
                reason: "the CUDA driver library (libcuda) could not be loaded".into(),
            })
        }
    }

    /// The cudarc context this backend works in.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The home device's ordinal.
    pub fn device(&self) -> u32 {
        self.device
    }

    /// What this backend's device chunks are like: made for NCCL or not,
    /// their handle types, RDMA flag, peers and granularity.
    pub fn chunk_kind(&self) -> Result<ChunkKind> {
        let granularity = self.granularity(self.home())?;
        Ok(match &self.nccl {
            Some(n) => {
                let types = n.handle_types.load(std::sync::atomic::Ordering::Relaxed);
                ChunkKind {
                    nccl_ready: true,
                    posix_fd: true,
                    fabric: types & driver::HANDLE_FABRIC != 0,
                    no_fabric: n.no_fabric.lock().clone(),
                    gpu_direct_rdma: n.rdma,
                    peers: n.peers.clone(),
                    granularity,
                }
            }
            None => ChunkKind {
                nccl_ready: false,
                posix_fd: false,
                fabric: false,
                no_fabric: Some(
                    "chunks are not made NCCL-ready (CudaBackendDesc::nccl_ready)".into(),
                ),
                gpu_direct_rdma: false,
                peers: Vec::new(),
                granularity,
            },
        })
    }

    /// The NCCL settings that apply to chunks at `placement`: device chunks
    /// of an NCCL-ready backend.
    fn nccl_for(&self, placement: Location) -> Option<&NcclChunks> {
        self.nccl.as_ref().filter(|_| placement != Location::Host)
    }

    /// The properties chunks at `location` (`placement`) are made with
    /// (apart from a shareable chunk's handle type): what their granularity
    /// is asked with.
    fn chunk_prop(
        &self,
        placement: Location,
        location: sys::CUmemLocation,
    ) -> sys::CUmemAllocationProp {
        match self.nccl_for(placement) {
            Some(n) => driver::nccl_prop(
                location,
                n.handle_types.load(std::sync::atomic::Ordering::Relaxed),
                n.rdma,
            ),
            None => driver::allocation_prop(location),
        }
    }

    /// Creates a device chunk as `ncclMemAlloc` does: POSIX_FD (and FABRIC
    /// until the driver refuses it), RDMA capable where supported. With
    /// whether it has the fabric handle type.
    fn create_nccl(
        &self,
        n: &NcclChunks,
        bytes: usize,
        location: sys::CUmemLocation,
    ) -> Result<(sys::CUmemGenericAllocationHandle, bool)> {
        use std::sync::atomic::Ordering::Relaxed;
        let types = n.handle_types.load(Relaxed);
        let fabric = types & driver::HANDLE_FABRIC != 0;
        match driver::mem_create(bytes, &driver::nccl_prop(location, types, n.rdma)) {
            Err(Error::Driver { source, .. })
                if fabric
                    && matches!(
                        source.0,
                        sys::CUresult::CUDA_ERROR_NOT_PERMITTED
                            | sys::CUresult::CUDA_ERROR_NOT_SUPPORTED
                    ) =>
            {
                // No IMEX channel (or no fabric here): POSIX_FD alone from
                // now on, as NCCL falls back.
                tracing::info!(error = %source, "vmmbuf: fabric handles refused; POSIX_FD only");
                *n.no_fabric.lock() = Some(format!("the driver refused them: {source}"));
                n.handle_types.store(driver::HANDLE_POSIX_FD, Relaxed);
                driver::mem_create(
                    bytes,
                    &driver::nccl_prop(location, driver::HANDLE_POSIX_FD, n.rdma),
                )
                .map(|h| (h, false))
            }
            r => r.map(|h| (h, fabric)),
        }
    }

    /// `(free, total)` bytes of the home device, from `cuMemGetInfo`.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        driver::bind(&self.ctx)?;
        driver::mem_info()
    }

    /// A fence after all work submitted to `stream` so far: an event recorded
    /// on it. Give it to
    /// [`GrowableBuffer::shrink_to_fit_after`](crate::GrowableBuffer::shrink_to_fit_after)
    /// once the last work that uses the bytes being given back is on `stream`.
    pub fn fence(&self, stream: &CudaStream) -> Result<CudaFence> {
        // A recycled event of this context if there is one: creating and
        // destroying an event per fence costs more than the fence.
        // Spares carry their context's handle: matching one reads no
        // event's context (a miss with cold caches). The latest returned
        // is tried first: its memory is the likeliest still cached.
        let key = stream_key(stream);
        let spare = {
            let mut spares = self.spare_events.lock();
            let at = spares.iter().rposition(|(ctx, _)| *ctx == key.0);
            at.map(|i| spares.swap_remove(i).1)
        };
        let event = match spare {
            Some(e) => {
                driver::event_record(&e, stream)?;
                e
            }
            None => driver::record_event(stream)?,
        };
        Ok(CudaFence {
            event: Some(event),
            key,
            spares: Arc::downgrade(&self.spare_events),
        })
    }

    fn check_location(&self, l: Location) -> Result<()> {
        match l {
            Location::Device(d) if d >= self.device_count => Err(Error::InvalidDevice {
                device: d,
                count: self.device_count,
            }),
            _ => Ok(()),
        }
    }

    /// The `CUmemLocation` of a placement.
    fn placement(&self, l: Location) -> Result<sys::CUmemLocation> {
        self.check_location(l)?;
        use sys::CUmemLocationType as T;
        Ok(match l {
            Location::Device(d) => driver::location(T::CU_MEM_LOCATION_TYPE_DEVICE, d as i32),
            Location::Host => match self.host_numa {
                Some(node) => driver::location(T::CU_MEM_LOCATION_TYPE_HOST_NUMA, node),
                None => {
                    return Err(Error::Unsupported {
                        what: format!(
                            "host placement: gpu{} has no host-NUMA VMM support",
                            self.device
                        ),
                    })
                }
            },
        })
    }

    /// The granularity for `placement` with `flag`, asked of the driver with
    /// the properties this backend's chunks there are made with.
    pub(crate) fn query_granularity(
        &self,
        placement: Location,
        flag: sys::CUmemAllocationGranularity_flags,
    ) -> Result<usize> {
        let prop = self.chunk_prop(placement, self.placement(placement)?);
        driver::bind(&self.ctx)?;
        let g = driver::allocation_granularity(&prop, flag)?;
        if !g.is_power_of_two() {
            return Err(Error::Unsupported {
                what: format!("granularity {g} is not a power of two"),
            });
        }
        Ok(g)
    }

    /// The CUDA location an access descriptor names.
    fn access_location(&self, l: Location) -> Result<sys::CUmemLocation> {
        self.check_location(l)?;
        use sys::CUmemLocationType as T;
        Ok(match l {
            Location::Device(id) => driver::location(T::CU_MEM_LOCATION_TYPE_DEVICE, id as i32),
            // HOST_NUMA, whose id the driver ignores for access, is what it
            // takes for host-NUMA allocations (the only host chunks we make).
            Location::Host => driver::location(
                T::CU_MEM_LOCATION_TYPE_HOST_NUMA,
                self.host_numa.unwrap_or(0),
            ),
        })
    }
}

impl CudaBackend {
    fn create_with(&self, bytes: usize, placement: Location, shareable: bool) -> Result<CudaChunk> {
        let granularity = self.granularity(placement)?;
        super::check_chunk(bytes, granularity)?;
        let location = self.placement(placement)?;
        driver::bind(&self.ctx)?;
        let nccl = self.nccl_for(placement);
        let (handle, fabric) = match nccl {
            Some(n) => self.create_nccl(n, bytes, location)?,
            None if shareable => (
                driver::mem_create(bytes, &driver::shareable_prop(location))?,
                false,
            ),
            None => (
                driver::mem_create(bytes, &driver::allocation_prop(location))?,
                false,
            ),
        };
        self.counters.update(|c| {
            c.chunks += 1;
            c.chunk_bytes += bytes;
        });
        Ok(CudaChunk {
            handle,
            id: super::next_chunk_id(),
            bytes,
            placement,
            shareable,
            exportable: shareable || nccl.is_some(),
            fabric,
            released: false,
            ctx: self.ctx.clone(),
            counters: self.counters.clone(),
        })
    }
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
