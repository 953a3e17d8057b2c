//! CUDA graph capture: which capture a stream is in, a thread's relaxed
//! capture mode, and a callback run when a captured graph is gone.
//!
//! What an allocator needs around graphs ([`Arena::alloc_in_graph`]):
//! - [`capture_of`]: is this stream being captured, and into which graph
//!   (CUDA's capture id names the graph's pool);
//! - [`RelaxedCapture`]: while another stream is captured in CUDA's global
//!   mode, any thread's "unsafe" call (`cuEventQuery`, `cuMemCreate`,
//!   `cuStreamCreate`) would invalidate that capture; in relaxed mode the
//!   calling thread may make them (it still must not query an event
//!   recorded inside a capture, which the arena never does). vmmbuf makes
//!   each of its own unsafe calls in relaxed mode already; the guard is for
//!   a caller's own calls around it;
//! - [`Capture::on_release`]: a user object whose destructor CUDA runs once
//!   the graph and every executable graph made from it are destroyed and
//!   their launches have finished: the moment a graph's memory may go back.
//!
//! [`Arena::alloc_in_graph`]: crate::Arena::alloc_in_graph
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::{sys, CudaStream};

use super::driver;
use crate::error::{Error, Result};
use crate::graph_id::GraphPoolId;

/// Captures begun and not yet ended, as announced by
/// [`capture_begins`] and [`capture_ends`].
static UNDERWAY: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// A CUDA graph capture is about to begin in this process (call it before
/// `cuStreamBeginCapture`): until [`capture_ends`], no vmmbuf call
/// synchronises the device (CUDA would refuse it and invalidate the
/// capture); where only a synchronisation would free memory, an allocation
/// fails with [`Error::ArenaOutOfMemory`] `during_capture`, and
/// `empty_cache`, a sleep or a wake that needs one with
/// [`Error::CaptureUnderway`]. The PyTorch plug-in announces PyTorch's
/// captures; [`Arena::alloc_in_graph`](crate::Arena::alloc_in_graph) never
/// synchronises in any case.
pub fn capture_begins() {
    UNDERWAY.fetch_add(1, Ordering::SeqCst);
}

/// A capture announced with [`capture_begins`] has ended (call it after
/// `cuStreamEndCapture`, whether it succeeded or not). An end with none
/// under way is refused and changes nothing.
pub fn capture_ends() -> Result<()> {
    UNDERWAY
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .map(drop)
        .map_err(|_| Error::invalid("a capture ended with none announced as begun"))
}

/// Captures announced as begun and not yet ended.
pub fn captures_underway() -> usize {
    UNDERWAY.load(Ordering::SeqCst)
}

/// A capture under way on a stream: its id and the graph being built.
#[derive(Debug)]
pub struct Capture {
    id: u64,
    graph: sys::CUgraph,
}

// SAFETY: a CUgraph handle is a driver object usable from any thread; the
// capture's owner keeps it alive while it captures.
unsafe impl Send for Capture {}

impl Capture {
    /// The pool of the graph being captured: CUDA's capture id (unique in
    /// the process).
    pub fn pool(&self) -> GraphPoolId {
        GraphPoolId(self.id)
    }

    /// Runs `f` once the graph being captured and every executable graph
    /// instantiated from it are destroyed and their launches have finished
    /// (a user object the graph takes the only reference of:
    /// `cuUserObjectCreate`, `cuGraphRetainUserObject` with
    /// `CU_GRAPH_USER_OBJECT_MOVE`). `f` runs on a thread of the driver's
    /// and must not call CUDA; it may run at once if the capture fails.
    pub fn on_release(&self, f: impl FnOnce() + Send + 'static) -> Result<()> {
        /// The callback, disarmed if the graph never took the object.
        struct Callback {
            armed: AtomicBool,
            f: Box<dyn FnOnce() + Send>,
        }
        unsafe extern "C" fn run(data: *mut c_void) {
            // SAFETY: `data` is the Box::into_raw below, handed to the driver
            // once and destroyed by it once.
            let c = unsafe { Box::from_raw(data.cast::<Callback>()) };
            if c.armed.load(Ordering::SeqCst) {
                // A panic must not unwind into the driver's thread.
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(c.f));
            }
        }
        let data = Box::into_raw(Box::new(Callback {
            armed: AtomicBool::new(true),
            f: Box::new(f),
        }));
        // SAFETY: `run` is a valid destructor for `data`; the driver calls it
        // once, when the object's last reference goes.
        let obj = match unsafe { driver::user_object_create(data.cast(), run) } {
            Ok(obj) => obj,
            Err(e) => {
                // SAFETY: the driver did not take `data`.
                drop(unsafe { Box::from_raw(data) });
                return Err(e);
            }
        };
        // SAFETY: `self.graph` is the graph being captured (from
        // cuStreamGetCaptureInfo); MOVE hands it our one reference.
        if let Err(e) = unsafe { driver::graph_take_user_object(self.graph, obj) } {
            // SAFETY: `data` lives until the destructor, which only our
            // reference (released next) can run: disarmed first, it frees
            // `data` without calling `f`.
            unsafe { (*data).armed.store(false, Ordering::SeqCst) };
            // SAFETY: ours is the only reference.
            let _ = unsafe { driver::user_object_release(obj) };
            return Err(e);
        }
        Ok(())
    }
}

/// Where a stream stands with CUDA graph capture ([`capture_state`]).
#[derive(Debug)]
pub enum CaptureState {
    /// Not being captured: work queued on it runs, and fences recorded on
    /// it are points a query can see pass.
    None,
    /// Being captured into the graph of this capture: work queued on it is
    /// recorded into the graph, not run; so would a fence be.
    Active(Capture),
    /// Its capture was invalidated (an unsafe call during it, say) and has
    /// not yet been ended: CUDA refuses work and fences on it until
    /// `cuStreamEndCapture`, which fails and discards the graph. Work
    /// queued before the capture began may still be running.
    Invalidated,
}

impl CaptureState {
    /// The capture, if one is active (an invalidated one is not).
    pub fn active(&self) -> Option<&Capture> {
        match self {
            CaptureState::Active(c) => Some(c),
            CaptureState::None | CaptureState::Invalidated => None,
        }
    }

    /// [`active`](Self::active), by value.
    pub fn into_active(self) -> Option<Capture> {
        match self {
            CaptureState::Active(c) => Some(c),
            CaptureState::None | CaptureState::Invalidated => None,
        }
    }
}

/// Where `stream` stands with CUDA graph capture. Cheap
/// (`cuStreamIsCapturing`) when it is not captured.
pub fn capture_state(stream: &CudaStream) -> Result<CaptureState> {
    // The calling thread may have no current context (PyTorch's autograd
    // threads): the stream's own.
    super::driver::before_switch();
    stream
        .context()
        .bind_to_thread()
        .map_err(|source| Error::Driver {
            call: "cuCtxSetCurrent",
            source,
        })?;
    let s = stream.cu_stream();
    // SAFETY: `s` is a live stream (the caller holds it) of the context
    // bound above.
    match unsafe { driver::capture_status(s) }? {
        sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE => return Ok(CaptureState::None),
        sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE => {}
        _ => return Ok(CaptureState::Invalidated),
    }
    // SAFETY: as above.
    let (status, id, graph) = unsafe { driver::capture_info(s) }?;
    Ok(match status {
        sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE => {
            CaptureState::Active(Capture { id, graph })
        }
        sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE => CaptureState::None,
        _ => CaptureState::Invalidated,
    })
}

/// The capture `stream` is part of, if it is being captured (active, not
/// invalidated): [`capture_state`]'s active case. Cheap
/// (`cuStreamIsCapturing`) when it is not.
pub fn capture_of(stream: &CudaStream) -> Result<Option<Capture>> {
    Ok(capture_state(stream)?.into_active())
}

/// This thread in CUDA's relaxed capture mode while the guard lives; the
/// previous mode comes back on drop. See the module's documentation.
#[derive(Debug)]
pub struct RelaxedCapture {
    _mode: driver::RelaxedMode,
}

impl RelaxedCapture {
    /// Switches this thread to relaxed mode (`cuThreadExchangeStreamCaptureMode`).
    /// [`Error::DriverUnavailable`] without a loadable driver.
    pub fn new() -> Result<Self> {
        crate::CudaBackend::check_driver()?;
        Ok(Self {
            _mode: driver::RelaxedMode::new()?,
        })
    }
}
