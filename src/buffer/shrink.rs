//! Shrinking, with `Vec`'s names: [`truncate`](GrowableBuffer::truncate)
//! keeps memory; [`shrink_to_fit`](GrowableBuffer::shrink_to_fit) and
//! [`shrink_to`](GrowableBuffer::shrink_to) give back whole chunks past the
//! length (after waiting for the GPU);
//! [`shrink_to_fit_after`](GrowableBuffer::shrink_to_fit_after) gives them
//! back once a fence has passed, without blocking.

use std::time::Instant;

use super::{GrowableBuffer, Inner, Pending};
use crate::backend::Backend;
use crate::error::Result;

impl<B: Backend> GrowableBuffer<B> {
    /// Reduces the length to `bytes`, keeping the chunks mapped for regrowth.
    /// A `bytes` at or above the length changes nothing, as in
    /// [`Vec::truncate`].
    pub fn truncate(&mut self, bytes: usize) {
        let g = self.inner.get_mut();
        if bytes < g.region.table.len() {
            g.region
                .table
                .set_len(bytes)
                .expect("a shorter length is always mapped");
            g.stats.shrinks += 1;
        }
    }

    /// Sets the length to 0, keeping the memory: `truncate(0)`.
    pub fn clear(&mut self) {
        self.truncate(0);
    }

    /// Gives back every chunk that lies wholly past the length, after waiting
    /// for every recorded use and every fence an earlier
    /// [`shrink_to_fit_after`](Self::shrink_to_fit_after) was given (see
    /// [`record_use`](Self::record_use); the host
    /// blocks until they finish, or use
    /// [`shrink_to_fit_after`](Self::shrink_to_fit_after), which does not). A chunk that holds any byte in use stays.
    /// Chunks go to the pool if the buffer has one.
    ///
    /// If the wait or the unmap fails, nothing has changed. If releasing a
    /// chunk fails, the buffer is shrunk all the same and the error is
    /// returned (the chunk's token retries and logs when it drops).
    pub fn shrink_to_fit(&mut self) -> Result<()> {
        self.shrink_to(0)
    }

    /// Gives back every chunk that lies wholly past `max(len, min_capacity)`,
    /// as [`shrink_to_fit`](Self::shrink_to_fit) does: the capacity is then
    /// at least that much, as with [`Vec::shrink_to`].
    pub fn shrink_to(&mut self, min_capacity: usize) -> Result<()> {
        let mut g = self.inner.lock();
        g.check_poison()?;
        let keep_to = g.region.table.len().max(min_capacity);
        // Every deferred fence is waited for (in `release_from`) before
        // anything is unmapped; then none is left to keep. If nothing was
        // released, nothing waited: the deferred fences stay.
        if self.release_from(&mut g, keep_to, true)? {
            g.pending.clear();
        }
        Ok(())
    }

    /// Gives back every chunk wholly past the length once `fence` has passed,
    /// without blocking the host: stream-ordered release. The release happens
    /// in a later call that finds the fence done ([`grow_to`](Self::grow_to),
    /// [`reclaim`](Self::reclaim), this one), or at once in
    /// [`shrink_to_fit`](Self::shrink_to_fit) and drop, which wait.
    ///
    /// The fence alone is not trusted: the release also waits until every
    /// recorded use (views on any stream, [`record_use`](Self::record_use))
    /// has passed. `fence` adds work the buffer does not know of (for CUDA,
    /// [`CudaBackend::fence`](crate::CudaBackend::fence) on that work's
    /// stream). Growing again before then simply reuses the chunks still
    /// mapped; nothing that was in use since is ever released. The fence is
    /// kept until it passes even when no chunk lies wholly past the length
    /// now: every later unmap, migration, access change and drop waits for
    /// it. On error nothing has changed.
    pub fn shrink_to_fit_after(&mut self, fence: B::Fence) -> Result<()> {
        let mut g = self.inner.lock();
        g.check_poison()?;
        // Earlier requests first: an error there leaves this one unrecorded.
        self.reclaim_locked(&mut g)?;
        // A fence that cannot be asked is refused before it is recorded.
        self.backend.fence_done(&fence)?;
        let window = g.window.max(g.region.table.len());
        g.pending.push(Pending { fence, window });
        g.window = g.region.table.len();
        // Passed already (and nothing earlier holds the tail): released now.
        // On error the request stays, for a later call.
        self.reclaim_locked(&mut g)
    }

    /// Gives back what earlier [`shrink_to_fit_after`](Self::shrink_to_fit_after)
    /// calls deferred, where their fences have passed. Never blocks on the GPU.
    pub fn reclaim(&self) -> Result<()> {
        let mut g = self.inner.lock();
        g.check_poison()?;
        self.reclaim_locked(&mut g)
    }

    /// Releases the chunks past the length that no deferred release's
    /// unpassed fence covers, once every recorded use has passed. An
    /// unpassed fence covers the bytes below its window (the largest length
    /// between the request before it and its own), and work since the last
    /// request may use the bytes below the largest length since (its fence
    /// comes with the next request): chunks from the largest of these up
    /// go, whatever the order the fences pass in (on different streams they
    /// pass in any order).
    pub(super) fn reclaim_locked(&self, g: &mut Inner<B>) -> Result<()> {
        if g.pending.is_empty() || !self.uses_done()? {
            return Ok(());
        }
        let mut err = None;
        let before = g.pending.len();
        g.pending
            .retain(|p| match self.backend.fence_done(&p.fence) {
                Ok(done) => !done,
                Err(e) => {
                    err.get_or_insert(e);
                    true
                }
            });
        if g.pending.len() < before {
            let boundary = g
                .pending
                .iter()
                .map(|p| p.window)
                .max()
                .unwrap_or(0)
                .max(g.window)
                .max(g.region.table.len());
            self.release_from(g, boundary, false)?;
        }
        err.map_or(Ok(()), Err)
    }

    /// Unmaps every chunk that starts at or past `keep_to` (at or past the
    /// length) and gives it to the pool or the driver; with `wait`, waits for
    /// the recorded uses and the deferred fences first. Returns whether
    /// anything was there to release (and so, with `wait`, whether it
    /// waited).
    fn release_from(&self, g: &mut Inner<B>, keep_to: usize, wait: bool) -> Result<bool> {
        // With a map hook, never part of a reported range.
        let keep_to = g.region.span_boundary_at_or_after(keep_to);
        let Some((from, _)) = g.region.table.iter().find(|(o, _)| *o >= keep_to) else {
            return Ok(false);
        };
        let start = Instant::now();
        let bytes = g.capacity() - from;
        let _span = tracing::debug_span!(
            "vmmbuf.shrink",
            len = g.region.table.len(),
            from,
            bytes,
            wait
        )
        .entered();
        if wait {
            self.wait_all(g)?;
        }
        // The region gives the budget back as it unmaps.
        let gone = g.region.unmap(from, bytes)?;
        let released = gone.len();
        g.debug_check();
        g.stats.trims += 1;
        g.stats.chunks_released_total += released as u64;
        let mut first_err = None;
        for (_, e) in gone {
            if let Err(err) = self.dispose(e.chunk, e.bytes, e.placement) {
                first_err.get_or_insert(err);
            }
        }
        tracing::debug!(
            chunks = released,
            bytes,
            elapsed_us = start.elapsed().as_micros() as u64,
            "vmmbuf: gave chunks back"
        );
        first_err.map_or(Ok(true), Err)
    }
}
