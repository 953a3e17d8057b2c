//! cudarc views of CUDA arena allocations: the same [`View`] and [`ViewMut`]
//! types as for buffers, bound to the allocation's stream (or another one),
//! recording their use there when they drop; the allocation's free waits for
//! it.

use std::sync::Arc;

use cudarc::driver::CudaStream;

use crate::arena::Allocation;
use crate::backend::cuda::interop::{Element, View, ViewMut};
use crate::error::{Error, Result};
use crate::CudaBackend;

/// cudarc's streams are an arena's streams on the CUDA backend.
impl crate::arena::ArenaStream<CudaBackend> for Arc<CudaStream> {
    fn key(&self) -> crate::StreamKey {
        crate::backend::cuda::stream_key(self)
    }
    fn fence(&self, backend: &CudaBackend) -> Result<crate::cuda::CudaFence> {
        backend.fence(self)
    }
}

/// An allocation of a CUDA arena.
pub type CudaAllocation = Allocation<CudaBackend, Arc<CudaStream>>;

/// An arena on one GPU, for cudarc's streams: owned typed tensors come from
/// [`alloc_tensor`](CudaArena::alloc_tensor) and
/// [`alloc_zeros`](CudaArena::alloc_zeros).
pub type CudaArena = crate::Arena<CudaBackend, Arc<CudaStream>>;

impl Allocation<CudaBackend, Arc<CudaStream>> {
    /// The allocation as `len()/size_of::<T>()` elements of `T`, for cudarc
    /// copies and kernel arguments on `stream` (its own stream, or another
    /// of the same device or of a peer the arena's memory is shared with).
    pub fn view<T: Element>(&self, stream: &Arc<CudaStream>) -> Result<View<'_, T>> {
        self.grant_cpu()?;
        Ok(View::new(
            self.address(),
            self.elements::<T>()?,
            stream.clone(),
            self.uses_ref(),
        ))
    }

    /// A mutable view; see [`view`](Self::view). `&mut self`: one writer at
    /// a time per allocation, any number of allocations at once.
    pub fn view_mut<T: Element>(&mut self, stream: &Arc<CudaStream>) -> Result<ViewMut<'_, T>> {
        let n = self.elements::<T>()?;
        self.grant_cpu()?;
        Ok(ViewMut::new(
            self.address(),
            n,
            stream.clone(),
            self.uses_ref(),
        ))
    }

    fn elements<T>(&self) -> Result<usize> {
        let size = std::mem::size_of::<T>();
        if size == 0
            || !self
                .address()
                .is_multiple_of(std::mem::align_of::<T>() as u64)
        {
            return Err(Error::invalid(format!(
                "{} does not fit the allocation's alignment",
                std::any::type_name::<T>()
            )));
        }
        Ok(self.len() / size)
    }
}
