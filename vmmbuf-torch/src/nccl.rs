//! Keeping the plug-in's memory registered with NCCL communicators while it
//! grows, shrinks and sleeps (issue 24).
//!
//! PyTorch's `ProcessGroupNCCL.register_mem_pool` registers a pool's
//! segments as its caching layer sees them at the call: memory mapped later
//! is not registered (PyTorch PR #192112), and nothing deregisters a range
//! before the allocator unmaps it. Here one [`NcclHook`] per device is the
//! map hook of every arena of the device ([`vmmbuf::hook`]): each range the
//! arenas map is registered with every communicator added
//! ([`NcclHook::add`]), and deregistered before it is unmapped; a
//! communicator added later gets the ranges mapped so far at once, and one
//! removed ([`NcclHook::remove`]) has each of its registrations undone.
//!
//! The NCCL calls go to the library the process already loaded (PyTorch's:
//! a communicator belongs to the library instance that made it), found by
//! its name without loading another ([`NcclLib::loaded`]). They run in
//! CUDA's relaxed capture mode, as vmmbuf's own driver calls do, so that an
//! arena growing inside a CUDA graph capture cannot invalidate it through a
//! call the capture forbids (a precaution: NCCL 2.28's registration made
//! none in `test_growth_inside_a_cuda_graph_capture_is_registered`, with
//! the switch or without).

use std::collections::{BTreeMap, HashMap};

use parking_lot::Mutex;
use vmmbuf::hook::{MapHook, MappedRange};
use vmmbuf::{Error, Location, Result};

/// What the hook calls to register and deregister: NCCL ([`NcclLib`]), or a
/// test's recorder.
pub(crate) trait Registrar: Send + Sync + 'static {
    /// Registers `bytes` at `addr` with the communicator `comm`; NCCL's
    /// handle for the registration.
    fn register(&self, comm: usize, addr: u64, bytes: usize) -> std::result::Result<usize, String>;
    /// Undoes the registration `handle` of `comm`.
    fn deregister(&self, comm: usize, handle: usize) -> std::result::Result<(), String>;
}

/// Counters of a device's NCCL registrations (in the plug-in's statistics).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct NcclCounts {
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
    counts: NcclCounts,
}

/// The map hook of every arena of one device while communicators are
/// added: see the [module docs](self).
pub(crate) struct NcclHook<R: Registrar> {
    lib: R,
    st: Mutex<HookState>,
}

impl<R: Registrar> NcclHook<R> {
    /// A hook with no communicator yet, calling `lib`.
    pub(crate) fn new(lib: R) -> Self {
        Self {
            lib,
            st: Mutex::new(HookState {
                live: BTreeMap::new(),
                comms: Vec::new(),
                next_id: 1,
                counts: NcclCounts::default(),
            }),
        }
    }

    /// Registers one range with one communicator, counting the outcome.
    fn register(lib: &R, counts: &mut NcclCounts, c: &mut Comm, addr: u64, bytes: usize) {
        match lib.register(c.comm, addr, bytes) {
            Ok(h) => {
                c.handles.insert(addr, (bytes, h));
                counts.registrations += 1;
                counts.registered_bytes += bytes as u64;
            }
            Err(e) => {
                counts.failures += 1;
                tracing::warn!(error = %e, addr = format_args!("{addr:#x}"), bytes, comm = format_args!("{:#x}", c.comm),
                    "vmmbuf-torch: ncclCommRegister failed; the range stays unregistered with this communicator");
            }
        }
    }

    /// Undoes one registration, counting the outcome.
    fn deregister(lib: &R, counts: &mut NcclCounts, comm: usize, bytes: usize, handle: usize) {
        counts.registered_bytes -= bytes as u64;
        match lib.deregister(comm, handle) {
            Ok(()) => counts.deregistrations += 1,
            Err(e) => {
                counts.failures += 1;
                tracing::warn!(error = %e, comm = format_args!("{comm:#x}"),
                    "vmmbuf-torch: ncclCommDeregister failed");
            }
        }
    }

    /// Keeps every mapped range registered with `comm` from now on,
    /// registering those mapped already at once; the registration's id for
    /// [`remove`](Self::remove). A communicator added twice is refused.
    pub(crate) fn add(&self, comm: usize) -> Result<u64> {
        if comm == 0 {
            return Err(Error::InvalidArgument(
                "a null NCCL communicator (PyTorch creates a process group's communicator at its first collective, or at init_process_group with device_id)".into(),
            ));
        }
        let mut st = self.st.lock();
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
        let HookState { live, counts, .. } = &mut *st;
        Self::relaxed(|| {
            for (&addr, &bytes) in live.iter() {
                Self::register(&self.lib, counts, &mut c, addr, bytes);
            }
        });
        st.comms.push(c);
        st.counts.comms = st.comms.len();
        Ok(id)
    }

    /// Undoes every registration of the communicator added as `id` and
    /// stops registering with it. Call it before the communicator is
    /// destroyed (`destroy_process_group`). An unknown id is refused.
    pub(crate) fn remove(&self, id: u64) -> Result<()> {
        let mut st = self.st.lock();
        let Some(i) = st.comms.iter().position(|c| c.id == id) else {
            return Err(Error::InvalidArgument(format!(
                "no NCCL registration {id} (removed already, or never made)"
            )));
        };
        let c = st.comms.remove(i);
        st.counts.comms = st.comms.len();
        let counts = &mut st.counts;
        Self::relaxed(|| {
            for (_, (bytes, h)) in c.handles {
                Self::deregister(&self.lib, counts, c.comm, bytes, h);
            }
        });
        Ok(())
    }

    /// Whether no communicator is added.
    pub(crate) fn is_empty(&self) -> bool {
        self.st.lock().comms.is_empty()
    }

    /// The counters now.
    pub(crate) fn counts(&self) -> NcclCounts {
        self.st.lock().counts
    }

    /// Runs `f` in CUDA's relaxed capture mode where a driver is loaded (a
    /// failure to switch is logged, and `f` runs in the thread's mode).
    fn relaxed<T>(f: impl FnOnce() -> T) -> T {
        let _guard = match vmmbuf::cuda::RelaxedCapture::new() {
            Ok(g) => Some(g),
            Err(e) => {
                tracing::debug!(error = %e, "vmmbuf-torch: no relaxed capture mode for NCCL's calls");
                None
            }
        };
        f()
    }
}

impl<R: Registrar> MapHook for NcclHook<R> {
    fn mapped(&self, range: MappedRange) {
        // NCCL skips a registration with any host-backed chunk.
        if range.placement == Location::Host {
            return;
        }
        let mut st = self.st.lock();
        let HookState {
            live,
            comms,
            counts,
            ..
        } = &mut *st;
        live.insert(range.addr, range.bytes);
        counts.mapped_bytes += range.bytes as u64;
        if comms.is_empty() {
            return;
        }
        Self::relaxed(|| {
            for c in comms.iter_mut() {
                Self::register(&self.lib, counts, c, range.addr, range.bytes);
            }
        });
    }

    fn unmapping(&self, range: MappedRange) {
        let mut st = self.st.lock();
        let HookState {
            live,
            comms,
            counts,
            ..
        } = &mut *st;
        if live.remove(&range.addr).is_none() {
            return;
        }
        counts.mapped_bytes -= range.bytes as u64;
        Self::relaxed(|| {
            for c in comms.iter_mut() {
                if let Some((bytes, h)) = c.handles.remove(&range.addr) {
                    Self::deregister(&self.lib, counts, c.comm, bytes, h);
                }
            }
        });
    }
}

/// `ncclResult_t ncclCommRegister(ncclComm_t, void*, size_t, void**)`.
type RegisterFn = unsafe extern "C" fn(
    *mut std::ffi::c_void,
    *mut std::ffi::c_void,
    usize,
    *mut *mut std::ffi::c_void,
) -> std::ffi::c_int;
/// `ncclResult_t ncclCommDeregister(ncclComm_t, void*)`.
type DeregisterFn =
    unsafe extern "C" fn(*mut std::ffi::c_void, *mut std::ffi::c_void) -> std::ffi::c_int;

/// NCCL's registration calls, from a library already loaded.
pub(crate) struct NcclLib {
    register: RegisterFn,
    deregister: DeregisterFn,
    /// Keeps the library loaded while the hook may call it.
    #[cfg(unix)]
    _lib: libloading::os::unix::Library,
}

impl NcclLib {
    /// The NCCL the process loaded already (PyTorch's `libnccl.so.2`), or
    /// the library at `path` (the same file as the loaded one yields the
    /// same instance; another file, another NCCL, whose communicators are
    /// not PyTorch's). Nothing is loaded by name that is not loaded yet.
    #[cfg(unix)]
    pub(crate) fn loaded(path: Option<&str>) -> Result<Self> {
        use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};
        /// `dlopen`'s "only if loaded already" flag (glibc and musl).
        const RTLD_NOLOAD: std::ffi::c_int = 0x4;
        let (name, flags) = match path {
            Some(p) => (p, RTLD_NOW | RTLD_LOCAL),
            None => ("libnccl.so.2", RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD),
        };
        // SAFETY: FFI: dlopen of NCCL, which the process has loaded already
        // (RTLD_NOLOAD) or the caller names: its initialisers ran or are
        // NCCL's own, which run no code of ours.
        let lib = unsafe { Library::open(Some(name), flags) }.map_err(|e| Error::Unsupported {
            what: format!(
                "NCCL registration: {name} is not loaded in this process ({e}); import torch with CUDA first, or pass NCCL's path"
            ),
        })?;
        // SAFETY: FFI: the symbols' C signatures as nccl.h declares them
        // (ncclCommRegister since NCCL 2.19); the library stays loaded in
        // `_lib` as long as the pointers are used.
        let (register, deregister) = unsafe {
            let r = lib.get::<RegisterFn>(b"ncclCommRegister\0");
            let d = lib.get::<DeregisterFn>(b"ncclCommDeregister\0");
            match (r, d) {
                (Ok(r), Ok(d)) => (*r, *d),
                (Err(e), _) | (_, Err(e)) => {
                    return Err(Error::Unsupported {
                        what: format!(
                            "NCCL registration: {name} has no ncclCommRegister/ncclCommDeregister (NCCL 2.19 or later has them): {e}"
                        ),
                    })
                }
            }
        };
        Ok(Self {
            register,
            deregister,
            _lib: lib,
        })
    }

    /// NCCL registration needs `dlopen` (Unix).
    #[cfg(not(unix))]
    pub(crate) fn loaded(_path: Option<&str>) -> Result<Self> {
        Err(Error::Unsupported {
            what: "NCCL registration on this platform".into(),
        })
    }
}

impl Registrar for NcclLib {
    fn register(&self, comm: usize, addr: u64, bytes: usize) -> std::result::Result<usize, String> {
        let mut handle: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: FFI: `comm` is a live communicator of this NCCL (the
        // caller of `add` promised it and removes it before destroying it);
        // `addr..addr + bytes` is device memory mapped now (the arena calls
        // the hook after mapping it); `handle` is a valid out-pointer.
        let res = unsafe { (self.register)(comm as *mut _, addr as *mut _, bytes, &mut handle) };
        match res {
            0 => Ok(handle as usize),
            e => Err(format!("ncclCommRegister returned {e}")),
        }
    }

    fn deregister(&self, comm: usize, handle: usize) -> std::result::Result<(), String> {
        // SAFETY: FFI: a handle this communicator's ncclCommRegister gave,
        // undone once (the hook drops it from its table here).
        let res = unsafe { (self.deregister)(comm as *mut _, handle as *mut _) };
        match res {
            0 => Ok(()),
            e => Err(format!("ncclCommDeregister returned {e}")),
        }
    }
}

// SAFETY: the struct holds plain function pointers and a library handle;
// NCCL's registration calls may come from any thread (the hook makes them
// one at a time, under its lock).
unsafe impl Send for NcclLib {}
// SAFETY: as above.
unsafe impl Sync for NcclLib {}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// Records every call; refuses a registration at an address in `refuse`.
    #[derive(Default)]
    struct Recorder {
        calls: Mutex<Vec<(char, usize, u64, usize)>>,
        refuse: Mutex<Vec<u64>>,
        next: std::sync::atomic::AtomicUsize,
        /// handle -> (comm, addr) of registrations not yet undone.
        open: Mutex<HashMap<usize, (usize, u64)>>,
    }

    impl Registrar for Arc<Recorder> {
        fn register(
            &self,
            comm: usize,
            addr: u64,
            bytes: usize,
        ) -> std::result::Result<usize, String> {
            self.calls.lock().push(('r', comm, addr, bytes));
            if self.refuse.lock().contains(&addr) {
                return Err("refused".into());
            }
            let h = 1000 + self.next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            self.open.lock().insert(h, (comm, addr));
            Ok(h)
        }
        fn deregister(&self, comm: usize, handle: usize) -> std::result::Result<(), String> {
            let Some((c, addr)) = self.open.lock().remove(&handle) else {
                return Err(format!("handle {handle} is not open"));
            };
            assert_eq!(c, comm, "a handle undone with another communicator");
            self.calls.lock().push(('d', comm, addr, 0));
            Ok(())
        }
    }

    const HOST_AT: u64 = 1 << 40;

    fn dev(addr: u64, bytes: usize) -> MappedRange {
        MappedRange::new(addr, bytes, Location::Device(0))
    }

    /// Ranges mapped before and after each communicator is added are
    /// registered with it; an unmapping deregisters the range with every
    /// communicator; a removed communicator's registrations are all undone,
    /// and none is undone twice or with another communicator. Host ranges
    /// are never registered. Drawn over many orders of the same calls.
    #[test]
    fn every_mapped_device_range_is_registered_with_every_communicator() {
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut draw = |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        let mut seen = (0u64, 0u64, 0u64);
        for case in 0..200 {
            let rec = Arc::new(Recorder::default());
            let hook = NcclHook::new(rec.clone());
            let mut mapped: BTreeMap<u64, MappedRange> = BTreeMap::new();
            let mut comms: Vec<(u64, usize)> = Vec::new();
            let mut next_comm = 0x10usize;
            for _ in 0..60 {
                match draw(6) {
                    0 | 1 => {
                        let addr = (draw(64) + 1) << 21;
                        if mapped.contains_key(&addr) || mapped.contains_key(&(HOST_AT + addr)) {
                            continue;
                        }
                        // Host ranges lie apart, at and above HOST_AT:
                        // no registration may ever name an address there.
                        let r = if draw(5) == 0 {
                            MappedRange::new(HOST_AT + addr, 2 << 20, Location::Host)
                        } else {
                            dev(addr, (draw(3) as usize + 1) << 21)
                        };
                        hook.mapped(r);
                        mapped.insert(addr, r);
                    }
                    2 => {
                        if let Some(&a) = mapped.keys().nth(draw(mapped.len() as u64 + 1) as usize)
                        {
                            let r = mapped.remove(&a).unwrap();
                            hook.unmapping(r);
                        }
                    }
                    3 => {
                        next_comm += 1;
                        comms.push((hook.add(next_comm).unwrap(), next_comm));
                    }
                    4 => {
                        if !comms.is_empty() {
                            let (id, _) = comms.remove(draw(comms.len() as u64) as usize);
                            hook.remove(id).unwrap();
                            assert!(hook.remove(id).is_err(), "case {case}: removed twice");
                        }
                    }
                    _ => {
                        // NCCL refuses one device range's registrations.
                        if let Some(r) = mapped.values().find(|r| r.placement != Location::Host) {
                            rec.refuse.lock().push(r.addr);
                        }
                    }
                }
                // What is open is exactly each communicator's device ranges
                // that NCCL did not refuse.
                let refused = rec.refuse.lock().clone();
                let mut want: Vec<(usize, u64)> = comms
                    .iter()
                    .flat_map(|&(_, c)| {
                        mapped
                            .values()
                            .filter(|r| r.placement != Location::Host)
                            .map(move |r| (c, r.addr))
                    })
                    .collect();
                let mut open: Vec<(usize, u64)> = rec.open.lock().values().copied().collect();
                // A range refused after its registration stays registered.
                want.retain(|w| open.contains(w) || !refused.contains(&w.1));
                want.sort_unstable();
                open.sort_unstable();
                assert_eq!(open, want, "case {case}");
                let n = hook.counts();
                let dev_bytes: u64 = mapped
                    .values()
                    .filter(|r| r.placement != Location::Host)
                    .map(|r| r.bytes as u64)
                    .sum();
                assert_eq!(n.mapped_bytes, dev_bytes, "case {case}");
                let reg_bytes: u64 = open.iter().map(|(_, a)| mapped[a].bytes as u64).sum();
                assert_eq!(n.registered_bytes, reg_bytes, "case {case}");
                assert_eq!(n.comms, comms.len());
                assert_eq!(
                    n.registrations - n.deregistrations,
                    open.len() as u64,
                    "case {case}: {n:?}"
                );
            }
            assert!(
                rec.calls.lock().iter().all(|c| c.2 < HOST_AT),
                "case {case}: a host range was registered"
            );
            let n = hook.counts();
            seen.0 += n.deregistrations;
            seen.1 += n.failures;
            seen.2 += rec.calls.lock().iter().filter(|c| c.0 == 'r').count() as u64;
        }
        // The draws took every path: registrations, refusals, undoing.
        assert!(seen.0 > 0 && seen.1 > 0 && seen.2 > 0, "{seen:?}");
    }

    #[test]
    fn a_null_or_repeated_communicator_is_refused() {
        let hook = NcclHook::new(Arc::new(Recorder::default()));
        assert!(matches!(hook.add(0), Err(Error::InvalidArgument(_))));
        let id = hook.add(7).unwrap();
        let e = hook.add(7).unwrap_err().to_string();
        assert!(e.contains("registered already"), "{e}");
        hook.remove(id).unwrap();
        assert!(hook.is_empty());
        assert!(hook.add(7).is_ok(), "added again once removed");
    }
}
