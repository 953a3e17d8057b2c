//! Simulated CUDA graph captures for the host backend, so that host tests
//! of capture paths see what a GPU does: while any stream of the backend is
//! captured, the calls CUDA refuses during a capture fail here too and
//! invalidate the capture (as CUDA invalidates it), and the end of an
//! invalidated capture fails.
//!
//! What CUDA refuses, and so this refuses, while a capture is under way:
//! - a device-wide synchronisation (`cuCtxSynchronize`: every capture);
//! - a fence recorded on a captured stream (an event recorded there is a
//!   graph node that no query sees pass: that capture);
//! - a synchronous copy between the host and the device (`cuMemcpyHtoD`
//!   and `DtoH` order on the legacy stream: every capture).
//!
//! A wait for, or a query of, a fence recorded before the capture is
//! allowed, as CUDA allows `cuEventSynchronize` and `cuEventQuery` of such
//! an event in relaxed capture mode (vmmbuf's CUDA backend makes both in
//! it).
#![deny(unsafe_code)]

use std::collections::BTreeMap;

use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::order::StreamKey;

/// Where a stream of the host backend stands with capture.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum HostCaptureState {
    /// Not captured.
    None,
    /// Being captured.
    Active,
    /// Its capture was invalidated by a refused call; its end will fail.
    Invalidated,
}

/// The captures under way: stream -> still valid.
#[derive(Debug, Default)]
pub(crate) struct Captures {
    streams: Mutex<BTreeMap<StreamKey, bool>>,
}

impl Captures {
    /// `key` starts being captured; refused if it is already.
    pub(crate) fn begin(&self, key: StreamKey) -> Result<()> {
        let mut s = self.streams.lock();
        if s.contains_key(&key) {
            return Err(Error::invalid(format!(
                "stream {key:?} is being captured already"
            )));
        }
        s.insert(key, true);
        Ok(())
    }

    /// `key`'s capture ends: an error if it was invalidated (CUDA's
    /// `cuStreamEndCapture` fails then and gives no graph) or none was
    /// under way.
    pub(crate) fn end(&self, key: StreamKey) -> Result<()> {
        match self.streams.lock().remove(&key) {
            Some(true) => Ok(()),
            Some(false) => Err(Error::invalid(format!(
                "the capture of stream {key:?} was invalidated by a call CUDA refuses during a capture"
            ))),
            None => Err(Error::invalid(format!(
                "stream {key:?} is not being captured"
            ))),
        }
    }

    /// Where `key` stands.
    pub(crate) fn state(&self, key: StreamKey) -> HostCaptureState {
        match self.streams.lock().get(&key) {
            None => HostCaptureState::None,
            Some(true) => HostCaptureState::Active,
            Some(false) => HostCaptureState::Invalidated,
        }
    }

    /// Whether any capture is under way (valid or not yet ended).
    pub(crate) fn any(&self) -> bool {
        !self.streams.lock().is_empty()
    }

    /// A call every capture forbids: refused, and every capture
    /// invalidated, if one is under way.
    pub(crate) fn refuse_any(&self, what: &'static str) -> Result<()> {
        let mut s = self.streams.lock();
        if s.is_empty() {
            return Ok(());
        }
        s.values_mut().for_each(|v| *v = false);
        Err(Error::CaptureUnderway { what })
    }

    /// A call on stream `key` that its capture forbids: refused, and its
    /// capture invalidated, if it is captured.
    pub(crate) fn refuse_on(&self, key: StreamKey, what: &'static str) -> Result<()> {
        match self.streams.lock().get_mut(&key) {
            Some(v) => {
                *v = false;
                Err(Error::CaptureUnderway { what })
            }
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_call_invalidates_and_the_end_says_so() {
        let c = Captures::default();
        let (s, t) = ((0, 1), (0, 2));
        assert!(c.refuse_any("x").is_ok(), "nothing captured: allowed");
        c.begin(s).unwrap();
        assert!(c.begin(s).is_err(), "captured twice");
        assert!(c.refuse_on(t, "x").is_ok(), "another stream's fence");
        assert_eq!(c.state(s), HostCaptureState::Active);
        assert!(matches!(
            c.refuse_any("a synchronisation"),
            Err(Error::CaptureUnderway { .. })
        ));
        assert_eq!(c.state(s), HostCaptureState::Invalidated);
        assert!(c.any());
        assert!(c.end(s).is_err(), "an invalidated capture's end fails");
        assert!(!c.any() && c.state(s) == HostCaptureState::None);
        c.begin(t).unwrap();
        assert!(c.refuse_on(t, "a fence").is_err());
        assert!(c.end(t).is_err());
        c.begin(t).unwrap();
        c.end(t).unwrap();
        assert!(c.end(t).is_err(), "no capture to end");
    }
}
