//! NCCL for the tests and the bandwidth bench (`benches/nccl.rs` includes
//! this file): a communicator per process, and [`NcclRegistrar`], the map
//! hook that keeps an arena or a buffer registered with NCCL
//! (`ncclCommRegister` on every device range reported mapped,
//! `ncclCommDeregister` before it goes). NCCL is loaded at run time
//! (cudarc's loader looks for `libnccl.so`: PyTorch's wheel ships one under
//! `site-packages/nvidia/nccl/lib`; put a `libnccl.so` link to it on
//! `LD_LIBRARY_PATH`).
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};

use cudarc::nccl::sys;
use vmmbuf::hook::{MapHook, MappedRange};
use vmmbuf::Location;

/// A communicator, destroyed on drop.
pub struct Comm(pub sys::ncclComm_t);

// SAFETY: an NCCL communicator may be used from any thread, one call at a
// time; the tests and the bench make NCCL calls from one thread per process
// (the hook's calls come under the arena's lock).
unsafe impl Send for Comm {}
// SAFETY: as above.
unsafe impl Sync for Comm {}

impl Drop for Comm {
    fn drop(&mut self) {
        // SAFETY: a communicator from ncclCommInitRank, destroyed once.
        let r = unsafe { sys::ncclCommDestroy(self.0) };
        if r != sys::ncclResult_t::ncclSuccess {
            eprintln!("ncclCommDestroy: {r:?}");
        }
    }
}

/// An NCCL result as `Result`, naming the call.
pub fn check(call: &str, r: sys::ncclResult_t) -> Result<(), String> {
    if r == sys::ncclResult_t::ncclSuccess {
        Ok(())
    } else {
        Err(format!("{call}: {r:?}"))
    }
}

/// Whether libnccl loads here, and its version, or why not.
pub fn version() -> Result<i32, String> {
    // SAFETY: opens the library by each candidate name; nothing else.
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        return Err(
            "libnccl could not be loaded (put a libnccl.so on LD_LIBRARY_PATH: \
             PyTorch's wheel ships one under site-packages/nvidia/nccl/lib)"
                .into(),
        );
    }
    let mut v = 0;
    // SAFETY: a valid out-pointer.
    check("ncclGetVersion", unsafe { sys::ncclGetVersion(&mut v) })?;
    Ok(v)
}

/// A new unique id, as hex (for a child's environment).
pub fn unique_id_hex() -> Result<String, String> {
    version()?;
    // SAFETY: plain C data, all-zero valid; filled in by NCCL.
    let mut id: sys::ncclUniqueId = unsafe { std::mem::zeroed() };
    // SAFETY: a valid out-pointer.
    check("ncclGetUniqueId", unsafe { sys::ncclGetUniqueId(&mut id) })?;
    Ok(id
        .internal
        .iter()
        .map(|&c| format!("{:02x}", c as u8))
        .collect())
}

/// Joins the communicator of `ranks` ranks with id `uid_hex` as `rank`, on
/// the current CUDA context's device.
pub fn join(uid_hex: &str, ranks: i32, rank: i32) -> Result<Comm, String> {
    // SAFETY: plain C data, all-zero valid.
    let mut id: sys::ncclUniqueId = unsafe { std::mem::zeroed() };
    if uid_hex.len() != 2 * id.internal.len() {
        return Err(format!("a unique id of {} hex digits", uid_hex.len()));
    }
    for (i, c) in id.internal.iter_mut().enumerate() {
        *c = u8::from_str_radix(&uid_hex[2 * i..2 * i + 2], 16).map_err(|e| e.to_string())?
            as std::ffi::c_char;
    }
    let mut comm: sys::ncclComm_t = std::ptr::null_mut();
    // SAFETY: a valid out-pointer and an id from ncclGetUniqueId.
    check("ncclCommInitRank", unsafe {
        sys::ncclCommInitRank(&mut comm, ranks, id, rank)
    })?;
    Ok(Comm(comm))
}

/// Sum-all-reduces `count` f32s from `send` into `recv` (the same address
/// for in place) on `stream`.
///
/// # Safety
/// `send` and `recv` hold `count` f32s of device memory that stays mapped
/// until the stream's work has finished; `comm` is this process's.
pub unsafe fn all_reduce_f32(
    comm: &Comm,
    send: u64,
    recv: u64,
    count: usize,
    stream: sys::cudaStream_t,
) -> Result<(), String> {
    // SAFETY: forwarded to the caller.
    let r = unsafe {
        sys::ncclAllReduce(
            send as *const _,
            recv as *mut _,
            count,
            sys::ncclDataType_t::ncclFloat32,
            sys::ncclRedOp_t::ncclSum,
            comm.0,
            stream,
        )
    };
    check("ncclAllReduce", r)
}

/// All-gathers `send_count` f32s of each rank's `send` into `recv` (ranks x
/// `send_count` f32s) on `stream`.
///
/// # Safety
/// As [`all_reduce_f32`], for `send_count` f32s at `send` and ranks times
/// that at `recv`.
pub unsafe fn all_gather_f32(
    comm: &Comm,
    send: u64,
    recv: u64,
    send_count: usize,
    stream: sys::cudaStream_t,
) -> Result<(), String> {
    // SAFETY: forwarded to the caller.
    let r = unsafe {
        sys::ncclAllGather(
            send as *const _,
            recv as *mut _,
            send_count,
            sys::ncclDataType_t::ncclFloat32,
            comm.0,
            stream,
        )
    };
    check("ncclAllGather", r)
}

/// The map hook that registers device ranges with a communicator.
pub struct NcclRegistrar {
    comm: sys::ncclComm_t,
    /// address -> (bytes, NCCL's handle)
    regs: parking_lot::Mutex<BTreeMap<u64, (usize, usize)>>,
    pub registered: AtomicUsize,
    pub deregistered: AtomicUsize,
    pub skipped_host: AtomicUsize,
    pub failures: parking_lot::Mutex<Vec<String>>,
}

// SAFETY: see `Comm`; the registrar's NCCL calls are made under the lock of
// the arena or buffer that calls it.
unsafe impl Send for NcclRegistrar {}
// SAFETY: as above.
unsafe impl Sync for NcclRegistrar {}

impl NcclRegistrar {
    /// A registrar for `comm`, which must outlive it.
    pub fn new(comm: &Comm) -> std::sync::Arc<Self> {
        std::sync::Arc::new(Self {
            comm: comm.0,
            regs: Default::default(),
            registered: AtomicUsize::new(0),
            deregistered: AtomicUsize::new(0),
            skipped_host: AtomicUsize::new(0),
            failures: Default::default(),
        })
    }

    /// The registered ranges, `(address, bytes)`.
    pub fn ranges(&self) -> Vec<(u64, usize)> {
        self.regs
            .lock()
            .iter()
            .map(|(&a, &(b, _))| (a, b))
            .collect()
    }

    /// Whether `[addr, addr + bytes)` lies in one registered range.
    pub fn covers(&self, addr: u64, bytes: usize) -> bool {
        self.regs
            .lock()
            .range(..=addr)
            .next_back()
            .is_some_and(|(&a, &(b, _))| addr + bytes as u64 <= a + b as u64)
    }
}

impl MapHook for NcclRegistrar {
    fn mapped(&self, r: MappedRange) {
        if r.placement == Location::Host {
            // NCCL skips a registration with any host-backed chunk.
            self.skipped_host.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let mut handle: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: the range is mapped and accessible (the hook's promise)
        // until `unmapping`, which deregisters it first.
        let res =
            unsafe { sys::ncclCommRegister(self.comm, r.addr as *mut _, r.bytes, &mut handle) };
        match check("ncclCommRegister", res) {
            Ok(()) => {
                self.regs.lock().insert(r.addr, (r.bytes, handle as usize));
                self.registered.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => self
                .failures
                .lock()
                .push(format!("{e} at {:#x}+{:#x}", r.addr, r.bytes)),
        }
    }

    fn unmapping(&self, r: MappedRange) {
        let Some((bytes, handle)) = self.regs.lock().remove(&r.addr) else {
            return;
        };
        if bytes != r.bytes {
            self.failures.lock().push(format!(
                "unmapping {:#x}+{:#x}, registered {bytes:#x}",
                r.addr, r.bytes
            ));
        }
        // SAFETY: a handle ncclCommRegister gave for this communicator,
        // deregistered once.
        let res = unsafe { sys::ncclCommDeregister(self.comm, handle as *mut _) };
        match check("ncclCommDeregister", res) {
            Ok(()) => {
                self.deregistered.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => self.failures.lock().push(e),
        }
    }
}
