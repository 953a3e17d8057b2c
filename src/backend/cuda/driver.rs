//! The thin layer: one function per CUDA driver call vmmbuf makes, turning
//! each `CUresult` into [`Error`]. The only place in vmmbuf that calls the
//! driver (through `cudarc::driver::sys`, or cudarc's own thin `result` and
//! safe layers for contexts, streams and events).
//!
//! As in cudarc's `result` layer, a call whose arguments cannot make it touch
//! memory it should not is a safe `fn`; a call that trusts a pointer, a
//! handle or a mapping is an `unsafe fn` whose `# Safety` says what the
//! caller guarantees.
#![allow(unsafe_code)]

use std::mem::MaybeUninit;
use std::sync::Arc;

use cudarc::driver::result::device;
use cudarc::driver::{sys, CudaContext, CudaEvent, CudaStream, DriverError};

use crate::error::{Error, Result};
use crate::location::Access;

mod graph;
mod switch;
// Exporting and importing chunks: inter-process sharing, Unix only.
#[cfg(unix)]
mod handles;
pub(crate) use graph::*;
#[cfg(unix)]
pub(crate) use handles::*;
pub(crate) use switch::{before_switch, LAZY};

/// Turns a driver result into vmmbuf's error, naming the call. Out of memory
/// is [`Error::OutOfMemory`] (transient), with the bytes the call asked for.
fn check(call: &'static str, r: sys::CUresult, requested_bytes: usize) -> Result<()> {
    match r {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => Err(Error::OutOfMemory {
            call,
            requested_bytes,
        }),
        other => Err(Error::Driver {
            call,
            source: DriverError(other),
        }),
    }
}

/// Runs `f` with this thread in CUDA's relaxed capture mode, the thread's
/// mode back after. CUDA counts these calls as unsafe during a stream
/// capture: made in the default global mode while any thread captures a
/// stream in global mode (PyTorch's default), they invalidate that capture.
/// None of vmmbuf's touches a captured stream (it never queries an event
/// recorded in a capture nor synchronises a captured stream), so each runs
/// in relaxed mode on its own, and the common paths (an allocation from
/// free memory, a free's fence) make no mode switch at all. A mode that
/// cannot be switched is logged and the call made in the thread's mode.
fn relaxed<T>(f: impl FnOnce() -> T) -> T {
    before_switch();
    // The guard puts the thread's mode back when it drops, after `f`.
    let _mode = RelaxedMode::new()
        .map_err(
            |e| tracing::debug!(error = %e, "vmmbuf: no relaxed capture mode for an unsafe call"),
        )
        .ok();
    f()
}

/// Maps an error of cudarc's own layers, naming the call.
fn cudarc_err(call: &'static str) -> impl Fn(DriverError) -> Error {
    move |e| match check(call, e.0, 0) {
        Err(e) => e,
        Ok(()) => Error::Driver { call, source: e },
    }
}

/// True if the driver library can be loaded. Never panics (cudarc's lazy
/// loader would, on the first call, without a library). Asked once per
/// process: cudarc's check opens the library by every candidate name, and
/// the plug-in asks on every allocation and free.
pub(crate) fn driver_present() -> bool {
    static PRESENT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    // SAFETY: loading the system's CUDA driver library runs only its own
    // initialisers, the same load cudarc performs on its first call.
    *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
}

/// `cuInit(0)`.
pub(crate) fn init() -> Result<()> {
    cudarc::driver::result::init().map_err(cudarc_err("cuInit"))
}

/// `cuDeviceGetCount`.
pub(crate) fn device_count() -> Result<u32> {
    device::get_count()
        .map(|n| n.max(0) as u32)
        .map_err(cudarc_err("cuDeviceGetCount"))
}

/// `cuDeviceGet`.
pub(crate) fn device_get(ordinal: u32) -> Result<sys::CUdevice> {
    device::get(ordinal as i32).map_err(cudarc_err("cuDeviceGet"))
}

/// `cuDeviceGetAttribute`.
///
/// # Safety
/// `dev` comes from [`device_get`].
pub(crate) unsafe fn device_attribute(
    dev: sys::CUdevice,
    attr: sys::CUdevice_attribute,
) -> Result<i32> {
    // SAFETY: forwarded to the caller.
    unsafe { device::get_attribute(dev, attr) }.map_err(cudarc_err("cuDeviceGetAttribute"))
}

/// `cuDeviceGetName`.
pub(crate) fn device_name(dev: sys::CUdevice) -> Result<String> {
    device::get_name(dev).map_err(cudarc_err("cuDeviceGetName"))
}

/// `cuDeviceTotalMem`.
///
/// # Safety
/// `dev` comes from [`device_get`].
pub(crate) unsafe fn device_total_mem(dev: sys::CUdevice) -> Result<usize> {
    // SAFETY: forwarded to the caller.
    unsafe { device::total_mem(dev) }.map_err(cudarc_err("cuDeviceTotalMem"))
}

/// `cuDriverGetVersion`.
pub(crate) fn driver_version() -> Result<i32> {
    let mut v = 0;
    check(
        "cuDriverGetVersion",
        // SAFETY: a valid out-pointer.
        unsafe { sys::cuDriverGetVersion(&mut v) },
        0,
    )?;
    Ok(v)
}

/// `cuDeviceCanAccessPeer`.
///
/// # Safety
/// Both handles come from [`device_get`].
pub(crate) unsafe fn can_access_peer(dev: sys::CUdevice, peer: sys::CUdevice) -> Result<bool> {
    let mut can = 0;
    check(
        "cuDeviceCanAccessPeer",
        // SAFETY: a valid out-pointer; the handles are valid (caller).
        unsafe { sys::cuDeviceCanAccessPeer(&mut can, dev, peer) },
        0,
    )?;
    Ok(can != 0)
}

/// `cuCtxCreate` on the primary context, through cudarc.
pub(crate) fn context(ordinal: u32) -> Result<Arc<CudaContext>> {
    before_switch();
    CudaContext::new(ordinal as usize).map_err(cudarc_err("cuDevicePrimaryCtxRetain"))
}

/// `cuDeviceGetAttribute` for a context's device.
pub(crate) fn context_attribute(ctx: &CudaContext, attr: sys::CUdevice_attribute) -> Result<i32> {
    before_switch();
    ctx.attribute(attr)
        .map_err(cudarc_err("cuDeviceGetAttribute"))
}

/// `cuCtxSetCurrent`: makes `ctx` current on this thread.
pub(crate) fn bind(ctx: &CudaContext) -> Result<()> {
    before_switch();
    ctx.bind_to_thread().map_err(cudarc_err("cuCtxSetCurrent"))
}

/// `cuCtxGetDevice`: the ordinal of the device of the context current on
/// this thread (the CUDA runtime's current device).
pub(crate) fn current_device() -> Result<u32> {
    let mut dev: sys::CUdevice = 0;
    check(
        "cuCtxGetDevice",
        // SAFETY: a valid out-pointer.
        unsafe { sys::cuCtxGetDevice(&mut dev) },
        0,
    )?;
    u32::try_from(dev).map_err(|_| crate::Error::invalid(format!("cuCtxGetDevice gave {dev}")))
}

/// `cuCtxGetCurrent`: the context current on this thread (null for none),
/// as a raw handle for [`restore_current`].
pub(crate) fn current_raw() -> Result<sys::CUcontext> {
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    check(
        "cuCtxGetCurrent",
        // SAFETY: a valid out-pointer.
        unsafe { sys::cuCtxGetCurrent(&mut ctx) },
        0,
    )?;
    Ok(ctx)
}

/// `cuCtxSetCurrent` with a handle [`current_raw`] returned on this thread
/// (or null): puts back what was current.
///
/// # Safety
/// `ctx` is null or a context that is still alive (a primary context the
/// caller's thread had current, which its owner keeps).
pub(crate) unsafe fn restore_current(ctx: sys::CUcontext) -> Result<()> {
    check(
        "cuCtxSetCurrent",
        // No hook: this puts the caller's context back (the guard's drop).
        // SAFETY: forwarded to the caller.
        unsafe { sys::cuCtxSetCurrent(ctx) },
        0,
    )
}

/// `cuCtxSynchronize`: waits for all work in `ctx`.
pub(crate) fn synchronize(ctx: &CudaContext) -> Result<()> {
    relaxed(|| ctx.synchronize()).map_err(cudarc_err("cuCtxSynchronize"))
}

/// `cuStreamCreate`, through cudarc.
pub(crate) fn new_stream(ctx: &Arc<CudaContext>) -> Result<Arc<CudaStream>> {
    relaxed(|| ctx.new_stream()).map_err(cudarc_err("cuStreamCreate"))
}

/// `cuEventRecord` of a new event on `stream`.
pub(crate) fn record_event(stream: &CudaStream) -> Result<CudaEvent> {
    // An event is created first (`cuEventCreate`).
    relaxed(|| stream.record_event(None)).map_err(cudarc_err("cuEventRecord"))
}

/// `cuEventSynchronize`: blocks until the work before the event has finished.
pub(crate) fn event_wait(event: &CudaEvent) -> Result<()> {
    relaxed(|| event.synchronize()).map_err(cudarc_err("cuEventSynchronize"))
}

/// `cuEventRecord` of an existing event on `stream`.
pub(crate) fn event_record(event: &CudaEvent, stream: &CudaStream) -> Result<()> {
    before_switch();
    event.record(stream).map_err(cudarc_err("cuEventRecord"))
}

/// `cuStreamSynchronize`: blocks until `stream`'s work has finished.
pub(crate) fn stream_synchronize(stream: &CudaStream) -> Result<()> {
    relaxed(|| stream.synchronize()).map_err(cudarc_err("cuStreamSynchronize"))
}

/// `cuEventQuery`: true once the work before the event has finished.
pub(crate) fn event_done(event: &CudaEvent) -> Result<bool> {
    relaxed(|| event.try_is_complete()).map_err(cudarc_err("cuEventQuery"))
}

/// `cuMemGetInfo`: `(free, total)` bytes of the current context's device.
pub(crate) fn mem_info() -> Result<(usize, usize)> {
    let (mut free, mut total) = (0usize, 0usize);
    check(
        "cuMemGetInfo",
        relaxed(|| {
            // SAFETY: two valid out-pointers; without a current context the driver
            // returns an error.
            unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) }
        }),
        0,
    )?;
    Ok((free, total))
}

/// `CUmemLocation` changed its source form (an anonymous union) at CUDA 13.2
/// while keeping its layout: `{ type, int id }`. This mirror builds it the
/// same way whichever bindings cudarc picked.
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

/// A `CUmemLocation` of `type_` and `id`.
pub(crate) fn location(type_: sys::CUmemLocationType, id: i32) -> sys::CUmemLocation {
    // SAFETY: same size and alignment (asserted above), same field order and
    // types as the driver's `CUmemLocation` in every CUDA version; both are
    // plain `Copy` data.
    unsafe { std::mem::transmute::<RawLocation, sys::CUmemLocation>(RawLocation { type_, id }) }
}

/// The driver's flags for an [`Access`].
pub(crate) fn access_flags(a: Access) -> sys::CUmemAccess_flags {
    match a {
        Access::None => sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE,
        Access::Read => sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ,
        Access::ReadWrite => sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    }
}

/// The type and id of a `CUmemLocation` (checking an imported chunk).
#[cfg(unix)]
pub(crate) fn location_parts(loc: sys::CUmemLocation) -> (sys::CUmemLocationType, i32) {
    // SAFETY: as in `location`, the other way.
    let raw = unsafe { std::mem::transmute::<sys::CUmemLocation, RawLocation>(loc) };
    (raw.type_, raw.id)
}

/// Properties of a pinned allocation at `location` that exports as a POSIX
/// file descriptor.
pub(crate) fn shareable_prop(location: sys::CUmemLocation) -> sys::CUmemAllocationProp {
    let mut prop = allocation_prop(location);
    prop.requestedHandleTypes =
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop
}

/// Handle type bits (`CUmemAllocationHandleType` values, a bit mask).
pub(crate) const HANDLE_POSIX_FD: u32 =
    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR.0;
/// See [`HANDLE_POSIX_FD`].
pub(crate) const HANDLE_FABRIC: u32 = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC.0;

/// Properties of a pinned allocation at `location` as `ncclMemAlloc`
/// makes it: the handle types `handle_types` (POSIX_FD, plus FABRIC where
/// the device supports it), and GPUDirect RDMA capable if `rdma`.
pub(crate) fn nccl_prop(
    location: sys::CUmemLocation,
    handle_types: u32,
    rdma: bool,
) -> sys::CUmemAllocationProp {
    let mut prop = allocation_prop(location);
    prop.requestedHandleTypes = sys::CUmemAllocationHandleType(handle_types);
    prop.allocFlags.gpuDirectRDMACapable = u8::from(rdma);
    prop
}

/// `cuMemGetAllocationPropertiesFromHandle`.
///
/// # Safety
/// `handle` is live.
#[cfg(unix)]
pub(crate) unsafe fn mem_properties(
    handle: sys::CUmemGenericAllocationHandle,
) -> Result<sys::CUmemAllocationProp> {
    // SAFETY: plain C data, all-zero valid; filled in by the driver.
    let mut prop: sys::CUmemAllocationProp = unsafe { MaybeUninit::zeroed().assume_init() };
    check(
        "cuMemGetAllocationPropertiesFromHandle",
        // SAFETY: a valid out-pointer; the handle is live (the caller's promise).
        unsafe { sys::cuMemGetAllocationPropertiesFromHandle(&mut prop, handle) },
        0,
    )?;
    Ok(prop)
}

/// Properties of a pinned allocation at `location`, no handle types.
pub(crate) fn allocation_prop(location: sys::CUmemLocation) -> sys::CUmemAllocationProp {
    // SAFETY: `CUmemAllocationProp` is plain C data for which all-zero is the
    // driver's documented default (no handle types, no flags).
    let mut prop: sys::CUmemAllocationProp = unsafe { MaybeUninit::zeroed().assume_init() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location = location;
    prop
}

/// `cuMemGetAllocationGranularity`.
pub(crate) fn allocation_granularity(
    prop: &sys::CUmemAllocationProp,
    flag: sys::CUmemAllocationGranularity_flags,
) -> Result<usize> {
    let mut g = 0usize;
    check(
        "cuMemGetAllocationGranularity",
        // SAFETY: a valid out-pointer and a fully initialised property struct.
        unsafe { sys::cuMemGetAllocationGranularity(&mut g, prop, flag) },
        0,
    )?;
    Ok(g)
}

/// `cuMemAddressReserve` of `bytes` aligned to `align`, no hint, no flags.
pub(crate) fn address_reserve(bytes: usize, align: usize) -> Result<sys::CUdeviceptr> {
    let mut ptr: sys::CUdeviceptr = 0;
    check(
        "cuMemAddressReserve",
        relaxed(|| {
            // SAFETY: a valid out-pointer; reserving address space touches no memory.
            unsafe { sys::cuMemAddressReserve(&mut ptr, bytes, align, 0, 0) }
        }),
        bytes,
    )?;
    Ok(ptr)
}

/// `cuMemAddressFree`.
///
/// # Safety
/// `(ptr, bytes)` is exactly one live reservation, with nothing mapped in it,
/// that nothing will use again.
pub(crate) unsafe fn address_free(ptr: sys::CUdeviceptr, bytes: usize) -> Result<()> {
    // SAFETY: forwarded to the caller.
    check(
        "cuMemAddressFree",
        relaxed(|| unsafe { sys::cuMemAddressFree(ptr, bytes) }),
        0,
    )
}

/// `cuMemCreate` of `bytes` with `prop`.
pub(crate) fn mem_create(
    bytes: usize,
    prop: &sys::CUmemAllocationProp,
) -> Result<sys::CUmemGenericAllocationHandle> {
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    check(
        "cuMemCreate",
        relaxed(|| {
            // SAFETY: a valid out-pointer and a fully initialised property struct.
            unsafe { sys::cuMemCreate(&mut handle, bytes, prop, 0) }
        }),
        bytes,
    )?;
    Ok(handle)
}

/// `cuMemRelease`. The memory goes back once nothing maps it (and no other
/// process holds it).
///
/// # Safety
/// `handle` came from [`mem_create`] or [`mem_import_fd`] and is released
/// once.
pub(crate) unsafe fn mem_release(
    handle: sys::CUmemGenericAllocationHandle,
    bytes: usize,
) -> Result<()> {
    // SAFETY: forwarded to the caller.
    check(
        "cuMemRelease",
        relaxed(|| unsafe { sys::cuMemRelease(handle) }),
        bytes,
    )
}

/// `cuMemMap` of the whole `handle` at `ptr`, offset 0, no flags.
///
/// # Safety
/// `[ptr, ptr + bytes)` lies inside a live reservation and holds no mapping;
/// `handle` is live and `bytes` is its size.
pub(crate) unsafe fn mem_map(
    ptr: sys::CUdeviceptr,
    bytes: usize,
    handle: sys::CUmemGenericAllocationHandle,
) -> Result<()> {
    // SAFETY: forwarded to the caller.
    check(
        "cuMemMap",
        relaxed(|| unsafe { sys::cuMemMap(ptr, bytes, 0, handle, 0) }),
        bytes,
    )
}

/// `cuMemUnmap`. Does not wait for kernels.
///
/// # Safety
/// `[ptr, ptr + bytes)` is made of whole live mappings, and no work still
/// running or queued, nor any live reference, uses it.
pub(crate) unsafe fn mem_unmap(ptr: sys::CUdeviceptr, bytes: usize) -> Result<()> {
    // SAFETY: forwarded to the caller.
    check(
        "cuMemUnmap",
        relaxed(|| unsafe { sys::cuMemUnmap(ptr, bytes) }),
        bytes,
    )
}

/// `cuMemSetAccess` of `[ptr, ptr + bytes)` to exactly `descs`.
///
/// # Safety
/// The range is made of whole live mappings, and narrowing access does not
/// pull memory from under a live reference or running work.
pub(crate) unsafe fn mem_set_access(
    ptr: sys::CUdeviceptr,
    bytes: usize,
    descs: &[sys::CUmemAccessDesc],
) -> Result<()> {
    // SAFETY: `descs` holds `descs.len()` initialised entries; the rest is
    // forwarded to the caller.
    check(
        "cuMemSetAccess",
        relaxed(|| unsafe { sys::cuMemSetAccess(ptr, bytes, descs.as_ptr(), descs.len()) }),
        bytes,
    )
}

/// `cuMemcpyDtoDAsync` of `bytes` on `stream`.
///
/// # Safety
/// Both ranges are mapped with access for the stream's device until the copy
/// has finished, and do not overlap.
pub(crate) unsafe fn memcpy_dtod_async(
    dst: sys::CUdeviceptr,
    src: sys::CUdeviceptr,
    bytes: usize,
    stream: &CudaStream,
) -> Result<()> {
    // SAFETY: forwarded to the caller.
    check(
        "cuMemcpyDtoDAsync",
        unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, stream.cu_stream()) },
        bytes,
    )
}

/// `cuMemsetD8Async` of `bytes` zero bytes at `dst`, queued on `stream`.
///
/// # Safety
/// `[dst, dst + bytes)` is mapped with write access for the stream's device
/// until the memset has finished.
pub(crate) unsafe fn memset_zeros_async(
    dst: sys::CUdeviceptr,
    bytes: usize,
    stream: &CudaStream,
) -> Result<()> {
    // SAFETY: forwarded to the caller.
    check(
        "cuMemsetD8Async",
        unsafe { sys::cuMemsetD8Async(dst, 0, bytes, stream.cu_stream()) },
        bytes,
    )
}

/// `cuMemcpyDtoH` into `dst`: synchronous.
///
/// # Safety
/// `[src, src + dst.len())` is mapped, readable by the current context's
/// device, and all of one placement (a copy spanning a GPU chunk and a
/// host-NUMA chunk crashes driver 580.159.04).
pub(crate) unsafe fn memcpy_dtoh(dst: &mut [u8], src: sys::CUdeviceptr) -> Result<()> {
    // SAFETY: `dst` is a live host buffer of `dst.len()` bytes; the rest is
    // forwarded to the caller.
    check(
        "cuMemcpyDtoH",
        relaxed(|| unsafe { sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), src, dst.len()) }),
        dst.len(),
    )
}

/// `cuMemcpyHtoD` from `src`: synchronous.
///
/// # Safety
/// `[dst, dst + src.len())` is mapped, writable by the current context's
/// device, of one placement (see [`memcpy_dtoh`]), and no live reference
/// reads it.
pub(crate) unsafe fn memcpy_htod(dst: sys::CUdeviceptr, src: &[u8]) -> Result<()> {
    // SAFETY: `src` is a live host buffer of `src.len()` bytes; the rest is
    // forwarded to the caller.
    check(
        "cuMemcpyHtoD",
        relaxed(|| unsafe { sys::cuMemcpyHtoD_v2(dst, src.as_ptr().cast(), src.len()) }),
        src.len(),
    )
}
