//! How the arena finds memory: free blocks first (settling passed frees,
//! then joining the stream's pending blocks with settled ones), then chunks
//! mapped at the
//! lowest hole that fits (pooled ones first); and how whole free chunks go
//! back to the pool. Every function runs under the arena's lock.

use super::blocks::{Free, StreamKey};
use super::heap::Heap;
use super::{ArenaStream, Shared, State};
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::location::Location;
use crate::plan::round_up;
use crate::pool::ChunkSource;
use crate::region::NewChunk;
use crate::table::{cpu_at_once, driver_access_for};

/// See `map_at`: how far past its peak allocated an arena with a map hook
/// maps before it gives whole free chunks back to map a new one.
const HOOKED_SLACK: f64 = 1.10;

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
            st.heap.owed.want_all_but(key);
        }
        self.settle_zone(st, z);
        if let Some(o) = self.take(st, z, size, key) {
            return Ok(o);
        }
        let coalesced = {
            let State { heap, region, .. } = &mut *st;
            heap.zones[z].coalesce_in(key, &region.walls())
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
        let past_pending = st.heap.zones[z]
            .iter()
            .any(|(_, f)| f.size >= size && !f.usable_by(key));
        let before = st.region.table.mapped_bytes();
        let got = if st.region.has_hook() {
            // With a map hook, a request that needs new memory gets a
            // mapping of its own, so that it lies in one reported range
            // (one NCCL registration) instead of straddling the free tail
            // before it and the new chunks.
            self.map_whole(st, z, size, key)
        } else {
            self.map_for(st, z, size, key).and_then(|()| {
                st.heap.zones[z]
                    .take(size, key)
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
    /// free block of another stream that fits `size`, then settles the
    /// zone and takes a block. Of several, the one whose newest fence has
    /// the lowest number: on one stream, the one that passes first; numbers
    /// of different streams are not comparable, so across streams this is
    /// only a tie-break. A block with a deferred free is a candidate once
    /// a cover stands for that free (the wait is on the cover's event);
    /// before, it is left alone: only a device-wide synchronisation could
    /// wait for it. `None` if there is no such block, or the wait
    /// failed (logged: the caller grows instead).
    fn wait_for_pending(
        &self,
        st: &mut State<B>,
        z: usize,
        size: usize,
        key: StreamKey,
    ) -> Option<usize> {
        use super::owed::Mark;
        let backend = &*self.backend;
        let Heap { zones, owed, .. } = &mut st.heap;
        let (_, f) = zones[z]
            .iter()
            .filter(|(_, f)| {
                f.size >= size
                    && !f.usable_by(key)
                    && f.fences.iter().all(|x| match x.fence {
                        Mark::Fence(_) => true,
                        Mark::Owed => owed.covered(x.key, x.seq),
                    })
            })
            .min_by_key(|(_, f)| f.fences.iter().map(|x| x.seq).max())?;
        if let Err(e) = owed.wait_set(backend, &f.fences) {
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
            heap.zones[z].insert_fresh_in(at + size, need - size, key, &region.walls());
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
            return st.heap.zones[z].take(size, key);
        }
        let State { heap, region, .. } = st;
        let table = &region.table;
        heap.zones[z].take_sparing(size, key, |end| {
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
            heap.zones[z].insert_fresh_in(at + moved, need - moved, key, &region.walls());
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
        let g = self.granularity;
        let reserved = st.region.table.reserved();
        let zone = if z == 0 {
            0..st.heap.small_end
        } else {
            st.heap.small_end..reserved
        };
        self.reap_ghosts(st, false)?;
        let mut regions = st.region.without_ghosts(st.region.table.gaps(zone));
        // Discarded ranges stay unmapped until the wake.
        if let Some(a) = &st.asleep {
            regions = a.exclude(regions);
        }
        let mut fits = regions.into_iter().filter_map(|h| {
            let before = st.heap.zones[z]
                .ending_at(h.start)
                .filter(|(_, f)| !whole && (f.settled() || f.stream == Some(key)))
                .map_or(0, |(_, f)| f.size);
            let need = round_up(size.saturating_sub(before), g)?;
            (need <= h.end - h.start).then_some((h.start, need, before))
        });
        // Moving, the hole whose free block before it leaves the least to
        // map (each chunk moved costs a mapping now and an unmapping
        // later: host replays of four traces at a lag of 100 events moved
        // 4-16% fewer chunks than with the first hole that fits, at the
        // same peak within 0.001x); otherwise the first.
        let found = if self.move_free_chunks {
            fits.min_by_key(|&(at, need, _)| (need, at))
        } else {
            fits.next()
        };
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
        let (at_fresh, need_fresh) = (at + moved, need - moved);
        self.check_room(st, size, need_fresh)?;
        // The budget shared with other arenas and buffers: taken before any
        // chunk is created, given back if the mapping fails.
        let Some(hold) = st.region.hold(need_fresh) else {
            return Err(self.out_of_memory(st, size, None));
        };
        // Chunks of at most `chunk_bytes`, pooled ones first, placed where
        // the arena is now (the host, while asleep keeping the data).
        // With a hook (`whole`), one chunk for the whole request: the hook
        // registers chunk by chunk, and a block never straddles two
        // (`Region::walls`), so one larger than a chunk needs one of its own.
        let sizes: Vec<usize> = if whole {
            vec![need_fresh]
        } else {
            (0..need_fresh.div_ceil(self.chunk_bytes))
                .map(|i| (need_fresh - i * self.chunk_bytes).min(self.chunk_bytes))
                .collect()
        };
        self.map_fresh(st, at_fresh, &sizes)?;
        hold.keep();
        Ok((at, need, moved))
    }

    /// How many of `need` bytes to map for a request of `size` should be
    /// moved free memory: all of them, or with
    /// [`ArenaDesc::release_over_percent`](super::ArenaDesc::release_over_percent)
    /// only what mapping them would take past that share of the peak
    /// allocated (each move costs a mapping now and an unmapping later).
    fn move_at_most(&self, st: &State<B>, size: usize, need: usize) -> usize {
        let Some(p) = self.release_over_percent else {
            return need;
        };
        let over = self.past_share(st, size, need, f64::from(p) / 100.0);
        round_up(over, self.granularity).map_or(need, |o| o.min(need))
    }

    /// The bytes by which mapping `want` more for a request of `size` would
    /// take the arena past `share` times its peak allocated (the request
    /// counted): 0 if it stays within.
    fn past_share(&self, st: &State<B>, size: usize, want: usize, share: f64) -> usize {
        let live = st
            .heap
            .allocated
            .saturating_add(size)
            .max(st.stats.allocated_bytes.peak);
        st.region
            .table
            .mapped_bytes()
            .saturating_add(want)
            .saturating_sub((share * live as f64) as usize)
    }

    /// Moves whole free chunks that `key` may take now (settled, or freed
    /// on `key` alone) to `[at, at + need)`, from its start, as far as they
    /// fit (none inside `keep`, the free block the request extends), and
    /// puts them in zone `z`'s index there: a settled chunk's old
    /// address is unmapped at once, a pending one's stays mapped (a ghost)
    /// until a fence recorded on `key` after now has passed, and the moved
    /// memory is `key`'s alone until then (a mark owed on `key`, which
    /// `key`'s next call covers). Returns the bytes moved. On an error the
    /// chunk being moved stays where it was, free, and what moved before
    /// stays moved.
    fn move_free_for(
        &self,
        st: &mut State<B>,
        z: usize,
        keep: std::ops::Range<usize>,
        at: usize,
        need: usize,
        key: StreamKey,
    ) -> Result<usize> {
        if need == 0 || st.asleep.is_some() || st.region.has_hook() {
            return Ok(0);
        }
        let placement = st.placement;
        // Pending memory moved after the free block the request extends
        // joins it only as `key`'s pending block too: that block is marked
        // as the moved memory is, which it must allow.
        let pending_ok = keep.is_empty()
            || st.heap.zones[st.heap.zone_of_offset(keep.start)].covers_for(
                keep.start,
                keep.len(),
                key,
            );
        // The chunks inside free blocks `key` may take, by offset.
        let mut donors: Vec<(usize, usize)> = Vec::new();
        for zz in 0..st.heap.zones.len() {
            for (o, f) in st.heap.zones[zz].iter() {
                if !(f.settled() || (pending_ok && f.stream == Some(key) && f.fences.only_on(key)))
                {
                    continue;
                }
                donors.extend(
                    st.region
                        .table
                        .overlapping(o..o + f.size)
                        .filter(|(co, e)| {
                            *co >= o
                                && co + e.bytes <= o + f.size
                                && e.placement == placement
                                && (co + e.bytes <= keep.start || *co >= keep.end)
                        })
                        .map(|(co, e)| (co, e.bytes)),
                );
            }
        }
        if donors.is_empty() {
            return Ok(0);
        }
        // One number for the whole move: every use of a pending donor was
        // queued on `key` before it.
        let seq = crate::order::stamp(key);
        let marks = || {
            let mut set = crate::order::FenceSet::default();
            set.add(super::owed::owed_at(key, seq));
            set
        };
        // Free memory that is `key`'s alone until that number has passed.
        let pending = |size| Free {
            size,
            stream: Some(key),
            fences: marks(),
        };
        // The donors taken, in order: (offset, bytes, zone, settled).
        let mut plan: Vec<(usize, usize, usize, bool)> = Vec::new();
        let mut planned = 0;
        for (o, b) in donors {
            if planned + b > need {
                continue;
            }
            let zz = st.heap.zone_of_offset(o);
            if st.heap.zone_of_offset(o + b - 1) != zz {
                continue;
            }
            let Some(settled) = st.heap.zones[zz].carve_for(o, b, key, marks) else {
                continue;
            };
            plan.push((o, b, zz, settled));
            planned += b;
            if planned == need {
                break;
            }
        }
        // One batch: adjacent destinations share their access call, and
        // adjacent settled donors their unmap.
        let mut to = at;
        let moves: Vec<_> = plan
            .iter()
            .map(|&(o, b, _, settled)| {
                let m = (o, to, (!settled).then_some((key, seq)));
                to += b;
                m
            })
            .collect();
        let (n, err) = timed(&mut st.stats.move_ns, || st.region.move_chunks(&moves));
        let State {
            heap,
            region,
            stats,
            ..
        } = &mut *st;
        // Those not moved: back where they were, free as they were (or later).
        let mut owed = false;
        for &(o, b, zz, settled) in &plan[n..] {
            if settled {
                heap.zones[zz].insert_fresh_in(o, b, key, &region.walls());
            } else {
                heap.insert_free(o, pending(b), &region.walls());
                owed = true;
            }
        }
        // Nothing may still use a settled donor's old address.
        let gone: Vec<usize> = plan[..n].iter().filter(|p| p.3).map(|p| p.0).collect();
        if timed(&mut stats.move_ns, || region.unmap_ghosts(&gone)).is_err() {
            // Left as ghosts with no mark: the next reap tries again.
            tracing::warn!(
                "vmmbuf arena: unmapping moved chunks' old addresses failed; tried again later"
            );
        }
        let mut moved = 0;
        for (&(_, b, _, settled), &(_, to, _)) in plan[..n].iter().zip(&moves) {
            if settled {
                heap.zones[z].insert_fresh_in(to, b, key, &region.walls());
            } else {
                heap.insert_free(to, pending(b), &region.walls());
                owed = true;
            }
            stats.num_chunks_moved += 1;
            moved += b;
        }
        if n > 0 {
            stats.num_moving_growths += 1;
        }
        if owed {
            st.heap.owed.owe_wanted(key);
            if !keep.is_empty() {
                // The block the request extends, `key`'s pending block now,
                // so that it joins the moved memory.
                let zk = st.heap.zone_of_offset(keep.start);
                if st.heap.zones[zk]
                    .carve_for(keep.start, keep.len(), key, marks)
                    .is_some()
                {
                    let State { heap, region, .. } = &mut *st;
                    heap.insert_free(keep.start, pending(keep.len()), &region.walls());
                }
            }
        }
        match err {
            Some(e) => Err(e),
            None => Ok(moved),
        }
    }

    /// Unmaps the old addresses of moved chunks
    /// ([`move_free_for`](Self::move_free_for)) whose mark has passed; with
    /// `wait`, of all of them, waiting for their marks (a device
    /// synchronisation where a mark has no fence yet).
    pub(super) fn reap_ghosts(&self, st: &mut State<B>, wait: bool) -> Result<()> {
        if st.region.ghosts().next().is_none() {
            return Ok(());
        }
        let backend = &*self.backend;
        let ghosts: Vec<_> = st.region.ghost_marks().collect();
        let mut not_yet = crate::order::NotYet::default();
        let mut passed = Vec::with_capacity(ghosts.len());
        for (o, mark) in ghosts {
            if let Some((key, seq)) = mark {
                if !st.heap.owed.done_in(backend, key, seq, &mut not_yet) {
                    if !wait {
                        continue;
                    }
                    st.heap.owed.wait(backend, key, seq)?;
                }
            }
            passed.push(o);
        }
        // One unmap for each run of adjacent ones.
        timed(&mut st.stats.move_ns, || st.region.unmap_ghosts(&passed))
    }

    /// Whole free chunks go to the pool before a mapping, which takes from
    /// it, so that memory taken follows memory allocated: always with
    /// `release_before_map`; with a hook (`whole`), where mapping `size`
    /// would take memory past `HOOKED_SLACK` times the peak allocated (a
    /// chunk's free bytes then serve only requests that fit in that chunk).
    fn release_before_mapping(&self, st: &mut State<B>, size: usize, whole: bool) -> Result<()> {
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
        let cpu = cpu_at_once(self.backend.home(), placement);
        let recorded: std::sync::Arc<[crate::location::AccessDesc]> = st.access.as_slice().into();
        let new: Vec<NewChunk<B::Chunk>> = chunks
            .into_iter()
            .zip(sizes)
            .map(|(chunk, &bytes)| NewChunk {
                chunk,
                bytes,
                placement,
            })
            .collect();
        st.region
            .map_batch(
                at,
                new,
                |p| driver_access_for(&st.access, p, cpu),
                |_| recorded.clone(),
                |_| cpu,
            )
            .map_err(|(e, back)| {
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
        let backend = &*self.backend;
        let Heap {
            zones,
            graphs,
            owed,
            ..
        } = &mut st.heap;
        for (_, f) in zones.iter().flat_map(|z| z.iter()) {
            owed.wait_set(backend, &f.fences)?;
        }
        for (_, h) in graphs.blocks() {
            owed.wait_set(backend, &h.fences)?;
        }
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
            Ok(c) => st.heap.owed.cover(c),
            Err(e) => {
                tracing::warn!(error = %e, "vmmbuf arena: recording a deferred free fence failed; those frees wait for a later one")
            }
        }
    }

    /// Settles zone `z`'s frees whose fences (recorded or owed) have
    /// passed. Returns how many settled.
    pub(super) fn settle_zone(&self, st: &mut State<B>, z: usize) -> usize {
        let backend = &*self.backend;
        let State { heap, region, .. } = st;
        let Heap { zones, owed, .. } = heap;
        let mut not_yet = crate::order::NotYet::default();
        zones[z].settle_in(
            |x| owed.stamp_done(backend, x, &mut not_yet),
            &region.walls(),
        )
    }

    /// Waits for the uses recorded on live allocations (views,
    /// `record_use`) and, for one retaken from graphs
    /// ([`Arena::retake`](crate::Arena::retake)), for the uses its block's
    /// earlier life left: before their chunks move.
    pub(super) fn wait_live_uses(&self, st: &mut State<B>) -> Result<()> {
        let backend = &*self.backend;
        let Heap { live, owed, .. } = &mut st.heap;
        for l in live.values() {
            l.uses.each(|fence| backend.wait(fence))?;
            if let Some(r) = &l.retaken {
                owed.wait_set(backend, &r.fences)?;
            }
        }
        Ok(())
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
        for z in 0..st.heap.zones.len() {
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
        whole.retain(|&(o, b)| {
            st.heap
                .zone_pieces(o, b)
                .all(|(z, at, n)| st.heap.zones[z].covers(at, n, true))
        });
        let mut released = Vec::with_capacity(whole.len());
        for (o, b) in whole {
            // Settled: the uses of these bytes have passed, no wait needed.
            for (_, e) in st.region.unmap(o, b)? {
                let _ = self.pool.give(e.placement, e.bytes, e.chunk);
            }
            // A range a hook was told of at once may cross the zones' border.
            for (z, at, n) in st.heap.zone_pieces(o, b).collect::<Vec<_>>() {
                st.heap.zones[z].carve(at, n);
            }
            released.push((o, b));
            st.stats.num_device_free += 1;
        }
        Ok(released)
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
        let zone = if Heap::<B::Fence>::zone_of_size(requested) == 0 {
            st.heap.small_end
        } else {
            st.region.table.reserved() - st.heap.small_end
        };
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

    /// Updates the counters that keep a peak, at every operation (constant
    /// time), so allocated <= active <= reserved holds for current values
    /// and peaks alike. What has no peak is counted when read
    /// ([`refresh`](Self::refresh)): an allocator call under a training
    /// step's cold caches then touches fewer lines.
    pub(super) fn count(&self, st: &mut State<B>) {
        let (allocated, requested) = (st.heap.allocated, st.heap.requested);
        let mapped = st.region.table.mapped_bytes();
        let pending: usize = st.heap.zones.iter().map(|z| z.pending_bytes()).sum();
        let split = st.split.inactive_split();
        let s = &mut st.stats;
        s.allocated_bytes.set(allocated);
        s.requested_bytes.set(requested);
        s.reserved_bytes.set(mapped);
        // Blocks graphs hold free are not active: a private pool's free
        // blocks are not in PyTorch's count either.
        s.active_bytes.set(allocated + pending);
        s.inactive_split_bytes.set(split);
    }

    /// The counters without a peak: current values only, set when read.
    fn count_current(&self, st: &mut State<B>) {
        let mapped = st.region.table.mapped_bytes();
        let split = st.split.inactive_split();
        let s = &mut st.stats;
        s.graph_bytes = st.heap.graphs.held_bytes();
        s.discarded_bytes = st.asleep.as_ref().map_or(0, |a| a.discarded_bytes());
        s.stash_bytes = st.stash.as_ref().map_or(0, |x| x.table.mapped_bytes());
        s.pageable_bytes = st.asleep.as_ref().map_or(0, |a| a.pageable_bytes())
            + super::sleep::pages_bytes(&st.kept_pages);
        s.fragmentation = if mapped == 0 {
            0.0
        } else {
            split as f64 / mapped as f64
        };
    }

    /// Settles the frees whose fences have passed, then counts; and reads
    /// what only a read needs (pool, placement, device syncs).
    pub(super) fn refresh(&self, st: &mut State<B>) {
        for z in 0..st.heap.zones.len() {
            if st.heap.zones[z].any_pending() {
                self.settle_zone(st, z);
            }
        }
        self.count(st);
        self.count_current(st);
        let mapped = st.region.table.mapped_bytes();
        let s = &mut st.stats;
        s.num_device_syncs = self.backend.live().device_syncs - self.syncs_at_start;
        s.pooled_bytes = self.pool.stats().pooled_bytes;
        let host = st.region.table.host_bytes();
        st.stats.host_bytes = host;
        st.stats.device_bytes = mapped - host;
    }
}

impl<B: Backend> Drop for Shared<B> {
    fn drop(&mut self) {
        // Every allocation holds the arena: nothing is allocated now, and
        // every free block's fences are waited for before unmapping.
        let st = self.state.get_mut();
        let backend = &*self.backend;
        let mut waited = true;
        let Heap { zones, owed, .. } = &mut st.heap;
        for (_, f) in zones.iter().flat_map(|z| z.iter()) {
            if let Err(e) = owed.wait_set(backend, &f.fences) {
                tracing::error!(error = %e, "vmmbuf arena: waiting for a free's fence in drop failed; nothing is unmapped");
                waited = false;
            }
        }
        // The old addresses of moved chunks (the region unmaps them).
        for (key, seq) in st.region.ghost_marks().filter_map(|(_, m)| m) {
            if let Err(e) = owed.wait(backend, key, seq) {
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
        if let Some(stash) = st.stash.as_mut() {
            stash.close(true, |chunk, bytes, placement| {
                let _ = pool.give(placement, bytes, chunk);
            });
        }
    }
}

/// `f`'s result, its nanoseconds added to `ns` (saturating).
fn timed<T>(ns: &mut u64, f: impl FnOnce() -> T) -> T {
    let started = std::time::Instant::now();
    let r = f();
    let took = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
    *ns = ns.saturating_add(took);
    r
}
