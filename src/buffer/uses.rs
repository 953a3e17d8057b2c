//! Stream order: the last use of the buffer per stream, recorded as a fence,
//! and waited on (that stream's work only) before anything is unmapped,
//! remapped or read back. No device-wide synchronisation.
//!
//! Views record their use on the stream they were made for when they drop;
//! work that uses the buffer through raw addresses (`base() + offset` in a
//! kernel, a CUDA graph) records it with [`record_use`](GrowableBuffer::record_use)
//! or [`record_stream`](GrowableBuffer::record_stream), as with PyTorch's
//! `record_stream`. Unrecorded work is not waited for.

use cudarc::driver::CudaStream;

use super::GrowableBuffer;
use crate::backend::Backend;
use crate::error::Result;
use crate::CudaBackend;

impl<B: Backend> GrowableBuffer<B> {
    /// Records that work before `fence` uses the buffer: giving memory back,
    /// migrating, changing access, host views, `read`/`write` and drop wait
    /// for it first. A later fence on the same queue (stream) replaces the
    /// earlier one.
    pub fn record_use(&self, fence: B::Fence) {
        let key = self.backend.fence_key(&fence);
        self.uses.put(key, fence);
    }

    /// Blocks until every recorded use has finished (each stream's own
    /// work, never the whole device).
    pub(crate) fn wait_uses(&self) -> Result<()> {
        self.uses.each(|f| self.backend.wait(f))
    }

    /// Blocks until every recorded use and every fence given to a deferred
    /// release ([`shrink_to_fit_after`](Self::shrink_to_fit_after)) has
    /// passed: what must come before any unmap, remap or access change.
    /// A deferred fence stands for work on the tail that the buffer does not
    /// otherwise know of; forgetting it would unmap under that work.
    pub(super) fn wait_all(&self, g: &super::Inner<B>) -> Result<()> {
        for p in &g.pending {
            self.backend.wait(&p.fence)?;
        }
        self.wait_uses()
    }

    /// True once every recorded use has finished. Never blocks.
    pub(super) fn uses_done(&self) -> Result<bool> {
        self.uses.all(|f| self.backend.fence_done(f))
    }
}

impl GrowableBuffer<CudaBackend> {
    /// Records that all work queued on `stream` so far may use the buffer:
    /// [`record_use`](Self::record_use) with a fence on `stream`, reusing one
    /// event per stream. Call it after queueing work that reaches the buffer
    /// through raw addresses; views record their own use.
    pub fn record_stream(&self, stream: &CudaStream) -> Result<()> {
        self.uses.record_stream(stream)
    }
}
