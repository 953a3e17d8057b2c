//! What a sleep does with the data: one mode type, one name and one
//! number for each mode, across Rust, the C functions and Python.

use crate::error::{Error, Result};

/// What a sleep does with the data.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum SleepMode {
    /// Every chunk moves to pinned host memory with its data, at the same
    /// address (vLLM's sleep level 1, torch_memory_saver with a CPU
    /// backup). Kernels and the CPU still reach the allocations while
    /// asleep, over the bus.
    #[default]
    Keep,
    /// The data is copied to pinned host memory mapped away from the
    /// allocations (a stash the arena keeps from one sleep to the next),
    /// and the allocations' ranges are unmapped until the wake, as
    /// torch_memory_saver's and vLLM's backups leave them: touching one
    /// before the wake faults. One copy each way and no host-memory grant
    /// per sleep (which costs ~12-20 ms per GiB on an H100, per mapping):
    /// the fastest way to keep the data.
    Stash,
    /// Every chunk is unmapped and given back without a copy (vLLM's level
    /// 2, torch_memory_saver without a backup): for KV caches and
    /// activations. The wake maps fresh memory at the same addresses; what
    /// it holds is undefined (zeros with [`WakeDesc::zero`](super::WakeDesc::zero)). Touching a
    /// discarded allocation before the wake faults.
    Discard,
    /// The data is copied to pageable host memory (an anonymous mapping of
    /// its own, no pinned memory taken) and the allocations' ranges are
    /// unmapped until the wake, which copies it back and gives that memory
    /// to the system (`munmap`): the process's resident memory grows by the
    /// data while asleep and falls at the wake (torch_memory_saver's
    /// `cpu_backup_backend="mmap"`). Slower copies than [`Stash`](Self::Stash)
    /// (the driver stages pageable memory), for hosts where pinned memory is
    /// scarce or must not stay resident.
    Pageable,
    /// As [`Pageable`](Self::Pageable), in files of the arena's spill
    /// directory instead ([`Arena::set_spill_dir`](crate::Arena::set_spill_dir);
    /// one file per chunk, mapped shared: the system writes them back and
    /// may evict them from memory), removed at the wake: for data larger
    /// than host memory allows (torch_memory_saver's disk backup). A sleep
    /// without a spill directory is refused.
    Disk,
}

impl SleepMode {
    /// Every mode, in the order of their [`code`](Self::code)s.
    pub const ALL: [SleepMode; 5] = [
        SleepMode::Keep,
        SleepMode::Discard,
        SleepMode::Stash,
        SleepMode::Pageable,
        SleepMode::Disk,
    ];

    /// The mode's name, one spelling everywhere: the Python package's
    /// `mode=`, its statistics, and [`Display`](std::fmt::Display):
    /// `"keep"`, `"stash"`, `"discard"`, `"pageable"`, `"disk"`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Keep => "keep",
            Self::Stash => "stash",
            Self::Discard => "discard",
            Self::Pageable => "pageable",
            Self::Disk => "disk",
        }
    }

    /// The mode's number in the PyTorch plug-in's C functions
    /// (`vmmbuf_sleep`'s `mode`, `VMMBUF_KEEP` 0, `VMMBUF_DISCARD` 1,
    /// `VMMBUF_STASH` 2, `VMMBUF_PAGEABLE` 3, `VMMBUF_DISK` 4).
    pub fn code(self) -> i32 {
        match self {
            Self::Keep => 0,
            Self::Discard => 1,
            Self::Stash => 2,
            Self::Pageable => 3,
            Self::Disk => 4,
        }
    }

    /// The mode numbered `code` (see [`code`](Self::code)), if any.
    pub fn from_code(code: i32) -> Option<Self> {
        Self::ALL.into_iter().find(|m| m.code() == code)
    }
}

impl SleepMode {
    /// Whether the sleep copies the data to host buffers of its own
    /// ([`Pageable`](Self::Pageable), [`Disk`](Self::Disk)).
    pub(crate) fn pages(self) -> bool {
        matches!(self, Self::Pageable | Self::Disk)
    }
}

impl std::fmt::Display for SleepMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for SleepMode {
    type Err = Error;

    /// A mode by its [`name`](SleepMode::name); anything else is refused,
    /// naming them.
    fn from_str(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "sleep mode {s:?}: \"keep\", \"stash\", \"discard\", \"pageable\" or \"disk\""
                ))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::SleepMode;

    /// Each mode's name and number lead back to it; nothing else does.
    #[test]
    fn a_mode_is_one_name_and_one_number() {
        for m in SleepMode::ALL {
            assert_eq!(m.name().parse::<SleepMode>().unwrap(), m);
            assert_eq!(SleepMode::from_code(m.code()), Some(m));
            assert_eq!(m.to_string(), m.name());
        }
        assert_eq!(SleepMode::ALL.map(|m| m.code()), [0, 1, 2, 3, 4]);
        assert!("Keep".parse::<SleepMode>().is_err());
        assert!("".parse::<SleepMode>().is_err());
        assert_eq!(SleepMode::from_code(5), None);
        assert_eq!(SleepMode::from_code(-1), None);
    }
}
