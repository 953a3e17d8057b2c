//! # vmmbuf
//!
//! Growable GPU buffers on CUDA's virtual memory management (VMM) API.
//!
//! A [`GrowableBuffer`] reserves a large virtual address range once, maps
//! physical chunks into it as it grows, and never moves its base address.
//! Growing keeps the data and costs no copy; shrinking gives memory back.
//! It is made for tensors, KV caches and arenas that must grow without
//! copying and without their address changing (captured CUDA graphs, pointers
//! handed to kernels).
//!
//! Two real backends implement one [`Backend`] trait:
//! [`CudaBackend`] (CUDA VMM through cudarc's driver bindings) and
//! [`HostBackend`] (the host's own virtual memory: `mmap`, `memfd`,
//! `mprotect`), so the same code runs, and is tested, on machines without a GPU.
//!
//! ```
//! use vmmbuf::{BufferDesc, GrowableBuffer, HostBackend};
//!
//! let mut buf = GrowableBuffer::new(HostBackend::new(), BufferDesc::new(1 << 30))?;
//! let base = buf.base();
//! buf.grow_to(4096)?;
//! buf.write(0, b"hello")?;
//! buf.grow_to(10 << 20)?; // no copy, same address
//! assert_eq!(buf.base(), base);
//! assert_eq!(&buf.host_slice(..5)?, b"hello");
//! buf.truncate(0); // keeps the memory for regrowth, as Vec does
//! buf.shrink_to_fit()?; // gives it back
//! # #[cfg(target_os = "linux")]
//! assert_eq!(buf.capacity(), 0);
//! # Ok::<(), vmmbuf::Error>(())
//! ```
//!
//! See [`GrowableBuffer`] for the guarantees, and [`GrowthPolicy`] for how
//! chunk sizes follow the buffer: the cost of growing is per mapping, not per
//! byte, so the default policy sizes chunks with the buffer.
//!
//! For tensors, an [`Arena`] is a stream-ordered allocator over one
//! reservation: many owned [`Allocation`]s of any size, freed on drop in
//! stream order (the block goes to another stream only once every recorded
//! use has passed), with PyTorch-named statistics ([`ArenaStats`](crate::stats::ArenaStats)), traces,
//! and sleep and wake at the same addresses ([`Arena::sleep`],
//! [`Arena::wake`]): the data kept in pinned host memory (reachable while
//! asleep, or stashed away from the addresses) or discarded, the device
//! memory given back. `vmmbuf-torch` makes it PyTorch's CUDA allocator.
//!
//! A buffer created [shareable](BufferDesc::shareable) can be followed by
//! other processes: [`GrowableBuffer::publish`] sends each generation over a
//! Unix socket ([`Exporter`](crate::ipc::Exporter)), and a [`SharedBuffer`](crate::ipc::SharedBuffer) maps the same chunks at
//! the same offsets in its own range, on the same or another GPU.
//!
//! Beyond growing:
//! - **Placement and access** ([`Location`], [`Access`], [`MigrationPolicy`](migration::MigrationPolicy),
//!   [`MigrationPlan`](migration::MigrationPlan)): chunks live on a GPU or in pinned host memory and move
//!   between them without changing address (`migrate`, `offload`, `restore`);
//!   access is set per chunk and per device (`set_access`, `add_peer`).
//! - **Reuse** ([`ChunkPool`]): released chunks kept for regrowth across
//!   buffers; [`GrowableBuffer::shrink_to_fit_after`] releases in stream
//!   order instead of blocking on the whole device.
//! - **cudarc interop** ([`View`](crate::cuda::View), [`ViewMut`](crate::cuda::ViewMut), [`SliceRef`](crate::cuda::SliceRef)):
//!   typed views that cudarc's copies and kernel launches accept, and a
//!   non-owning `CudaSlice` for APIs that take nothing else.
//! - **Several GPUs and NCCL**: chunks made as `ncclMemAlloc` makes them
//!   ([`CudaBackendDesc::nccl_ready`](crate::cuda::CudaBackendDesc::nccl_ready)),
//!   and [map hooks](crate::hook) that keep a growing arena or buffer
//!   registered with NCCL (`Arena::set_map_hook`).
//! - **What the machine supports**: [`probe`](crate::cuda::probe).
//!
//! # The root's names
//! Twenty-three, what most programs name: the buffer ([`GrowableBuffer`],
//! [`BufferDesc`], [`GrowthPolicy`]); the arena ([`Arena`], [`ArenaDesc`],
//! [`Allocation`], [`ArenaStream`], [`StreamKey`], [`GraphPoolId`]); sleep
//! ([`SleepDesc`], [`SleepMode`], [`WakeDesc`]); backends ([`Backend`],
//! [`CudaBackend`], [`HostBackend`]); placement ([`Location`], [`Access`],
//! [`AccessDesc`]); chunk reuse ([`ChunkPool`], [`PoolDesc`], [`Budget`]);
//! and [`Error`] with its [`Result`]. The rest, one module each:
//! [`cuda`] (tokens, cudarc interop, capture, probe), [`host`], [`migration`]
//! (plans, policies and their reports), [`stats`] (every counter and
//! report, a sleep's too), [`trace`], [`hook`] and [`nccl`] (map hooks,
//! NCCL registration), [`ipc`] (sharing across processes), [`hash`], and
//! [`backends`] (what a backend's methods name).
//!
//! # Where things live
//! `unsafe` is denied crate-wide and allowed only where memory meets the
//! driver or becomes a Rust slice: the two backends (`backend/cuda/`,
//! `backend/host.rs`), the pageable sleep's host buffer
//! (`backend/pages.rs`), the buffer's CPU views (`cpu_view.rs`) and
//! the CUDA-only pieces (`cuda/`: typed tensors, cudarc views of arena
//! allocations and of buffers). The chunk table, the growth plan, the pool and the
//! statistics are safe code, tested without a GPU.
#![warn(missing_docs)]
#![deny(unsafe_code)]
#![deny(unsafe_op_in_unsafe_fn)]

/// The README's Rust blocks, compiled (and, where they need no GPU, run) as
/// doctests: the code a newcomer copies first must build.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

/// The Rust guide's blocks (`docs/rust.md`), compiled as the README's are.
#[cfg(doctest)]
#[doc = include_str!("../docs/rust.md")]
pub struct RustGuideDoctests;

/// How many cases a property test draws under miri, which interprets
/// every step: `VMMBUF_MIRI_CASES` (CI's miri job sets 1), else 4.
#[cfg(test)]
pub(crate) fn miri_cases() -> u32 {
    std::env::var("VMMBUF_MIRI_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4)
}

mod arena;
mod backend;
mod buffer;
mod cpu_view;
mod error;
mod graph_id;
pub mod hash;
pub mod hook;
#[cfg(target_os = "linux")]
pub mod ipc;
mod location;
pub mod migration;
pub mod nccl;
mod order;
mod plan;
mod pool;
mod ranges;
mod region;
mod report;
mod sleep;
mod table;

// About twenty names at the root (listed in the crate's docs): what most
// users name. The rest lives in the modules below.
pub use arena::{Allocation, Arena, ArenaDesc, ArenaStream, GraphPoolId};
pub use backend::cuda::CudaBackend;
#[cfg(target_os = "linux")]
pub use backend::host::HostBackend;
pub use backend::Backend;
pub use buffer::{BufferDesc, GrowableBuffer};
pub use error::{Error, Result};
pub use location::{Access, AccessDesc, Location};
pub use order::StreamKey;
pub use plan::GrowthPolicy;
pub use pool::{Budget, ChunkPool, PoolDesc};
pub use sleep::{SleepDesc, SleepMode, WakeDesc};

/// What a [`Backend`]'s methods name besides the trait: the mark of
/// backends whose memory the CPU can be given access to, and the slot a
/// backend lends its default pool.
pub mod backends {
    pub use crate::backend::{HostMapped, PoolSlot};
}

pub mod cuda;

/// The host backend (Linux): the host's own virtual memory, the same code
/// paths as CUDA's, for machines without a GPU and for tests.
#[cfg(target_os = "linux")]
pub mod host {
    pub use crate::arena::HostStream;

    /// An arena in host memory: the same allocator as on a GPU, for
    /// machines without one, tests and examples (`HostStream(n)` names a
    /// stream).
    pub type HostArena = crate::Arena<HostBackend, HostStream>;

    /// An allocation of a [`HostArena`].
    pub type HostAllocation = crate::Allocation<HostBackend, HostStream>;

    pub use crate::backend::host::{
        raise_fd_limit, HostBackend, HostChunk, HostFence, HostReservation,
    };
    pub use crate::backend::host_capture::HostCaptureState;
}

/// Traces of an arena's allocs and frees: record with
/// [`Arena::record_trace`](crate::Arena::record_trace), parse, replay.
pub mod trace {
    pub use crate::arena::{
        parse_trace, replay_trace, replay_trace_with, ReplayReport, TraceEvent, TRACE_HEADER,
    };
}

/// Counters and reports: a buffer's, an arena's, a pool's, and the
/// backend's live handles.
pub mod stats {
    pub use crate::arena::{ArenaSnapshot, ArenaStats, BlockInfo, StatValue};
    pub use crate::backend::LiveCounts;
    pub use crate::pool::PoolStats;
    pub use crate::report::{BufferStats, Bytes, ChunkInfo, Report};
    pub use crate::sleep::SleepReport;
}
