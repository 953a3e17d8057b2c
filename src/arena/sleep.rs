//! The arena's sleep and wake, as its users call them: the arena waits for
//! its streams and frees and gives whole free chunks back, under its lock,
//! and hands the rest to [`crate::sleep`] through [`Held`], the arena as a
//! sleep's [`Host`](crate::sleep::Host). What a sleep keeps and how each mode works is there.

use std::time::Instant;

use super::host::Held;
use super::{Arena, ArenaStream, Shared, State};
use crate::backend::Backend;
use crate::error::Result;
use crate::location::Location;
use crate::migration::MigrationReport;
use crate::sleep::{Env, SleepDesc, SleepMode, SleepReport, WakeDesc};
#[cfg(doc)]
use crate::Error;

use super::stats::SplitCount;

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
        let env = sh.env();
        env.refuse_under_capture("a sleep")?;
        let piece = env.piece_of(desc)?;
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
        crate::sleep::trace_report(&r, false);
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
        let env = sh.env();
        env.refuse_under_capture("a wake")?;
        let mut guard = sh.state.lock();
        let st = &mut *guard;
        st.region.check_poison()?;
        let Some(mode) = st.sleep.mode() else {
            return Ok(SleepReport::default());
        };
        let mut r = SleepReport {
            mode,
            ..SleepReport::default()
        };
        let t = Instant::now();
        let waited = sh.quiesce(st, streams);
        r.wait_time = t.elapsed();
        waited?;
        if let Err(e) = env.wake(&mut Held { sh, st }, desc, &mut r) {
            sh.count(st);
            return Err(e);
        }
        sh.rebuild_split(st);
        sh.count(st);
        drop(guard);
        r.total_time = start.elapsed();
        crate::sleep::trace_report(&r, true);
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
        let env = sh.env();
        let piece = env.piece_of(desc)?;
        let sizes = {
            let mut st = sh.state.lock();
            st.region.check_poison()?;
            env.pieces_to_prepare(&Held { sh, st: &mut st }, desc.mode, piece)
        };
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
        let n = st.sleep.release(&self.shared.pool)?;
        self.shared.count(&mut st);
        Ok(n)
    }

    /// Sets the directory a [`SleepMode::Disk`] sleep writes its files to
    /// (None: none, and such a sleep is refused). It must exist; files of a
    /// sleep already made stay where they are until its wake.
    pub fn set_spill_dir(&self, dir: Option<std::path::PathBuf>) {
        self.shared.state.lock().sleep.set_spill_dir(dir);
    }

    /// The most bytes one file of a [`SleepMode::Disk`] sleep holds: a
    /// chunk larger than that is written to several files, each at most
    /// `bytes` long (torch_memory_saver's `TMS_DISK_BACKUP_CHUNK_MB`). 0,
    /// the default: a file per chunk. Sleeps made after the call follow it.
    pub fn set_spill_file_bytes(&self, bytes: usize) {
        self.shared.state.lock().sleep.set_spill_file_bytes(bytes);
    }

    /// How the arena sleeps now; `None` while awake.
    pub fn sleep_mode(&self) -> Option<SleepMode> {
        self.shared.state.lock().sleep.mode()
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
    /// Copies the bytes a stashing or pageable sleep kept for `[address,
    /// address + dst.len())` into `dst`, while the arena is asleep in
    /// [`SleepMode::Stash`] or [`SleepMode::Pageable`], or awake after a
    /// wake that kept the backup ([`WakeDesc::keep_backup`]):
    /// torch_memory_saver's `get_cpu_backup`. True; false, with `dst`
    /// untouched, when there is no such backup, or it does not hold every
    /// byte of the range (a range outside the arena, or outside what was
    /// mapped at the sleep). Synchronous; the backup stays as it is.
    pub fn read_backup(&self, address: u64, dst: &mut [u8]) -> Result<bool> {
        let Some((offset, _)) = self.offsets(address, dst.len()) else {
            return Ok(false);
        };
        let sh = &*self.shared;
        sh.state.lock().sleep.read_backup(&sh.backend, offset, dst)
    }

    /// The host address at which the copy a [`SleepMode::Pageable`] or
    /// [`SleepMode::Disk`] sleep kept of `[address, address + len)` lies,
    /// whole and readable by the CPU (while asleep, or after a wake that
    /// kept it), or `None`: torch_memory_saver's
    /// `get_cpu_backup(zero_copy=True)`. The address stays valid, and
    /// stays the same, until the copy goes: a wake that does not keep it,
    /// [`release_stash`](Self::release_stash), or the arena's drop; a later
    /// sleep reuses it where the runs are the same (its bytes then change).
    /// Reading through it after that is the caller's fault, as after any
    /// free. An empty range has none. A [`SleepMode::Stash`] copy (pinned
    /// host memory mapped in the stash's own reservation) is offered too:
    /// its pieces are mapped for the device, and the host's access is
    /// given to the ones the range covers first (the CPU faults reading
    /// them otherwise). The stash's pieces stay at their addresses between
    /// sleeps of the same runs, so the address then stays the same.
    pub fn backup_address(&self, address: u64, len: usize) -> Result<Option<u64>> {
        let Some((offset, end)) = self.offsets(address, len) else {
            return Ok(None);
        };
        if len == 0 {
            return Ok(None);
        }
        let sh = &*self.shared;
        sh.state
            .lock()
            .sleep
            .backup_address(&sh.backend, offset, end)
    }

    /// Whether a backup readable now (a sleep's, or one a wake kept) holds
    /// every byte of `[address, address + len)`: what
    /// [`read_backup`](Self::read_backup) would find, asked without a
    /// buffer (a caller sizes one only for a backup that exists).
    pub fn holds_backup(&self, address: u64, len: usize) -> bool {
        let Some((offset, end)) = self.offsets(address, len) else {
            return false;
        };
        self.shared.state.lock().sleep.holds_backup(offset, end)
    }

    /// `[address, address + len)` as offsets in the arena, if it starts in
    /// it.
    fn offsets(&self, address: u64, len: usize) -> Option<(usize, usize)> {
        let offset = usize::try_from(address.checked_sub(self.shared.base)?).ok()?;
        Some((offset, offset.checked_add(len)?))
    }
}

impl<B: Backend> Shared<B> {
    /// The arena's fixed parts, as a sleep uses them.
    fn env(&self) -> Env<'_, B> {
        Env {
            backend: &self.backend,
            pool: &self.pool,
            granularity: self.granularity,
            chunk_bytes: self.chunk_bytes,
            home: self.placement,
            budget: self.budget,
        }
    }

    /// A sleep in `mode`, under the arena's lock: the streams' work and the
    /// pending frees waited for, whole free chunks given back, then what
    /// `mode` does with the rest (see [`SleepMode`]); its figures in `r`.
    /// On an error the arena's counts are made true again.
    fn sleep_locked<S: ArenaStream<B>>(
        &self,
        st: &mut State<B>,
        streams: &[S],
        mode: SleepMode,
        piece: usize,
        r: &mut SleepReport,
    ) -> Result<()> {
        let device_before = st.region.table.mapped_bytes() - st.region.table.host_bytes();
        let t = Instant::now();
        let freed = self.quiesce(st, streams)?;
        r.free_bytes = freed.iter().map(|x| x.1).sum();
        r.wait_time = t.elapsed();
        let done = self.env().sleep(
            &mut Held {
                sh: self,
                st: &mut *st,
            },
            mode,
            piece,
            freed,
            r,
        );
        if done.is_ok() {
            r.device_bytes = device_before;
        }
        self.rebuild_split(st);
        self.count(st);
        done
    }

    /// Waits for `streams`' work, the uses recorded on live allocations and
    /// the pending frees; then gives whole free chunks to the pool and
    /// returns their ranges, `(offset, bytes)`.
    fn quiesce<S: ArenaStream<B>>(
        &self,
        st: &mut State<B>,
        streams: &[S],
    ) -> Result<Vec<(usize, usize)>> {
        let backend = &*self.backend;
        // Each stream's fence, numbered: it also covers the frees owed on
        // the stream so far (no device synchronisation for those).
        let fences = streams
            .iter()
            .map(|s| crate::order::record(s.key(), || s.fence(backend)))
            .collect::<Result<Vec<_>>>()?;
        for f in &fences {
            backend.wait(&f.fence)?;
        }
        for f in fences {
            st.heap.cover_passed(f);
        }
        self.wait_live_uses(st)?;
        self.wait_pending_frees(st)?;
        self.release_free_ranges(st)
    }

    /// The inactive split counted afresh (after a sleep or a wake).
    pub(super) fn rebuild_split(&self, st: &mut State<B>) {
        // What graphs hold free counts as allocated, as it does elsewhere.
        let held: Vec<(usize, usize)> = st.heap.graph_held().collect();
        st.split = SplitCount::rebuild(&st.region.table, st.heap.live_ranges().chain(held));
    }

    /// Maps the stash's missing pieces into it now, a batch under each
    /// hold of the arena's lock (see [`Env::stage_batch`]). Returns the
    /// pieces staged.
    fn stage_all(&self, piece: usize) -> Result<usize> {
        let mut staged = 0;
        loop {
            let mut st = self.state.lock();
            st.region.check_poison()?;
            let (n, more) = self.env().stage_batch(
                &mut Held {
                    sh: self,
                    st: &mut st,
                },
                piece,
            )?;
            staged += n;
            if !more {
                return Ok(staged);
            }
        }
    }
}
