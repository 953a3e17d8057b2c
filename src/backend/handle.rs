//! How a chunk travels to another process: the handle kinds a backend may
//! export ([`HandleKind`]) and an exported handle ([`ChunkHandle`]).
#![deny(unsafe_code)]

use std::os::fd::OwnedFd;

/// A kind of handle a chunk can be exported as.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum HandleKind {
    /// A POSIX file descriptor (CUDA's `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`,
    /// the host backend's sealed memfd): processes of one host, sent over a
    /// Unix socket with SCM_RIGHTS.
    PosixFd,
    /// A fabric handle (`CU_MEM_HANDLE_TYPE_FABRIC`): 64 bytes that any
    /// process of the same NVLink fabric imports (several hosts of a
    /// multi-node NVLink system, through an IMEX channel), sent as plain
    /// bytes. The chunk must have been created with the fabric handle type
    /// ([`CudaBackendDesc::nccl_ready`](crate::cuda::CudaBackendDesc::nccl_ready)
    /// asks for it where the device supports it and the driver permits it).
    Fabric,
}

impl std::fmt::Display for HandleKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::PosixFd => "a POSIX file descriptor",
            Self::Fabric => "a fabric handle",
        })
    }
}

/// The 64 bytes of a fabric handle (`CUmemFabricHandle`).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct FabricHandle(pub [u8; 64]);

impl std::fmt::Debug for FabricHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "FabricHandle(")?;
        for b in &self.0[..8] {
            write!(f, "{b:02x}")?;
        }
        write!(f, "..)")
    }
}

/// A chunk exported for another process
/// ([`Backend::export_handle`](crate::Backend::export_handle)); the memory
/// stays alive while any process holds the chunk, a handle of it or a
/// mapping.
#[derive(Debug)]
#[non_exhaustive]
pub enum ChunkHandle {
    /// See [`HandleKind::PosixFd`].
    PosixFd(OwnedFd),
    /// See [`HandleKind::Fabric`].
    Fabric(FabricHandle),
}

impl ChunkHandle {
    /// Its kind.
    pub fn kind(&self) -> HandleKind {
        match self {
            Self::PosixFd(_) => HandleKind::PosixFd,
            Self::Fabric(_) => HandleKind::Fabric,
        }
    }
}
