//! The virtual memory calls: locations and properties, reserving address
//! space, creating, mapping, unmapping and releasing chunks, access.
#![allow(unsafe_code)]

use std::mem::MaybeUninit;

use cudarc::driver::sys;

use super::{check, relaxed};
use crate::error::Result;
use crate::location::Access;

/// `CUmemLocation` changed its source form (an anonymous union) at CUDA 13.2
/// while keeping its layout: `{ type, int id }`. This mirror builds it the
/// same way whichever bindings cudarc picked.
#[repr(C)]
#[derive(Clone, Copy)]
struct RawLocation {
    type_: sys::CUmemLocationType,
    id: std::ffi::c_int,
}

const _: () =
    assert!(std::mem::size_of::<RawLocation>() == std::mem::size_of::<sys::CUmemLocation>());
const _: () =
    assert!(std::mem::align_of::<RawLocation>() == std::mem::align_of::<sys::CUmemLocation>());

/// A `CUmemLocation` of `type_` and `id`.
pub(crate) fn location(type_: sys::CUmemLocationType, id: i32) -> sys::CUmemLocation {
    // SAFETY: same size and alignment (asserted above), same field order and
    // types as the driver's `CUmemLocation` in every CUDA version; both are
    // plain `Copy` data.
    unsafe { std::mem::transmute::<RawLocation, sys::CUmemLocation>(RawLocation { type_, id }) }
}

/// The driver's flags for an [`Access`].
pub(crate) fn access_flags(a: Access) -> sys::CUmemAccess_flags {
    match a {
        Access::None => sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE,
        Access::Read => sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ,
        Access::ReadWrite => sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    }
}

/// The type and id of a `CUmemLocation` (checking an imported chunk).
#[cfg(unix)]
pub(crate) fn location_parts(loc: sys::CUmemLocation) -> (sys::CUmemLocationType, i32) {
    // SAFETY: as in `location`, the other way.
    let raw = unsafe { std::mem::transmute::<sys::CUmemLocation, RawLocation>(loc) };
    (raw.type_, raw.id)
}

/// Properties of a pinned allocation at `location` that exports as a POSIX
/// file descriptor.
pub(crate) fn shareable_prop(location: sys::CUmemLocation) -> sys::CUmemAllocationProp {
    let mut prop = allocation_prop(location);
    prop.requestedHandleTypes =
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop
}

/// Handle type bits (`CUmemAllocationHandleType` values, a bit mask).
pub(crate) const HANDLE_POSIX_FD: u32 =
    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR.0;
/// See [`HANDLE_POSIX_FD`].
pub(crate) const HANDLE_FABRIC: u32 = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC.0;

/// Properties of a pinned allocation at `location` as `ncclMemAlloc`
/// makes it: the handle types `handle_types` (POSIX_FD, plus FABRIC where
/// the device supports it), and GPUDirect RDMA capable if `rdma`.
pub(crate) fn nccl_prop(
    location: sys::CUmemLocation,
    handle_types: u32,
    rdma: bool,
) -> sys::CUmemAllocationProp {
    let mut prop = allocation_prop(location);
    prop.requestedHandleTypes = sys::CUmemAllocationHandleType(handle_types);
    prop.allocFlags.gpuDirectRDMACapable = u8::from(rdma);
    prop
}

/// `cuMemGetAllocationPropertiesFromHandle`.
///
/// # Safety
/// `handle` is live.
#[cfg(unix)]
pub(crate) unsafe fn mem_properties(
    handle: sys::CUmemGenericAllocationHandle,
) -> Result<sys::CUmemAllocationProp> {
    // SAFETY: plain C data, all-zero valid; filled in by the driver.
    let mut prop: sys::CUmemAllocationProp = unsafe { MaybeUninit::zeroed().assume_init() };
    check(
        "cuMemGetAllocationPropertiesFromHandle",
        // SAFETY: a valid out-pointer; the handle is live (the caller's promise).
        unsafe { sys::cuMemGetAllocationPropertiesFromHandle(&mut prop, handle) },
        0,
    )?;
    Ok(prop)
}

/// Properties of a pinned allocation at `location`, no handle types.
pub(crate) fn allocation_prop(location: sys::CUmemLocation) -> sys::CUmemAllocationProp {
    // SAFETY: `CUmemAllocationProp` is plain C data for which all-zero is the
    // driver's documented default (no handle types, no flags).
    let mut prop: sys::CUmemAllocationProp = unsafe { MaybeUninit::zeroed().assume_init() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location = location;
    prop
}

/// `cuMemGetAllocationGranularity`.
pub(crate) fn allocation_granularity(
    prop: &sys::CUmemAllocationProp,
    flag: sys::CUmemAllocationGranularity_flags,
) -> Result<usize> {
    let mut g = 0usize;
    check(
        "cuMemGetAllocationGranularity",
        // SAFETY: a valid out-pointer and a fully initialised property struct.
        unsafe { sys::cuMemGetAllocationGranularity(&mut g, prop, flag) },
        0,
    )?;
    Ok(g)
}

/// `cuMemAddressReserve` of `bytes` aligned to `align`, no hint, no flags.
pub(crate) fn address_reserve(bytes: usize, align: usize) -> Result<sys::CUdeviceptr> {
    let mut ptr: sys::CUdeviceptr = 0;
    check(
        "cuMemAddressReserve",
        relaxed(|| {
            // SAFETY: a valid out-pointer; reserving address space touches no memory.
            unsafe { sys::cuMemAddressReserve(&mut ptr, bytes, align, 0, 0) }
        }),
        bytes,
    )?;
    Ok(ptr)
}

/// `cuMemAddressFree`.
///
/// # Safety
/// `(ptr, bytes)` is exactly one live reservation, with nothing mapped in it,
/// that nothing will use again.
pub(crate) unsafe fn address_free(ptr: sys::CUdeviceptr, bytes: usize) -> Result<()> {
    // SAFETY: forwarded to the caller.
    check(
        "cuMemAddressFree",
        relaxed(|| unsafe { sys::cuMemAddressFree(ptr, bytes) }),
        0,
    )
}

/// `cuMemCreate` of `bytes` with `prop`.
pub(crate) fn mem_create(
    bytes: usize,
    prop: &sys::CUmemAllocationProp,
) -> Result<sys::CUmemGenericAllocationHandle> {
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    check(
        "cuMemCreate",
        relaxed(|| {
            // SAFETY: a valid out-pointer and a fully initialised property struct.
            unsafe { sys::cuMemCreate(&mut handle, bytes, prop, 0) }
        }),
        bytes,
    )?;
    Ok(handle)
}

/// `cuMemRelease`. The memory goes back once nothing maps it (and no other
/// process holds it).
///
/// # Safety
/// `handle` came from [`mem_create`] or [`mem_import_fd`] and is released
/// once.
pub(crate) unsafe fn mem_release(
    handle: sys::CUmemGenericAllocationHandle,
    bytes: usize,
) -> Result<()> {
    // SAFETY: forwarded to the caller.
    check(
        "cuMemRelease",
        relaxed(|| unsafe { sys::cuMemRelease(handle) }),
        bytes,
    )
}

/// `cuMemMap` of the whole `handle` at `ptr`, offset 0, no flags.
///
/// # Safety
/// `[ptr, ptr + bytes)` lies inside a live reservation and holds no mapping;
/// `handle` is live and `bytes` is its size.
pub(crate) unsafe fn mem_map(
    ptr: sys::CUdeviceptr,
    bytes: usize,
    handle: sys::CUmemGenericAllocationHandle,
) -> Result<()> {
    // SAFETY: forwarded to the caller.
    check(
        "cuMemMap",
        relaxed(|| unsafe { sys::cuMemMap(ptr, bytes, 0, handle, 0) }),
        bytes,
    )
}

/// `cuMemUnmap`. Does not wait for kernels.
///
/// # Safety
/// `[ptr, ptr + bytes)` is made of whole live mappings, and no work still
/// running or queued, nor any live reference, uses it.
pub(crate) unsafe fn mem_unmap(ptr: sys::CUdeviceptr, bytes: usize) -> Result<()> {
    // SAFETY: forwarded to the caller.
    check(
        "cuMemUnmap",
        relaxed(|| unsafe { sys::cuMemUnmap(ptr, bytes) }),
        bytes,
    )
}

/// `cuMemSetAccess` of `[ptr, ptr + bytes)` to exactly `descs`.
///
/// # Safety
/// The range is made of whole live mappings, and narrowing access does not
/// pull memory from under a live reference or running work.
pub(crate) unsafe fn mem_set_access(
    ptr: sys::CUdeviceptr,
    bytes: usize,
    descs: &[sys::CUmemAccessDesc],
) -> Result<()> {
    // SAFETY: `descs` holds `descs.len()` initialised entries; the rest is
    // forwarded to the caller.
    check(
        "cuMemSetAccess",
        relaxed(|| unsafe { sys::cuMemSetAccess(ptr, bytes, descs.as_ptr(), descs.len()) }),
        bytes,
    )
}
