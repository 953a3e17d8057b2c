//! Shareable handles of physical chunks: POSIX file descriptors and
//! fabric handles, exported and imported.

use super::*;

/// `cuMemExportToShareableHandle` as a POSIX file descriptor, owned by the
/// caller.
///
/// # Safety
/// `handle` is live (from [`mem_create`] with [`shareable_prop`], or
/// imported).
#[cfg(unix)]
pub(crate) unsafe fn mem_export_fd(
    handle: sys::CUmemGenericAllocationHandle,
) -> Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    let mut fd: std::ffi::c_int = -1;
    check(
        "cuMemExportToShareableHandle",
        // SAFETY: a valid out-pointer for an int, as the POSIX-fd handle type
        // writes; the handle is live (the caller's promise).
        unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut fd as *mut std::ffi::c_int).cast(),
                handle,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        },
        0,
    )?;
    if fd < 0 {
        return Err(Error::protocol(
            "cuMemExportToShareableHandle gave no descriptor",
        ));
    }
    // SAFETY: the driver just opened `fd` for us; nothing else owns it.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}

/// `cuMemImportFromShareableHandle` of a POSIX file descriptor: a new
/// handle to release with [`mem_release`]. The descriptor stays the
/// caller's.
#[cfg(unix)]
pub(crate) fn mem_import_fd(
    fd: std::os::fd::BorrowedFd<'_>,
) -> Result<sys::CUmemGenericAllocationHandle> {
    use std::os::fd::AsRawFd;
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    check(
        "cuMemImportFromShareableHandle",
        // SAFETY: a valid out-pointer; the POSIX-fd handle type passes the
        // descriptor's number as the pointer value, and the descriptor is open
        // for the whole call (borrowed). A descriptor that is no chunk is the
        // driver's error to report.
        unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut handle,
                fd.as_raw_fd() as usize as *mut std::ffi::c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        },
        0,
    )?;
    Ok(handle)
}

/// `cuMemExportToShareableHandle` as a fabric handle: its 64 bytes.
///
/// # Safety
/// `handle` is live.
pub(crate) unsafe fn mem_export_fabric(
    handle: sys::CUmemGenericAllocationHandle,
) -> Result<[u8; 64]> {
    let mut out = sys::CUmemFabricHandle { data: [0; 64] };
    check(
        "cuMemExportToShareableHandle",
        // SAFETY: a valid out-pointer to a CUmemFabricHandle, as the fabric
        // handle type writes; the handle is live (the caller's promise).
        unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut out as *mut sys::CUmemFabricHandle).cast(),
                handle,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC,
                0,
            )
        },
        0,
    )?;
    Ok(out.data)
}

/// `cuMemImportFromShareableHandle` of a fabric handle's bytes: a new
/// handle to release with [`mem_release`].
pub(crate) fn mem_import_fabric(bytes: &[u8; 64]) -> Result<sys::CUmemGenericAllocationHandle> {
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    let mut h = sys::CUmemFabricHandle { data: *bytes };
    check(
        "cuMemImportFromShareableHandle",
        // SAFETY: a valid out-pointer; the fabric handle type reads the 64
        // bytes `h` holds for the whole call. Bytes that name no chunk are the
        // driver's error to report.
        unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut handle,
                (&mut h as *mut sys::CUmemFabricHandle).cast(),
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC,
            )
        },
        0,
    )?;
    Ok(handle)
}
