//! How a sleep and a wake go: [`SleepDesc`] and [`WakeDesc`]. Split from
//! `sleep.rs` (the calls that take them).

use super::SleepMode;
#[cfg(doc)]
use super::SleepReport;
#[cfg(doc)]
use crate::Arena;

/// How [`Arena::sleep`] sleeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct SleepDesc {
    /// Keep the data, or discard it.
    pub mode: SleepMode,
    /// The largest piece a run of adjacent chunks is joined into, for the
    /// sleep and the wake after it (rounded to the granularity; 64 MiB by
    /// default, 256 MiB for [`SleepDesc::discard`]). Larger pieces mean fewer driver calls; a piece goes back
    /// to the driver only whole, so after a wake the arena may hold up to
    /// one piece more than its allocations need per run.
    pub max_piece_bytes: usize,
}

impl Default for SleepDesc {
    fn default() -> Self {
        Self {
            mode: SleepMode::Keep,
            max_piece_bytes: 64 << 20,
        }
    }
}

impl SleepDesc {
    /// Sleep keeping the data (the default).
    pub fn keep() -> Self {
        Self::default()
    }

    /// Sleep stashing the data away from the allocations
    /// ([`SleepMode::Stash`]).
    pub fn stash() -> Self {
        Self {
            mode: SleepMode::Stash,
            ..Self::default()
        }
    }

    /// Sleep discarding the data, in pieces of up to 256 MiB: with no copy
    /// to overlap, a discarding sleep and its wake cost per mapping (on an
    /// H100, 1.9 ms per GiB for both with 256 MiB pieces, 2.2 with 64 MiB).
    pub fn discard() -> Self {
        Self {
            mode: SleepMode::Discard,
            max_piece_bytes: 256 << 20,
        }
    }

    /// Sets the largest piece runs are joined into.
    pub fn max_piece_bytes(mut self, bytes: usize) -> Self {
        self.max_piece_bytes = bytes;
        self
    }
}

impl From<SleepMode> for SleepDesc {
    /// The default sleep of `mode` ([`SleepDesc::keep`],
    /// [`SleepDesc::stash`] or [`SleepDesc::discard`]).
    fn from(mode: SleepMode) -> Self {
        match mode {
            SleepMode::Discard => Self::discard(),
            mode => Self {
                mode,
                ..Self::default()
            },
        }
    }
}

/// How [`Arena::wake`] wakes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct WakeDesc {
    /// After a discarding sleep, fill the fresh memory with zeros (queued on
    /// the backend's stream and waited for). The other modes ignore it.
    pub zero: bool,
    /// After a stashing or pageable sleep, keep its host copy after the
    /// wake (torch_memory_saver's `retain_cpu_backup`): it stays readable
    /// ([`Arena::read_backup`], [`Arena::backup_address`], at the same host
    /// address) until the next sleep, which copies into the same memory
    /// where the runs match, or [`Arena::release_stash`]. Without it a
    /// pageable copy goes back to the system at the wake, and no backup is
    /// readable while awake. The other modes ignore it.
    pub keep_backup: bool,
    /// Also map fresh memory again over the whole free chunks the sleep
    /// gave back (where nothing was mapped since), free for the next
    /// allocations: the arena's footprint after the wake is the one before
    /// the sleep, as torch_memory_saver's resume maps back everything its
    /// pause unmapped, PyTorch's cached free blocks included. Without it
    /// only the bytes allocations hold are mapped, and free memory is
    /// mapped again when an allocation needs it. Best effort: what the
    /// budget or the device cannot hold stays unmapped, and the wake
    /// stands ([`SleepReport::free_bytes`] says what was mapped).
    pub restore_free: bool,
}

impl WakeDesc {
    /// A wake that zero-fills discarded memory.
    pub fn zeroed() -> Self {
        Self {
            zero: true,
            ..Self::default()
        }
    }

    /// A wake that keeps the host copy of a stashing or pageable sleep
    /// ([`keep_backup`](Self::keep_backup)).
    pub fn keeping_backup() -> Self {
        Self {
            keep_backup: true,
            ..Self::default()
        }
    }
}
