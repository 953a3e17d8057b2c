//! Devices, contexts, streams and events: the driver calls around memory.
#![allow(unsafe_code)]

use std::sync::Arc;

use cudarc::driver::result::device;
use cudarc::driver::{sys, CudaContext, CudaEvent, CudaStream};

use super::{before_switch, check, cudarc_err, relaxed};
use crate::error::Result;

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
