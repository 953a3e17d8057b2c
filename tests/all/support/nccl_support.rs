//! NCCL for the tests and the bandwidth bench (`benches/nccl.rs` includes
//! this file): a communicator per process, collectives over raw addresses,
//! and [`registered_hook`], the library's map hook that keeps an arena or a
//! buffer registered with NCCL (`ncclCommRegister` on every device range
//! reported mapped, `ncclCommDeregister` before it goes). NCCL is loaded at run time
//! (cudarc's loader looks for `libnccl.so`: PyTorch's wheel ships one under
//! `site-packages/nvidia/nccl/lib`; put a `libnccl.so` link to it on
//! `LD_LIBRARY_PATH`).
#![allow(dead_code)]

use cudarc::nccl::sys;
use vmmbuf::nccl::NcclHook;

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

/// The library's NCCL hook ([`vmmbuf::nccl::NcclHook`]) over the NCCL
/// cudarc loaded, with `comm` added; the id to remove it with.
pub fn registered_hook(comm: &Comm) -> (std::sync::Arc<NcclHook>, u64) {
    let hook = std::sync::Arc::new(NcclHook::loaded().expect("the NCCL cudarc loaded"));
    // SAFETY: `comm` outlives the hook's use: the callers remove it (or
    // drop the arenas that call it) before the communicator goes.
    let id = unsafe { hook.add(comm.0.cast()) }.expect("a communicator added");
    (hook, id)
}
