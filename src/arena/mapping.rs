//! How the arena finds memory: free blocks first (settling passed frees,
//! then joining the stream's pending blocks with settled ones), then chunks
//! mapped at the
//! lowest hole that fits (pooled ones first); and how whole free chunks go
//! back to the pool. Every function runs under the arena's lock.

use super::blocks::StreamKey;
use super::heap::Heap;
use super::{ArenaStream, Shared, State};
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::location::Location;
use crate::location::{cpu_at_once, Grants};
use crate::plan::round_up;
use crate::pool::ChunkSource;
use crate::region::NewChunk;

impl<B: Backend> Shared<B> {
    /// A free block of `size` for `key`: from the index, after settling
    /// passed frees, or from newly mapped memory.
    pub(super) fn find(&self, st: &mut State<B>, size: usize, key: StreamKey) -> Result<usize> {
        let z = Heap::<B::Fence>::zone_of_size(size);
        if let Some(o) = self.take(st, z, size, key) {
            return Ok(o);
        }
        // A miss: streams with frees owed record their covers at their next
        // call, so that their blocks may settle for the others.
        if self.defer_free_fences {
            st.heap.want_covers_but(key);
        }
        self.settle_zone(st, z);
        if let Some(o) = self.take(st, z, size, key) {
            return Ok(o);
        }
        let coalesced = {
            let State { heap, region, .. } = &mut *st;
            heap.coalesce(z, key, &region.walls())
        };
        if coalesced > 0 {
            if let Some(o) = self.take(st, z, size, key) {
                return Ok(o);
            }
        }
        if self.wait_before_grow {
            if let Some(o) = self.wait_for_pending(st, z, size, key) {
                return Ok(o);
            }
        }
        // Growth. Counted apart when another stream's pending block could
        // have served (the GPU's lag made this memory).
        let past_pending = st.heap.pending_fits(z, size, key);
        let before = st.region.table.mapped_bytes();
        let got = if st.region.has_hook() {
            // With a map hook, a request that needs new memory gets a
            // mapping of its own, so that it lies in one reported range
            // (one NCCL registration) instead of straddling the free tail
            // before it and the new chunks.
            self.map_whole(st, z, size, key)
        } else {
            self.map_for(st, z, size, key).and_then(|()| {
                st.heap
                    .take(z, size, key)
                    .ok_or_else(|| Error::invalid("mapped memory did not make a block (a bug)"))
            })
        };
        if past_pending && got.is_ok() {
            st.stats.num_grows_past_pending += 1;
            st.stats.grown_past_pending_bytes +=
                st.region.table.mapped_bytes().saturating_sub(before) as u64;
        }
        got
    }

    /// Instead of growing: waits on the CPU for the fences of a pending
    /// free block of another stream that fits `size` (the heap picks it:
    /// [`Heap::wait_for_pending`]), then settles the zone and takes a
    /// block. `None` if there is no such block, or the wait failed
    /// (logged: the caller grows instead).
    fn wait_for_pending(
        &self,
        st: &mut State<B>,
        z: usize,
        size: usize,
        key: StreamKey,
    ) -> Option<usize> {
        if let Err(e) = st.heap.wait_for_pending(&*self.backend, z, size, key)? {
            tracing::warn!(error = %e, "vmmbuf arena: waiting for a pending free failed; growing instead");
            return None;
        }
        self.settle_zone(st, z);
        let o = self.take(st, z, size, key)?;
        st.stats.num_waits_before_grow += 1;
        Some(o)
    }

    /// Maps chunks for `size` bytes at the lowest hole of zone `z` where
    /// they fit whole, and returns their start, taken for the request; the
    /// rest of the last chunk goes to the free index.
    fn map_whole(&self, st: &mut State<B>, z: usize, size: usize, key: StreamKey) -> Result<usize> {
        let (at, need, _) = self.map_at(st, z, size, key, true)?;
        if need > size {
            let State { heap, region, .. } = &mut *st;
            heap.insert_fresh_for(z, at + size, need - size, key, &region.walls());
        }
        Ok(at)
    }

    /// The best-fitting free block of zone `z` for `size` on `key`. When
    /// free chunks stay mapped, a block that ends where the zone's mapped
    /// memory ends is spared while another fits, kept to grow into (as
    /// PyTorch's expandable segments do): replaying a conv net's training
    /// with the GPU lagging, 1.047x its peak instead of 1.17x.
    fn take(&self, st: &mut State<B>, z: usize, size: usize, key: StreamKey) -> Option<usize> {
        // With a hook, growth never extends a free block (each request
        // that grows gets chunks of its own): nothing to spare.
        if self.release_before_map || st.region.has_hook() {
            return st.heap.take(z, size, key);
        }
        let State { heap, region, .. } = st;
        let table = &region.table;
        heap.take_sparing(z, size, key, |end| {
            end < table.reserved() && table.chunk_at(end).is_none()
        })
    }

    /// Maps chunks at the lowest unmapped address of zone `z` where `size`
    /// fits, counting the free block `key` may use that ends there.
    pub(super) fn map_for(
        &self,
        st: &mut State<B>,
        z: usize,
        size: usize,
        key: StreamKey,
    ) -> Result<()> {
        let (at, need, moved) = self.map_at(st, z, size, key, false)?;
        // Fresh memory: any stream may use it; tagged with `key` so it merges
        // with `key`'s pending block before it. Moved memory is in the index
        // already (`move_free_for`).
        if need > moved {
            let State { heap, region, .. } = &mut *st;
            heap.insert_fresh_for(z, at + moved, need - moved, key, &region.walls());
        }
        Ok(())
    }

    /// Maps the chunks [`map_for`](Self::map_for) needs (with `whole`, all
    /// of `size`, not counting a free block that ends at the hole) and
    /// returns where, how many bytes, and how many of those at the start
    /// were moved there and put in the index already
    /// ([`ArenaDesc::move_free_chunks`](super::ArenaDesc::move_free_chunks));
    /// the caller puts the rest in the index.
    fn map_at(
        &self,
        st: &mut State<B>,
        z: usize,
        size: usize,
        key: StreamKey,
        whole: bool,
    ) -> Result<(usize, usize, usize)> {
        self.release_before_mapping(st, size, whole)?;
        self.reap_ghosts(st, false)?;
        let found = self.hole_for(st, z, size, key, whole);
        let (at, need, before) = found.ok_or_else(|| self.out_of_memory(st, size, None))?;
        let moved = if self.move_free_chunks && !whole {
            let most = self.move_at_most(st, size, need);
            self.move_free_for(st, z, at - before..at, at, most, key)?
        } else {
            0
        };
        if moved == need {
            return Ok((at, need, moved));
        }
        self.map_new(st, at + moved, need - moved, size, whole)?;
        Ok((at, need, moved))
    }

    /// The hole of zone `z` to map `size` bytes for `key` in: `(where,
    /// bytes to map, bytes of the free block before it that `key` may
    /// extend)`, each rounded to the granularity; with `whole`, all of
    /// `size` is mapped. Moving, the hole whose free block before it leaves
    /// the least to map (each chunk moved costs a mapping now and an
    /// unmapping later: host replays of four traces at a lag of 100 events
    /// moved 4-16% fewer chunks than with the first hole that fits, at the
    /// same peak within 0.001x); otherwise the first. Discarded ranges stay
    /// unmapped until the wake.
    fn hole_for(
        &self,
        st: &State<B>,
        z: usize,
        size: usize,
        key: StreamKey,
        whole: bool,
    ) -> Option<(usize, usize, usize)> {
        let zone = st.heap.zone_range(z, st.region.table.reserved());
        let regions = st
            .sleep
            .exclude(st.region.without_ghosts(st.region.table.gaps(zone)));
        let mut fits = regions.into_iter().filter_map(|h| {
            let before = st
                .heap
                .free_ending_at(z, h.start)
                .filter(|(_, f)| !whole && (f.settled() || f.stream == Some(key)))
                .map_or(0, |(_, f)| f.size);
            let need = round_up(size.saturating_sub(before), self.granularity)?;
            (need <= h.end - h.start).then_some((h.start, need, before))
        });
        if self.move_free_chunks {
            fits.min_by_key(|&(at, need, _)| (need, at))
        } else {
            fits.next()
        }
    }

    /// Maps `need` fresh bytes at `at` for a request of `size`: the room
    /// and the shared budget checked first (the budget taken before any
    /// chunk is created, given back if the mapping fails), in chunks of at
    /// most `chunk_bytes`, pooled ones first, placed where the arena is now
    /// (the host, while asleep keeping the data). With a hook (`whole`),
    /// one chunk for the whole request: the hook registers chunk by chunk,
    /// and a block never straddles two (`Region::walls`), so one larger
    /// than a chunk needs one of its own.
    fn map_new(
        &self,
        st: &mut State<B>,
        at: usize,
        need: usize,
        size: usize,
        whole: bool,
    ) -> Result<()> {
        self.check_room(st, size, need)?;
        let Some(hold) = st.region.hold(need) else {
            return Err(self.out_of_memory(st, size, None));
        };
        let sizes: Vec<usize> = if whole {
            vec![need]
        } else {
            (0..need.div_ceil(self.chunk_bytes))
                .map(|i| (need - i * self.chunk_bytes).min(self.chunk_bytes))
                .collect()
        };
        self.map_fresh(st, at, &sizes)?;
        hold.keep();
        Ok(())
    }

    /// Whether `need` more bytes may be mapped for a request of `size`:
    /// within the arena's budget, and leaving the device margin free.
    pub(super) fn check_room(&self, st: &State<B>, size: usize, need: usize) -> Result<()> {
        if self
            .budget
            .is_some_and(|budget| st.region.table.mapped_bytes() + need > budget)
        {
            return Err(self.out_of_memory(st, size, None));
        }
        let margin = self.margin.load(std::sync::atomic::Ordering::Relaxed);
        if margin > 0 && matches!(st.placement, Location::Device(_)) {
            if let Some((free, total)) = self.backend.device_memory() {
                if need.saturating_add(margin) > free {
                    return Err(self.out_of_memory(st, size, Some((free, total))));
                }
            }
        }
        Ok(())
    }

    /// Maps new chunks of `sizes` bytes, one after the other from `at`,
    /// placed where the arena is now, pooled ones first, with the arena's
    /// access. All or nothing: on an error the chunks go back to the pool.
    /// The caller holds the budget. Returns the time spent getting the
    /// chunks (creating them is the slow part).
    pub(super) fn map_fresh(
        &self,
        st: &mut State<B>,
        at: usize,
        sizes: &[usize],
    ) -> Result<std::time::Duration> {
        let placement = st.placement;
        let t = std::time::Instant::now();
        let wants: Vec<(Location, usize)> = sizes.iter().map(|&n| (placement, n)).collect();
        let chunks = self.pool.take_many(false, &wants)?;
        let acquired = t.elapsed();
        let grants = Grants::new(&st.access, cpu_at_once(self.backend.home(), placement));
        let new: Vec<NewChunk<B::Chunk>> = chunks
            .into_iter()
            .zip(sizes)
            .map(|(chunk, &bytes)| NewChunk {
                chunk,
                bytes,
                placement,
            })
            .collect();
        st.region.map_batch(at, new, &grants).map_err(|(e, back)| {
            for c in back {
                let _ = self.pool.give(c.placement, c.bytes, c.chunk);
            }
            e
        })?;
        st.stats.num_device_alloc += sizes.len() as u64;
        Ok(acquired)
    }

    /// Waits for the fences of every free block still pending (their
    /// streams' work only, never the whole device), so that all of them
    /// settle.
    pub(super) fn wait_pending_frees(&self, st: &mut State<B>) -> Result<()> {
        st.heap.wait_pending(&*self.backend)?;
        self.reap_ghosts(st, true)
    }

    /// Notes `key` as the stream of the latest call; returns whether it
    /// was the stream of the call before too.
    pub(super) fn note_stream(&self, key: StreamKey) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        // Read first: the stream rarely changes between calls, and a read
        // leaves the line shared where a swap would take it exclusive at
        // every call.
        let now = (
            self.last_stream[0].load(Relaxed),
            self.last_stream[1].load(Relaxed),
        );
        if now == key {
            return true;
        }
        let was = (
            self.last_stream[0].swap(key.0, Relaxed),
            self.last_stream[1].swap(key.1, Relaxed),
        );
        was == key
    }

    /// Records, on `stream`, one fence for the frees owed there (see
    /// [`owed`](super::owed)). On failure they keep waiting for a later
    /// cover or a device synchronisation (logged).
    pub(super) fn cover<S: ArenaStream<B>>(&self, st: &mut State<B>, stream: &S) {
        match crate::order::record(stream.key(), || stream.fence(&*self.backend)) {
            Ok(c) => st.heap.cover(c),
            Err(e) => {
                tracing::warn!(error = %e, "vmmbuf arena: recording a deferred free fence failed; those frees wait for a later one")
            }
        }
    }

    /// Settles zone `z`'s frees whose fences (recorded or owed) have
    /// passed. Returns how many settled.
    pub(super) fn settle_zone(&self, st: &mut State<B>, z: usize) -> usize {
        let State { heap, region, .. } = st;
        heap.settle(z, &*self.backend, &region.walls())
    }

    /// Waits for the uses recorded on live allocations (views,
    /// `record_use`) and, for one retaken from graphs
    /// ([`Arena::retake`](crate::Arena::retake)), for the uses its block's
    /// earlier life left: before their chunks move.
    pub(super) fn wait_live_uses(&self, st: &mut State<B>) -> Result<()> {
        st.heap.wait_live_uses(&*self.backend)
    }

    /// The error for a request that could not be served, with the device's
    /// `(free, total)` bytes where they are known.
    pub(super) fn out_of_memory(
        &self,
        st: &State<B>,
        requested: usize,
        device: Option<(usize, usize)>,
    ) -> Error {
        // What the request needs mapped at least, against what could ever be.
        let need = round_up(requested, self.granularity).unwrap_or(usize::MAX);
        let zone = st
            .heap
            .zone_range(
                Heap::<B::Fence>::zone_of_size(requested),
                st.region.table.reserved(),
            )
            .len();
        let never_fits = need > zone
            || self.budget.is_some_and(|b| need > b)
            || st.region.budget().is_some_and(|b| need > b.limit())
            || device.is_some_and(|(_, total)| need > total);
        Error::ArenaOutOfMemory {
            requested_bytes: requested,
            free_bytes: device.map(|d| d.0),
            total_bytes: device.map(|d| d.1),
            reserved_bytes: st.region.table.mapped_bytes(),
            // The tighter of the arena's own budget and the shared one.
            budget_bytes: match (self.budget, st.region.budget().and_then(|b| b.limit_set())) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            },
            never_fits,
            during_capture: false,
        }
    }
}

/// `f`'s result, its nanoseconds added to `ns` (saturating).
pub(super) fn timed<T>(ns: &mut u64, f: impl FnOnce() -> T) -> T {
    let started = std::time::Instant::now();
    let r = f();
    let took = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
    *ns = ns.saturating_add(took);
    r
}
