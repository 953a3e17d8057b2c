//! The error type of every fallible vmmbuf call.

/// `Result` with vmmbuf's [`Error`] as the default error type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in vmmbuf.
///
/// The variants separate what a caller can act on: [`Error::OutOfMemory`] is
/// transient (free something and retry), [`Error::ReservationExhausted`] can
/// never succeed for this buffer, [`Error::DriverUnavailable`] and
/// [`Error::VmmUnsupported`] mean "use another backend".
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The CUDA driver library could not be loaded or initialised.
    #[error("CUDA driver unavailable: {reason}")]
    DriverUnavailable {
        /// Why, in words.
        reason: String,
    },
    /// The device exists but does not support virtual memory management.
    #[error("device {device} does not support CUDA virtual memory management")]
    VmmUnsupported {
        /// The device's ordinal.
        device: u32,
    },
    /// A feature this backend or device does not offer (for example host
    /// placement on a GPU without host-NUMA VMM support).
    #[error("unsupported: {what}")]
    Unsupported {
        /// What was asked for.
        what: String,
    },
    /// The device ordinal does not name a device of this machine.
    #[error("no device {device}: this machine has {count}")]
    InvalidDevice {
        /// The ordinal asked for.
        device: u32,
        /// How many devices there are.
        count: u32,
    },
    /// Physical memory ran out. Transient: the buffer is unchanged, and the
    /// same call may succeed after memory is freed elsewhere.
    #[error("out of memory in {call} asking for {requested_bytes} bytes")]
    OutOfMemory {
        /// The driver or OS call that failed.
        call: &'static str,
        /// Bytes the failing step asked for.
        requested_bytes: usize,
    },
    /// An arena could not serve a request after giving back every cached
    /// chunk: the device is full, or the arena's budget or reservation is
    /// spent. Existing allocations are untouched. Transient
    /// ([`Error::is_transient`]) unless `never_fits`: a request larger than
    /// the budget, the arena's reservation or the device's total memory
    /// fails however often it is retried.
    #[error("{}", arena_oom_text(*requested_bytes, *reserved_bytes, *budget_bytes, *free_bytes, *total_bytes, *never_fits, *during_capture))]
    ArenaOutOfMemory {
        /// Bytes asked for.
        requested_bytes: usize,
        /// Free bytes on the device, where the backend can tell.
        free_bytes: Option<usize>,
        /// Total bytes of the device, where the backend can tell.
        total_bytes: Option<usize>,
        /// Bytes the arena has mapped.
        reserved_bytes: usize,
        /// The budget the arena maps under (its own, or the shared one it
        /// draws on: the tighter), if it has one.
        budget_bytes: Option<usize>,
        /// True when no retry can succeed: the request exceeds the budget,
        /// the arena's reservation (the part for its size) or the device's
        /// total memory.
        never_fits: bool,
        /// True when a CUDA graph capture was under way: the frees still in
        /// flight were not waited for (only a device synchronisation would
        /// have shown some of them finished, and a capture forbids one), so
        /// a retry after the capture may succeed.
        during_capture: bool,
    },
    /// The request can never fit in this buffer's reserved address range.
    /// Buffers never move; reserve more up front.
    #[error("{}", reservation_text(*requested_bytes, *reserved_bytes))]
    ReservationExhausted {
        /// Bytes asked for.
        requested_bytes: usize,
        /// Bytes reserved when the buffer was created.
        reserved_bytes: usize,
    },
    /// An argument was out of range, zero where it may not be, misaligned or
    /// overflowing.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// Any other CUDA driver failure: the call, and cudarc's error (its
    /// `CUresult`) as the source.
    #[error("{call} failed: {:?}", .source.0)]
    Driver {
        /// The driver entry point, e.g. `cuMemMap`.
        call: &'static str,
        /// The driver's result code, as cudarc reports it.
        #[source]
        source: cudarc::driver::DriverError,
    },
    /// The range spans chunks placed in host memory and chunks on a GPU. No
    /// view or `CudaSlice` may cover it: a driver copy over such a range
    /// crashes the process (seen with driver 580.159.04). Split it at
    /// `split_at`, where the placement changes.
    #[error("bytes {offset:#x}+{bytes:#x} span host and GPU chunks; split at {split_at:#x}")]
    MixedPlacement {
        /// Start of the range asked for.
        offset: usize,
        /// Its length.
        bytes: usize,
        /// The first offset where the placement changes.
        split_at: usize,
    },
    /// An earlier failure left this buffer in a state it could not undo (a
    /// chunk it could not unmap): every later call answers this instead of
    /// risking memory in use elsewhere. Dropping the buffer tries once more to
    /// give everything back.
    #[error("the buffer is poisoned: {reason}")]
    Poisoned {
        /// What went wrong, in words.
        reason: String,
    },
    /// The other process of a shared buffer is gone: its end of the socket
    /// closed (it exited or dropped it) before a whole message went across.
    /// Nothing was mapped or changed.
    #[error("the peer process is gone: {reason}")]
    PeerGone {
        /// What the socket said.
        reason: String,
    },
    /// What came over a shared buffer's socket is not a valid description of
    /// a buffer: a bad header, chunks that do not tile, a count of file
    /// descriptors that does not match, or a descriptor that is not the chunk
    /// it claims to be. Nothing was mapped; the descriptors received were
    /// closed.
    #[error("invalid shared-buffer message: {reason}")]
    Protocol {
        /// What was wrong, in words.
        reason: String,
    },
    /// A shared-buffer message older than what the importer already holds:
    /// generations only move forward. Nothing changed.
    #[error("stale generation {got}: the importer is at {have}")]
    StaleGeneration {
        /// The generation received.
        got: u64,
        /// The importer's generation.
        have: u64,
    },
    /// The call needs a device-wide synchronisation, which a CUDA graph
    /// capture under way forbids (CUDA would refuse it and invalidate the
    /// capture): nothing was changed. Call it again once the capture has
    /// ended.
    #[error("{what} needs a device synchronisation, which the CUDA graph capture under way forbids (it would invalidate the capture); nothing was changed: call it again after the capture")]
    CaptureUnderway {
        /// What needed the synchronisation.
        what: &'static str,
    },
    /// A disk backup could not be made in the spill directory (it does not
    /// exist, cannot be written, or the disk lacks the room): nothing was
    /// put to sleep by the failing step.
    #[error("cannot spill {bytes} bytes into {}: {source}", dir.display())]
    Spill {
        /// The spill directory.
        dir: std::path::PathBuf,
        /// The bytes the file needed.
        bytes: usize,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// An operating-system call of the host backend failed.
    #[error("{call} failed: {source}")]
    Os {
        /// The system call, e.g. `mmap`.
        call: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    /// True for failures that may succeed on retry once memory is freed (an
    /// [`Error::ArenaOutOfMemory`] that `never_fits` is not: a retry loop
    /// on this ends).
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            Error::OutOfMemory { .. }
                | Error::ArenaOutOfMemory {
                    never_fits: false,
                    during_capture: false,
                    ..
                }
        )
    }

    pub(crate) fn invalid(msg: impl Into<String>) -> Self {
        Error::InvalidArgument(msg.into())
    }

    /// A peer's message or handle that is not what was agreed (IPC: Unix).
    #[cfg_attr(not(unix), allow(dead_code))]
    pub(crate) fn protocol(msg: impl Into<String>) -> Self {
        Error::Protocol { reason: msg.into() }
    }
}

/// [`Error::ArenaOutOfMemory`]'s words: sizes in KiB..PiB, and only what
/// is known (no budget, no device figures on the host backend).
fn arena_oom_text(
    requested: usize,
    reserved: usize,
    budget: Option<usize>,
    free: Option<usize>,
    total: Option<usize>,
    never_fits: bool,
    during_capture: bool,
) -> String {
    use crate::report::Bytes;
    let mut s = format!(
        "arena out of memory: {} requested, {} mapped by the arena",
        Bytes(requested),
        Bytes(reserved)
    );
    if let Some(b) = budget {
        s += &format!(", budget {}", Bytes(b));
    }
    match (free, total) {
        (Some(f), Some(t)) => s += &format!(", device {} free of {}", Bytes(f), Bytes(t)),
        (Some(f), None) => s += &format!(", device {} free", Bytes(f)),
        (None, Some(t)) => s += &format!(", device of {}", Bytes(t)),
        (None, None) => {}
    }
    if never_fits {
        s += " (more than the budget, the reservation or the device holds: no retry can succeed)";
    }
    if during_capture {
        s += " (during a CUDA graph capture: frees still in flight were not waited for, since only a device synchronisation would show them finished and a capture forbids one)";
    }
    s
}

/// [`Error::ReservationExhausted`]'s words: a reservation the address
/// space refused (nothing reserved), or a growth past what was reserved.
fn reservation_text(requested: usize, reserved: usize) -> String {
    if reserved == 0 {
        format!(
            "a range of {} does not fit in the address space (a host process has about 128 TiB): ask for less",
            crate::report::Bytes(requested)
        )
    } else {
        format!(
            "{} does not fit in the {} reserved when the buffer was made (buffers never move: reserve more up front)",
            crate::report::Bytes(requested),
            crate::report::Bytes(reserved)
        )
    }
}

#[cfg(test)]
mod words {
    use super::*;

    #[test]
    fn out_of_memory_reads_in_a_users_words() {
        let e = Error::ArenaOutOfMemory {
            requested_bytes: 3 << 30,
            free_bytes: Some(1 << 30),
            total_bytes: Some(80 << 30),
            reserved_bytes: 64 << 20,
            budget_bytes: None,
            never_fits: false,
            during_capture: false,
        };
        assert_eq!(
            e.to_string(),
            "arena out of memory: 3.0 GiB requested, 64.0 MiB mapped by the arena, device 1.0 GiB free of 80.0 GiB"
        );
        let e = Error::ArenaOutOfMemory {
            requested_bytes: 4096,
            free_bytes: None,
            total_bytes: None,
            reserved_bytes: 0,
            budget_bytes: Some(2 << 20),
            never_fits: true,
            during_capture: false,
        };
        let t = e.to_string();
        assert!(!t.contains("Some") && !t.contains("None"), "{t}");
        assert!(
            t.contains("budget 2.0 MiB") && t.contains("no retry"),
            "{t}"
        );
    }

    #[test]
    fn sizes_and_reservations_read_in_a_users_words() {
        let e = Error::ReservationExhausted {
            requested_bytes: 1 << 47,
            reserved_bytes: 0,
        };
        assert_eq!(
            e.to_string(),
            "a range of 128.0 TiB does not fit in the address space (a host process has about 128 TiB): ask for less"
        );
        let e = Error::ReservationExhausted {
            requested_bytes: 3 << 20,
            reserved_bytes: 2 << 20,
        };
        assert!(
            e.to_string()
                .starts_with("3.0 MiB does not fit in the 2.0 MiB reserved"),
            "{e}"
        );
    }
}
