//! cudarc views of CUDA-backed buffers: typed [`View`]s and [`ViewMut`]s that
//! cudarc's copies and kernel launches accept, and non-owning `CudaSlice`s
//! ([`SliceRef`]) for APIs that take nothing else. The types
//! and their cudarc trait impls live in `backend/cuda/interop.rs`.
#![allow(unsafe_code)]

use std::sync::Arc;

use cudarc::driver::CudaStream;

use crate::backend::cuda::interop::{Element, SliceRef, View, ViewMut};
use crate::buffer::GrowableBuffer;
use crate::error::{Error, Result};
use crate::location::{Access, Location};
use crate::CudaBackend;

impl GrowableBuffer<CudaBackend> {
    /// Checks a typed range and returns its device address.
    fn typed_range<T>(
        &self,
        stream: &Arc<CudaStream>,
        offset_bytes: usize,
        len: usize,
        need: Access,
    ) -> Result<u64> {
        let size = std::mem::size_of::<T>();
        if size == 0 {
            return Err(Error::invalid("zero-sized element type"));
        }
        if !offset_bytes.is_multiple_of(std::mem::align_of::<T>()) {
            return Err(Error::invalid(format!(
                "offset {offset_bytes} is not aligned to {} for {}",
                std::mem::align_of::<T>(),
                std::any::type_name::<T>()
            )));
        }
        // The device that will touch the range: the buffer's own, or a peer
        // whose stream this is (it needs access: `add_peer`).
        let who = Location::Device(stream.context().ordinal() as u32);
        let bytes = len
            .checked_mul(size)
            .ok_or_else(|| Error::invalid(format!("{len} elements of {size} bytes overflow")))?;
        self.check_access(who, need, offset_bytes, bytes)?;
        // A copy over a range that spans a host-placed chunk and a GPU chunk
        // crashes the driver (SIGSEGV in 580.159.04, either direction), and a
        // view is handed to cudarc's copies: refuse it.
        let runs = self.placement_runs(offset_bytes, bytes);
        if runs.len() > 1 {
            return Err(Error::MixedPlacement {
                offset: offset_bytes,
                bytes,
                split_at: runs[1].0,
            });
        }
        // cudarc's copies of host memory run on the CPU inside the driver:
        // host-placed chunks need the host's access entry first.
        if runs.first().is_some_and(|r| r.2 == Location::Host) {
            self.grant_cpu(offset_bytes, bytes)?;
        }
        Ok(self.base() + offset_bytes as u64)
    }

    /// A view of `len` elements of `T` starting `offset_bytes` into the bytes
    /// in use, for cudarc copies and kernel arguments on `stream`.
    ///
    /// Errors: the range is past the length, `offset_bytes` is misaligned for
    /// `T`, `stream` is of another context, the device lacks read access, or
    /// [`Error::MixedPlacement`]: the range spans chunks in host memory and on
    /// the GPU (take one view per placement).
    pub fn view<T: Element>(
        &self,
        stream: &Arc<CudaStream>,
        offset_bytes: usize,
        len: usize,
    ) -> Result<View<'_, T>> {
        let ptr = self.typed_range::<T>(stream, offset_bytes, len, Access::Read)?;
        Ok(View::new(ptr, len, stream.clone(), self.uses_ref()))
    }

    /// A mutable view; see [`view`](Self::view). Needs read-write access.
    pub fn view_mut<T: Element>(
        &mut self,
        stream: &Arc<CudaStream>,
        offset_bytes: usize,
        len: usize,
    ) -> Result<ViewMut<'_, T>> {
        let ptr = self.typed_range::<T>(stream, offset_bytes, len, Access::ReadWrite)?;
        Ok(ViewMut::new(ptr, len, stream.clone(), self.uses_ref()))
    }

    /// A non-owning cudarc `CudaSlice<T>` over the range; see [`SliceRef`].
    pub fn cuda_slice<T: Element>(
        &self,
        stream: &Arc<CudaStream>,
        offset_bytes: usize,
        len: usize,
    ) -> Result<SliceRef<'_, T>> {
        let ptr = self.typed_range::<T>(stream, offset_bytes, len, Access::Read)?;
        // SAFETY: `ptr` starts `len` mapped, in-use elements of this buffer
        // (checked above), which the returned borrow of `self` keeps from
        // shrinking, migrating or dropping.
        Ok(unsafe { SliceRef::from_raw(stream, ptr, len, self.uses_ref()) })
    }
}
