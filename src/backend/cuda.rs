//! The CUDA backend: CUDA's virtual memory management API through
//! `cudarc::driver::sys`. The only module of vmmbuf that calls the driver.
//!
//! Before the first driver call, [`CudaBackend::new`] checks that the driver
//! library can be loaded, that the device exists and that it supports VMM,
//! and answers with a typed error otherwise: cudarc never gets the chance to
//! panic for a missing library.

use std::mem::MaybeUninit;
use std::sync::Arc;

use cudarc::driver::sys;
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};

use super::{Backend, Counters, LiveCounts, MapTable};
use crate::error::{Error, Result};
use crate::location::{Access, AccessDesc, Location};

/// Names under which the driver library may be found.
const DRIVER_LIBRARIES: &[&str] = &["libcuda.so.1", "libcuda.so", "nvcuda.dll"];

/// Turns a driver result into vmmbuf's error, naming the call.
fn check(call: &'static str, r: sys::CUresult, requested_bytes: usize) -> Result<()> {
    match r {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => Err(Error::OutOfMemory {
            call,
            requested_bytes,
        }),
        other => Err(Error::Driver {
            call,
            code: other as u32,
            name: format!("{other:?}"),
        }),
    }
}

/// Maps a cudarc safe-layer error to vmmbuf's, naming the call.
fn driver_err(call: &'static str) -> impl Fn(cudarc::driver::DriverError) -> Error {
    move |e| Error::Driver {
        call,
        code: e.0 as u32,
        name: format!("{:?}", e.0),
    }
}

/// `CUmemLocation` changed its source form (an anonymous union) at CUDA 13.2
/// while keeping its layout: `{ type, int id }`. This mirror builds it the same
/// way whichever bindings cudarc picked.
#[repr(C)]
#[derive(Clone, Copy)]
struct RawLocation {
    type_: sys::CUmemLocationType,
    id: std::ffi::c_int,
}

const _: () =
    assert!(std::mem::size_of::<RawLocation>() == std::mem::size_of::<sys::CUmemLocation>());
const _: () =
    assert!(std::mem::align_of::<RawLocation>() == std::mem::align_of::<sys::CUmemLocation>());

fn raw_location(type_: sys::CUmemLocationType, id: i32) -> sys::CUmemLocation {
    // SAFETY: same size and alignment (asserted above), same field order and
    // types as the driver's `CUmemLocation` in every CUDA version; both are
    // plain `Copy` data.
    unsafe { std::mem::transmute::<RawLocation, sys::CUmemLocation>(RawLocation { type_, id }) }
}

fn access_flags(a: Access) -> sys::CUmemAccess_flags {
    match a {
        Access::None => sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE,
        Access::Read => sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ,
        Access::ReadWrite => sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    }
}

/// CUDA VMM on one device's primary context.
#[derive(Debug)]
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    device: u32,
    device_count: u32,
    granularity: usize,
    /// The host NUMA node for host placement, where the device supports it.
    host_numa: Option<i32>,
    /// Where the backend's own copies (migration) are ordered.
    stream: Arc<CudaStream>,
    counters: Arc<Counters>,
}

impl CudaBackend {
    /// A backend on GPU `ordinal`'s primary context.
    ///
    /// Errors: [`Error::DriverUnavailable`] without a loadable driver or when
    /// it fails to initialise, [`Error::InvalidDevice`] for an ordinal the
    /// machine lacks, [`Error::VmmUnsupported`] where the device has no VMM.
    pub fn new(ordinal: u32) -> Result<Arc<Self>> {
        Self::check_driver()?;
        cudarc::driver::result::init().map_err(|e| Error::DriverUnavailable {
            reason: format!("cuInit: {e}"),
        })?;
        let count =
            cudarc::driver::result::device::get_count().map_err(|e| Error::DriverUnavailable {
                reason: format!("cuDeviceGetCount: {e}"),
            })? as u32;
        if ordinal >= count {
            return Err(Error::InvalidDevice {
                device: ordinal,
                count,
            });
        }
        let ctx = CudaContext::new(ordinal as usize).map_err(|e| Error::DriverUnavailable {
            reason: format!("context on gpu{ordinal}: {e}"),
        })?;
        Self::from_context(ctx)
    }

    /// A backend on an existing cudarc context (its device is the home).
    pub fn from_context(ctx: Arc<CudaContext>) -> Result<Arc<Self>> {
        let device = ctx.ordinal() as u32;
        let attr = |a| ctx.attribute(a).map_err(driver_err("cuDeviceGetAttribute"));
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
        let device_count =
            CudaContext::device_count().map_err(driver_err("cuDeviceGetCount"))? as u32;
        let stream = ctx.new_stream().map_err(driver_err("cuStreamCreate"))?;
        let mut this = Self {
            stream,
            ctx,
            device,
            device_count,
            granularity: 0,
            host_numa,
            counters: Arc::default(),
        };
        this.granularity = this.query_granularity(Location::Device(device))?;
        Ok(Arc::new(this))
    }

    /// Returns `Ok` if the CUDA driver library can be loaded here.
    pub fn check_driver() -> Result<()> {
        for name in DRIVER_LIBRARIES {
            // SAFETY: loading the system's CUDA driver library runs only its
            // own initialisers, the same load cudarc itself performs.
            if unsafe { libloading::Library::new(name) }.is_ok() {
                return Ok(());
            }
        }
        Err(Error::DriverUnavailable {
            reason: format!("none of {DRIVER_LIBRARIES:?} could be loaded"),
        })
    }

    /// The cudarc context this backend works in.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The home device's ordinal.
    pub fn device(&self) -> u32 {
        self.device
    }

    /// `(free, total)` bytes of the home device, from `cuMemGetInfo`.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.bind()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: two valid out-pointers; a context is current (bind).
        check(
            "cuMemGetInfo",
            unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) },
            0,
        )?;
        Ok((free, total))
    }

    /// A fence after all work submitted to `stream` so far: an event recorded
    /// on it. Give it to
    /// [`GrowableBuffer::shrink_to_after`](crate::GrowableBuffer::shrink_to_after)
    /// once the last work that uses the bytes being shrunk away is on `stream`.
    pub fn fence(&self, stream: &CudaStream) -> Result<CudaFence> {
        stream
            .record_event(None)
            .map(CudaFence)
            .map_err(driver_err("cuEventRecord"))
    }

    fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(driver_err("cuCtxSetCurrent"))
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
            Location::Device(d) => raw_location(T::CU_MEM_LOCATION_TYPE_DEVICE, d as i32),
            Location::Host => match self.host_numa {
                Some(node) => raw_location(T::CU_MEM_LOCATION_TYPE_HOST_NUMA, node),
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

    fn prop(&self, placement: Location) -> Result<sys::CUmemAllocationProp> {
        // SAFETY: `CUmemAllocationProp` is plain C data for which all-zero is
        // the driver's documented default (no handle types, no flags).
        let mut prop: sys::CUmemAllocationProp = unsafe { MaybeUninit::zeroed().assume_init() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location = self.placement(placement)?;
        Ok(prop)
    }

    fn query_granularity(&self, placement: Location) -> Result<usize> {
        self.query_granularity_flag(
            placement,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
    }

    fn query_granularity_flag(
        &self,
        placement: Location,
        flag: sys::CUmemAllocationGranularity_flags,
    ) -> Result<usize> {
        let prop = self.prop(placement)?;
        self.bind()?;
        let mut g = 0usize;
        // SAFETY: valid out-pointer and a fully initialised property struct.
        check(
            "cuMemGetAllocationGranularity",
            unsafe { sys::cuMemGetAllocationGranularity(&mut g, &prop, flag) },
            0,
        )?;
        if !g.is_power_of_two() {
            return Err(Error::Unsupported {
                what: format!("granularity {g} is not a power of two"),
            });
        }
        Ok(g)
    }
}

/// A point in a CUDA stream (an event recorded on it), made by
/// [`CudaBackend::fence`].
#[derive(Debug)]
pub struct CudaFence(CudaEvent);

impl CudaFence {
    /// The event behind the fence.
    pub fn event(&self) -> &CudaEvent {
        &self.0
    }
}

/// A reserved range of the process's unified (GPU) address space.
#[derive(Debug)]
pub struct CudaReservation {
    ptr: sys::CUdeviceptr,
    table: MapTable,
    ctx: Arc<CudaContext>,
    counters: Arc<Counters>,
}

impl Drop for CudaReservation {
    fn drop(&mut self) {
        if self.ptr == 0 {
            return; // freed through Backend::free
        }
        let _ = self.ctx.bind_to_thread();
        // A token dropped with mappings left: wait for the GPU, then take them
        // down before the range can be freed.
        let mappings = self.table.mappings();
        if !mappings.is_empty() {
            let _ = self.ctx.synchronize();
        }
        for (off, bytes) in mappings {
            // SAFETY: (ptr + off, bytes) is one live mapping of this token.
            let r = unsafe { sys::cuMemUnmap(self.ptr + off as u64, bytes) };
            if r == sys::CUresult::CUDA_SUCCESS {
                self.counters.update(|c| c.mapped_bytes -= bytes);
            } else {
                tracing::error!(?r, "vmmbuf cuda: cuMemUnmap failed in drop");
            }
        }
        // SAFETY: (ptr, bytes) is exactly this token's reservation.
        let r = unsafe { sys::cuMemAddressFree(self.ptr, self.table.bytes) };
        if r == sys::CUresult::CUDA_SUCCESS {
            let bytes = self.table.bytes;
            self.counters.update(|c| {
                c.reservations -= 1;
                c.reserved_bytes -= bytes;
            });
        } else {
            tracing::error!(
                ?r,
                "vmmbuf cuda: cuMemAddressFree failed in drop; the range leaks"
            );
        }
    }
}

/// A physical allocation handle from `cuMemCreate`.
#[derive(Debug)]
pub struct CudaChunk {
    handle: sys::CUmemGenericAllocationHandle,
    bytes: usize,
    placement: Location,
    released: bool,
    ctx: Arc<CudaContext>,
    counters: Arc<Counters>,
}

impl CudaChunk {
    fn release_now(&mut self) -> Result<()> {
        // SAFETY: the handle came from cuMemCreate and has not been released
        // (`released` is false); releasing while mapped is allowed.
        check(
            "cuMemRelease",
            unsafe { sys::cuMemRelease(self.handle) },
            self.bytes,
        )?;
        self.released = true;
        let bytes = self.bytes;
        self.counters.update(|c| {
            c.chunks -= 1;
            c.chunk_bytes -= bytes;
        });
        Ok(())
    }
}

impl Drop for CudaChunk {
    fn drop(&mut self) {
        if !self.released {
            let _ = self.ctx.bind_to_thread();
            if let Err(e) = self.release_now() {
                tracing::error!(error = %e, "vmmbuf cuda: releasing a chunk in drop failed");
            }
        }
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
        if placement == Location::Device(self.device) {
            Ok(self.granularity)
        } else {
            self.query_granularity(placement)
        }
    }

    fn reserve(&self, bytes: usize, align: usize) -> Result<CudaReservation> {
        if bytes == 0 || bytes % self.granularity != 0 || !align.is_power_of_two() {
            return Err(Error::invalid(format!(
                "reserve {bytes} bytes aligned {align}: size must be a non-zero multiple of {}",
                self.granularity
            )));
        }
        self.bind()?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: valid out-pointer; no address hint, no flags.
        check(
            "cuMemAddressReserve",
            unsafe { sys::cuMemAddressReserve(&mut ptr, bytes, align, 0, 0) },
            bytes,
        )
        .map_err(|e| match e {
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
            table: MapTable::new(bytes),
            ctx: self.ctx.clone(),
            counters: self.counters.clone(),
        })
    }

    fn base(&self, res: &CudaReservation) -> u64 {
        res.ptr
    }

    fn free(&self, mut res: CudaReservation) -> Result<()> {
        if !res.table.is_empty() {
            return Err(Error::invalid(
                "freeing a reservation that still has mappings (dropped instead)",
            ));
        }
        self.bind()?;
        // SAFETY: (ptr, bytes) is exactly this token's reservation, and nothing
        // in it is mapped (checked above).
        check(
            "cuMemAddressFree",
            unsafe { sys::cuMemAddressFree(res.ptr, res.table.bytes) },
            0,
        )?;
        let bytes = res.table.bytes;
        self.counters.update(|c| {
            c.reservations -= 1;
            c.reserved_bytes -= bytes;
        });
        res.ptr = 0;
        Ok(())
    }

    fn create(&self, bytes: usize, placement: Location) -> Result<CudaChunk> {
        let granularity = self.granularity(placement)?;
        if bytes == 0 || bytes % granularity != 0 {
            return Err(Error::invalid(format!(
                "chunk of {bytes} bytes is not a non-zero multiple of {granularity}"
            )));
        }
        let prop = self.prop(placement)?;
        self.bind()?;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: valid out-pointer and a fully initialised property struct.
        check(
            "cuMemCreate",
            unsafe { sys::cuMemCreate(&mut handle, bytes, &prop, 0) },
            bytes,
        )?;
        self.counters.update(|c| {
            c.chunks += 1;
            c.chunk_bytes += bytes;
        });
        Ok(CudaChunk {
            handle,
            bytes,
            placement,
            released: false,
            ctx: self.ctx.clone(),
            counters: self.counters.clone(),
        })
    }

    fn release(&self, mut chunk: CudaChunk) -> Result<()> {
        self.bind()?;
        chunk.release_now()
    }

    fn map(&self, res: &mut CudaReservation, offset: usize, chunk: &CudaChunk) -> Result<()> {
        res.table.check_map(offset, chunk.bytes, self.granularity)?;
        self.bind()?;
        // SAFETY: the range lies inside this token's reservation and holds no
        // mapping (checked above); the handle is live; offset 0, no flags.
        check(
            "cuMemMap",
            unsafe { sys::cuMemMap(res.ptr + offset as u64, chunk.bytes, 0, chunk.handle, 0) },
            chunk.bytes,
        )?;
        res.table.insert(offset, chunk.bytes, chunk.placement);
        self.counters.update(|c| c.mapped_bytes += chunk.bytes);
        Ok(())
    }

    fn unmap(&self, res: &mut CudaReservation, offset: usize, bytes: usize) -> Result<()> {
        let keys = res.table.covering(offset, bytes, true, Access::None)?;
        self.bind()?;
        // SAFETY: the range is made of whole live mappings of this token
        // (checked above). The caller has waited for GPU work using it.
        check(
            "cuMemUnmap",
            unsafe { sys::cuMemUnmap(res.ptr + offset as u64, bytes) },
            bytes,
        )?;
        res.table.remove(&keys);
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
        let keys = res.table.covering(offset, bytes, true, Access::None)?;
        let mut descs = Vec::with_capacity(access.len());
        let mut host = Access::None;
        for d in access {
            self.check_location(d.location)?;
            let location = match d.location {
                Location::Device(id) => raw_location(
                    sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                    id as i32,
                ),
                Location::Host => {
                    host = d.access;
                    // HOST_NUMA, whose id the driver ignores for access, is what it
                    // takes for host-NUMA allocations (the only host chunks we make).
                    raw_location(
                        sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST_NUMA,
                        self.host_numa.unwrap_or(0),
                    )
                }
            };
            descs.push(sys::CUmemAccessDesc {
                location,
                flags: access_flags(d.access),
            });
        }
        self.bind()?;
        // SAFETY: the range is made of whole live mappings of this token
        // (checked above); `descs` holds `descs.len()` initialised entries.
        check(
            "cuMemSetAccess",
            unsafe {
                sys::cuMemSetAccess(res.ptr + offset as u64, bytes, descs.as_ptr(), descs.len())
            },
            bytes,
        )?;
        res.table.set_host_access(&keys, host);
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        self.ctx
            .synchronize()
            .map_err(driver_err("cuCtxSynchronize"))
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
        src.table.covering(src_offset, bytes, false, Access::None)?;
        dst.table.covering(dst_offset, bytes, false, Access::None)?;
        self.bind()?;
        // SAFETY: both ranges are mapped in their tokens (checked above); the
        // copy is ordered on our own stream, which outlives it (synchronize
        // waits for the whole context before anything is unmapped).
        check(
            "cuMemcpyDtoDAsync",
            unsafe {
                sys::cuMemcpyDtoDAsync_v2(
                    dst.ptr + dst_offset as u64,
                    src.ptr + src_offset as u64,
                    bytes,
                    self.stream.cu_stream(),
                )
            },
            bytes,
        )
    }

    fn can_access_peer(&self, device: u32, peer: u32) -> Result<bool> {
        for d in [device, peer] {
            self.check_location(Location::Device(d))?;
        }
        if device == peer {
            return Ok(true);
        }
        let get = |o: u32| {
            cudarc::driver::result::device::get(o as i32).map_err(driver_err("cuDeviceGet"))
        };
        let (a, b) = (get(device)?, get(peer)?);
        let mut can = 0;
        // SAFETY: valid out-pointer and device handles.
        check(
            "cuDeviceCanAccessPeer",
            unsafe { sys::cuDeviceCanAccessPeer(&mut can, a, b) },
            0,
        )?;
        Ok(can != 0)
    }

    fn fence_done(&self, fence: &CudaFence) -> Result<bool> {
        fence
            .0
            .try_is_complete()
            .map_err(driver_err("cuEventQuery"))
    }

    fn read(&self, res: &CudaReservation, offset: usize, dst: &mut [u8]) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        res.table.covering(offset, dst.len(), false, Access::None)?;
        self.bind()?;
        // One copy per run of equal placement: a synchronous cuMemcpyDtoH whose
        // source spans a GPU chunk and host-NUMA chunks segfaults inside the
        // driver (seen on 580.159.04, H200); each run on its own is fine.
        for (at, n) in res.table.placement_runs(offset, dst.len()) {
            let d = &mut dst[at - offset..at - offset + n];
            // SAFETY: the source run is mapped in this token (checked above);
            // `d` is a live host buffer of `n` bytes. The copy is synchronous.
            check(
                "cuMemcpyDtoH",
                unsafe { sys::cuMemcpyDtoH_v2(d.as_mut_ptr().cast(), res.ptr + at as u64, n) },
                n,
            )?;
        }
        Ok(())
    }

    fn write(&self, res: &mut CudaReservation, offset: usize, src: &[u8]) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        res.table.covering(offset, src.len(), false, Access::None)?;
        self.bind()?;
        // One copy per run of equal placement, as in `read`.
        for (at, n) in res.table.placement_runs(offset, src.len()) {
            let s = &src[at - offset..at - offset + n];
            // SAFETY: the destination run is mapped in this token (checked
            // above); `s` is a live host buffer of `n` bytes. Synchronous.
            check(
                "cuMemcpyHtoD",
                unsafe { sys::cuMemcpyHtoD_v2(res.ptr + at as u64, s.as_ptr().cast(), n) },
                n,
            )?;
        }
        Ok(())
    }

    fn live(&self) -> LiveCounts {
        self.counters.get()
    }
}

/// What one GPU supports, as plain data.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeviceProbe {
    /// Device ordinal.
    pub ordinal: u32,
    /// Marketing name.
    pub name: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// Total memory in bytes.
    pub total_bytes: usize,
    /// Virtual memory management supported.
    pub vmm: bool,
    /// Host (NUMA) placement of VMM chunks supported, and the node to use.
    pub host_numa_node: Option<i32>,
    /// Minimum and recommended mapping granularity for device chunks (0 without VMM).
    pub granularity: (usize, usize),
    /// Chunks exportable as POSIX file descriptors (IPC).
    pub posix_fd_handles: bool,
    /// Chunks exportable as fabric handles (multi-node).
    pub fabric_handles: bool,
    /// GPUDirect RDMA on VMM memory.
    pub rdma_with_vmm: bool,
}

/// What the machine's CUDA driver and GPUs support; see [`probe`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Probe {
    /// Driver API version, e.g. 13000 for CUDA 13.0.
    pub driver_version: i32,
    /// One entry per GPU.
    pub devices: Vec<DeviceProbe>,
    /// `peer_access[a][b]`: device `a` can map memory of device `b`.
    pub peer_access: Vec<Vec<bool>>,
}

impl std::fmt::Display for Probe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let v = self.driver_version;
        writeln!(
            f,
            "CUDA driver {}.{} ({} GPU(s))",
            v / 1000,
            v % 1000 / 10,
            self.devices.len()
        )?;
        let yes = |b: bool| if b { "yes" } else { "no" };
        for d in &self.devices {
            writeln!(
                f,
                "gpu{}: {} (sm_{}{}), {}\n  VMM: {}; granularity {} min / {} recommended\n  \
                 host placement: {}; IPC by POSIX fd: {}; fabric handles: {}; RDMA on VMM: {}",
                d.ordinal,
                d.name,
                d.compute_capability.0,
                d.compute_capability.1,
                crate::Bytes(d.total_bytes),
                yes(d.vmm),
                crate::Bytes(d.granularity.0),
                crate::Bytes(d.granularity.1),
                d.host_numa_node
                    .map_or("no".to_string(), |n| format!("yes (NUMA node {n})")),
                yes(d.posix_fd_handles),
                yes(d.fabric_handles),
                yes(d.rdma_with_vmm),
            )?;
        }
        if self.devices.len() > 1 {
            writeln!(f, "peer access (row maps column's memory):")?;
            for (a, row) in self.peer_access.iter().enumerate() {
                let cells: Vec<&str> = row
                    .iter()
                    .enumerate()
                    .map(|(b, &p)| if a == b { "-" } else { yes(p) })
                    .collect();
                writeln!(f, "  gpu{a}: {}", cells.join(" "))?;
            }
        }
        Ok(())
    }
}

/// Reads what the driver and every GPU support, without allocating memory.
/// [`Error::DriverUnavailable`] where there is no usable driver.
pub fn probe() -> Result<Probe> {
    use cudarc::driver::result;
    use sys::CUdevice_attribute as A;
    CudaBackend::check_driver()?;
    result::init().map_err(|e| Error::DriverUnavailable {
        reason: format!("cuInit: {e}"),
    })?;
    let mut driver_version = 0;
    // SAFETY: valid out-pointer; the driver is initialised.
    check(
        "cuDriverGetVersion",
        unsafe { sys::cuDriverGetVersion(&mut driver_version) },
        0,
    )?;
    let count = result::device::get_count().map_err(driver_err("cuDeviceGetCount"))?;
    let handles: Vec<sys::CUdevice> = (0..count)
        .map(|i| result::device::get(i).map_err(driver_err("cuDeviceGet")))
        .collect::<Result<_>>()?;
    let mut devices = Vec::new();
    for (i, &dev) in handles.iter().enumerate() {
        // SAFETY: `dev` is a valid device handle from cuDeviceGet.
        let attr = |a| {
            unsafe { result::device::get_attribute(dev, a) }
                .map_err(driver_err("cuDeviceGetAttribute"))
        };
        let vmm = attr(A::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)? != 0;
        let granularity = if vmm {
            let b = CudaBackend::new(i as u32)?;
            let place = Location::Device(i as u32);
            (
                b.granularity,
                b.query_granularity_flag(
                    place,
                    sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
                )?,
            )
        } else {
            (0, 0)
        };
        devices.push(DeviceProbe {
            ordinal: i as u32,
            name: result::device::get_name(dev).map_err(driver_err("cuDeviceGetName"))?,
            compute_capability: (
                attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
                attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
            ),
            // SAFETY: valid device handle.
            total_bytes: unsafe { result::device::total_mem(dev) }
                .map_err(driver_err("cuDeviceTotalMem"))?,
            vmm,
            host_numa_node: if attr(
                A::CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
            )? != 0
            {
                Some(attr(A::CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID)?)
            } else {
                None
            },
            granularity,
            posix_fd_handles: attr(
                A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
            )? != 0,
            fabric_handles: attr(A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED)? != 0,
            rdma_with_vmm: attr(A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED)?
                != 0,
        });
    }
    let mut peer_access = vec![vec![false; handles.len()]; handles.len()];
    for (a, &da) in handles.iter().enumerate() {
        for (b, &db) in handles.iter().enumerate() {
            if a != b {
                let mut can = 0;
                // SAFETY: valid out-pointer and device handles.
                check(
                    "cuDeviceCanAccessPeer",
                    unsafe { sys::cuDeviceCanAccessPeer(&mut can, da, db) },
                    0,
                )?;
                peer_access[a][b] = can != 0;
            }
        }
    }
    Ok(Probe {
        driver_version,
        devices,
        peer_access,
    })
}
