//! Copies and fills between mapped ranges and host memory.
#![allow(unsafe_code)]

use cudarc::driver::{sys, CudaStream};

use super::{check, relaxed};
use crate::error::Result;

/// `cuMemcpyDtoDAsync` of `bytes` on `stream`.
///
/// # Safety
/// Both ranges are mapped with access for the stream's device until the copy
/// has finished, and do not overlap.
pub(crate) unsafe fn memcpy_dtod_async(
    dst: sys::CUdeviceptr,
    src: sys::CUdeviceptr,
    bytes: usize,
    stream: &CudaStream,
) -> Result<()> {
    // SAFETY: forwarded to the caller.
    check(
        "cuMemcpyDtoDAsync",
        unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, stream.cu_stream()) },
        bytes,
    )
}

/// `cuMemsetD8Async` of `bytes` zero bytes at `dst`, queued on `stream`.
///
/// # Safety
/// `[dst, dst + bytes)` is mapped with write access for the stream's device
/// until the memset has finished.
pub(crate) unsafe fn memset_zeros_async(
    dst: sys::CUdeviceptr,
    bytes: usize,
    stream: &CudaStream,
) -> Result<()> {
    // SAFETY: forwarded to the caller.
    check(
        "cuMemsetD8Async",
        unsafe { sys::cuMemsetD8Async(dst, 0, bytes, stream.cu_stream()) },
        bytes,
    )
}

/// `cuMemcpyDtoH` into `dst`: synchronous.
///
/// # Safety
/// `[src, src + dst.len())` is mapped, readable by the current context's
/// device, and all of one placement (a copy spanning a GPU chunk and a
/// host-NUMA chunk crashes driver 580.159.04).
pub(crate) unsafe fn memcpy_dtoh(dst: &mut [u8], src: sys::CUdeviceptr) -> Result<()> {
    // SAFETY: `dst` is a live host buffer of `dst.len()` bytes; the rest is
    // forwarded to the caller.
    check(
        "cuMemcpyDtoH",
        relaxed(|| unsafe { sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), src, dst.len()) }),
        dst.len(),
    )
}

/// `cuMemcpyHtoD` from `src`: synchronous.
///
/// # Safety
/// `[dst, dst + src.len())` is mapped, writable by the current context's
/// device, of one placement (see [`memcpy_dtoh`]), and no live reference
/// reads it.
pub(crate) unsafe fn memcpy_htod(dst: sys::CUdeviceptr, src: &[u8]) -> Result<()> {
    // SAFETY: `src` is a live host buffer of `src.len()` bytes; the rest is
    // forwarded to the caller.
    check(
        "cuMemcpyHtoD",
        relaxed(|| unsafe { sys::cuMemcpyHtoD_v2(dst, src.as_ptr().cast(), src.len()) }),
        src.len(),
    )
}
