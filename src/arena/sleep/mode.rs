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
}

impl SleepMode {
    /// Every mode, in the order of their [`code`](Self::code)s.
    pub const ALL: [SleepMode; 3] = [SleepMode::Keep, SleepMode::Discard, SleepMode::Stash];

    /// The mode's name, one spelling everywhere: the Python package's
    /// `mode=`, its statistics, and [`Display`](std::fmt::Display):
    /// `"keep"`, `"stash"`, `"discard"`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Keep => "keep",
            Self::Stash => "stash",
            Self::Discard => "discard",
        }
    }

    /// The mode's number in the PyTorch plug-in's C functions
    /// (`vmmbuf_sleep`'s `mode`, `VMMBUF_KEEP` 0, `VMMBUF_DISCARD` 1,
    /// `VMMBUF_STASH` 2).
    pub fn code(self) -> i32 {
        match self {
            Self::Keep => 0,
            Self::Discard => 1,
            Self::Stash => 2,
        }
    }

    /// The mode numbered `code` (see [`code`](Self::code)), if any.
    pub fn from_code(code: i32) -> Option<Self> {
        Self::ALL.into_iter().find(|m| m.code() == code)
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
    /// naming the three.
    fn from_str(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "sleep mode {s:?}: \"keep\", \"stash\" or \"discard\""
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
        assert_eq!(SleepMode::ALL.map(|m| m.code()), [0, 1, 2]);
        assert!("Keep".parse::<SleepMode>().is_err());
        assert!("".parse::<SleepMode>().is_err());
        assert_eq!(SleepMode::from_code(3), None);
        assert_eq!(SleepMode::from_code(-1), None);
    }
}
