//! Sleep and wake: an arena's memory goes back to the driver while its
//! allocations keep their addresses, either with the data (kept in pinned
//! host memory, reachable by kernels and the CPU while asleep) or without
//! (discarded: the contents are undefined after the wake). What RL
//! post-training runs between rollout and training, and what an inference
//! server's sleep mode needs.
//!
//! Every driver call costs per mapping (`cuMemSetAccess` ~20 us, `cuMemUnmap`
//! ~13 us for a 2 MiB chunk), so a sleep joins each run of the arena's small
//! chunks into pieces of up to [`SleepDesc::max_piece_bytes`], and the wake
//! maps device pieces of the same sizes: from the second sleep on, a GiB is
//! a few mappings, and the copy runs at the link's speed. Host pieces are
//! kept in the arena's [`ChunkPool`](crate::ChunkPool) after a wake, so a
//! steady-state sleep pins nothing: one copy pass each way.

use std::time::{Duration, Instant};

use super::{Arena, ArenaStream, Mark, Shared, State};
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::location::Location;
use crate::migration::{Group, MigrationReport, Mover};
use crate::order::FenceSet;
use crate::pool::ChunkSource;
use crate::region::NewChunk;
use crate::table::{ChunkTable, Entry};

use super::stats::SplitCount;

mod backup;
mod desc;
mod keep;
mod mode;
mod modes;
mod pages;
mod stash;
mod unmapped;

pub use desc::{SleepDesc, WakeDesc};
pub use mode::SleepMode;

/// What a sleep or a wake did, and where its time went.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SleepReport {
    /// The mode of the sleep (for a wake: of the sleep it ended).
    pub mode: SleepMode,
    /// Bytes put to sleep or woken (copied for [`SleepMode::Keep`] and
    /// [`SleepMode::Stash`], unmapped or mapped again for
    /// [`SleepMode::Discard`]).
    pub bytes: usize,
    /// Chunks those bytes were in before, and after (runs joined).
    pub chunks_before: usize,
    /// See `chunks_before`.
    pub chunks_after: usize,
    /// Bytes of device memory the arena unmapped (sleep: its free chunks
    /// too) or mapped (wake).
    pub device_bytes: usize,
    /// A wake with [`WakeDesc::restore_free`]: the bytes of free memory
    /// mapped again (counted in `device_bytes` too). A sleep: the bytes of
    /// whole free chunks it gave back.
    pub free_bytes: usize,
    /// The copy pipeline's phases (a kept sleep and its wake).
    pub migration: MigrationReport,
    /// Waiting for the streams, the recorded uses and the pending frees.
    pub wait_time: Duration,
    /// The whole call.
    pub total_time: Duration,
}

/// An arena asleep.
#[derive(Debug)]
pub(super) struct Asleep<F> {
    pub(super) mode: SleepMode,
    /// The piece size of the sleep, for the wake.
    piece: usize,
    /// Discard and stash: the runs given back, `(offset, bytes)` in address
    /// order. Nothing is mapped there until the wake, and nothing else may
    /// be.
    runs: Vec<(usize, usize)>,
    /// Discard and stash: fences of the allocations in those runs freed
    /// while asleep.
    frees: Vec<FenceSet<F>>,
    /// Discard and stash: blocks freed while asleep whose fence could not be
    /// recorded, `(offset, bytes)`: never handed out again.
    lost: Vec<(usize, usize)>,
    /// Pageable: each run's data, `(offset, buffer)` in address order (one
    /// per run, as long as the run), until the wake.
    paged: Vec<(usize, crate::backend::pages::PageableBuf)>,
    /// The whole free chunks the sleeps gave back, `(offset, bytes)`, for
    /// a wake that maps them again ([`WakeDesc::restore_free`]).
    freed: Vec<(usize, usize)>,
}

impl<F> Asleep<F> {
    fn new(mode: SleepMode, piece: usize) -> Self {
        Self {
            mode,
            piece,
            runs: Vec::new(),
            frees: Vec::new(),
            lost: Vec::new(),
            paged: Vec::new(),
            freed: Vec::new(),
        }
    }

    /// Bytes of the discarded runs.
    pub(super) fn discarded_bytes(&self) -> usize {
        self.runs.iter().map(|r| r.1).sum()
    }

    /// Bytes of the pageable copies.
    pub(super) fn pageable_bytes(&self) -> usize {
        pages_bytes(&self.paged)
    }

    /// Whether `offset` lies in a discarded run.
    pub(super) fn discarded(&self, offset: usize) -> bool {
        let i = self.runs.partition_point(|&(o, _)| o <= offset);
        i > 0 && {
            let (o, b) = self.runs[i - 1];
            offset < o + b
        }
    }

    /// The parts of `[offset, offset + size)` in no discarded run (a block
    /// over both, after a sleep cut short between its chunks), in order.
    pub(super) fn awake_parts(&self, offset: usize, size: usize) -> Vec<std::ops::Range<usize>> {
        self.exclude(std::iter::once(offset..offset + size).collect())
    }

    /// Keeps a free's fences of a block in a discarded run: the wake waits
    /// for them before the bytes are handed out again.
    pub(super) fn note_free(&mut self, offset: usize, size: usize, fences: Option<FenceSet<F>>) {
        match fences {
            Some(f) => self.frees.push(f),
            None => self.lost.push((offset, size)),
        }
    }

    /// `gaps` without the discarded runs.
    pub(super) fn exclude(&self, gaps: Vec<std::ops::Range<usize>>) -> Vec<std::ops::Range<usize>> {
        crate::ranges::subtract(gaps, self.runs.iter().copied())
    }
}

/// What the arena's sleep keeps, owned here: the rest of the arena asks
/// through its verbs (is it asleep, which free bytes are awake, what it
/// holds where).
pub(super) struct SleepState<B: Backend> {
    /// Set while the arena sleeps.
    asleep: Option<Asleep<Mark<B::Fence>>>,
    /// Where [`SleepMode::Stash`] keeps the data: host pieces mapped at the
    /// arena's own offsets in a reservation of their own, kept from one
    /// sleep to the next.
    stash: Option<crate::region::Region<B>>,
    /// A pageable sleep's copies kept past its wake
    /// ([`WakeDesc::keep_backup`]), `(offset, buffer)` in address order:
    /// readable until the next sleep, which writes into them again.
    kept_pages: Vec<(usize, crate::backend::pages::PageableBuf)>,
    /// Whether the last wake kept the host copy (the stash or
    /// `kept_pages`) readable ([`WakeDesc::keep_backup`]).
    backup_kept: bool,
}

impl<B: Backend> Default for SleepState<B> {
    fn default() -> Self {
        Self {
            asleep: None,
            stash: None,
            kept_pages: Vec::new(),
            backup_kept: false,
        }
    }
}

impl<B: Backend> SleepState<B> {
    /// Whether the arena sleeps.
    pub(super) fn is_asleep(&self) -> bool {
        self.asleep.is_some()
    }

    /// Refuses a sleep in `mode` while the arena sleeps in another (a sleep
    /// in the same mode takes what was woken or made since).
    pub(super) fn check_mode(&self, mode: SleepMode) -> Result<()> {
        match &self.asleep {
            Some(a) if a.mode != mode => Err(Error::invalid(format!(
                "the arena sleeps in {} mode: wake it before a {} sleep",
                a.mode, mode
            ))),
            _ => Ok(()),
        }
    }

    /// The unmapped `regions` where growth may map: a discarded range stays
    /// unmapped until the wake.
    pub(super) fn exclude(
        &self,
        regions: Vec<std::ops::Range<usize>>,
    ) -> Vec<std::ops::Range<usize>> {
        match &self.asleep {
            Some(a) => a.exclude(regions),
            None => regions,
        }
    }

    /// While asleep, the parts of a freed block `[offset, offset + size)`
    /// that are mapped (the rest was given back by the sleep); `None`
    /// awake.
    pub(super) fn awake_parts(
        &self,
        offset: usize,
        size: usize,
    ) -> Option<Vec<std::ops::Range<usize>>> {
        self.asleep.as_ref().map(|a| a.awake_parts(offset, size))
    }

    /// A free made while asleep, of a block whose memory the sleep gave
    /// back (in part): its fences, waited for before the wake.
    pub(super) fn note_free(
        &mut self,
        offset: usize,
        size: usize,
        fences: Option<FenceSet<Mark<B::Fence>>>,
    ) {
        if let Some(a) = self.asleep.as_mut() {
            a.note_free(offset, size, fences);
        }
    }

    /// `(discarded, stash, pageable)` bytes: given back while asleep, in
    /// the stash's pinned pieces, and in pageable copies.
    pub(super) fn held_bytes(&self) -> (usize, usize, usize) {
        let discarded = self.asleep.as_ref().map_or(0, |a| a.discarded_bytes());
        let stash = self.stash.as_ref().map_or(0, |x| x.table.mapped_bytes());
        let pageable =
            self.asleep.as_ref().map_or(0, |a| a.pageable_bytes()) + pages_bytes(&self.kept_pages);
        (discarded, stash, pageable)
    }

    /// The stash's pieces go to `give` (the arena's drop: their copies were
    /// waited for when they were made).
    pub(super) fn close(&mut self, give: impl FnMut(B::Chunk, usize, Location)) {
        if let Some(stash) = self.stash.as_mut() {
            stash.close(true, give);
        }
    }

    /// The stash's chunk count (tests).
    #[cfg(all(test, target_os = "linux"))]
    pub(super) fn stash_pieces(&self) -> usize {
        self.stash.as_ref().map_or(0, |x| x.table.chunk_count())
    }
}

/// Groups the table's chunks that `select` picks into pieces of at most
/// `max_piece` bytes (a bigger chunk is a group of its own): adjacent
/// chunks of one placement, access and CPU grant, never across `split_at`
/// (the arena's zone boundary), each bound for `to`.
fn plan_groups<C>(
    table: &ChunkTable<C>,
    select: impl Fn(usize, &Entry<C>) -> bool,
    to: Location,
    max_piece: usize,
    split_at: usize,
) -> Vec<Group> {
    let mut groups: Vec<Group> = Vec::new();
    let mut first: Option<&Entry<C>> = None;
    for (o, e) in table.iter() {
        if !select(o, e) {
            first = None;
            continue;
        }
        let joins = match (groups.last(), first) {
            (Some(g), Some(f)) => {
                g.offset + g.bytes == o
                    && !(g.offset < split_at && o >= split_at)
                    && g.bytes + e.bytes <= max_piece
                    && f.placement == e.placement
                    && f.cpu == e.cpu
                    && f.access[..] == e.access[..]
            }
            _ => false,
        };
        if joins {
            groups.last_mut().expect("checked").bytes += e.bytes;
        } else {
            groups.push(Group {
                offset: o,
                bytes: e.bytes,
                to,
            });
            first = Some(e);
        }
    }
    groups
}

/// The most bytes of a stash's pieces `prepare_sleep` maps under one
/// hold of the arena's lock (mapping and granting cost ~30 ms per GiB on an
/// H200).
/// (Unit tests take 1 MiB, so that their arenas stage in several holds.)
pub(super) const STAGE_BATCH_BYTES: usize = if cfg!(test) { 1 << 20 } else { 1 << 30 };

/// The arena's free bytes as merged ranges `(start, end)`, in address
/// order: a sleep gives the whole chunks they cover back before it moves
/// (once their frees have passed, adjacent free blocks have merged).
fn free_ranges<B: Backend>(st: &State<B>) -> Vec<(usize, usize)> {
    let mut blocks: Vec<(usize, usize)> = st
        .heap
        .free_blocks()
        .map(|(o, f)| (o, o + f.size))
        .collect();
    blocks.sort_unstable();
    let mut free: Vec<(usize, usize)> = Vec::new();
    for (a, b) in blocks {
        match free.last_mut() {
            Some(last) if last.1 == a => last.1 = b,
            _ => free.push((a, b)),
        }
    }
    free
}

/// Whether the merged `free` ranges cover `[o, o + n)`.
fn covers(free: &[(usize, usize)], o: usize, n: usize) -> bool {
    let i = free.partition_point(|&(a, _)| a <= o);
    i > 0 && free[i - 1].1 >= o + n
}

/// The pieces `(offset, bytes)` a stashing sleep would copy now: the runs
/// left mapped once whole free chunks are gone, cut at multiples of
/// `piece` across chunks, never across the zones' border (as
/// `sleep_stash` cuts them).
fn stash_parts<B: Backend>(st: &State<B>, piece: usize) -> Vec<(usize, usize)> {
    let free = free_ranges(st);
    let runs = st
        .region
        .table
        .runs_without(|o, e| covers(&free, o, e.bytes));
    runs.iter()
        .flat_map(|&(o, b)| pieces(o, b, piece, st.heap.zone_border()))
        .collect()
}

/// Whether the stash holds a piece of exactly `n` bytes at `o`.
fn stash_holds<B: Backend>(st: &State<B>, o: usize, n: usize) -> bool {
    st.sleep
        .stash
        .as_ref()
        .is_some_and(|x| x.table.get(o).is_some_and(|e| e.bytes == n))
}

/// The pieces of [`stash_parts`] the stash does not hold yet: what a
/// stashing sleep would still have to take and map.
fn stash_missing<B: Backend>(st: &State<B>, piece: usize) -> Vec<(usize, usize)> {
    stash_parts(st, piece)
        .into_iter()
        .filter(|&(o, n)| !stash_holds(st, o, n))
        .collect()
}

/// Splits the run `[offset, offset + bytes)` into pieces of at most
/// `max_piece` (multiples of `g`), never across `split_at`.
fn pieces(offset: usize, bytes: usize, max_piece: usize, split_at: usize) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let end = offset + bytes;
    let mut at = offset;
    while at < end {
        let limit = if at < split_at {
            end.min(split_at)
        } else {
            end
        };
        let n = (limit - at).min(max_piece);
        out.push((at, n));
        at += n;
    }
    out
}

/// Bytes of a pageable or disk sleep's copies, `(offset, buffer)`.
fn pages_bytes(pages: &[(usize, crate::backend::pages::PageableBuf)]) -> usize {
    pages.iter().map(|p| p.1.len()).sum()
}

/// How many chunks of `table` the groups cover.
fn count_in<C>(table: &ChunkTable<C>, groups: &[Group]) -> usize {
    groups
        .iter()
        .map(|g| table.overlapping(g.offset..g.offset + g.bytes).count())
        .sum()
}

impl<B: Backend, S: ArenaStream<B>> Arena<B, S> {
    /// Puts the arena to sleep: its memory goes back to the driver while
    /// every allocation keeps its address. With [`SleepMode::Keep`] the
    /// chunks move to pinned host memory with their data (runs of small
    /// chunks joined into pieces of up to [`SleepDesc::max_piece_bytes`]),
    /// and allocating still works, in host memory, until the
    /// [`wake`](Self::wake). With [`SleepMode::Stash`] each run is copied
    /// to the arena's stash (pinned host pieces mapped away from the
    /// allocations, kept from one sleep to the next) and unmapped; with
    /// [`SleepMode::Discard`] it is unmapped without a copy; with
    /// [`SleepMode::Pageable`] it is copied to pageable host memory of its
    /// own (given back to the system at the wake) and unmapped, with
    /// [`SleepMode::Disk`] likewise to files of the
    /// [spill directory](Self::set_spill_dir). In these,
    /// allocating still works, in fresh device memory outside the sleeping
    /// ranges, and touching an allocation in them faults until the wake.
    ///
    /// First it waits for the work queued so far on each of `streams` (pass
    /// every stream that may still use the arena's allocations), for the
    /// uses recorded on live allocations (views on any stream,
    /// [`Allocation::record_use`](crate::Allocation::record_use)) and for the
    /// frees the arena holds fences for; never for the whole device, but
    /// once where [deferred](crate::ArenaDesc::defer_free_fences) frees
    /// were made on a stream not in `streams` and no later call there
    /// covered them. Whole
    /// free chunks, and the device chunks the arena's pool holds, go back to
    /// the driver. Host pieces come from the pool first (a wake leaves them
    /// there): a steady-state sleep pins nothing.
    ///
    /// A kept sleep is all or nothing: on error nothing moved, unless
    /// undoing failed too, which poisons the arena
    /// ([`Error::Poisoned`](crate::Error::Poisoned)). A stashing or
    /// discarding sleep that fails part way keeps the ranges it unmapped so
    /// far asleep (stashed ones with their data); one that fails before
    /// leaves the arena as it was. Sleeping
    /// again in the same mode takes what was mapped since; in the other
    /// mode it is [`Error::InvalidArgument`]: wake first.
    pub fn sleep(&self, streams: &[S], desc: &SleepDesc) -> Result<SleepReport> {
        let start = Instant::now();
        let sh = &*self.shared;
        refuse_under_capture(sh, "a sleep")?;
        let piece = sh.piece_of(desc)?;
        if desc.mode == SleepMode::Keep {
            crate::migration::check_placement(&*sh.backend, sh.granularity, Location::Host)?;
        }
        // What the pool held for the sleep, for its debug line: a pause
        // whose pieces were prepared takes them all from the pool.
        let pool_before = sh.pool.stats();
        let mut r = SleepReport {
            mode: desc.mode,
            ..SleepReport::default()
        };
        {
            let mut guard = sh.state.lock();
            let st = &mut *guard;
            st.region.check_poison()?;
            st.sleep.check_mode(desc.mode)?;
            sh.sleep_locked(st, streams, desc.mode, piece, &mut r)?;
        }
        // The device memory left in the pool goes back to the driver; the
        // sleep stands if that fails (logged by the pool).
        let t = Instant::now();
        if sh.placement != Location::Host {
            let _ = sh.pool.trim_at(sh.placement);
        }
        r.migration.dispose_time += t.elapsed();
        r.total_time = start.elapsed();
        trace_report(&r, false);
        tracing::debug!(
            pooled_host_bytes_before = pool_before.pooled_host_bytes,
            pool_hits = sh.pool.stats().hits.saturating_sub(pool_before.hits),
            pieces = r.chunks_after,
            "vmmbuf: arena asleep, host pieces from the pool"
        );
        Ok(r)
    }

    /// Wakes the arena: after a kept sleep every chunk moves back to the
    /// arena's placement with its data (host pieces stay in the pool for
    /// the next sleep, up to its host bound); after a stashing sleep fresh
    /// memory is mapped at the same addresses and filled from the stash
    /// (which stays, up to the pool's host bound); after a pageable one
    /// likewise from its host copy, which then goes back to the system;
    /// after a discarding sleep
    /// fresh memory is mapped there, its contents undefined unless
    /// `desc.zero`. Waits as [`sleep`](Self::sleep) does. All or nothing: on
    /// error the arena stays asleep as it was (unless undoing failed,
    /// which poisons it). Waking an arena that is awake does nothing.
    pub fn wake(&self, streams: &[S], desc: &WakeDesc) -> Result<SleepReport> {
        let start = Instant::now();
        let sh = &*self.shared;
        refuse_under_capture(sh, "a wake")?;
        let mut guard = sh.state.lock();
        let st = &mut *guard;
        st.region.check_poison()?;
        let Some(asleep) = st.sleep.asleep.take() else {
            return Ok(SleepReport::default());
        };
        let mut r = SleepReport {
            mode: asleep.mode,
            ..SleepReport::default()
        };
        let t = Instant::now();
        let waited = sh.quiesce(st, streams);
        r.wait_time = t.elapsed();
        if let Err(e) = waited {
            st.sleep.asleep = Some(asleep);
            return Err(e);
        }
        let _span = tracing::debug_span!("vmmbuf.arena.wake", mode = %asleep.mode).entered();
        let res = match asleep.mode {
            SleepMode::Keep => sh.wake_keep(st, &asleep, &mut r),
            _ => sh.wake_discard(st, &asleep, desc.zero, &mut r).map(|()| {
                if asleep.mode != SleepMode::Discard {
                    r.migration.bytes_moved = r.bytes;
                }
            }),
        };
        if let Err(e) = res {
            st.sleep.asleep = Some(asleep);
            sh.count(st);
            return Err(e);
        }
        if desc.restore_free {
            r.free_bytes = sh.refill(st, &asleep.freed);
            if sh.placement != Location::Host {
                r.device_bytes += r.free_bytes;
            }
        }
        sh.keep_or_shed_backup(st, desc, asleep);
        sh.rebuild_split(st);
        sh.count(st);
        drop(guard);
        r.total_time = start.elapsed();
        trace_report(&r, true);
        Ok(r)
    }

    /// Creates, ahead of a [`sleep`](Self::sleep) with `desc`, the host
    /// pieces it would take, cut as that sleep cuts them, and keeps them:
    /// for a kept sleep in the arena's pool, for a stashing one mapped into
    /// the arena's stash (counted in `stash_bytes`; the sleep then maps
    /// nothing either). That sleep then pins nothing and runs at copy
    /// speed. Pinning host memory costs ~260-400 ms per GiB (H100), which
    /// this pays now, on the calling thread: call it on a thread of its own
    /// while the GPU works (the arena's lock is held to plan, and for a
    /// stash to map the pieces, ~30 ms per GiB on an H200). Pieces the pool
    /// or the stash holds already count; what changes in the arena before
    /// the sleep, the sleep fits. A discarding or pageable `desc` needs
    /// none. Returns the bytes created.
    ///
    /// A backup a wake kept ([`WakeDesc::keep_backup`]) is never touched:
    /// while it is readable the stash is not refitted (its pieces stay
    /// where [`read_backup`](Self::read_backup) and
    /// [`backup_address`](Self::backup_address) find them); the pinned
    /// pieces a refit would need are created into the pool instead, and
    /// the next stashing sleep maps them.
    pub fn prepare_sleep(&self, desc: &SleepDesc) -> Result<usize> {
        if desc.mode == SleepMode::Discard || desc.mode.pages() {
            return Ok(0);
        }
        let sh = &*self.shared;
        let piece = sh.piece_of(desc)?;
        let sizes = sh.pieces_to_prepare(desc.mode, piece)?;
        let made = sh.pool.stock(Location::Host, &sizes)?;
        let staged = match desc.mode {
            SleepMode::Stash => sh.stage_all(piece)?,
            _ => 0,
        };
        tracing::debug!(
            pieces = sizes.len(),
            bytes = sizes.iter().sum::<usize>(),
            created_bytes = made,
            staged,
            mode = %desc.mode,
            "vmmbuf: sleep prepared"
        );
        Ok(made)
    }

    /// Gives the pinned host memory of the arena's stash (kept from one
    /// [`SleepMode::Stash`] sleep to the next) to its pool, whose
    /// [`trim_at(Location::Host)`](crate::ChunkPool::trim_at) then gives it
    /// back to the driver, and a pageable copy a wake kept
    /// ([`WakeDesc::keep_backup`]) to the system. [`Error::InvalidArgument`]
    /// while the arena sleeps stashed (the stash holds its data). Returns
    /// the bytes.
    pub fn release_stash(&self) -> Result<usize> {
        let mut st = self.shared.state.lock();
        if st
            .sleep
            .asleep
            .as_ref()
            .is_some_and(|a| a.mode == SleepMode::Stash)
        {
            return Err(Error::invalid(
                "the arena sleeps stashed: its stash holds the data until the wake",
            ));
        }
        // A pageable copy kept past a wake goes back to the system too.
        let kept = pages_bytes(&std::mem::take(&mut st.sleep.kept_pages));
        st.sleep.backup_kept = false;
        let n = kept + self.shared.drop_stash(&mut st)?;
        self.shared.count(&mut st);
        Ok(n)
    }

    /// Sets the directory a [`SleepMode::Disk`] sleep writes its files to
    /// (None: none, and such a sleep is refused). It must exist; files of a
    /// sleep already made stay where they are until its wake.
    pub fn set_spill_dir(&self, dir: Option<std::path::PathBuf>) {
        *self.shared.spill_dir.lock() = dir;
    }

    /// The most bytes one file of a [`SleepMode::Disk`] sleep holds: a
    /// chunk larger than that is written to several files, each at most
    /// `bytes` long (torch_memory_saver's `TMS_DISK_BACKUP_CHUNK_MB`). 0,
    /// the default: a file per chunk. Sleeps made after the call follow it.
    pub fn set_spill_file_bytes(&self, bytes: usize) {
        self.shared
            .spill_file_bytes
            .store(bytes, std::sync::atomic::Ordering::Relaxed);
    }

    /// How the arena sleeps now; `None` while awake.
    pub fn sleep_mode(&self) -> Option<SleepMode> {
        self.shared
            .state
            .lock()
            .sleep
            .asleep
            .as_ref()
            .map(|a| a.mode)
    }

    /// [`sleep`](Self::sleep) keeping the data, with the default pieces:
    /// the copy pipeline's report.
    pub fn offload(&self, streams: &[S]) -> Result<MigrationReport> {
        self.sleep(streams, &SleepDesc::keep()).map(|r| r.migration)
    }

    /// [`wake`](Self::wake): the copy pipeline's report.
    pub fn restore(&self, streams: &[S]) -> Result<MigrationReport> {
        self.wake(streams, &WakeDesc::default())
            .map(|r| r.migration)
    }

    /// Whether the arena sleeps with its data in host memory at its
    /// addresses ([`offload`](Self::offload)).
    pub fn is_offloaded(&self) -> bool {
        self.sleep_mode() == Some(SleepMode::Keep)
    }
}

/// A sleep and a wake wait for the streams' work and copy synchronously:
/// refused, before anything changes, while a CUDA graph capture may be
/// under way (CUDA would refuse those calls and invalidate the capture).
fn refuse_under_capture<B: Backend>(sh: &Shared<B>, what: &'static str) -> Result<()> {
    if sh.backend.capture_underway() {
        return Err(Error::CaptureUnderway { what });
    }
    Ok(())
}

/// A sleep's or a wake's report at debug level (`VMMBUF_LOG=debug`), with
/// where its time went: a pause that pins host memory anew shows it in
/// `acquire_us`, one that waits for the GPU in `wait_us`.
fn trace_report(r: &SleepReport, awake: bool) {
    let us = |d: std::time::Duration| d.as_micros() as u64;
    let m = &r.migration;
    let (total, wait, acquire) = (us(r.total_time), us(r.wait_time), us(m.acquire_time));
    let (stage, copy, swap, dispose) = (
        us(m.stage_time),
        us(m.copy_time),
        us(m.swap_time),
        us(m.dispose_time),
    );
    let (mode, bytes, free) = (r.mode, r.bytes, r.free_bytes);
    let (chunks, pieces) = (r.chunks_before, r.chunks_after);
    if awake {
        tracing::debug!(%mode, bytes, free_bytes = free, total_us = total, acquire_us = acquire,
            stage_us = stage, copy_us = copy, swap_us = swap, "vmmbuf: arena awake");
    } else {
        tracing::debug!(%mode, bytes, chunks, pieces, total_us = total, wait_us = wait,
            acquire_us = acquire, stage_us = stage, copy_us = copy, swap_us = swap,
            dispose_us = dispose, "vmmbuf: arena asleep");
    }
}
