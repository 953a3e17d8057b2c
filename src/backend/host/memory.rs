//! The host backend's tokens and their OS errors: a reservation (an
//! `mmap(PROT_NONE)` range with the table of what is mapped in it) and a
//! chunk (a memfd), each counted in the backend's live counts and given
//! back when it drops.
#![allow(unsafe_code)]

use std::os::fd::OwnedFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use rustix::mm::ProtFlags;

use super::super::Counters;
use crate::error::{Error, Result};
use crate::location::{Access, Location};
use crate::table::ChunkTable;

/// An OS error as vmmbuf's: out of memory (transient) for what more memory
/// or fewer mappings can cure (ENOMEM, also what `vm.max_map_count` gives;
/// ENOSPC); anything else, too many open files included, as it is.
pub(super) fn os(call: &'static str, e: rustix::io::Errno, requested_bytes: usize) -> Error {
    if e == rustix::io::Errno::NOMEM || e == rustix::io::Errno::NOSPC {
        Error::OutOfMemory {
            call,
            requested_bytes,
        }
    } else {
        Error::Os {
            call,
            source: e.into(),
        }
    }
}

/// The error of a failed reservation: ENOMEM for more than the process's
/// whole address space (47 bits on x86-64 and most arm64 kernels) can never
/// succeed; below that it may be `vm.max_map_count` or a passing shortage,
/// so it is out of memory (transient).
pub(super) fn reserve_error(e: rustix::io::Errno, bytes: usize) -> Error {
    if e == rustix::io::Errno::NOMEM && bytes as u64 >= 1 << 47 {
        Error::ReservationExhausted {
            requested_bytes: bytes,
            reserved_bytes: 0,
        }
    } else {
        os("mmap", e, bytes)
    }
}

/// Checks that `[offset, offset + bytes)` is mapped without a gap and that
/// the host may do `need` there.
pub(super) fn host_range(
    table: &ChunkTable<MappedFlag>,
    offset: usize,
    bytes: usize,
    need: Access,
) -> Result<()> {
    table.covering(offset, bytes, false)?;
    table.check_access(offset, bytes, Location::Host, need)
}

pub(super) fn prot(access: Access) -> ProtFlags {
    match access {
        Access::None => ProtFlags::empty(),
        Access::Read => ProtFlags::READ,
        Access::ReadWrite => ProtFlags::READ | ProtFlags::WRITE,
    }
}

/// A reserved range of the process's address space.
#[derive(Debug)]
pub struct HostReservation {
    pub(super) base: NonNull<u8>,
    pub(super) table: ChunkTable<MappedFlag>,
    pub(super) counters: Arc<Counters>,
}

// SAFETY: the token owns its address range exclusively; the raw pointer is only
// an address, and every access through it happens in the host backend under `&mut`
// for writes or `&` for reads, so moving or sharing the token between threads
// is no different from moving or sharing a `Vec<u8>`.
unsafe impl Send for HostReservation {}
// SAFETY: see `Send`; `&HostReservation` only permits reads of the range.
unsafe impl Sync for HostReservation {}

impl HostReservation {
    pub(super) fn addr(&self, offset: usize) -> *mut std::ffi::c_void {
        self.base.as_ptr().wrapping_add(offset).cast()
    }
}

impl Drop for HostReservation {
    fn drop(&mut self) {
        // SAFETY: the token owns [base, base + bytes) exclusively and is going
        // away; unmapping it whole also drops any chunk mappings left in it.
        let unmapped =
            unsafe { rustix::mm::munmap(self.base.as_ptr().cast(), self.table.reserved()) };
        if let Err(e) = unmapped {
            tracing::error!(error = %e, "vmmbuf host: munmap of a reservation failed in drop");
        }
        for (_, e) in self.table.iter() {
            e.chunk.fetch_sub(1, Ordering::SeqCst);
        }
        let mapped = self.table.mapped_bytes();
        let bytes = self.table.reserved();
        self.counters.update(|c| {
            c.reservations -= 1;
            c.reserved_bytes -= bytes;
            c.mapped_bytes -= mapped;
        });
    }
}

/// How many mappings a chunk has now, shared by the chunk and the tables of
/// the reservations that map it: one at most, unless the backend maps
/// chunks twice ([`HostBackend::mapping_chunks_twice`]; the pages are the
/// memfd's, shared by every mapping).
pub(super) type MappedFlag = Arc<AtomicUsize>;

/// A physical chunk of host memory: a memfd of the chunk's size.
#[derive(Debug)]
pub struct HostChunk {
    pub(super) fd: OwnedFd,
    pub(super) bytes: usize,
    pub(super) mapped: MappedFlag,
    pub(super) counters: Arc<Counters>,
    /// Sealed against shrinking and growing, so that another process may
    /// map it: an importer's mapping cannot lose its pages under it.
    pub(super) sealed: bool,
    /// Never reused in this process ([`super::next_chunk_id`]).
    pub(super) id: u64,
}

impl Drop for HostChunk {
    fn drop(&mut self) {
        let bytes = self.bytes;
        self.counters.update(|c| {
            c.chunks -= 1;
            c.chunk_bytes -= bytes;
        });
    }
}

impl super::HostBackend {
    /// A memfd chunk of `bytes`; `sealed`: sealed against resizing, so that
    /// another process may map it.
    pub(super) fn memfd_chunk(
        &self,
        bytes: usize,
        placement: Location,
        sealed: bool,
    ) -> Result<HostChunk> {
        use rustix::fs::{MemfdFlags, SealFlags};
        self.check_host(placement)?;
        super::super::check_chunk(bytes, self.granularity)?;
        let flags = if sealed {
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING
        } else {
            MemfdFlags::CLOEXEC
        };
        let fd =
            rustix::fs::memfd_create("vmmbuf", flags).map_err(|e| os("memfd_create", e, bytes))?;
        rustix::fs::ftruncate(&fd, bytes as u64).map_err(|e| os("ftruncate", e, bytes))?;
        if sealed {
            rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
                .map_err(|e| os("fcntl(F_ADD_SEALS)", e, bytes))?;
        }
        let id = super::super::next_chunk_id();
        self.counters.update(|c| {
            c.chunks += 1;
            c.chunk_bytes += bytes;
        });
        Ok(HostChunk {
            fd,
            bytes,
            mapped: MappedFlag::default(),
            counters: self.counters.clone(),
            sealed,
            id,
        })
    }
}

/// Lifts this process's soft limit of open descriptors to its hard limit:
/// every chunk of the host backend is a memfd, and an arena of many small
/// chunks (a replayed training trace: about two thousand at its peak) runs
/// past the usual soft limit of 1024. Best effort: a refusal leaves the
/// limit as it was.
pub fn raise_fd_limit() {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let l = getrlimit(Resource::Nofile);
    let _ = setrlimit(
        Resource::Nofile,
        Rlimit {
            current: l.maximum,
            maximum: l.maximum,
        },
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustix::io::Errno;

    #[test]
    fn errors_say_what_can_be_cured() {
        // vm.max_map_count and a passing shortage look alike: transient.
        assert!(reserve_error(Errno::NOMEM, 1 << 40).is_transient());
        assert!(matches!(
            reserve_error(Errno::NOMEM, 1 << 47),
            Error::ReservationExhausted { .. }
        ));
        assert!(os("mmap", Errno::NOMEM, 1).is_transient());
        let mfile = os("memfd_create", Errno::MFILE, 1);
        assert!(
            matches!(
                mfile,
                Error::Os {
                    call: "memfd_create",
                    ..
                }
            ) && !mfile.is_transient()
        );
    }
}
