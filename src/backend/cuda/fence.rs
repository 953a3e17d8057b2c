//! [`CudaFence`]: a point in a CUDA stream, and how uses are recorded on
//! streams (one event per stream, re-recorded).
#![allow(unsafe_code)]

use super::*;

/// A point in a CUDA stream (an event recorded on it), made by
/// [`CudaBackend::fence`].
#[derive(Debug)]
pub struct CudaFence {
    /// `None` only while dropping.
    pub(super) event: Option<CudaEvent>,
    pub(super) key: crate::StreamKey,
    /// The backend's spare events, each with its context's handle.
    pub(super) spares: std::sync::Weak<Mutex<Vec<(u64, CudaEvent)>>>,
}

impl Drop for CudaFence {
    fn drop(&mut self) {
        // Back to the backend for the next fence (at most a few hundred kept).
        let Some(e) = self.event.take() else {
            return;
        };
        if let Some(spares) = self.spares.upgrade() {
            let mut v = spares.lock();
            if v.len() < 256 {
                // The key's first half is the event's context: recorded on
                // a stream of that context.
                v.push((self.key.0, e));
                return;
            }
        }
        // cudarc binds the event's context to destroy it.
        super::driver::before_switch();
        drop(e);
    }
}

impl CudaFence {
    /// The event behind the fence.
    pub fn event(&self) -> &CudaEvent {
        self.event
            .as_ref()
            .expect("a fence has its event until it drops")
    }

    /// Records the fence again, now, on `stream` (its own stream): one event
    /// per stream serves every later use.
    pub(crate) fn rerecord(&self, stream: &CudaStream) -> Result<()> {
        driver::event_record(self.event(), stream)
    }
}

impl crate::backend::Uses<CudaFence> {
    /// Records a use of everything queued on `stream` so far, re-recording
    /// the stream's event when it has one (no event is created per use).
    pub(crate) fn record_stream(&self, stream: &CudaStream) -> Result<()> {
        let key = stream_key(stream);
        self.record(
            key,
            |f| f.rerecord(stream),
            || {
                Ok(CudaFence {
                    event: Some(driver::record_event(stream)?),
                    key,
                    spares: std::sync::Weak::new(),
                })
            },
        )
    }
}

/// The key of a stream's fences: its context and its handle (unique among
/// live streams; every context's default stream is the null handle).
pub(crate) fn stream_key(stream: &CudaStream) -> crate::StreamKey {
    (stream.context().cu_ctx() as u64, stream.cu_stream() as u64)
}
