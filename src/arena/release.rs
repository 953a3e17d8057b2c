//! Giving memory back: whole free chunks (whole reported ranges under a
//! map hook) unmapped to the pool before a mapping, on `empty_cache`, for a
//! sleep; and everything at the arena's end.

use super::{Shared, State};
use crate::backend::Backend;
use crate::error::Result;
use crate::plan::round_up;
use crate::pool::ChunkSource;

/// How far past its peak allocated an arena with a map hook maps before it
/// gives whole free chunks back to map a new one (see `Shared::map_at`).
const HOOKED_SLACK: f64 = 1.10;

impl<B: Backend> Shared<B> {
    /// Whole free chunks go to the pool before a mapping, which takes from
    /// it, so that memory taken follows memory allocated: always with
    /// `release_before_map`; with a hook (`whole`), where mapping `size`
    /// would take memory past `HOOKED_SLACK` times the peak allocated (a
    /// chunk's free bytes then serve only requests that fit in that chunk).
    pub(super) fn release_before_mapping(
        &self,
        st: &mut State<B>,
        size: usize,
        whole: bool,
    ) -> Result<()> {
        let hooked = st.region.has_hook();
        // Past what share of the peak allocated whole free chunks go back.
        let over = match (self.release_over_percent, hooked && whole) {
            (Some(p), _) => Some(f64::from(p) / 100.0),
            (None, true) => Some(HOOKED_SLACK),
            (None, false) => None,
        };
        let release = self.release_before_map
            || over.is_some_and(|over| {
                let want = round_up(size, self.granularity).unwrap_or(usize::MAX);
                self.past_share(st, size, want, over) > 0
            });
        if !release {
            return Ok(());
        }
        self.release_free_chunks(st)?;
        if hooked || (over.is_some() && !self.release_before_map) {
            // Chunks of any size (with a hook a growing request maps one of
            // its own; without, the last chunk of a mapping is as long as
            // the request needs), so the pool seldom has one that fits:
            // kept there they piled up (registered FSDP on 2x H200 took
            // 2.6-3.9x its peak allocated while mapping 1.07x). They go on
            // to the driver; the pool logs a failure and keeps what it
            // could not give back.
            let _ = self.pool.trim_at(self.placement);
        }
        Ok(())
    }

    /// The bytes by which mapping `want` more for a request of `size` would
    /// take the arena past `share` times its peak allocated (the request
    /// counted): 0 if it stays within.
    pub(super) fn past_share(&self, st: &State<B>, size: usize, want: usize, share: f64) -> usize {
        let live = st
            .heap
            .allocated()
            .0
            .saturating_add(size)
            .max(st.stats.allocated_bytes.peak);
        st.region
            .table
            .mapped_bytes()
            .saturating_add(want)
            .saturating_sub((share * live as f64) as usize)
    }

    /// Unmaps every chunk that lies wholly inside a settled free block and
    /// hands it to the pool. Returns the bytes released.
    pub(super) fn release_free_chunks(&self, st: &mut State<B>) -> Result<usize> {
        Ok(self.release_free_ranges(st)?.iter().map(|r| r.1).sum())
    }

    /// [`release_free_chunks`](Self::release_free_chunks), returning the
    /// ranges given back, `(offset, bytes)`.
    pub(super) fn release_free_ranges(&self, st: &mut State<B>) -> Result<Vec<(usize, usize)>> {
        self.reap_ghosts(st, false)?;
        for z in 0..2 {
            self.settle_zone(st, z);
        }
        // Whole free chunks; with a map hook, whole reported ranges (a
        // hook may hold a registration over all of one, which must not go
        // while a neighbour's use may be in flight).
        let hooked = st.region.has_hook();
        let mut whole: Vec<(usize, usize)> = st
            .region
            .table
            .iter()
            .filter_map(|(o, e)| match hooked {
                true => st.region.span_of(o),
                false => Some((o, e.bytes)),
            })
            .collect();
        whole.dedup();
        whole.retain(|&(o, b)| st.heap.covers(o, b, true));
        let mut released = Vec::with_capacity(whole.len());
        for (o, b) in whole {
            // Settled: the uses of these bytes have passed, no wait needed.
            for (_, e) in st.region.unmap(o, b)? {
                let _ = self.pool.give(e.placement, e.bytes, e.chunk);
            }
            // A range a hook was told of at once may cross the zones' border.
            st.heap.carve(o, b);
            released.push((o, b));
            st.stats.num_device_free += 1;
        }
        Ok(released)
    }
}

impl<B: Backend> Drop for Shared<B> {
    fn drop(&mut self) {
        // Every allocation holds the arena: nothing is allocated now, and
        // every free block's fences are waited for before unmapping.
        let st = self.state.get_mut();
        let backend = &*self.backend;
        let mut waited = true;
        for e in st.heap.wait_free_blocks(backend) {
            tracing::error!(error = %e, "vmmbuf arena: waiting for a free's fence in drop failed; nothing is unmapped");
            waited = false;
        }
        // The old addresses of moved chunks (the region unmaps them).
        for (key, seq) in st.region.ghost_marks().filter_map(|(_, m)| m) {
            if let Err(e) = st.heap.wait_mark(backend, key, seq) {
                tracing::error!(error = %e, "vmmbuf arena: waiting for a moved chunk's old uses in drop failed; nothing is unmapped");
                waited = false;
            }
        }
        // Unmapped by hand and pooled only if every fence was waited for.
        // The shared budget gets back what this arena mapped either way
        // (the region gives it back as it closes).
        let pool = &self.pool;
        st.region.close(waited, |chunk, bytes, placement| {
            let _ = pool.give(placement, bytes, chunk);
        });
        // The stash: its copies were waited for when they were made.
        st.sleep.close(|chunk, bytes, placement| {
            let _ = pool.give(placement, bytes, chunk);
        });
    }
}
