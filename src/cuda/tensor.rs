//! Owned typed tensors for cudarc engines: [`CudaTensor<T>`], what an engine
//! stores where it would store a `CudaSlice<T>`. It owns arena memory, frees
//! it in stream order on drop, and implements cudarc's `DeviceSlice`,
//! `DevicePtr`, `DevicePtrMut` and kernel-argument traits, so every cudarc
//! copy and launch takes it; `slice(range)` and `split_at_mut(mid)` give
//! borrowed [`View`]s / [`ViewMut`]s of parts of it.
//!
//! # Stream order
//! A tensor belongs to the stream it was allocated for. Work queued there
//! with it (copies, launches) is covered by the free's fence when it drops.
//! A copy on another stream synchronises that stream once queued (as a view
//! does); a launch on another stream must be recorded with
//! [`record_stream`](CudaTensor::record_stream), or use
//! [`view`](CudaTensor::view) for that stream, whose drop records it.
#![allow(unsafe_code)]

use std::marker::PhantomData;
use std::ops::{Range, RangeBounds};
use std::sync::Arc;

use cudarc::driver::{
    CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, LaunchArgs, PushKernelArg, SyncOnDrop,
};

use super::{CudaAllocation, CudaArena};
use crate::backend::cuda::interop::{Element, View, ViewMut};
use crate::backend::cuda::{driver, stream_key};
use crate::error::{Error, Result};

/// `len` elements of `T` in a CUDA arena: an owned tensor, `Send + Sync`,
/// freed in stream order when it drops. See the module docs.
///
/// ```no_run
/// use vmmbuf::cuda::CudaArena;
/// use vmmbuf::{Arena, ArenaDesc, CudaBackend};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let gpu = CudaBackend::new(0)?;
/// let stream = gpu.context().new_stream()?;
/// let arena: CudaArena = Arena::new(gpu.clone(), ArenaDesc::new(16 << 30))?;
/// let mut w = arena.alloc_tensor::<f32>(1 << 20, &stream)?;
/// stream.memcpy_htod(&vec![0.5f32; 1 << 20], &mut w)?;  // a cudarc copy
/// let head = stream.clone_dtoh(&w.slice(..16)?)?;        // a view of part
/// assert_eq!(head, vec![0.5f32; 16]);
/// let (mut lo, mut hi) = w.split_at_mut(1 << 19)?;      // two mutable halves
/// stream.memset_zeros(&mut hi)?;
/// # let _ = &mut lo;
/// # Ok(())
/// # }
/// ```
pub struct CudaTensor<T> {
    alloc: CudaAllocation,
    /// The first element's device address (kernel arguments point at it).
    ptr: u64,
    len: usize,
    _t: PhantomData<T>,
}

impl<T> std::fmt::Debug for CudaTensor<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaTensor")
            .field("address", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("type", &std::any::type_name::<T>())
            .finish()
    }
}

impl CudaArena {
    /// An owned tensor of `len` elements of `T` for work on `stream`. Its
    /// contents are whatever the memory held (any bit pattern is a valid
    /// `T`); [`alloc_zeros`](Self::alloc_zeros) clears them. Errors as
    /// [`alloc`](crate::Arena::alloc); `len` of 0 or a size that overflows is
    /// [`Error::InvalidArgument`].
    pub fn alloc_tensor<T: Element>(
        &self,
        len: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<CudaTensor<T>> {
        let align = std::mem::align_of::<T>();
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .filter(|&b| b > 0)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "{len} elements of {} is no size",
                    std::any::type_name::<T>()
                ))
            })?;
        if align > self.alignment() {
            return Err(Error::invalid(format!(
                "{} needs {align}-byte alignment, the arena gives {}",
                std::any::type_name::<T>(),
                self.alignment()
            )));
        }
        let alloc = self.alloc(bytes, stream)?;
        Ok(CudaTensor {
            ptr: alloc.address(),
            alloc,
            len,
            _t: PhantomData,
        })
    }

    /// [`alloc_tensor`](Self::alloc_tensor), cleared to zero bytes on
    /// `stream` (queued, not waited for).
    pub fn alloc_zeros<T: Element>(
        &self,
        len: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<CudaTensor<T>> {
        let t = self.alloc_tensor::<T>(len, stream)?;
        // SAFETY: the tensor's bytes are mapped with read-write access for
        // the arena's device, and stay so until its free, which is ordered
        // after this memset on the same stream.
        unsafe { driver::memset_zeros_async(t.ptr, t.num_bytes(), stream) }?;
        Ok(t)
    }
}

impl<T: Element> CudaTensor<T> {
    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true: tensors hold at least one element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of the elements.
    pub fn num_bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    /// The device address of the first element.
    pub fn device_address(&self) -> u64 {
        self.ptr
    }

    /// The stream it belongs to.
    pub fn stream(&self) -> &Arc<CudaStream> {
        self.alloc.stream()
    }

    /// The allocation underneath (stats, `record_use`, host reads).
    pub fn allocation(&self) -> &CudaAllocation {
        &self.alloc
    }

    /// Records that work queued on `stream` so far uses the tensor: its free
    /// waits for it (PyTorch's `record_stream`).
    pub fn record_stream(&self, stream: &Arc<CudaStream>) {
        self.alloc.record_stream(stream);
    }

    /// A view of the elements in `range`, for work on `stream`; its drop
    /// records the use there.
    pub fn view(
        &self,
        range: impl RangeBounds<usize>,
        stream: &Arc<CudaStream>,
    ) -> Result<View<'_, T>> {
        let r = self.range(range)?;
        self.alloc.grant_cpu()?;
        Ok(View::new(
            self.elem(r.start),
            r.len(),
            stream.clone(),
            self.alloc.uses_ref(),
        ))
    }

    /// A view of the elements in `range` on the tensor's own stream (as
    /// `CudaSlice::slice`).
    pub fn slice(&self, range: impl RangeBounds<usize>) -> Result<View<'_, T>> {
        self.view(range, &self.alloc.stream().clone())
    }

    /// A mutable view of the elements in `range` on the tensor's stream.
    pub fn slice_mut(&mut self, range: impl RangeBounds<usize>) -> Result<ViewMut<'_, T>> {
        let r = self.range(range)?;
        self.alloc.grant_cpu()?;
        let stream = self.alloc.stream().clone();
        Ok(ViewMut::new(
            self.elem(r.start),
            r.len(),
            stream,
            self.alloc.uses_ref(),
        ))
    }

    /// Two mutable views, `[0, mid)` and `[mid, len)`, on the tensor's
    /// stream (as `CudaSlice::split_at_mut`). `mid` past the length is
    /// [`Error::InvalidArgument`].
    pub fn split_at_mut(&mut self, mid: usize) -> Result<(ViewMut<'_, T>, ViewMut<'_, T>)> {
        if mid > self.len {
            return Err(Error::invalid(format!(
                "split at {mid} of a {}-element tensor",
                self.len
            )));
        }
        self.alloc.grant_cpu()?;
        let stream = self.alloc.stream().clone();
        let uses = self.alloc.uses_ref();
        Ok((
            ViewMut::new(self.elem(0), mid, stream.clone(), uses),
            ViewMut::new(self.elem(mid), self.len - mid, stream, uses),
        ))
    }

    fn elem(&self, i: usize) -> u64 {
        self.ptr + (i * std::mem::size_of::<T>()) as u64
    }

    fn range(&self, range: impl RangeBounds<usize>) -> Result<Range<usize>> {
        crate::ranges::within(&range, self.len).ok_or_else(|| {
            Error::invalid(format!(
                "{:?}..{:?} is not within {} elements",
                range.start_bound(),
                range.end_bound(),
                self.len
            ))
        })
    }

    /// What a copy on `used` must do: nothing on the tensor's own stream;
    /// on another, wait for it (its use cannot be recorded from here). The
    /// driver copies offloaded (host-placed) memory with the CPU, which then
    /// needs the host's access entry: granted first.
    fn for_copy<'s>(&self, used: &'s CudaStream) -> SyncOnDrop<'s> {
        if let Err(e) = self.alloc.grant_cpu() {
            tracing::error!(error = %e, "vmmbuf: granting the CPU access for a copy failed");
        }
        if stream_key(self.alloc.stream()) == stream_key(used) {
            SyncOnDrop::Sync(None)
        } else {
            SyncOnDrop::Sync(Some(used))
        }
    }
}

impl<T: Element> DeviceSlice<T> for CudaTensor<T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.alloc.stream()
    }
}

impl<T: Element> DevicePtr<T> for CudaTensor<T> {
    fn device_ptr<'s>(&'s self, stream: &'s CudaStream) -> (u64, SyncOnDrop<'s>) {
        (self.ptr, self.for_copy(stream))
    }
}

impl<T: Element> DevicePtrMut<T> for CudaTensor<T> {
    fn device_ptr_mut<'s>(&'s mut self, stream: &'s CudaStream) -> (u64, SyncOnDrop<'s>) {
        (self.ptr, self.for_copy(stream))
    }
}

// SAFETY: pushes a reference to the allocation's device address (a field of
// the allocation, which the borrow `'b` keeps alive) through cudarc's impl
// for `&u64`: the kernel receives a pointer to `len` mapped elements, as for
// a `&CudaSlice`.
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b CudaTensor<T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b CudaTensor<T>) -> &mut Self {
        self.arg(&arg.ptr)
    }
}

// SAFETY: as for `&CudaTensor`.
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b mut CudaTensor<T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut CudaTensor<T>) -> &mut Self {
        self.arg(&arg.ptr)
    }
}
