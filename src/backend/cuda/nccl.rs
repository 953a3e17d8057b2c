//! NCCL's registration calls (`ncclCommRegister`, `ncclCommDeregister`)
//! for [`crate::nccl::NcclHook`], from a library found with `dlopen`.
#![allow(unsafe_code)]

use crate::error::{Error, Result};
use crate::hook::Registrar;

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
    /// The NCCL the process loaded already (`libnccl.so.2`, PyTorch's or
    /// cudarc's), or
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
        // NCCL may set its communicator's device (and so the context).
        super::driver::before_switch();
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
        // NCCL may set its communicator's device (and so the context).
        super::driver::before_switch();
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
