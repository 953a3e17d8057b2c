//! The driver's graph-capture calls: a stream's capture status and info,
//! a thread's capture mode, and the user objects a graph holds. Every such
//! call of `capture.rs` goes through here, as every other driver call goes
//! through the parent module.

use std::ffi::c_void;
use std::ptr;

use cudarc::driver::sys;

use super::check;
use crate::error::Result;

/// `cuStreamIsCapturing`.
///
/// # Safety
/// `stream` is a live stream of the thread's current context.
pub(crate) unsafe fn capture_status(stream: sys::CUstream) -> Result<sys::CUstreamCaptureStatus> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    check(
        "cuStreamIsCapturing",
        // SAFETY: `stream` is live (the caller's promise); a valid out-pointer.
        unsafe { sys::cuStreamIsCapturing(stream, &mut status) },
        0,
    )?;
    Ok(status)
}

/// `cuStreamGetCaptureInfo_v3`: the status, the capture's id and the graph
/// being captured (null unless active).
///
/// # Safety
/// `stream` is a live stream of the thread's current context.
pub(crate) unsafe fn capture_info(
    stream: sys::CUstream,
) -> Result<(sys::CUstreamCaptureStatus, u64, sys::CUgraph)> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let mut id: sys::cuuint64_t = 0;
    let mut graph: sys::CUgraph = ptr::null_mut();
    let mut deps: *const sys::CUgraphNode = ptr::null();
    let mut edges: *const sys::CUgraphEdgeData = ptr::null();
    let mut n: usize = 0;
    check(
        "cuStreamGetCaptureInfo_v3",
        // SAFETY: `stream` is live (the caller's promise); every out-pointer is
        // valid for one write.
        unsafe {
            sys::cuStreamGetCaptureInfo_v3(
                stream,
                &mut status,
                &mut id,
                &mut graph,
                &mut deps,
                &mut edges,
                &mut n,
            )
        },
        0,
    )?;
    Ok((status, id, graph))
}

/// `cuThreadExchangeStreamCaptureMode`: sets this thread's capture mode to
/// `mode` and returns the one it had.
fn exchange_capture_mode(mode: sys::CUstreamCaptureMode) -> Result<sys::CUstreamCaptureMode> {
    let mut m = mode;
    check(
        "cuThreadExchangeStreamCaptureMode",
        // SAFETY: a thread-local exchange of a plain value through a valid
        // pointer.
        unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut m) },
        0,
    )?;
    Ok(m)
}

/// This thread in relaxed capture mode while it lives; the mode it had
/// comes back on drop (a failure to restore it is logged).
#[derive(Debug)]
pub(crate) struct RelaxedMode {
    previous: sys::CUstreamCaptureMode,
}

impl RelaxedMode {
    /// Switches this thread to relaxed mode.
    pub(crate) fn new() -> Result<Self> {
        let previous =
            exchange_capture_mode(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)?;
        Ok(Self { previous })
    }
}

impl Drop for RelaxedMode {
    fn drop(&mut self) {
        if let Err(e) = exchange_capture_mode(self.previous) {
            tracing::error!(error = %e, "vmmbuf: restoring the thread's capture mode failed");
        }
    }
}

/// `cuUserObjectCreate` with one reference and no destructor sync.
///
/// # Safety
/// `destroy(data)` must be sound to run once, on a thread of the driver's,
/// when the object's last reference goes; on an error the driver has not
/// taken `data`.
pub(crate) unsafe fn user_object_create(
    data: *mut c_void,
    destroy: unsafe extern "C" fn(*mut c_void),
) -> Result<sys::CUuserObject> {
    let mut obj: sys::CUuserObject = ptr::null_mut();
    check(
        "cuUserObjectCreate",
        // SAFETY: the caller vouches for `destroy` and `data`; a valid
        // out-pointer.
        unsafe {
            sys::cuUserObjectCreate(
                &mut obj,
                data,
                Some(destroy),
                1,
                sys::CUuserObject_flags::CU_USER_OBJECT_NO_DESTRUCTOR_SYNC as u32,
            )
        },
        0,
    )?;
    Ok(obj)
}

/// `cuGraphRetainUserObject` with `CU_GRAPH_USER_OBJECT_MOVE`: hands the
/// caller's one reference of `obj` to `graph`.
///
/// # Safety
/// `graph` is live (being captured) and `obj` holds the caller's reference.
pub(crate) unsafe fn graph_take_user_object(
    graph: sys::CUgraph,
    obj: sys::CUuserObject,
) -> Result<()> {
    check(
        "cuGraphRetainUserObject",
        // SAFETY: forwarded to the caller.
        unsafe {
            sys::cuGraphRetainUserObject(
                graph,
                obj,
                1,
                sys::CUuserObjectRetain_flags::CU_GRAPH_USER_OBJECT_MOVE as u32,
            )
        },
        0,
    )
}

/// `cuUserObjectRelease` of one reference.
///
/// # Safety
/// The caller holds that reference of `obj`.
pub(crate) unsafe fn user_object_release(obj: sys::CUuserObject) -> Result<()> {
    check(
        "cuUserObjectRelease",
        // SAFETY: forwarded to the caller.
        unsafe { sys::cuUserObjectRelease(obj, 1) },
        0,
    )
}
