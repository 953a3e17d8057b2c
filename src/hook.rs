//! [`MapHook`]: told when memory of an arena or a buffer becomes mapped and
//! before it stops being mapped, so that a library that registers memory
//! (NCCL's `ncclCommRegister`, an RDMA NIC's memory registration) follows a
//! range that grows, shrinks, sleeps and migrates.
//!
//! The rules a hook can rely on:
//! - [`MapHook::mapped`] comes after the range's chunks are mapped with
//!   their access set, and before the call that mapped them returns: no
//!   allocation in it has been handed out yet.
//! - Every range reported mapped is reported [`MapHook::unmapping`] exactly
//!   once, whole, with the same address and length, before any of its bytes
//!   is unmapped or moved to another chunk (a shrink, a release, a sleep, a
//!   migration, a drop). A hook can keep one registration per reported range
//!   and undo exactly that one.
//! - Arenas and buffers with a hook unmap only whole reported ranges while
//!   running (a range goes back once every byte of it is free and every use
//!   recorded on it has passed), so a range is never reported unmapping
//!   while vmmbuf knows of work on it. A migration or a sleep waits for the
//!   recorded uses of the whole arena or buffer first; the parts of a
//!   reported range that stay mapped (a migration of part of it) are
//!   reported again as new ranges afterwards.
//! - A range is one chunk: one physical allocation, of one placement.
//!   NCCL 2.28 maps at a peer only the one allocation that holds the
//!   buffer it is registering, and reuses that mapping for every later
//!   buffer in the same registration: a registration over two allocations
//!   gives peers wrong addresses for the second. NCCL skips a registration
//!   with any host-backed chunk, so a hook registers device ranges only.
//! - The calls are made with the arena's or buffer's lock held: a hook must
//!   not call back into the arena or buffer that called it.
//!
//! An arena with a hook hands out no block that straddles two chunks:
//! free blocks do not join across a chunk's start, and a request that
//! needs new memory gets one chunk of its own, whatever its size (and where
//! that would map more than 1.1x the peak allocated, whole free chunks go
//! back first: a chunk's free bytes serve only requests that fit in it). So every
//! tensor of such an arena lies in one reported range, on every process
//! alike. That matters for NCCL: each rank decides alone whether a buffer
//! is registered, and a collective in which one rank's buffer is and
//! another's is not (one rank's tensor across two registrations) is
//! undefined; ranks stop in it. A [`GrowableBuffer`](crate::GrowableBuffer)
//! maps a chunk at a time as it grows, so a tensor over its whole length
//! lies in several ranges.
//!
//! ```
//! # #[cfg(target_os = "linux")] {
//! use std::sync::Arc;
//! use vmmbuf::hook::{HookCall, RecordingHook};
//! use vmmbuf::host::HostStream;
//! use vmmbuf::{Arena, ArenaDesc, HostBackend};
//!
//! let arena: Arena<HostBackend, HostStream> =
//!     Arena::new(HostBackend::new(), ArenaDesc::new(1 << 30))?;
//! let hook = RecordingHook::new();
//! arena.set_map_hook(Some(hook.clone()))?;
//! let a = arena.alloc(3 << 20, &HostStream(0))?; // maps: the hook hears of it
//! let live = hook.live();
//! assert!(live.iter().any(|r| r.addr <= a.address() && a.address() + (3 << 20) <= r.end()));
//! drop(a);
//! arena.release_cached()?; // the range goes back whole: the hook hears first
//! assert!(hook.live().is_empty());
//! assert!(matches!(hook.calls().last(), Some(HookCall::Unmapping(_))));
//! hook.check().map_err(vmmbuf::Error::InvalidArgument)?;
//! # }
//! # Ok::<(), vmmbuf::Error>(())
//! ```
#![deny(unsafe_code)]

use crate::location::Location;

/// A range of a reservation whose chunks are mapped, all at one placement.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct MappedRange {
    /// The range's first address (device pointer, or host address with the
    /// host backend).
    pub addr: u64,
    /// Its length in bytes: whole chunks, a multiple of the granularity.
    pub bytes: usize,
    /// Where its chunks are placed.
    pub placement: Location,
}

impl MappedRange {
    /// A range of `bytes` at `addr`, placed at `placement`.
    pub fn new(addr: u64, bytes: usize, placement: Location) -> Self {
        Self {
            addr,
            bytes,
            placement,
        }
    }

    /// One past its last address.
    pub fn end(&self) -> u64 {
        self.addr + self.bytes as u64
    }
}

/// Told when memory of an arena ([`Arena::set_map_hook`](crate::Arena::set_map_hook))
/// or a buffer ([`GrowableBuffer::set_map_hook`](crate::GrowableBuffer::set_map_hook))
/// becomes mapped and before it stops being mapped. See the
/// [module docs](crate::hook) for the rules.
///
/// The calls cannot fail: a hook whose registration fails leaves the range
/// unregistered (NCCL then copies through its own buffers), logs, and is
/// still told when the range goes. A hook that panics has the panic caught
/// and logged; the arena or buffer goes on as if the call had returned.
pub trait MapHook: Send + Sync + 'static {
    /// `range` is mapped and accessible, and nothing in it is in use yet.
    fn mapped(&self, range: MappedRange);

    /// `range`, exactly as reported by [`mapped`](Self::mapped), is about to
    /// be unmapped or moved: every use vmmbuf knows of has passed.
    fn unmapping(&self, range: MappedRange);
}

/// A hook that records every call, for tests and for watching what a hook
/// would be told: [`calls`](Self::calls) lists them in order, and
/// [`live`](Self::live) the ranges reported mapped and not yet unmapping.
#[derive(Debug, Default)]
pub struct RecordingHook {
    calls: parking_lot::Mutex<Vec<HookCall>>,
}

/// One call a [`RecordingHook`] saw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HookCall {
    /// [`MapHook::mapped`].
    Mapped(MappedRange),
    /// [`MapHook::unmapping`].
    Unmapping(MappedRange),
}

impl RecordingHook {
    /// A hook with no calls yet.
    pub fn new() -> std::sync::Arc<Self> {
        std::sync::Arc::default()
    }

    /// Every call so far, in order.
    pub fn calls(&self) -> Vec<HookCall> {
        self.calls.lock().clone()
    }

    /// Takes the calls so far, leaving none.
    pub fn take(&self) -> Vec<HookCall> {
        std::mem::take(&mut *self.calls.lock())
    }

    /// The ranges reported mapped and not yet reported unmapping, in address
    /// order. Panics never; a call sequence that breaks the rules (an
    /// unmapping of a range not live, two live ranges that overlap) shows in
    /// [`check`](Self::check).
    pub fn live(&self) -> Vec<MappedRange> {
        let mut live = self.replay().0;
        live.sort_by_key(|r| r.addr);
        live
    }

    /// Checks the calls against the rules: every unmapping names a live
    /// range exactly, and live ranges never overlap. The first breach, said.
    pub fn check(&self) -> std::result::Result<(), String> {
        self.replay().1.map_or(Ok(()), Err)
    }

    /// The calls replayed: the ranges live at the end, and the first breach
    /// of the rules if any (the replay goes on past it).
    fn replay(&self) -> (Vec<MappedRange>, Option<String>) {
        let mut live: Vec<MappedRange> = Vec::new();
        let mut breach = None;
        for (i, c) in self.calls.lock().iter().enumerate() {
            match c {
                HookCall::Mapped(r) => {
                    if r.bytes == 0 {
                        breach.get_or_insert(format!("call {i}: an empty range reported mapped"));
                    }
                    if let Some(o) = live.iter().find(|l| l.addr < r.end() && r.addr < l.end()) {
                        breach.get_or_insert(format!(
                            "call {i}: {r:?} reported mapped while {o:?} is live and overlaps it"
                        ));
                    }
                    live.push(*r);
                }
                HookCall::Unmapping(r) => match live.iter().position(|l| l == r) {
                    Some(k) => {
                        live.swap_remove(k);
                    }
                    None => {
                        breach.get_or_insert(format!(
                            "call {i}: {r:?} reported unmapping, but no such range is live"
                        ));
                    }
                },
            }
        }
        (live, breach)
    }
}

impl MapHook for RecordingHook {
    fn mapped(&self, range: MappedRange) {
        self.calls.lock().push(HookCall::Mapped(range));
    }
    fn unmapping(&self, range: MappedRange) {
        self.calls.lock().push(HookCall::Unmapping(range));
    }
}

/// What the NCCL hook ([`crate::nccl::NcclHook`]) calls to register and
/// deregister: NCCL
/// (`backend::cuda::nccl::NcclLib`), or a test's recorder. Callers outside
/// the crate cannot implement it: a registrar's calls are trusted with the
/// communicators [`NcclHook::add`](crate::nccl::NcclHook::add) was given.
pub(crate) trait Registrar: Send + Sync + 'static {
    /// Registers `bytes` at `addr` with the communicator `comm`; NCCL's
    /// handle for the registration.
    fn register(&self, comm: usize, addr: u64, bytes: usize) -> std::result::Result<usize, String>;
    /// Undoes the registration `handle` of `comm`.
    fn deregister(&self, comm: usize, handle: usize) -> std::result::Result<(), String>;
}
