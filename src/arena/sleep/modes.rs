//! The arena's side of each sleep mode: quiescing, keeping the data in
//! host memory, stashing it, discarding it, and waking discarded memory.
//! Split from `sleep.rs` (the modes' types and the public calls).

use std::time::Instant;

use super::*;
use crate::pool::BudgetHold;

impl<B: Backend> Shared<B> {
    /// A sleep in `mode`, under the arena's lock: the streams' work and the
    /// pending frees waited for, whole free chunks given back, then what
    /// `mode` does with the rest (see [`SleepMode`]); its figures in `r`.
    /// On an error the arena's counts are made true again.
    pub(super) fn sleep_locked<S: ArenaStream<B>>(
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
        // A backup kept past the last wake is not readable once a sleep has
        // begun: the sleep copies into it afresh (a pageable one reuses its
        // buffers).
        st.sleep.backup_kept = false;
        r.wait_time = t.elapsed();
        let _span = tracing::debug_span!("vmmbuf.arena.sleep", mode = %mode).entered();
        let done = match mode {
            SleepMode::Keep => self.sleep_keep(st, piece, r).map(|()| {
                st.sleep
                    .asleep
                    .get_or_insert_with(|| Asleep::new(SleepMode::Keep, piece));
            }),
            _ => self.sleep_unmapping(st, mode, piece, r),
        };
        if done.is_ok() {
            r.device_bytes = device_before;
            if let Some(a) = st.sleep.asleep.as_mut() {
                a.freed.extend(freed);
            }
        }
        self.rebuild_split(st);
        self.count(st);
        done
    }

    /// Waits for `streams`' work, the uses recorded on live allocations and
    /// the pending frees; then gives whole free chunks to the pool and
    /// returns their ranges, `(offset, bytes)`.
    pub(super) fn quiesce<S: ArenaStream<B>>(
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

    /// The piece size `desc` asks for: rounded to the granularity, never
    /// under the arena's chunk.
    pub(super) fn piece_of(&self, desc: &SleepDesc) -> Result<usize> {
        Ok(
            crate::plan::round_up(desc.max_piece_bytes.max(1), self.granularity)
                .ok_or_else(|| Error::invalid("max_piece_bytes overflows"))?
                .max(self.chunk_bytes),
        )
    }

    pub(super) fn mover(&self) -> Mover<'_, B> {
        Mover {
            backend: &*self.backend,
            granularity: self.granularity,
            source: &*self.pool,
            shareable: false,
            release_old: false,
            release_joined: true,
        }
    }

    pub(super) fn rebuild_split(&self, st: &mut State<B>) {
        // What graphs hold free counts as allocated, as it does elsewhere.
        let held: Vec<(usize, usize)> = st.heap.graph_held().collect();
        st.split = SplitCount::rebuild(&st.region.table, st.heap.live_ranges().chain(held));
    }

    /// A kept sleep: device chunks to host pieces, with the data.
    pub(super) fn sleep_keep(
        &self,
        st: &mut State<B>,
        piece: usize,
        r: &mut SleepReport,
    ) -> Result<()> {
        let groups = plan_groups(
            &st.region.table,
            |_, e| e.placement != Location::Host,
            Location::Host,
            piece,
            st.heap.zone_border(),
        );
        r.chunks_before = count_in(&st.region.table, &groups);
        r.migration = self.mover().run_groups(&mut st.region, &groups)?;
        r.chunks_after = groups.len();
        r.bytes = r.migration.bytes_moved;
        st.placement = Location::Host;
        Ok(())
    }

    /// A sleep that unmaps (stash, pageable, disk or discard): the runs
    /// mapped now join those already asleep in `mode`. On an error the runs
    /// unmapped so far sleep (none: the arena stays awake, as it was).
    pub(super) fn sleep_unmapping(
        &self,
        st: &mut State<B>,
        mode: SleepMode,
        piece: usize,
        r: &mut SleepReport,
    ) -> Result<()> {
        let mut asleep = st
            .sleep
            .asleep
            .take()
            .unwrap_or_else(|| Asleep::new(mode, piece));
        r.chunks_before = st.region.table.chunk_count();
        let had = asleep.runs.len();
        let t = Instant::now();
        let res = match mode {
            SleepMode::Stash => self.sleep_stash(st, &mut asleep, r),
            SleepMode::Pageable | SleepMode::Disk => self.sleep_pageable(st, &mut asleep, r),
            _ => self.sleep_discard(st, &mut asleep),
        };
        if mode == SleepMode::Discard {
            r.migration.swap_time = t.elapsed();
        }
        r.bytes = asleep.runs.iter().map(|x| x.1).sum();
        if res.is_ok() || !asleep.runs.is_empty() || had > 0 {
            st.sleep.asleep = Some(asleep);
        }
        res.map(|_| ())
    }

    /// A stashing sleep: every mapped run copied to the stash (host pieces
    /// mapped at the same offsets of a reservation of their own, kept
    /// from one sleep to the next), then unmapped as a discarding sleep
    /// unmaps. On an error before the unmapping nothing changed but the
    /// stash; part way through it, the runs unmapped so far sleep (their
    /// data is in the stash).
    pub(super) fn sleep_stash(
        &self,
        st: &mut State<B>,
        asleep: &mut Asleep<Mark<B::Fence>>,
        r: &mut SleepReport,
    ) -> Result<usize> {
        let backend = &*self.backend;
        let runs = st.region.table.runs();
        let parts: Vec<(usize, usize)> = runs
            .iter()
            .flat_map(|&(o, b)| pieces(o, b, asleep.piece, st.heap.zone_border()))
            .collect();
        self.stage_stash(st, &parts, r)?;
        let stash = st.sleep.stash.as_mut().expect("staged above");
        // One copy per piece (all device memory on one side, all host
        // memory on the other), each followed by a fence.
        let t = Instant::now();
        let mut fences = Vec::with_capacity(parts.len());
        let issued = (|| {
            for &(o, b) in &parts {
                backend.copy(stash.res(), o, st.region.res_ref(), o, b)?;
                fences.push(backend.copies_fence()?);
            }
            Ok(())
        })();
        r.migration.copy_time += t.elapsed();
        if let Err(e) = issued {
            let _ = backend.wait_copies();
            return Err(e);
        }
        let moved = self.unmap_as_copied(st, asleep, r, &parts, &fences);
        if moved.is_err() {
            // No copy still writes into the stash the next sleep refits.
            let _ = backend.wait_copies();
        }
        moved
    }

    /// A stashing sleep's second half, while its copies run: as each
    /// piece's fence passes, the chunks copied whole by then are unmapped
    /// (their runs join the sleep) and their device memory goes back to
    /// the driver, so that unmapping and releasing overlap the copies
    /// still running (after all of them, on an H200 they took 4.5 ms of a
    /// 23 ms pause of 0.95 GiB). On an error the chunks unmapped so far
    /// sleep (the stash holds their data) and the others stay awake.
    fn unmap_as_copied(
        &self,
        st: &mut State<B>,
        asleep: &mut Asleep<Mark<B::Fence>>,
        r: &mut SleepReport,
        parts: &[(usize, usize)],
        fences: &[B::Fence],
    ) -> Result<usize> {
        let chunks: Vec<(usize, usize)> =
            st.region.table.iter().map(|(o, e)| (o, e.bytes)).collect();
        r.migration.bytes_moved = parts.iter().map(|x| x.1).sum();
        r.migration.chunks_moved = parts.len();
        r.chunks_after = parts.len();
        let mut unmapped = 0;
        let mut next = 0;
        // The entry of `asleep.runs` this sleep extended last.
        let mut last: Option<usize> = None;
        for (&(o, b), fence) in parts.iter().zip(fences) {
            let t = Instant::now();
            self.backend.wait(fence)?;
            r.migration.copy_time += t.elapsed();
            let t = Instant::now();
            // Parts tile the runs in address order, and chunks lie within
            // runs: a chunk ending by this part's end is copied whole.
            while let Some(&(co, cb)) = chunks.get(next).filter(|c| c.0 + c.1 <= o + b) {
                // The uses have passed (waited for): nothing reads it.
                unmapped += self.unmap_for_sleep(st, co, cb)?;
                match last.filter(|&i| asleep.runs[i].0 + asleep.runs[i].1 == co) {
                    Some(i) => asleep.runs[i].1 += cb,
                    None => {
                        let at = asleep.runs.partition_point(|&(x, _)| x < co);
                        asleep.runs.insert(at, (co, cb));
                        last = Some(at);
                    }
                }
                next += 1;
            }
            r.migration.swap_time += t.elapsed();
            // Their device memory goes back now, while later pieces copy.
            let t = Instant::now();
            if self.placement != Location::Host {
                let _ = self.pool.trim_at(self.placement);
            }
            r.migration.dispose_time += t.elapsed();
        }
        debug_assert_eq!(next, chunks.len(), "the parts tile every chunk");
        Ok(unmapped)
    }

    /// Makes the stash's pieces tile `parts` (see `fit_stash`), its
    /// reservation made on first use: what a stashing sleep does before it
    /// copies, and what `prepare_sleep` does ahead of it.
    pub(in crate::arena) fn stage_stash(
        &self,
        st: &mut State<B>,
        parts: &[(usize, usize)],
        r: &mut SleepReport,
    ) -> Result<()> {
        if st.sleep.stash.is_none() {
            st.sleep.stash = Some(crate::region::Region::reserve(
                &self.backend,
                st.region.table.reserved(),
                self.granularity,
                self.granularity,
            )?);
        }
        let stash = st.sleep.stash.as_mut().expect("made above");
        self.fit_stash(stash, parts, r)
    }

    /// After a copying sleep copied `runs` (in `pieces` pieces): counts
    /// them in the report and unmaps them as a discarding sleep does.
    fn unmap_copied(
        &self,
        st: &mut State<B>,
        asleep: &mut Asleep<Mark<B::Fence>>,
        r: &mut SleepReport,
        runs: &[(usize, usize)],
        pieces: usize,
    ) -> Result<usize> {
        r.migration.bytes_moved = runs.iter().map(|x| x.1).sum();
        r.migration.chunks_moved = pieces;
        r.chunks_after = pieces;
        let t = Instant::now();
        let unmapped = self.sleep_discard(st, asleep);
        r.migration.swap_time += t.elapsed();
        unmapped
    }

    /// Makes the stash's pieces tile `parts`: keeps the ones that match,
    /// gives the others to the pool, and maps what is missing (granted to
    /// the GPU only: no copy of a sleep runs on the CPU). On an error the
    /// pieces taken for it go back to the pool.
    fn fit_stash(
        &self,
        stash: &mut crate::region::Region<B>,
        parts: &[(usize, usize)],
        r: &mut SleepReport,
    ) -> Result<()> {
        let backend = &*self.backend;
        let t = Instant::now();
        let mut missing: Vec<(usize, usize)> = Vec::new();
        for &(o, n) in parts {
            if stash.table.get(o).is_some_and(|e| e.bytes == n) {
                continue;
            }
            let stale: Vec<(usize, usize)> = stash
                .table
                .overlapping(o..o + n)
                .map(|(k, e)| (k, e.bytes))
                .collect();
            for (k, b) in stale {
                for (_, e) in stash.unmap(k, b)? {
                    let _ = self.pool.give(e.placement, e.bytes, e.chunk);
                }
            }
            missing.push((o, n));
        }
        let wants: Vec<(Location, usize)> =
            missing.iter().map(|&(_, n)| (Location::Host, n)).collect();
        let chunks = self.pool.take_many(false, &wants)?;
        r.migration.acquire_time += t.elapsed();
        let t = Instant::now();
        // The host's descriptor is recorded but not given at the mapping
        // (not at once: `cpu` false): `migration::grant_cpu` gives it
        // before the CPU reads the stash (`Arena::backup_address`), as for
        // an arena's own host chunks.
        let rw = |at| crate::location::AccessDesc::new(at, crate::location::Access::ReadWrite);
        let home = backend.home();
        let grants = match home {
            Location::Host => crate::location::Grants::new(&[rw(home)], true),
            _ => crate::location::Grants::new(&[rw(home), rw(Location::Host)], false),
        };
        let mut todo = missing.iter().zip(chunks);
        while let Some((&(o, n), chunk)) = todo.next() {
            let new = vec![NewChunk {
                chunk,
                bytes: n,
                placement: Location::Host,
            }];
            if let Err((e, back)) = stash.map_batch(o, new, &grants) {
                for c in back {
                    let _ = self.pool.give(c.placement, c.bytes, c.chunk);
                }
                for (&(_, n), c) in todo {
                    let _ = self.pool.give(Location::Host, n, c);
                }
                return Err(e);
            }
        }
        r.migration.stage_time += t.elapsed();
        Ok(())
    }

    /// A pageable sleep: every mapped run copied to pageable host memory of
    /// its own (see [`SleepMode::Pageable`]; a disk sleep: every chunk to a
    /// file of the spill directory), then unmapped as a discarding sleep
    /// unmaps. On an error before the unmapping nothing changed (the copies
    /// made so far go back to the system); part way through it, the runs
    /// unmapped so far sleep with their copies.
    pub(super) fn sleep_pageable(
        &self,
        st: &mut State<B>,
        asleep: &mut Asleep<Mark<B::Fence>>,
        r: &mut SleepReport,
    ) -> Result<usize> {
        let backend = &*self.backend;
        let runs = st.region.table.runs();
        let dir = match asleep.mode {
            SleepMode::Disk => Some(self.spill_dir.lock().clone().ok_or_else(|| {
                Error::invalid("a disk sleep needs a spill directory (Arena::set_spill_dir)")
            })?),
            _ => None,
        };
        // One copy per run; in files, one per chunk, or per piece of at
        // most `spill_file_bytes` of it.
        let most = match self
            .spill_file_bytes
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            0 => usize::MAX,
            n => n,
        };
        let parts: Vec<(usize, usize)> = match dir {
            None => runs.clone(),
            Some(_) => runs
                .iter()
                .flat_map(|&(o, b)| {
                    st.region
                        .table
                        .overlapping(o..o + b)
                        .map(|(k, e)| (k, e.bytes))
                })
                .flat_map(|(k, n)| pieces(k, n, most, 0))
                .collect(),
        };
        let t = Instant::now();
        // The buffers a wake kept (WakeDesc::keep_backup) serve again where
        // a part is the same, at the same host address.
        let mut spare = std::mem::take(&mut st.sleep.kept_pages);
        let mut copies = Vec::with_capacity(parts.len());
        for &(o, b) in &parts {
            let mut buf = match spare.iter().position(|x| x.0 == o && x.1.len() == b) {
                Some(i) => spare.swap_remove(i).1,
                None => match &dir {
                    None => crate::backend::pages::PageableBuf::new(b)?,
                    // A failure names the bytes the whole sleep needs.
                    Some(d) => {
                        crate::backend::pages::PageableBuf::in_file(d, b).map_err(|e| match e {
                            Error::Spill { dir, source, .. } => Error::Spill {
                                dir,
                                bytes: parts.iter().map(|p| p.1).sum(),
                                source,
                            },
                            e => e,
                        })?
                    }
                },
            };
            backend.read(st.region.res_ref(), o, buf.as_mut_slice())?;
            copies.push((o, buf));
        }
        r.migration.copy_time += t.elapsed();
        let unmapped = self.unmap_copied(st, asleep, r, &runs, parts.len());
        // Each copy whose run now sleeps goes with it (all of them, unless
        // the unmapping failed part way).
        for (o, buf) in copies {
            if asleep.discarded(o) {
                let at = asleep.paged.partition_point(|x| x.0 < o);
                asleep.paged.insert(at, (o, buf));
            }
        }
        unmapped
    }

    /// After a wake: whether the backup stays readable (`keep_backup`, for
    /// a stash or a paged sleep), and a stash above the pool's host bound
    /// handed to the pool, which sheds what is over (unless kept).
    pub(super) fn keep_or_shed_backup(
        &self,
        st: &mut State<B>,
        desc: &WakeDesc,
        asleep: Asleep<Mark<B::Fence>>,
    ) {
        let keep = desc.keep_backup && (asleep.mode == SleepMode::Stash || asleep.mode.pages());
        st.sleep.backup_kept = keep;
        if keep && asleep.mode.pages() {
            st.sleep.kept_pages = asleep.paged;
        }
        let stash_bytes = st
            .sleep
            .stash
            .as_ref()
            .map_or(0, |s| s.table.mapped_bytes());
        if stash_bytes > self.pool.desc().max_host_bytes && !keep {
            let _ = self.drop_stash(st);
        }
    }

    /// Gives the stash's pieces to the pool (the caller has made sure the
    /// arena does not sleep stashed).
    pub(super) fn drop_stash(&self, st: &mut State<B>) -> Result<usize> {
        let Some(stash) = st.sleep.stash.as_mut() else {
            return Ok(0);
        };
        let mut gone = 0;
        for (o, b) in stash.table.runs() {
            for (_, e) in stash.unmap(o, b)? {
                gone += e.bytes;
                let _ = self.pool.give(e.placement, e.bytes, e.chunk);
            }
        }
        Ok(gone)
    }

    /// A discarding sleep: every mapped chunk unmapped, to the pool (and
    /// device ones on to the driver by the caller).
    pub(super) fn sleep_discard(
        &self,
        st: &mut State<B>,
        asleep: &mut Asleep<Mark<B::Fence>>,
    ) -> Result<usize> {
        let runs = st.region.table.runs();
        let mut unmapped = 0;
        for (o, b) in runs {
            // The uses have passed (waited for): nothing reads these bytes.
            unmapped += self.unmap_for_sleep(st, o, b)?;
            let at = asleep.runs.partition_point(|&(x, _)| x < o);
            asleep.runs.insert(at, (o, b));
        }
        Ok(unmapped)
    }

    /// Unmaps `[o, o + b)` for a sleep (every use of it has passed): its
    /// chunks go to the pool and its free bytes out of the zones (a run may
    /// span both, adjacent chunks at their border). Returns the device
    /// bytes unmapped.
    fn unmap_for_sleep(&self, st: &mut State<B>, o: usize, b: usize) -> Result<usize> {
        let mut unmapped = 0;
        for (_, e) in st.region.unmap(o, b)? {
            if e.placement != Location::Host {
                unmapped += e.bytes;
            }
            let _ = self.pool.give(e.placement, e.bytes, e.chunk);
        }
        st.heap.remove_free_within(o..o + b);
        Ok(unmapped)
    }

    /// The wake of a discarding or stashing sleep: fresh pieces mapped over
    /// every run, filled from the stash (stashed) or zeroed on request
    /// (discarded), the bytes no allocation holds free again.
    pub(super) fn wake_discard(
        &self,
        st: &mut State<B>,
        asleep: &Asleep<Mark<B::Fence>>,
        zero: bool,
        r: &mut SleepReport,
    ) -> Result<()> {
        for fences in &asleep.frees {
            st.heap.wait_fences(&*self.backend, fences)?;
        }
        let total: usize = asleep.runs.iter().map(|r| r.1).sum();
        let Some(mut hold) = st.region.hold(total) else {
            return Err(self.out_of_memory(st, total, None));
        };
        if self
            .budget
            .is_some_and(|budget| st.region.table.mapped_bytes() + total > budget)
        {
            return Err(self.out_of_memory(st, total, None));
        }
        let mut mapped: Vec<(usize, usize)> = Vec::new();
        if let Err(e) = self.map_runs(st, asleep, zero, r, &mut mapped, &mut hold) {
            // The runs mapped so far are the region's: its unmapping gives
            // their budget back, and the hold the rest.
            self.unmap_runs(st, mapped);
            return Err(e);
        }
        hold.keep();
        self.free_runs(st, asleep);
        r.bytes = total;
        r.device_bytes = if st.placement == Location::Host {
            0
        } else {
            total
        };
        Ok(())
    }

    /// Maps fresh pieces over every run of `asleep`, filled from the stash
    /// (a stashing sleep), from pageable copies, or zeroed (`zero`, a
    /// discarding one), and waits for those copies; each run mapped goes
    /// into `mapped` as it is.
    fn map_runs(
        &self,
        st: &mut State<B>,
        asleep: &Asleep<Mark<B::Fence>>,
        zero: bool,
        r: &mut SleepReport,
        mapped: &mut Vec<(usize, usize)>,
        hold: &mut BudgetHold,
    ) -> Result<()> {
        let backend = &*self.backend;
        let from_stash = asleep.mode == SleepMode::Stash;
        let from_pages = asleep.mode.pages();
        let zero = zero && !from_stash && !from_pages;
        let border = st.heap.zone_border();
        for &(o, b) in &asleep.runs {
            let pieces = pieces(o, b, asleep.piece, border);
            if from_stash {
                // Piece by piece: each piece's copy back runs while the
                // next one is created and mapped (a map hook is told of
                // each chunk as it is mapped, as at any mapping).
                for (po, pb) in pieces {
                    self.map_pieces(st, po, &[pb], r, hold)?;
                    mapped.push((po, pb));
                    self.copy_from_stash(st, po, pb, r)?;
                }
                continue;
            }
            let sizes: Vec<usize> = pieces.iter().map(|p| p.1).collect();
            self.map_pieces(st, o, &sizes, r, hold)?;
            mapped.push((o, b));
            if zero {
                backend.zero(st.region.res(), o, b)?;
            }
            if from_pages {
                let t = Instant::now();
                write_pages(st, backend, asleep, o, b)?;
                r.migration.copy_time += t.elapsed();
            }
        }
        let t = Instant::now();
        if zero || from_stash {
            backend.wait_copies()?;
        }
        if from_pages {
            // A copy from pageable memory may return before its transfer
            // has reached the device: the device is waited for, so that
            // every stream sees the data.
            st.heap.synchronize(backend)?;
        }
        r.migration.copy_time += t.elapsed();
        Ok(())
    }

    /// Maps fresh pieces of `sizes` from `at` (the budget's `hold` keeps
    /// their bytes), timed and counted in `r`.
    fn map_pieces(
        &self,
        st: &mut State<B>,
        at: usize,
        sizes: &[usize],
        r: &mut SleepReport,
        hold: &mut BudgetHold,
    ) -> Result<()> {
        let t = Instant::now();
        let acquired = self.map_fresh(st, at, sizes)?;
        r.migration.acquire_time += acquired;
        r.migration.swap_time += t.elapsed() - acquired;
        hold.keep_part(sizes.iter().sum());
        r.chunks_after += sizes.len();
        Ok(())
    }

    /// Copies `[offset, offset + bytes)` back from the stash (queued: the
    /// caller waits for the copies).
    fn copy_from_stash(
        &self,
        st: &mut State<B>,
        offset: usize,
        bytes: usize,
        r: &mut SleepReport,
    ) -> Result<()> {
        let stash = st
            .sleep
            .stash
            .as_ref()
            .ok_or_else(|| Error::invalid("a stashed arena without its stash (a bug)"))?;
        let t = Instant::now();
        self.backend
            .copy(st.region.res(), offset, stash.res_ref(), offset, bytes)?;
        r.migration.copy_time += t.elapsed();
        Ok(())
    }

    /// A wake's [`WakeDesc::restore_free`]: fresh memory mapped again over
    /// the free chunks the sleep gave back, `freed`, where nothing has been
    /// mapped since, free for the next allocations; returns the bytes
    /// mapped. Best effort, as a cache is: the first range the budgets, the
    /// device margin or the device cannot hold ends it (the wake stands, and a later
    /// allocation maps what it needs, or fails then with the cause).
    pub(super) fn refill(&self, st: &mut State<B>, freed: &[(usize, usize)]) -> usize {
        let mut done = 0;
        for &(o, b) in freed {
            if st.region.table.overlapping(o..o + b).next().is_some() {
                continue;
            }
            // Room as any mapping needs it: the arena's budget, the device
            // margin, then the shared budget.
            if self.check_room(st, b, b).is_err() {
                break;
            }
            let Some(hold) = st.region.hold(b) else {
                break;
            };
            let parts = pieces(o, b, usize::MAX, st.heap.zone_border());
            let sizes: Vec<usize> = parts.iter().map(|p| p.1).collect();
            if let Err(e) = self.map_fresh(st, o, &sizes) {
                tracing::debug!(offset = o, bytes = b, error = %e, "vmmbuf: free memory not restored");
                break;
            }
            hold.keep();
            let State { heap, region, .. } = &mut *st;
            heap.insert_fresh(o, b, &region.walls());
            done += b;
        }
        done
    }

    /// Undoes a failed wake: nothing used the fresh memory of `mapped`, so
    /// it goes back (the arena stays asleep); a run that will not unmap
    /// poisons the region.
    fn unmap_runs(&self, st: &mut State<B>, mapped: Vec<(usize, usize)>) {
        let _ = self.backend.wait_copies();
        for (o, b) in mapped {
            match st.region.unmap(o, b) {
                Ok(gone) => {
                    for (_, e) in gone {
                        let _ = self.pool.give(e.placement, e.bytes, e.chunk);
                    }
                }
                Err(u) => st.region.poison(
                    format!("undoing a failed wake: unmapping {o:#x} failed: {u}"),
                    [],
                ),
            }
        }
    }

    /// Every byte of `asleep`'s runs that no live allocation, lost block or
    /// graph holds is free again (the frees made while asleep were waited
    /// for before the wake).
    fn free_runs(&self, st: &mut State<B>, asleep: &Asleep<Mark<B::Fence>>) {
        // Live allocations in address order (the map is not ordered).
        let mut by_offset: Vec<(usize, usize)> = st.heap.live_ranges().collect();
        by_offset.sort_unstable();
        for &(o, b) in &asleep.runs {
            let mut at = o;
            // What overlaps the run, cut to it: a range may start in an
            // earlier run (runs of two sleeps lie side by side, and a graph
            // joins the blocks it holds across their border; counting only
            // ranges that start in the run handed out a graph's bytes).
            let cut = |(x, size): (usize, usize)| {
                let (from, to) = (x.max(o), (x + size).min(o + b));
                (from < to).then(|| (from, to - from))
            };
            // Live allocations do not overlap: of those starting before the
            // run, only the last may reach into it.
            let (from, to) = (
                by_offset.partition_point(|&(x, _)| x < o),
                by_offset.partition_point(|&(x, _)| x < o + b),
            );
            let mut held: Vec<(usize, usize)> = by_offset[from.saturating_sub(1)..to]
                .iter()
                .copied()
                .filter_map(cut)
                .collect();
            held.extend(asleep.lost.iter().copied().filter_map(cut));
            // Blocks graphs hold stay theirs.
            held.extend(st.heap.graph_held().filter_map(cut));
            held.sort_unstable();
            for (x, size) in held.into_iter().chain(std::iter::once((o + b, 0))) {
                // Free bytes (split at the zones' border).
                let State { heap, region, .. } = &mut *st;
                heap.insert_fresh(at, x.saturating_sub(at), &region.walls());
                at = at.max(x + size);
            }
        }
    }
}

/// Writes the run `[o, o + b)` back from `asleep`'s pageable copies, which
/// tile it; a run without its copies is refused (a bug).
fn write_pages<B: Backend>(
    st: &mut State<B>,
    backend: &B,
    asleep: &Asleep<Mark<B::Fence>>,
    o: usize,
    b: usize,
) -> Result<()> {
    let mut at = o;
    for (x, buf) in &asleep.paged[asleep.paged.partition_point(|p| p.0 < o)..] {
        if *x >= o + b || *x != at || x + buf.len() > o + b {
            break;
        }
        backend.write(st.region.res(), *x, buf.as_slice())?;
        at += buf.len();
    }
    if at != o + b {
        return Err(Error::invalid("a pageable run without its copy (a bug)"));
    }
    Ok(())
}
