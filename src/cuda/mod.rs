//! CUDA: the backend's tokens, cudarc interop (typed views, a non-owning
//! `CudaSlice`, owned tensors), arenas for cudarc's streams, graph capture
//! (which capture a stream is in, relaxed mode, a graph's release), and the
//! probe.
//!
//! The CUDA-only pieces over the generic arena and buffer live here: owned
//! typed tensors (`tensor.rs`), cudarc views of arena allocations
//! (`arena_view.rs`) and of buffers (`buffer_view.rs`).

mod arena_view;
mod buffer_view;
mod tensor;

pub use crate::backend::cuda::capture::{
    capture_begins, capture_ends, capture_of, capture_state, captures_underway, Capture,
    CaptureState, RelaxedCapture,
};
pub use crate::backend::cuda::interop::{Element, SliceRef, View, ViewMut};
pub use crate::backend::cuda::probe::{
    current_device, device_count, probe, DeviceProbe, KeepCurrentContext, LazyKeepCurrentContext,
    Probe,
};
pub use crate::backend::cuda::{
    ChunkKind, CudaBackend, CudaBackendDesc, CudaChunk, CudaFence, CudaReservation,
};
pub use arena_view::{CudaAllocation, CudaArena};
pub use tensor::CudaTensor;
