//! cudarc interop types: typed views that cudarc's copies and kernel launches
//! accept, and a non-owning `CudaSlice` for APIs that take nothing else. The
//! buffer and the arena hand them out (`cuda/buffer_view.rs`, `cuda/arena_view.rs`); their trait impls, which
//! promise cudarc a valid device range, live here with the backend.
//!
//! # Stream order
//! A view is made for one stream. When it drops, it records an event on that
//! stream as the buffer's last use there, so everything queued on it with
//! the view (copies, kernels that took the view as an argument) is waited
//! for before the buffer unmaps, migrates, changes access, reads back or
//! drops those bytes: that stream's work, never the whole device.
//!
//! To use a view on another stream:
//! - in a cudarc copy (`other.memcpy_dtoh(&view, ..)`): allowed; the copy
//!   synchronises `other` once it is queued (the view cannot record there);
//! - as a kernel argument on another stream: make a view for that stream
//!   instead (`buf.view(&other, ..)`), or call
//!   [`record_stream(&other)`](crate::GrowableBuffer::record_stream) after the
//!   launch. A launch on a stream the buffer does not know of is not waited
//!   for.
//!
//! Ordering *between* streams that share bytes is yours, as in CUDA: record
//! an event on the producer and make the consumer wait for it. A peer GPU's
//! stream is accepted once the buffer grants that GPU access
//! ([`add_peer`](crate::GrowableBuffer::add_peer)); its uses are waited for
//! the same way.
#![allow(unsafe_code)]

use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::ops::Deref;
use std::sync::Arc;

use cudarc::driver::{
    CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, DeviceSlice, LaunchArgs,
    PushKernelArg, SyncOnDrop,
};

use super::{stream_key, CudaFence};
use crate::backend::Uses;

/// Element types a view may hold: any bit pattern is a valid value (so bytes
/// the GPU wrote can be read back as `T`), and the type can cross to the device.
///
/// The primitive integers and floats qualify. `half::f16` and `half::bf16`
/// qualify once two features are on in the user's `Cargo.toml`: cudarc's
/// `f16` (its `DeviceRepr` for them) and half's `bytemuck` (`Pod`), e.g.
/// `cudarc = { version = "0.19", features = ["f16"] }` and
/// `half = { version = "2", features = ["bytemuck"] }`.
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
    uses: &'a Uses<CudaFence>,
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
    uses: &'a Uses<CudaFence>,
    _buf: PhantomData<&'a mut [T]>,
}

/// What a copy on `used` through a view of stream `own` must do once it is
/// queued: nothing on the view's own stream (its drop records the use); on
/// another stream, wait for that stream, since the view cannot record there.
fn on_stream<'s>(own: &CudaStream, used: &'s CudaStream) -> SyncOnDrop<'s> {
    if stream_key(own) == stream_key(used) {
        SyncOnDrop::Sync(None)
    } else {
        SyncOnDrop::Sync(Some(used))
    }
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

        /// Records the view's use on its stream: whatever was queued there
        /// with the view (copies, kernels) is waited for before the buffer
        /// unmaps, remaps or reads these bytes.
        impl<T> Drop for $ty<'_, T> {
            fn drop(&mut self) {
                if let Err(e) = self.uses.record_stream(&self.stream) {
                    tracing::error!(error = %e, "vmmbuf: recording a view's use failed");
                }
            }
        }

        impl<T> DevicePtr<T> for $ty<'_, T> {
            /// No event is recorded or waited for: see the module's
            /// "Stream order".
            fn device_ptr<'s>(&'s self, stream: &'s CudaStream) -> (u64, SyncOnDrop<'s>) {
                (self.ptr, on_stream(&self.stream, stream))
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
    fn device_ptr_mut<'s>(&'s mut self, stream: &'s CudaStream) -> (u64, SyncOnDrop<'s>) {
        (self.ptr, on_stream(&self.stream, stream))
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
/// `&CudaSlice` (storage types, library wrappers). It never owns the memory:
/// when it goes out of scope the inner `CudaSlice` is leaked, never freed, so
/// the buffer keeps its bytes. It borrows the buffer for its life.
///
/// Only `&CudaSlice` is handed out (through `Deref`): no safe code can take
/// an owned or `&mut CudaSlice` out of the wrapper, which would outlive the
/// buffer (reads after unmap, `cuMemFreeAsync` of VMM memory at its drop).
/// For outputs, use [`ViewMut`]: every cudarc copy and launch takes it.
/// Each escape route is refused by the compiler:
///
/// ```compile_fail,E0596
/// # use std::sync::Arc;
/// # use cudarc::driver::{CudaSlice, CudaStream};
/// # fn f(buf: &vmmbuf::GrowableBuffer<vmmbuf::CudaBackend>, s: &Arc<CudaStream>,
/// #      other: CudaSlice<u32>) -> vmmbuf::Result<()> {
/// let mut v = buf.cuda_slice::<u32>(s, 0, 4)?;
/// let escaped: CudaSlice<u32> = std::mem::replace(&mut *v, other); // no `&mut`
/// # Ok(()) }
/// ```
/// ```compile_fail,E0596
/// # use std::sync::Arc;
/// # use cudarc::driver::CudaStream;
/// # fn f(buf: &vmmbuf::GrowableBuffer<vmmbuf::CudaBackend>, s: &Arc<CudaStream>) -> vmmbuf::Result<()> {
/// let (mut a, mut b) = (buf.cuda_slice::<u32>(s, 0, 4)?, buf.cuda_slice::<u32>(s, 16, 4)?);
/// std::mem::swap(&mut *a, &mut *b); // no `&mut`
/// # Ok(()) }
/// ```
/// ```compile_fail,E0507
/// # use std::sync::Arc;
/// # use cudarc::driver::{CudaSlice, CudaStream};
/// # fn f(buf: &vmmbuf::GrowableBuffer<vmmbuf::CudaBackend>, s: &Arc<CudaStream>) -> vmmbuf::Result<()> {
/// let v = buf.cuda_slice::<u32>(s, 0, 4)?;
/// let owned: CudaSlice<u32> = *v; // no move out
/// # Ok(()) }
/// ```
/// ```compile_fail,E0507
/// # use std::sync::Arc;
/// # use cudarc::driver::CudaStream;
/// # fn f(buf: &vmmbuf::GrowableBuffer<vmmbuf::CudaBackend>, s: &Arc<CudaStream>) -> vmmbuf::Result<()> {
/// let v = buf.cuda_slice::<u32>(s, 0, 4)?;
/// let ptr = v.leak(); // `leak` takes the slice by value: no move out
/// # Ok(()) }
/// ```
/// ```compile_fail,E0616
/// # use std::sync::Arc;
/// # use cudarc::driver::CudaStream;
/// # fn f(buf: &vmmbuf::GrowableBuffer<vmmbuf::CudaBackend>, s: &Arc<CudaStream>) -> vmmbuf::Result<()> {
/// let mut v = buf.cuda_slice::<u32>(s, 0, 4)?;
/// let inner = unsafe { std::mem::ManuallyDrop::take(&mut v.slice) }; // private
/// # Ok(()) }
/// ```
/// And there is no mutable wrapper to take one from:
/// ```compile_fail
/// # use std::sync::Arc;
/// # use cudarc::driver::{CudaSlice, CudaStream};
/// # fn f(buf: &mut vmmbuf::GrowableBuffer<vmmbuf::CudaBackend>, s: &Arc<CudaStream>,
/// #      other: CudaSlice<u32>) -> vmmbuf::Result<()> {
/// let mut v = buf.cuda_slice_mut::<u32>(s, 0, 4)?;
/// let escaped: CudaSlice<u32> = std::mem::replace(&mut *v, other);
/// # Ok(()) }
/// ```
/// Borrowing it (`&CudaSlice`) is all it allows, and is enough for
/// read-only APIs; `clone()` copies into new memory that the clone owns.
pub struct SliceRef<'a, T> {
    slice: ManuallyDrop<CudaSlice<T>>,
    uses: &'a Uses<CudaFence>,
    _buf: PhantomData<&'a [T]>,
}

impl<T> Deref for SliceRef<'_, T> {
    type Target = CudaSlice<T>;
    fn deref(&self) -> &CudaSlice<T> {
        &self.slice
    }
}

impl<T> Drop for SliceRef<'_, T> {
    fn drop(&mut self) {
        // The use on its stream, as for views.
        if let Err(e) = self.uses.record_stream(self.slice.stream()) {
            tracing::error!(error = %e, "vmmbuf: recording a slice's use failed");
        }
        // SAFETY: taken once, here, and never used again.
        let slice = unsafe { ManuallyDrop::take(&mut self.slice) };
        // Waits for the slice's tracked work, then forgets it: the buffer
        // owns the memory.
        let _ = slice.leak();
    }
}

macro_rules! view_new {
    ($ty:ident) => {
        impl<'a, T> $ty<'a, T> {
            /// A view of `len` elements at `ptr`, used on `stream`. Holding a
            /// device address is safe; the buffer that makes it has checked the
            /// range and ties the view's lifetime to its borrow.
            pub(crate) fn new(
                ptr: u64,
                len: usize,
                stream: Arc<CudaStream>,
                uses: &'a Uses<CudaFence>,
            ) -> Self {
                Self {
                    ptr,
                    len,
                    stream,
                    uses,
                    _buf: PhantomData,
                }
            }
        }
    };
}
view_new!(View);
view_new!(ViewMut);

impl<'a, T: Element> SliceRef<'a, T> {
    /// A non-owning `CudaSlice` of `len` elements at `ptr`, recording its use
    /// in `uses` when it drops.
    ///
    /// # Safety
    /// `[ptr, ptr + len * size_of::<T>())` is mapped, in use, and stays so for
    /// the wrapper's lifetime (its borrow of the buffer).
    pub(crate) unsafe fn from_raw(
        stream: &Arc<CudaStream>,
        ptr: u64,
        len: usize,
        uses: &'a Uses<CudaFence>,
    ) -> Self {
        // SAFETY: forwarded to the caller; every bit pattern is a valid `T`
        // (`Element`); the slice is leaked, never freed, when the wrapper
        // drops.
        let slice = unsafe { stream.upgrade_device_ptr::<T>(ptr, len) };
        Self {
            slice: ManuallyDrop::new(slice),
            uses,
            _buf: PhantomData,
        }
    }
}
