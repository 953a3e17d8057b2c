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

use std::time::Duration;

use crate::backend::Backend;
use crate::error::Result;
use crate::location::Location;
use crate::migration::MigrationReport;

mod backup;
mod desc;
mod host;
mod keep;
mod mode;
mod pages;
mod plan;
mod stash;
mod state;
mod unmapped;

pub use desc::{SleepDesc, WakeDesc};
pub(crate) use host::{Env, Host};
pub use mode::SleepMode;
#[cfg(all(test, target_os = "linux"))]
pub(crate) use plan::STAGE_BATCH_BYTES;
use plan::{count_in, pieces, plan_groups};
use state::Asleep;
pub(crate) use state::SleepState;

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

impl<B: Backend> Env<'_, B> {
    /// A sleep in `mode` of the arena `host`, whose streams' work and
    /// pending frees were waited for and whose whole free chunks, `freed`
    /// (`(offset, bytes)`), were given back: what `mode` does with the rest
    /// (see [`SleepMode`]); its figures in `r`.
    pub(crate) fn sleep<H: Host<B>>(
        &self,
        host: &mut H,
        mode: SleepMode,
        piece: usize,
        freed: Vec<(usize, usize)>,
        r: &mut SleepReport,
    ) -> Result<()> {
        // A backup kept past the last wake is not readable once a sleep has
        // begun: the sleep copies into it afresh (a pageable one reuses its
        // buffers). A sleep that adds to one under way keeps its copy.
        let state = host.state_mut();
        if state.asleep.is_none() {
            state.backup.holds = backup::Holds::Nothing;
        }
        let _span = tracing::debug_span!("vmmbuf.arena.sleep", mode = %mode).entered();
        let done = match mode {
            SleepMode::Keep => self.sleep_keep(host, piece, r).map(|()| {
                host.state_mut()
                    .asleep
                    .get_or_insert_with(|| Asleep::new(SleepMode::Keep, piece));
            }),
            _ => self.sleep_unmapping(host, mode, piece, r),
        };
        if done.is_ok() {
            if let Some(a) = host.state_mut().asleep.as_mut() {
                a.freed.extend(freed);
            }
        }
        done
    }

    /// The wake of the arena `host`, whose streams' work was waited for:
    /// the data back where the sleep kept it (or fresh memory where it
    /// was discarded), free memory mapped again on request, the backup
    /// kept or shed. All or nothing: on error the arena stays asleep as it
    /// was. An arena awake is left as it is.
    pub(crate) fn wake<H: Host<B>>(
        &self,
        host: &mut H,
        desc: &WakeDesc,
        r: &mut SleepReport,
    ) -> Result<()> {
        let Some(asleep) = host.state_mut().asleep.take() else {
            return Ok(());
        };
        let _span = tracing::debug_span!("vmmbuf.arena.wake", mode = %asleep.mode).entered();
        let res = match asleep.mode {
            SleepMode::Keep => self.wake_keep(host, &asleep, r),
            _ => self.wake_unmapped(host, &asleep, desc.zero, r).map(|()| {
                if asleep.mode != SleepMode::Discard {
                    r.migration.bytes_moved = r.bytes;
                }
            }),
        };
        if let Err(e) = res {
            host.state_mut().asleep = Some(asleep);
            return Err(e);
        }
        if desc.restore_free {
            r.free_bytes = self.refill(host, &asleep.freed);
            if self.home != Location::Host {
                r.device_bytes += r.free_bytes;
            }
        }
        self.keep_or_shed_backup(host, desc, asleep);
        Ok(())
    }
}

/// A sleep's or a wake's report at debug level (`VMMBUF_LOG=debug`), with
/// where its time went: a pause that pins host memory anew shows it in
/// `acquire_us`, one that waits for the GPU in `wait_us`.
pub(crate) fn trace_report(r: &SleepReport, awake: bool) {
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
