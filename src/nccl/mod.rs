//! Keeping an arena's or a buffer's memory registered with NCCL
//! communicators while it grows, shrinks, sleeps and migrates (issue 24):
//! [`NcclHook`], a [`MapHook`] that registers each device range with every
//! communicator added ([`NcclHook::add`]) when it is mapped, and
//! deregisters it before it is unmapped; a communicator added later gets
//! the ranges mapped so far at once, and one removed
//! ([`NcclHook::remove`]) has each of its registrations undone.
//!
//! The registrations are local (`ncclCommRegister`): each process makes
//! its own when its memory grows, with no collective call, so ranks that
//! grow at different times cannot deadlock. (NCCL's symmetric windows,
//! `ncclCommWindowRegister`, are collective and cannot follow one rank's
//! growth.) The NCCL calls go to a library already loaded in the process
//! ([`NcclHook::loaded`]: the communicator's own library instance, such as
//! PyTorch's or the one cudarc loaded), or to one named by path
//! ([`NcclHook::open`]). They run in CUDA's relaxed capture mode, as
//! vmmbuf's own driver calls do, so that an arena growing inside a CUDA
//! graph capture cannot invalidate it through a call the capture forbids
//! (a precaution: NCCL 2.28's registration made none in the Python
//! package's capture test, with the switch or without).
//!
//! Chunks NCCL can use are made by a backend created with
//! [`CudaBackendDesc::nccl_ready`](crate::cuda::CudaBackendDesc::nccl_ready).
//!
//! ```no_run
//! # fn main() -> vmmbuf::Result<()> {
//! use std::sync::Arc;
//! use vmmbuf::cuda::{CudaArena, CudaBackendDesc};
//! use vmmbuf::nccl::NcclHook;
//! use vmmbuf::{Arena, ArenaDesc, CudaBackend};
//!
//! let gpu = CudaBackend::with_desc(0, &CudaBackendDesc::nccl_ready())?;
//! let arena: CudaArena = Arena::new(gpu, ArenaDesc::new(64 << 30))?;
//! # let comm: *mut std::ffi::c_void = std::ptr::null_mut();
//! // `comm`: an ncclComm_t made by the NCCL this process loaded.
//! let hook = Arc::new(NcclHook::loaded()?);
//! // SAFETY: `comm` stays live until `remove` below.
//! let id = unsafe { hook.add(comm)? };
//! arena.set_map_hook(Some(hook.clone()))?;
//! // ... allocate, grow, run collectives over the arena's memory ...
//! hook.remove(id)?; // before the communicator is destroyed
//! # Ok(()) }
//! ```
#![deny(unsafe_code)]

use std::collections::{BTreeMap, HashMap};

use parking_lot::Mutex;

use crate::hook::{MapHook, MappedRange, Registrar};
use crate::{Error, Location, Result};

/// Counters of an [`NcclHook`]'s registrations.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct NcclCounts {
    /// Communicators whose registrations the hook keeps now.
    pub comms: usize,
    /// Registrations made (one per range and communicator).
    pub registrations: u64,
    /// Registrations undone (a range unmapping, a communicator removed).
    pub deregistrations: u64,
    /// Calls NCCL refused (logged): a range left unregistered with one
    /// communicator, or a registration NCCL would not undo.
    pub failures: u64,
    /// Bytes registered now, summed over communicators.
    pub registered_bytes: u64,
    /// Device bytes mapped now in ranges the hook was told of.
    pub mapped_bytes: u64,
    /// Those ranges, counted.
    pub mapped_ranges: usize,
}

/// One communicator's registrations: address -> (bytes, NCCL's handle).
struct Comm {
    id: u64,
    comm: usize,
    handles: HashMap<u64, (usize, usize)>,
}

struct HookState {
    /// Device ranges mapped now (address -> bytes), as the arenas reported
    /// them.
    live: BTreeMap<u64, usize>,
    comms: Vec<Comm>,
    next_id: u64,
    /// The counters kept call by call; `comms` and the mapped figures
    /// stay 0 here and are derived in [`NcclHook::counts`].
    counts: NcclCounts,
}

/// A map hook that keeps every device range it is told of registered with
/// each NCCL communicator added: see the [module docs](self). Give it to
/// an arena or a buffer (`set_map_hook`), or to several.
pub struct NcclHook {
    lib: Box<dyn Registrar>,
    st: Mutex<HookState>,
}

impl std::fmt::Debug for NcclHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclHook")
            .field("counts", &self.counts())
            .finish()
    }
}

impl NcclHook {
    /// A hook calling the NCCL this process has loaded already
    /// (`libnccl.so.2`, found without loading another: a communicator
    /// belongs to the library instance that made it).
    /// [`Error::Unsupported`] if none is loaded, or it has no
    /// `ncclCommRegister` (NCCL before 2.19), or off Unix.
    pub fn loaded() -> Result<Self> {
        Ok(Self::with(crate::backend::cuda::nccl::NcclLib::loaded(
            None,
        )?))
    }

    /// A hook calling the NCCL library at `path` (the same file as a
    /// loaded one is that same instance; another file is another NCCL,
    /// whose communicators are not the loaded one's).
    pub fn open(path: &str) -> Result<Self> {
        Ok(Self::with(crate::backend::cuda::nccl::NcclLib::loaded(
            Some(path),
        )?))
    }

    /// A hook with no communicator yet, calling `lib`.
    pub(crate) fn with(lib: impl Registrar) -> Self {
        Self {
            lib: Box::new(lib),
            st: Mutex::new(HookState {
                live: BTreeMap::new(),
                comms: Vec::new(),
                next_id: 1,
                counts: NcclCounts::default(),
            }),
        }
    }

    /// Registers one range with one communicator, counting the outcome.
    fn register(
        lib: &dyn Registrar,
        counts: &mut NcclCounts,
        c: &mut Comm,
        addr: u64,
        bytes: usize,
    ) {
        match lib.register(c.comm, addr, bytes) {
            Ok(h) => {
                c.handles.insert(addr, (bytes, h));
                counts.registrations += 1;
                counts.registered_bytes += bytes as u64;
            }
            Err(e) => {
                counts.failures += 1;
                tracing::warn!(error = %e, addr = format_args!("{addr:#x}"), bytes, comm = format_args!("{:#x}", c.comm),
                    "vmmbuf: ncclCommRegister failed; the range stays unregistered with this communicator");
            }
        }
    }

    /// Undoes one registration, counting the outcome.
    fn deregister(
        lib: &dyn Registrar,
        counts: &mut NcclCounts,
        comm: usize,
        bytes: usize,
        handle: usize,
    ) {
        counts.registered_bytes -= bytes as u64;
        match lib.deregister(comm, handle) {
            Ok(()) => counts.deregistrations += 1,
            Err(e) => {
                counts.failures += 1;
                tracing::warn!(error = %e, comm = format_args!("{comm:#x}"),
                    "vmmbuf: ncclCommDeregister failed");
            }
        }
    }

    /// Keeps every device range the hook is told of registered with the
    /// communicator `comm` from now on, registering those mapped already
    /// at once; the id to [`remove`](Self::remove) it with. A null
    /// communicator, or one added already, is refused. A registration NCCL
    /// refuses leaves that range unregistered with `comm` (NCCL then copies
    /// through its own buffers), is logged and counted
    /// ([`NcclCounts::failures`]).
    ///
    /// # Safety
    ///
    /// `comm` must be an `ncclComm_t` of the library this hook calls, live
    /// until [`remove`](Self::remove) is called with the id returned: the
    /// hook calls NCCL with it whenever memory is mapped or unmapped.
    #[allow(unsafe_code)]
    pub unsafe fn add(&self, comm: *mut std::ffi::c_void) -> Result<u64> {
        let comm = comm as usize;
        if comm == 0 {
            return Err(Error::InvalidArgument(
                "a null NCCL communicator (PyTorch creates a process group's communicator at its first collective, or at init_process_group with device_id)".into(),
            ));
        }
        let st = &mut *self.st.lock();
        if st.comms.iter().any(|c| c.comm == comm) {
            return Err(Error::InvalidArgument(format!(
                "NCCL communicator {comm:#x} is registered already"
            )));
        }
        let id = st.next_id;
        st.next_id += 1;
        let mut c = Comm {
            id,
            comm,
            handles: HashMap::new(),
        };
        Self::relaxed(|| {
            for (&addr, &bytes) in &st.live {
                Self::register(&*self.lib, &mut st.counts, &mut c, addr, bytes);
            }
        });
        st.comms.push(c);
        Ok(id)
    }

    /// Undoes every registration of the communicator added as `id` and
    /// stops registering with it. Call it before the communicator is
    /// destroyed. An unknown id is refused.
    pub fn remove(&self, id: u64) -> Result<()> {
        let st = &mut *self.st.lock();
        let Some(i) = st.comms.iter().position(|c| c.id == id) else {
            return Err(Error::InvalidArgument(format!(
                "no NCCL registration {id} (removed already, or never made)"
            )));
        };
        let c = st.comms.remove(i);
        Self::relaxed(|| {
            for (_, (bytes, h)) in c.handles {
                Self::deregister(&*self.lib, &mut st.counts, c.comm, bytes, h);
            }
        });
        Ok(())
    }

    /// Whether no communicator is added.
    pub fn is_empty(&self) -> bool {
        self.st.lock().comms.is_empty()
    }

    /// The counters now.
    pub fn counts(&self) -> NcclCounts {
        let st = self.st.lock();
        NcclCounts {
            comms: st.comms.len(),
            mapped_bytes: st.live.values().map(|&b| b as u64).sum(),
            mapped_ranges: st.live.len(),
            ..st.counts
        }
    }

    /// Whether `[addr, addr + bytes)` lies in one range registered with
    /// every communicator added (and there is one): a tensor NCCL can use
    /// zero-copy, where its registrations matter.
    pub fn covers(&self, addr: u64, bytes: usize) -> bool {
        let st = self.st.lock();
        let end = addr + bytes as u64;
        let Some((&a, &len)) = st.live.range(..=addr).next_back() else {
            return false;
        };
        !st.comms.is_empty()
            && end <= a + len as u64
            && st.comms.iter().all(|c| c.handles.contains_key(&a))
    }

    /// Runs `f` in CUDA's relaxed capture mode where a driver is loaded (a
    /// failure to switch is logged, and `f` runs in the thread's mode).
    fn relaxed<T>(f: impl FnOnce() -> T) -> T {
        let _guard = match crate::cuda::RelaxedCapture::new() {
            Ok(g) => Some(g),
            Err(e) => {
                tracing::debug!(error = %e, "vmmbuf: no relaxed capture mode for NCCL's calls");
                None
            }
        };
        f()
    }
}

impl MapHook for NcclHook {
    fn mapped(&self, range: MappedRange) {
        // NCCL skips a registration with any host-backed chunk.
        if range.placement == Location::Host {
            return;
        }
        let st = &mut *self.st.lock();
        st.live.insert(range.addr, range.bytes);
        if st.comms.is_empty() {
            return;
        }
        Self::relaxed(|| {
            for c in &mut st.comms {
                Self::register(&*self.lib, &mut st.counts, c, range.addr, range.bytes);
            }
        });
    }

    fn unmapping(&self, range: MappedRange) {
        let st = &mut *self.st.lock();
        if st.live.remove(&range.addr).is_none() {
            return;
        }
        Self::relaxed(|| {
            for c in &mut st.comms {
                if let Some((bytes, h)) = c.handles.remove(&range.addr) {
                    Self::deregister(&*self.lib, &mut st.counts, c.comm, bytes, h);
                }
            }
        });
    }
}

#[cfg(test)]
mod tests;
