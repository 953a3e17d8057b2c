//! A stashing sleep: the data copied into the stash (host pieces mapped
//! at the arena's own offsets, kept from one sleep to the next) and the
//! device memory given back; the stash prepared ahead and copied back.

use std::time::Instant;

use super::backup::Holds;
use super::plan::{covers, stash_holds, stash_missing, STAGE_BATCH_BYTES};
use super::{pieces, plan_groups, Asleep, Env, Host, SleepMode, SleepReport};
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::location::Location;
use crate::pool::ChunkSource;
use crate::region::{NewChunk, Region};

impl<B: Backend> Env<'_, B> {
    /// Makes the stash's pieces tile `parts` (see `fit_stash`), its
    /// reservation made on first use: what a stashing sleep does before it
    /// copies, and what `prepare_sleep` does ahead of it.
    fn stage_stash<H: Host<B>>(
        &self,
        host: &mut H,
        parts: &[(usize, usize)],
        r: &mut SleepReport,
    ) -> Result<()> {
        let (region, state) = host.parts();
        if state.backup.stash.is_none() {
            state.backup.stash = Some(Region::reserve(
                self.backend,
                region.table.reserved(),
                self.granularity,
                self.granularity,
            )?);
        }
        let stash = state.backup.stash.as_mut().expect("made above");
        self.fit_stash(stash, parts, r)
    }

    /// A stashing sleep: every mapped run copied to the stash (host pieces
    /// mapped at the same offsets of a reservation of their own, kept
    /// from one sleep to the next), then unmapped as a discarding sleep
    /// unmaps. On an error before the unmapping nothing changed but the
    /// stash; part way through it, the runs unmapped so far sleep (their
    /// data is in the stash).
    pub(super) fn sleep_stash<H: Host<B>>(
        &self,
        host: &mut H,
        asleep: &mut Asleep<H::Fence>,
        r: &mut SleepReport,
    ) -> Result<usize> {
        let backend = &**self.backend;
        let runs = host.region().table.runs();
        let parts: Vec<(usize, usize)> = runs
            .iter()
            .flat_map(|&(o, b)| pieces(o, b, asleep.piece, host.zone_border()))
            .collect();
        self.stage_stash(host, &parts, r)?;
        let (region, state) = host.parts();
        let stash = state.backup.stash.as_mut().expect("staged above");
        // One copy per piece (all device memory on one side, all host
        // memory on the other), each followed by a fence.
        let t = Instant::now();
        let mut fences = Vec::with_capacity(parts.len());
        let issued = (|| {
            for &(o, b) in &parts {
                backend.copy(stash.res(), o, region.res_ref(), o, b)?;
                fences.push(backend.copies_fence()?);
            }
            Ok(())
        })();
        r.migration.copy_time += t.elapsed();
        if let Err(e) = issued {
            let _ = backend.wait_copies();
            return Err(e);
        }
        let moved = self.unmap_as_copied(host, asleep, r, &parts, &fences);
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
    pub(super) fn unmap_as_copied<H: Host<B>>(
        &self,
        host: &mut H,
        asleep: &mut Asleep<H::Fence>,
        r: &mut SleepReport,
        parts: &[(usize, usize)],
        fences: &[B::Fence],
    ) -> Result<usize> {
        let chunks: Vec<(usize, usize)> = host
            .region()
            .table
            .iter()
            .map(|(o, e)| (o, e.bytes))
            .collect();
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
                unmapped += self.unmap_for_sleep(host, co, cb)?;
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
            if self.home != Location::Host {
                let _ = self.pool.trim_at(self.home);
            }
            r.migration.dispose_time += t.elapsed();
        }
        debug_assert_eq!(next, chunks.len(), "the parts tile every chunk");
        Ok(unmapped)
    }

    /// After a copying sleep copied `runs` (in `pieces` pieces): counts
    /// them in the report and unmaps them as a discarding sleep does.
    pub(super) fn unmap_copied<H: Host<B>>(
        &self,
        host: &mut H,
        asleep: &mut Asleep<H::Fence>,
        r: &mut SleepReport,
        runs: &[(usize, usize)],
        pieces: usize,
    ) -> Result<usize> {
        r.migration.bytes_moved = runs.iter().map(|x| x.1).sum();
        r.migration.chunks_moved = pieces;
        r.chunks_after = pieces;
        let t = Instant::now();
        let unmapped = self.sleep_discard(host, asleep);
        r.migration.swap_time += t.elapsed();
        unmapped
    }

    /// Makes the stash's pieces tile `parts`: keeps the ones that match,
    /// gives the others to the pool, and maps what is missing (granted to
    /// the GPU only: no copy of a sleep runs on the CPU). On an error the
    /// pieces taken for it go back to the pool.
    pub(super) fn fit_stash(
        &self,
        stash: &mut Region<B>,
        parts: &[(usize, usize)],
        r: &mut SleepReport,
    ) -> Result<()> {
        let backend = &**self.backend;
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

    /// The sizes of the host pieces a sleep in `mode` (keep or stash, in
    /// pieces of at most `piece`) would take now: for a stash, those it
    /// lacks; for a kept sleep, its groups of whole device chunks.
    pub(crate) fn pieces_to_prepare<H: Host<B>>(
        &self,
        host: &H,
        mode: SleepMode,
        piece: usize,
    ) -> Vec<usize> {
        if mode == SleepMode::Stash {
            // The stash keeps the pieces it holds: those need none.
            return stash_missing(host, piece).iter().map(|p| p.1).collect();
        }
        // A kept sleep joins whole device chunks (`sleep_keep`).
        let free = host.free_ranges();
        let groups = plan_groups(
            &host.region().table,
            |o, e| e.placement != Location::Host && !covers(&free, o, e.bytes),
            Location::Host,
            piece,
            host.zone_border(),
        );
        groups.iter().map(|g| g.bytes).collect()
    }

    /// Maps the next batch of the stash's missing pieces into it (the
    /// first stashing sleep then maps nothing: on an H200, mapping and
    /// granting 0.95 GiB of pieces took 30 ms of a 60 ms first pause): at
    /// most [`STAGE_BATCH_BYTES`], so that the arena's lock, held by the
    /// caller, is not held for long (the arena's own allocations wait on
    /// it); the caller plans again under a new hold. Returns the pieces
    /// staged, and whether to go on. Asleep, or with a kept backup to
    /// leave as it is, it stages nothing; what changes after, the sleep
    /// fits.
    pub(crate) fn stage_batch<H: Host<B>>(
        &self,
        host: &mut H,
        piece: usize,
    ) -> Result<(usize, bool)> {
        if host.state().asleep.is_some() || host.state().backup.holds != Holds::Nothing {
            return Ok((0, false));
        }
        let mut bytes = 0;
        let batch: Vec<(usize, usize)> = stash_missing(host, piece)
            .into_iter()
            .take_while(|p| {
                let first = bytes == 0;
                bytes += p.1;
                first || bytes <= STAGE_BATCH_BYTES
            })
            .collect();
        if batch.is_empty() {
            return Ok((0, false));
        }
        self.stage_stash(host, &batch, &mut SleepReport::default())?;
        // No progress to be made (never seen): the sleep fits.
        let progress = batch.iter().all(|&(o, n)| stash_holds(host, o, n));
        Ok((batch.len(), progress))
    }

    /// Copies `[offset, offset + bytes)` back from the stash (queued: the
    /// caller waits for the copies).
    pub(super) fn copy_from_stash<H: Host<B>>(
        &self,
        host: &mut H,
        offset: usize,
        bytes: usize,
        r: &mut SleepReport,
    ) -> Result<()> {
        let (region, state) = host.parts();
        let stash = state
            .backup
            .stash
            .as_ref()
            .ok_or_else(|| Error::invalid("a stashed arena without its stash (a bug)"))?;
        let t = Instant::now();
        self.backend
            .copy(region.res(), offset, stash.res_ref(), offset, bytes)?;
        r.migration.copy_time += t.elapsed();
        Ok(())
    }
}
