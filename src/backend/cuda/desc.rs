//! How a [`CudaBackend`](super::CudaBackend) makes its chunks
//! ([`CudaBackendDesc`]), what it settled ([`NcclChunks`]), and what it
//! reports of them ([`ChunkKind`]).

use parking_lot::Mutex;

#[cfg(doc)]
use super::CudaBackend;

/// How a [`CudaBackend`] makes its chunks.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CudaBackendDesc {
    /// Make device chunks as NCCL's `ncclMemAlloc` does, so that NCCL can
    /// register them (`ncclCommRegister`, zero-copy collectives) and peers
    /// can reach them:
    /// - exportable as a POSIX file descriptor, and as a fabric handle where
    ///   the device supports one (`CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED`;
    ///   if creating such a chunk is refused, as without an IMEX channel,
    ///   the backend goes on with POSIX_FD alone, as NCCL does);
    /// - GPUDirect RDMA capable where the device supports it with VMM;
    /// - the recommended granularity instead of the minimum;
    /// - every mapping of a device chunk that grants the home device
    ///   read-write also grants it to every GPU that can access the home
    ///   device as a peer.
    ///
    /// Host-placed chunks are made as usual (NCCL does not register them).
    /// False by default.
    pub nccl_ready: bool,
}

impl CudaBackendDesc {
    /// Chunks as `ncclMemAlloc` makes them (see [`Self::nccl_ready`]).
    pub fn nccl_ready() -> Self {
        Self { nccl_ready: true }
    }
}

/// What [`CudaBackendDesc::nccl_ready`] settled for a backend.
#[derive(Debug)]
pub(super) struct NcclChunks {
    /// The handle types asked for: POSIX_FD, and FABRIC until the driver
    /// refuses it once.
    pub(super) handle_types: std::sync::atomic::AtomicU32,
    /// GPUDirect RDMA with VMM is supported.
    pub(super) rdma: bool,
    /// Why fabric handles are not asked for: the device's attribute, or
    /// the driver's refusal of the first chunk that asked.
    pub(super) no_fabric: Mutex<Option<String>>,
    /// Devices that can access the home device as peers.
    pub(super) peers: Vec<u32>,
}

/// What a backend's chunks are like, as [`CudaBackend::chunk_kind`] reports.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ChunkKind {
    /// Device chunks are made as `ncclMemAlloc` makes them.
    pub nccl_ready: bool,
    /// They export as POSIX file descriptors.
    pub posix_fd: bool,
    /// They export as fabric handles too (asked for while the driver has not
    /// refused it).
    pub fabric: bool,
    /// Why they do not, where they do not (no NCCL-ready chunks, the
    /// device's attribute, or the driver's refusal in its words).
    pub no_fabric: Option<String>,
    /// They are created GPUDirect RDMA capable.
    pub gpu_direct_rdma: bool,
    /// The devices every device mapping is also granted to.
    pub peers: Vec<u32>,
    /// The granularity of device chunks.
    pub granularity: usize,
}
