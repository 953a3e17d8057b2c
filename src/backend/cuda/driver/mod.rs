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

use cudarc::driver::{sys, DriverError};

use crate::error::{Error, Result};

mod copy;
mod devices;
mod graph;
mod switch;
mod vmm;
// Exporting and importing chunks: inter-process sharing, Unix only.
#[cfg(unix)]
mod handles;
pub(crate) use copy::*;
pub(crate) use devices::*;
pub(crate) use graph::*;
#[cfg(unix)]
pub(crate) use handles::*;
pub(crate) use switch::{before_switch, LAZY};
pub(crate) use vmm::*;

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
