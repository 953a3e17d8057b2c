//! Growing: `grow_to`, `grow_by`, `claim`, `resize`, `reserve`. All take `&self` (a lock
//! serialises them) and are all or nothing.

use std::time::Instant;

use super::{GrowableBuffer, Inner};
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::location::Grants;
use crate::plan::{plan_growth, round_up, GrowthRequest};
use crate::pool::{ChunkSource, Driver};
use crate::region::NewChunk;

impl<B: Backend> GrowableBuffer<B> {
    /// Grows the length to `bytes`, mapping chunks as the policy says. Keeps
    /// every byte in use, never moves the base. A `bytes` at or below the
    /// length changes nothing (use [`truncate`](Self::truncate) to shrink).
    ///
    /// On error nothing has changed: [`Error::OutOfMemory`] is transient,
    /// [`Error::ReservationExhausted`] is not.
    pub fn grow_to(&self, bytes: usize) -> Result<()> {
        self.grow_locked(&mut self.inner.lock(), bytes)
    }

    /// Grows the length by `additional` bytes in one step under the lock and
    /// returns the offset where the new bytes start, so threads appending
    /// concurrently each get their own range. See [`grow_to`](Self::grow_to).
    pub fn grow_by(&self, additional: usize) -> Result<usize> {
        let mut g = self.inner.lock();
        let at = g.region.table.len();
        self.grow_at_locked(&mut g, at, additional)
    }

    /// Hands out a sub-range of `bytes` at the buffer's alignment (256 bytes
    /// unless [`BufferDesc::alignment`](crate::BufferDesc::alignment) says
    /// otherwise): pads the length up to the alignment, grows by `bytes`, and
    /// returns the sub-range's offset. One step under the lock, so concurrent
    /// claims never overlap. The address is `base() + offset`, aligned since
    /// the base is.
    pub fn claim(&self, bytes: usize) -> Result<usize> {
        let mut g = self.inner.lock();
        let len = g.region.table.len();
        let at = round_up(len, self.alignment)
            .ok_or_else(|| Error::invalid(format!("aligning {len} bytes overflows")))?;
        self.grow_at_locked(&mut g, at, bytes)
    }

    /// Sets the length to `bytes`: grows as [`grow_to`](Self::grow_to) or
    /// shrinks as [`truncate`](Self::truncate) (keeping the memory).
    pub fn resize(&mut self, bytes: usize) -> Result<()> {
        if bytes > self.len() {
            self.grow_to(bytes)
        } else {
            self.truncate(bytes);
            Ok(())
        }
    }

    /// Grows the length to `at + bytes` (`at` at or past the length) and
    /// returns `at`.
    fn grow_at_locked(&self, g: &mut Inner<B>, at: usize, bytes: usize) -> Result<usize> {
        let target = at
            .checked_add(bytes)
            .ok_or_else(|| Error::invalid(format!("growing to {at} + {bytes} bytes overflows")))?;
        self.grow_locked(g, target)?;
        Ok(at)
    }

    fn grow_locked(&self, g: &mut Inner<B>, bytes: usize) -> Result<()> {
        if bytes <= g.region.table.len() {
            return g.check_poison();
        }
        self.capacity_locked(g, bytes)?;
        g.region
            .table
            .set_len(bytes)
            .expect("the capacity covers the new length");
        g.window = g.window.max(bytes);
        for p in &mut g.pending {
            p.window = p.window.max(bytes);
        }
        if let Err(e) = self.reclaim_locked(g) {
            tracing::warn!(error = %e, "vmmbuf: deferred release failed; retried at the next shrink or drop");
        }
        Ok(())
    }

    /// Maps chunks, as the policy says, until the capacity is at least
    /// `len() + additional`, leaving the length as it is (as
    /// [`Vec::reserve`]). A later growth within that capacity makes no
    /// driver call. Since growth takes `&self`, another thread can call
    /// this ahead of need while one grows, so that the growing thread does
    /// not wait for mapping: reserving one policy-sized chunk ahead of the
    /// length at most doubles the policy's over-commit bound (with the
    /// default `Proportional { divisor: 8 }`, use 16 to keep 12.5%). A
    /// deferred release ([`shrink_to_fit_after`](Self::shrink_to_fit_after))
    /// spares what this maps. Errors and all-or-nothing as
    /// [`grow_to`](Self::grow_to).
    pub fn reserve(&self, additional: usize) -> Result<()> {
        let mut g = self.inner.lock();
        let target = g
            .region
            .table
            .len()
            .checked_add(additional)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "reserving {additional} bytes past the length overflows"
                ))
            })?;
        self.capacity_locked(&mut g, target)?;
        g.window = g.window.max(target);
        for p in &mut g.pending {
            p.window = p.window.max(target);
        }
        Ok(())
    }

    /// Maps chunks until the capacity is at least `bytes` (within the
    /// reservation); on out of memory, drains the pool and tries once more.
    fn capacity_locked(&self, g: &mut Inner<B>, bytes: usize) -> Result<()> {
        g.check_poison()?;
        if bytes > self.reserved {
            return Err(Error::ReservationExhausted {
                requested_bytes: bytes,
                reserved_bytes: self.reserved,
            });
        }
        if bytes <= g.capacity() {
            return Ok(());
        }
        match self.map_more(g, bytes) {
            // Out of memory with chunks idle in the pool: give them back
            // to the driver and try once more.
            Err(e) if e.is_transient() && self.pool.as_ref().is_some_and(|p| p.drain_for_oom()) => {
                tracing::debug!(error = %e, "vmmbuf: grow out of memory; drained the pool, retrying");
                self.map_more(g, bytes)
            }
            r => r,
        }
    }

    /// The plan's chunks, in address order: pooled ones from the buffer's
    /// source (its pool: one another buffer took meanwhile is created
    /// anew), the others created. On an error the ones taken go back.
    fn take_planned(&self, plan: &[crate::plan::Planned]) -> Result<Vec<NewChunk<B::Chunk>>> {
        let driver = Driver(&*self.backend);
        let source = self.source(&driver);
        let mut chunks: Vec<NewChunk<B::Chunk>> = Vec::with_capacity(plan.len());
        for c in plan {
            let from: &dyn ChunkSource<B> = if c.pooled { source } else { &driver };
            match from.take(self.shareable, c.placement, c.bytes) {
                Ok(chunk) => chunks.push(NewChunk {
                    chunk,
                    bytes: c.bytes,
                    placement: c.placement,
                }),
                Err(e) => {
                    for c in chunks {
                        let _ = self.dispose(c.chunk, c.bytes, c.placement); // logged inside
                    }
                    return Err(e);
                }
            }
        }
        Ok(chunks)
    }

    /// Maps chunks until the capacity reaches `bytes`, as the one growth plan
    /// says (pooled chunks first), all or nothing.
    fn map_more(&self, g: &mut Inner<B>, bytes: usize) -> Result<()> {
        let start = Instant::now();
        let span =
            tracing::debug_span!("vmmbuf.grow", from = g.region.table.len(), to = bytes).entered();
        let at = g.capacity();
        let offer = self.pool.as_ref().map(|p| p.offer(self.shareable));
        let plan = plan_growth(&GrowthRequest {
            policy: self.growth_policy,
            granularity: self.granularity,
            at,
            target: bytes,
            limit: self.reserved,
            placement_at: &|o| self.placement_at(o),
            pool: offer.as_ref(),
        })?;
        // The shared budget first: nothing is created past it.
        let total: usize = plan.iter().map(|c| c.bytes).sum();
        let Some(hold) = g.region.hold(total) else {
            return Err(Error::OutOfMemory {
                call: "the shared budget",
                requested_bytes: total,
            });
        };
        let hits = || self.pool.as_ref().map_or(0, |p| p.stats().hits);
        let hits_before = hits();
        let chunks = self.take_planned(&plan)?;
        let n = chunks.len();
        let mapped = g
            .region
            .map_batch(at, chunks, &Grants::new(&self.grants, true));
        if let Err((e, back)) = mapped {
            // Unmapped again (or, if that failed, quarantined by the region):
            // what came back goes to the pool or the driver.
            for c in back {
                let _ = self.dispose(c.chunk, c.bytes, c.placement); // logged inside
            }
            tracing::debug!(error = %e, "vmmbuf: grow failed and was undone");
            return Err(e);
        }
        hold.keep();
        let offset = g.capacity();
        g.debug_check();
        g.stats.grows += 1;
        g.stats.chunks_mapped_total += n as u64;
        g.stats.peak_mapped_bytes = g.stats.peak_mapped_bytes.max(g.capacity());
        tracing::debug!(
            parent: &span,
            chunks = n,
            from_pool = hits() - hits_before,
            bytes = offset - at,
            elapsed_us = start.elapsed().as_micros() as u64,
            "vmmbuf: grew"
        );
        Ok(())
    }
}
