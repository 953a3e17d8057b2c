//! A pageable or disk sleep: every mapped run copied to pageable host
//! memory (or files) of its own, and what a wake keeps of those copies.

use std::time::Instant;

use super::backup::Holds;
use super::{pieces, Asleep, Env, Host, SleepMode, SleepReport, WakeDesc};
use crate::backend::pages::PageableBuf;
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::region::Region;

impl<B: Backend> Env<'_, B> {
    /// A pageable sleep: every mapped run copied to pageable host memory of
    /// its own (see [`SleepMode::Pageable`]; a disk sleep: every chunk to a
    /// file of the spill directory), then unmapped as a discarding sleep
    /// unmaps. On an error before the unmapping nothing changed (the copies
    /// made so far go back to the system); part way through it, the runs
    /// unmapped so far sleep with their copies.
    pub(super) fn sleep_pageable<H: Host<B>>(
        &self,
        host: &mut H,
        asleep: &mut Asleep<H::Fence>,
        r: &mut SleepReport,
    ) -> Result<usize> {
        let runs = host.region().table.runs();
        let dir = match asleep.mode {
            SleepMode::Disk => Some(host.state().spill_dir.clone().ok_or_else(|| {
                Error::invalid("a disk sleep needs a spill directory (Arena::set_spill_dir)")
            })?),
            _ => None,
        };
        let parts = self.copy_parts(host, &runs, dir.is_some());
        let t = Instant::now();
        let copies = self.copy_out(host, &parts, dir.as_deref())?;
        r.migration.copy_time += t.elapsed();
        let unmapped = self.unmap_copied(host, asleep, r, &runs, parts.len());
        // Each copy whose run now sleeps goes with it (all of them, unless
        // the unmapping failed part way).
        let pages = &mut host.state_mut().backup.pages;
        for (o, buf) in copies {
            if asleep.discarded(o) {
                let at = pages.partition_point(|x| x.0 < o);
                pages.insert(at, (o, buf));
            }
        }
        unmapped
    }

    /// The parts a pageable sleep copies: a run each; in files (`files`),
    /// one per chunk, or per piece of at most `spill_file_bytes` of it.
    fn copy_parts<H: Host<B>>(
        &self,
        host: &H,
        runs: &[(usize, usize)],
        files: bool,
    ) -> Vec<(usize, usize)> {
        if !files {
            return runs.to_vec();
        }
        let most = match host.state().spill_file_bytes {
            0 => usize::MAX,
            n => n,
        };
        runs.iter()
            .flat_map(|&(o, b)| {
                host.region()
                    .table
                    .overlapping(o..o + b)
                    .map(|(k, e)| (k, e.bytes))
            })
            .flat_map(|(k, n)| pieces(k, n, most, 0))
            .collect()
    }

    /// Copies every part to pageable memory of its own (or a file of
    /// `dir`): a buffer a wake kept (`WakeDesc::keep_backup`) serves again
    /// where a part is the same, at the same host address. While the arena
    /// already sleeps pageable, its copies hold data and serve no other.
    fn copy_out<H: Host<B>>(
        &self,
        host: &mut H,
        parts: &[(usize, usize)],
        dir: Option<&std::path::Path>,
    ) -> Result<Vec<(usize, PageableBuf)>> {
        let backup = &mut host.state_mut().backup;
        let mut spare = match backup.holds {
            Holds::Pages => Vec::new(),
            _ => std::mem::take(&mut backup.pages),
        };
        let mut copies = Vec::with_capacity(parts.len());
        for &(o, b) in parts {
            let mut buf = match spare.iter().position(|x| x.0 == o && x.1.len() == b) {
                Some(i) => spare.swap_remove(i).1,
                None => new_copy(dir, b, parts)?,
            };
            self.backend
                .read(host.region().res_ref(), o, buf.as_mut_slice())?;
            copies.push((o, buf));
        }
        Ok(copies)
    }

    /// After a wake: whether the backup stays readable (`keep_backup`, for
    /// a stash or a paged sleep), and a stash above the pool's host bound
    /// handed to the pool, which sheds what is over (unless kept).
    pub(super) fn keep_or_shed_backup<H: Host<B>>(
        &self,
        host: &mut H,
        desc: &WakeDesc,
        asleep: Asleep<H::Fence>,
    ) {
        let keep = desc.keep_backup && (asleep.mode == SleepMode::Stash || asleep.mode.pages());
        let backup = &mut host.state_mut().backup;
        if !keep {
            if asleep.mode.pages() {
                backup.drop_pages();
            }
            backup.holds = Holds::Nothing;
        }
        if backup.stash_bytes() > self.pool.desc().max_host_bytes && !keep {
            let _ = backup.drop_stash(self.pool);
        }
    }
}

/// Writes the run `[o, o + b)` back from a pageable sleep's copies
/// (`pages`, in address order), which tile it; a run without its copies is
/// refused (a bug).
pub(super) fn write_pages<B: Backend>(
    region: &mut Region<B>,
    backend: &B,
    pages: &[(usize, PageableBuf)],
    o: usize,
    b: usize,
) -> Result<()> {
    let mut at = o;
    for (x, buf) in &pages[pages.partition_point(|p| p.0 < o)..] {
        if *x >= o + b || *x != at || x + buf.len() > o + b {
            break;
        }
        backend.write(region.res(), *x, buf.as_slice())?;
        at += buf.len();
    }
    if at != o + b {
        return Err(Error::invalid("a pageable run without its copy (a bug)"));
    }
    Ok(())
}

/// A fresh copy of `bytes`: pageable memory, or a file of `dir`; a failure
/// names the bytes the whole sleep (`parts`) needs.
fn new_copy(
    dir: Option<&std::path::Path>,
    bytes: usize,
    parts: &[(usize, usize)],
) -> Result<PageableBuf> {
    let Some(d) = dir else {
        return PageableBuf::new(bytes);
    };
    PageableBuf::in_file(d, bytes).map_err(|e| match e {
        Error::Spill { dir, source, .. } => Error::Spill {
            dir,
            bytes: parts.iter().map(|p| p.1).sum(),
            source,
        },
        e => e,
    })
}
