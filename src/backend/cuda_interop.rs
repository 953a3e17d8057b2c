//! cudarc interop for CUDA-backed buffers: typed views that cudarc's copies
//! and kernel launches accept, and a non-owning `CudaSlice` for APIs that
//! take nothing else.
//!
//! # Stream order
//! cudarc tracks reads and writes of its own `CudaSlice`s with events; it
//! cannot do so for foreign types, so [`View`] and [`ViewMut`] record nothing
//! and wait for nothing. Work on one stream is ordered by the stream. When
//! several streams touch the same bytes, order them yourself: record an event
//! on the producer (`let e = producer.record_event(None)?`) and make the
//! consumer wait for it (`consumer.wait(&e)?`) before using the view there.
//! Shrinking, trimming and dropping the buffer wait for the whole device
//! (or for the fence given to
//! [`shrink_to_after`](crate::GrowableBuffer::shrink_to_after)).

use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use cudarc::driver::{
    CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, DeviceSlice, LaunchArgs,
    PushKernelArg, SyncOnDrop,
};

use super::{Backend, CudaBackend};
use crate::error::{Error, Result};
use crate::location::{Access, Location};
use crate::GrowableBuffer;

/// Element types a view may hold: any bit pattern is a valid value (so bytes
/// the GPU wrote can be read back as `T`), and the type can cross to the device.
pub trait Element: DeviceRepr + bytemuck::Pod {}
impl<T: DeviceRepr + bytemuck::Pod> Element for T {}

/// A read-only typed view of bytes in use in a CUDA-backed buffer.
///
/// Implements cudarc's [`DeviceSlice`] and [`DevicePtr`], so it is a source for
/// `memcpy_dtoh`, `memcpy_dtod`, `clone_dtoh`…, and a kernel argument
/// (`launch_builder(..).arg(&view)` passes its device pointer). Holding it
/// borrows the buffer, so the buffer cannot shrink meanwhile; growing can.
#[derive(Debug)]
pub struct View<'a, T> {
    ptr: u64,
    len: usize,
    stream: Arc<CudaStream>,
    _buf: PhantomData<&'a [T]>,
}

/// A mutable typed view of bytes in use in a CUDA-backed buffer: a
/// [`View`] that is also [`DevicePtrMut`], a destination for
/// `memcpy_htod`, `memcpy_dtod`, `memset_zeros`. Borrows the buffer mutably.
#[derive(Debug)]
pub struct ViewMut<'a, T> {
    ptr: u64,
    len: usize,
    stream: Arc<CudaStream>,
    _buf: PhantomData<&'a mut [T]>,
}

macro_rules! view_common {
    ($ty:ident) => {
        impl<T> $ty<'_, T> {
            /// The device address of the first element.
            pub fn device_address(&self) -> u64 {
                self.ptr
            }
        }

        impl<T> DeviceSlice<T> for $ty<'_, T> {
            fn len(&self) -> usize {
                self.len
            }
            fn stream(&self) -> &Arc<CudaStream> {
                &self.stream
            }
        }

        impl<T> DevicePtr<T> for $ty<'_, T> {
            /// No event is recorded or waited for: see the module's
            /// "Stream order".
            fn device_ptr<'s>(&'s self, _stream: &'s CudaStream) -> (u64, SyncOnDrop<'s>) {
                (self.ptr, SyncOnDrop::Sync(None))
            }
        }

        // SAFETY: pushes a reference to the view's `u64` device address, which
        // lives as long as the borrow `'b` of the view, through cudarc's own
        // impl for `&u64`; the kernel receives a pointer to mapped memory of
        // `len` elements, as for a `CudaSlice`.
        unsafe impl<'a, 'b: 'a, 'v, T> PushKernelArg<&'b $ty<'v, T>> for LaunchArgs<'a> {
            #[inline(always)]
            fn arg(&mut self, arg: &'b $ty<'v, T>) -> &mut Self {
                self.arg(&arg.ptr)
            }
        }
    };
}
view_common!(View);
view_common!(ViewMut);

impl<T> DevicePtrMut<T> for ViewMut<'_, T> {
    /// No event is recorded or waited for: see the module's "Stream order".
    fn device_ptr_mut<'s>(&'s mut self, _stream: &'s CudaStream) -> (u64, SyncOnDrop<'s>) {
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

// SAFETY: as for `&ViewMut`: pushes a reference to the device address.
unsafe impl<'a, 'b: 'a, 'v, T> PushKernelArg<&'b mut ViewMut<'v, T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut ViewMut<'v, T>) -> &mut Self {
        self.arg(&arg.ptr)
    }
}

/// A cudarc [`CudaSlice`] over bytes of a buffer, for code that takes only
/// `CudaSlice` (storage types, library wrappers). It never owns the memory:
/// when it goes out of scope the inner `CudaSlice` is leaked, never freed, so
/// the buffer keeps its bytes. It borrows the buffer for its life.
///
/// Only `&CudaSlice` is handed out (through `Deref`); see [`SliceMut`] for
/// APIs that need `&mut`.
pub struct SliceRef<'a, T> {
    slice: ManuallyDrop<CudaSlice<T>>,
    _buf: PhantomData<&'a [T]>,
}

/// Like [`SliceRef`], also handing out `&mut CudaSlice` (for outputs).
/// Swapping another slice in through `&mut` would make this wrapper leak that
/// one and hand ours to its new owner, whose drop would then ask the driver to
/// free an address it did not allocate (an error, not a free): don't.
pub struct SliceMut<'a, T> {
    slice: ManuallyDrop<CudaSlice<T>>,
    _buf: PhantomData<&'a mut [T]>,
}

impl<T> Deref for SliceRef<'_, T> {
    type Target = CudaSlice<T>;
    fn deref(&self) -> &CudaSlice<T> {
        &self.slice
    }
}

impl<T> Deref for SliceMut<'_, T> {
    type Target = CudaSlice<T>;
    fn deref(&self) -> &CudaSlice<T> {
        &self.slice
    }
}

impl<T> DerefMut for SliceMut<'_, T> {
    fn deref_mut(&mut self) -> &mut CudaSlice<T> {
        &mut self.slice
    }
}

macro_rules! leak_on_drop {
    ($ty:ident) => {
        impl<T> Drop for $ty<'_, T> {
            fn drop(&mut self) {
                // SAFETY: taken once, here, and never used again.
                let slice = unsafe { ManuallyDrop::take(&mut self.slice) };
                // Waits for the slice's tracked work, then forgets it: the
                // buffer owns the memory.
                let _ = slice.leak();
            }
        }
    };
}
leak_on_drop!(SliceRef);
leak_on_drop!(SliceMut);

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
        if offset_bytes % std::mem::align_of::<T>() != 0 {
            return Err(Error::invalid(format!(
                "offset {offset_bytes} is not aligned to {} for {}",
                std::mem::align_of::<T>(),
                std::any::type_name::<T>()
            )));
        }
        if stream.context() != self.backend().context() {
            return Err(Error::invalid(
                "the stream belongs to another context than the buffer",
            ));
        }
        let bytes = len
            .checked_mul(size)
            .ok_or_else(|| Error::invalid(format!("{len} elements of {size} bytes overflow")))?;
        self.check_access(
            Location::Device(self.backend().device()),
            need,
            offset_bytes,
            bytes,
        )?;
        Ok(self.base() + offset_bytes as u64)
    }

    /// A view of `len` elements of `T` starting `offset_bytes` into the bytes
    /// in use, for cudarc copies and kernel arguments on `stream`.
    ///
    /// Errors: the range is past the length, `offset_bytes` is misaligned for
    /// `T`, `stream` is of another context, or the device lacks read access.
    pub fn view<T: Element>(
        &self,
        stream: &Arc<CudaStream>,
        offset_bytes: usize,
        len: usize,
    ) -> Result<View<'_, T>> {
        let ptr = self.typed_range::<T>(stream, offset_bytes, len, Access::Read)?;
        Ok(View {
            ptr,
            len,
            stream: stream.clone(),
            _buf: PhantomData,
        })
    }

    /// A mutable view; see [`view`](Self::view). Needs read-write access.
    pub fn view_mut<T: Element>(
        &mut self,
        stream: &Arc<CudaStream>,
        offset_bytes: usize,
        len: usize,
    ) -> Result<ViewMut<'_, T>> {
        let ptr = self.typed_range::<T>(stream, offset_bytes, len, Access::ReadWrite)?;
        Ok(ViewMut {
            ptr,
            len,
            stream: stream.clone(),
            _buf: PhantomData,
        })
    }

    /// The CPU's view of bytes in host-placed chunks (see
    /// [`MigrationPolicy::PreferHost`](crate::MigrationPolicy) and
    /// [`offload`](GrowableBuffer::offload)), after waiting for the GPU.
    ///
    /// Sound because: every chunk in the range is host memory that grants the
    /// host read access (checked); it stays mapped and readable while `&self`
    /// lives (migration, access changes and shrinking take `&mut self`); the
    /// wait means no work submitted before is still writing it, and no safe
    /// API can write it while `&self` is borrowed (writes need `&mut self`).
    /// Kernels launched meanwhile (an `unsafe` act) must not write it.
    pub fn host_slice(&self, offset: usize, bytes: usize) -> Result<&[u8]> {
        self.check_access(Location::Host, Access::Read, offset, bytes)?;
        self.backend().synchronize()?;
        if bytes == 0 {
            return Ok(&[]);
        }
        // SAFETY: see the doc comment above.
        Ok(
            unsafe {
                std::slice::from_raw_parts((self.base() + offset as u64) as *const u8, bytes)
            },
        )
    }

    /// The CPU's mutable view of bytes in host-placed chunks; see
    /// [`host_slice`](Self::host_slice). Needs read-write host access.
    pub fn host_slice_mut(&mut self, offset: usize, bytes: usize) -> Result<&mut [u8]> {
        self.check_access(Location::Host, Access::ReadWrite, offset, bytes)?;
        self.backend().synchronize()?;
        if bytes == 0 {
            return Ok(&mut []);
        }
        // SAFETY: as in `host_slice`; `&mut self` makes the view exclusive.
        Ok(unsafe {
            std::slice::from_raw_parts_mut((self.base() + offset as u64) as *mut u8, bytes)
        })
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
        // (checked above), which the returned borrow keeps from shrinking;
        // every bit pattern is a valid `T` (`Element`); the slice is leaked,
        // never freed, when the wrapper drops.
        let slice = unsafe { stream.upgrade_device_ptr::<T>(ptr, len) };
        Ok(SliceRef {
            slice: ManuallyDrop::new(slice),
            _buf: PhantomData,
        })
    }

    /// A non-owning `CudaSlice<T>` that can be written; see [`SliceMut`].
    pub fn cuda_slice_mut<T: Element>(
        &mut self,
        stream: &Arc<CudaStream>,
        offset_bytes: usize,
        len: usize,
    ) -> Result<SliceMut<'_, T>> {
        let ptr = self.typed_range::<T>(stream, offset_bytes, len, Access::ReadWrite)?;
        // SAFETY: as in `cuda_slice`; `&mut self` makes it exclusive.
        let slice = unsafe { stream.upgrade_device_ptr::<T>(ptr, len) };
        Ok(SliceMut {
            slice: ManuallyDrop::new(slice),
            _buf: PhantomData,
        })
    }
}
