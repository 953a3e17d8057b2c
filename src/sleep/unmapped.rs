//! The sleeps that give device memory back (discard, stash, pageable,
//! disk) and their wake: fresh pieces mapped over every run, filled from
//! the backup or zeroed, and the bytes no allocation holds free again.

use std::time::Instant;

use super::backup::Holds;
use super::pages::write_pages;
use super::{pieces, Asleep, Env, Host, SleepMode, SleepReport};
use crate::backend::Backend;
use crate::error::Result;
use crate::location::Location;
use crate::pool::{BudgetHold, ChunkSource};

impl<B: Backend> Env<'_, B> {
    /// A sleep that unmaps (stash, pageable, disk or discard): the runs
    /// mapped now join those already asleep in `mode`. On an error the runs
    /// unmapped so far sleep (none: the arena stays awake, as it was).
    pub(super) fn sleep_unmapping<H: Host<B>>(
        &self,
        host: &mut H,
        mode: SleepMode,
        piece: usize,
        r: &mut SleepReport,
    ) -> Result<()> {
        let mut asleep = host
            .state_mut()
            .asleep
            .take()
            .unwrap_or_else(|| Asleep::new(mode, piece));
        r.chunks_before = host.region().table.chunk_count();
        let had = asleep.runs.len();
        let t = Instant::now();
        let res = match mode {
            SleepMode::Stash => self.sleep_stash(host, &mut asleep, r),
            SleepMode::Pageable | SleepMode::Disk => self.sleep_pageable(host, &mut asleep, r),
            _ => self.sleep_discard(host, &mut asleep),
        };
        if mode == SleepMode::Discard {
            r.migration.swap_time = t.elapsed();
        }
        r.bytes = asleep.runs.iter().map(|x| x.1).sum();
        if res.is_ok() || !asleep.runs.is_empty() || had > 0 {
            // The copy a reader may see is this sleep's.
            host.state_mut().backup.holds = match mode {
                SleepMode::Stash => Holds::Stash,
                m if m.pages() => Holds::Pages,
                _ => Holds::Nothing,
            };
            host.state_mut().asleep = Some(asleep);
        }
        res.map(|_| ())
    }

    /// A discarding sleep: every mapped chunk unmapped, to the pool (and
    /// device ones on to the driver by the caller).
    pub(super) fn sleep_discard<H: Host<B>>(
        &self,
        host: &mut H,
        asleep: &mut Asleep<H::Fence>,
    ) -> Result<usize> {
        let runs = host.region().table.runs();
        let mut unmapped = 0;
        for (o, b) in runs {
            // The uses have passed (waited for): nothing reads these bytes.
            unmapped += self.unmap_for_sleep(host, o, b)?;
            let at = asleep.runs.partition_point(|&(x, _)| x < o);
            asleep.runs.insert(at, (o, b));
        }
        Ok(unmapped)
    }

    /// Unmaps `[o, o + b)` for a sleep (every use of it has passed): its
    /// chunks go to the pool and its free bytes out of the zones (a run may
    /// span both, adjacent chunks at their border). Returns the device
    /// bytes unmapped.
    pub(super) fn unmap_for_sleep<H: Host<B>>(
        &self,
        host: &mut H,
        o: usize,
        b: usize,
    ) -> Result<usize> {
        let mut unmapped = 0;
        for (_, e) in host.region_mut().unmap(o, b)? {
            if e.placement != Location::Host {
                unmapped += e.bytes;
            }
            let _ = self.pool.give(e.placement, e.bytes, e.chunk);
        }
        host.forget_free(o..o + b);
        Ok(unmapped)
    }

    /// The wake of a discarding or stashing sleep: fresh pieces mapped over
    /// every run, filled from the stash (stashed) or zeroed on request
    /// (discarded), the bytes no allocation holds free again.
    pub(super) fn wake_unmapped<H: Host<B>>(
        &self,
        host: &mut H,
        asleep: &Asleep<H::Fence>,
        zero: bool,
        r: &mut SleepReport,
    ) -> Result<()> {
        for fences in &asleep.frees {
            host.wait_frees(fences)?;
        }
        let total: usize = asleep.runs.iter().map(|r| r.1).sum();
        let Some(mut hold) = host.region_mut().hold(total) else {
            return Err(host.out_of_memory(total));
        };
        if self
            .budget
            .is_some_and(|budget| host.region().table.mapped_bytes() + total > budget)
        {
            return Err(host.out_of_memory(total));
        }
        let mut mapped: Vec<(usize, usize)> = Vec::new();
        if let Err(e) = self.map_runs(host, asleep, zero, r, &mut mapped, &mut hold) {
            // The runs mapped so far are the region's: its unmapping gives
            // their budget back, and the hold the rest.
            self.unmap_runs(host, mapped);
            return Err(e);
        }
        hold.keep();
        self.free_runs(host, asleep);
        r.bytes = total;
        r.device_bytes = if host.placement() == Location::Host {
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
    pub(super) fn map_runs<H: Host<B>>(
        &self,
        host: &mut H,
        asleep: &Asleep<H::Fence>,
        zero: bool,
        r: &mut SleepReport,
        mapped: &mut Vec<(usize, usize)>,
        hold: &mut BudgetHold,
    ) -> Result<()> {
        let backend = &**self.backend;
        let from_stash = asleep.mode == SleepMode::Stash;
        let from_pages = asleep.mode.pages();
        let zero = zero && !from_stash && !from_pages;
        let border = host.zone_border();
        for &(o, b) in &asleep.runs {
            let pieces = pieces(o, b, asleep.piece, border);
            if from_stash {
                // Piece by piece: each piece's copy back runs while the
                // next one is created and mapped (a map hook is told of
                // each chunk as it is mapped, as at any mapping).
                for (po, pb) in pieces {
                    self.map_pieces(host, po, &[pb], r, hold)?;
                    mapped.push((po, pb));
                    self.copy_from_stash(host, po, pb, r)?;
                }
                continue;
            }
            let sizes: Vec<usize> = pieces.iter().map(|p| p.1).collect();
            self.map_pieces(host, o, &sizes, r, hold)?;
            mapped.push((o, b));
            if zero {
                backend.zero(host.region_mut().res(), o, b)?;
            }
            if from_pages {
                let t = Instant::now();
                let (region, state) = host.parts();
                write_pages(region, backend, &state.backup.pages, o, b)?;
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
            host.synchronize()?;
        }
        r.migration.copy_time += t.elapsed();
        Ok(())
    }

    /// Maps fresh pieces of `sizes` from `at` (the budget's `hold` keeps
    /// their bytes), timed and counted in `r`.
    pub(super) fn map_pieces<H: Host<B>>(
        &self,
        host: &mut H,
        at: usize,
        sizes: &[usize],
        r: &mut SleepReport,
        hold: &mut BudgetHold,
    ) -> Result<()> {
        let t = Instant::now();
        let acquired = host.map_fresh(at, sizes)?;
        r.migration.acquire_time += acquired;
        r.migration.swap_time += t.elapsed() - acquired;
        hold.keep_part(sizes.iter().sum());
        r.chunks_after += sizes.len();
        Ok(())
    }

    /// A wake's [`WakeDesc::restore_free`]: fresh memory mapped again over
    /// the free chunks the sleep gave back, `freed`, where nothing has been
    /// mapped since, free for the next allocations; returns the bytes
    /// mapped. Best effort, as a cache is: the first range the budgets, the
    /// device margin or the device cannot hold ends it (the wake stands, and a later
    /// allocation maps what it needs, or fails then with the cause).
    pub(super) fn refill<H: Host<B>>(&self, host: &mut H, freed: &[(usize, usize)]) -> usize {
        let mut done = 0;
        for &(o, b) in freed {
            if host.region().table.overlapping(o..o + b).next().is_some() {
                continue;
            }
            // Room as any mapping needs it: the arena's budget, the device
            // margin, then the shared budget.
            if host.check_room(b).is_err() {
                break;
            }
            let Some(hold) = host.region_mut().hold(b) else {
                break;
            };
            let parts = pieces(o, b, usize::MAX, host.zone_border());
            let sizes: Vec<usize> = parts.iter().map(|p| p.1).collect();
            if let Err(e) = host.map_fresh(o, &sizes) {
                tracing::debug!(offset = o, bytes = b, error = %e, "vmmbuf: free memory not restored");
                break;
            }
            hold.keep();
            host.free_again(o, b);
            done += b;
        }
        done
    }

    /// Undoes a failed wake: nothing used the fresh memory of `mapped`, so
    /// it goes back (the arena stays asleep); a run that will not unmap
    /// poisons the region.
    pub(super) fn unmap_runs<H: Host<B>>(&self, host: &mut H, mapped: Vec<(usize, usize)>) {
        let _ = self.backend.wait_copies();
        for (o, b) in mapped {
            match host.region_mut().unmap(o, b) {
                Ok(gone) => {
                    for (_, e) in gone {
                        let _ = self.pool.give(e.placement, e.bytes, e.chunk);
                    }
                }
                Err(u) => host.region_mut().poison(
                    format!("undoing a failed wake: unmapping {o:#x} failed: {u}"),
                    [],
                ),
            }
        }
    }

    /// Every byte of `asleep`'s runs that no live allocation, lost block or
    /// graph holds is free again (the frees made while asleep were waited
    /// for before the wake).
    pub(super) fn free_runs<H: Host<B>>(&self, host: &mut H, asleep: &Asleep<H::Fence>) {
        // Live allocations in address order.
        let by_offset = host.live_ranges();
        let graphs = host.graph_held();
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
            held.extend(graphs.iter().copied().filter_map(cut));
            held.sort_unstable();
            for (x, size) in held.into_iter().chain(std::iter::once((o + b, 0))) {
                // Free bytes (split at the zones' border).
                host.free_again(at, x.saturating_sub(at));
                at = at.max(x + size);
            }
        }
    }
}
