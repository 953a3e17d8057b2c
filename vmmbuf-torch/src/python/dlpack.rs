//! DLPack's C structures (dlpack.h, versions 0.8 and 1.x) and the capsule
//! that carries them to a consumer (`torch.from_dlpack`,
//! `cupy.from_dlpack`, `numpy.from_dlpack`).

use std::ffi::{c_void, CStr};

use pyo3::ffi;
use pyo3::prelude::*;

/// `kDLCPU`.
pub(crate) const DL_CPU: i32 = 1;
/// `kDLCUDA`.
pub(crate) const DL_CUDA: i32 = 2;

#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct DLDevice {
    pub device_type: i32,
    pub device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct DLDataType {
    pub code: u8,
    pub bits: u8,
    pub lanes: u16,
}

#[repr(C)]
pub(crate) struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

#[repr(C)]
struct DLPackVersion {
    major: u32,
    minor: u32,
}

#[repr(C)]
struct DLManagedTensorVersioned {
    version: DLPackVersion,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DLTensor,
}

/// The two managed-tensor structures, as one exporter sees them: the name
/// a capsule of each carries, how one is made around a tensor, and where
/// its context and deleter sit.
trait Managed: Sized + 'static {
    /// The capsule's name for this kind.
    const NAME: &'static CStr;
    /// A managed tensor around `dl_tensor` whose deleter drops a
    /// `Holder<Self, K>`; its context is set once the holder is placed.
    fn new<K: 'static>(dl_tensor: DLTensor) -> Self;
    fn ctx(&mut self) -> &mut *mut c_void;
    fn dl_tensor(&mut self) -> &mut DLTensor;
    /// Calls the deleter.
    ///
    /// # Safety
    /// `m` points at a live managed tensor that `export` made, whose
    /// deleter has not run.
    unsafe fn delete(m: *mut Self);
}

impl Managed for DLManagedTensor {
    const NAME: &'static CStr = c"dltensor";
    fn new<K: 'static>(dl_tensor: DLTensor) -> Self {
        DLManagedTensor {
            dl_tensor,
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete::<Self, K>),
        }
    }
    fn ctx(&mut self) -> &mut *mut c_void {
        &mut self.manager_ctx
    }
    fn dl_tensor(&mut self) -> &mut DLTensor {
        &mut self.dl_tensor
    }
    unsafe fn delete(m: *mut Self) {
        // SAFETY: the caller's contract.
        unsafe { ((*m).deleter.expect("export sets the deleter"))(m) }
    }
}

impl Managed for DLManagedTensorVersioned {
    const NAME: &'static CStr = c"dltensor_versioned";
    fn new<K: 'static>(dl_tensor: DLTensor) -> Self {
        DLManagedTensorVersioned {
            version: DLPackVersion { major: 1, minor: 1 },
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete::<Self, K>),
            flags: 0,
            dl_tensor,
        }
    }
    fn ctx(&mut self) -> &mut *mut c_void {
        &mut self.manager_ctx
    }
    fn dl_tensor(&mut self) -> &mut DLTensor {
        &mut self.dl_tensor
    }
    unsafe fn delete(m: *mut Self) {
        // SAFETY: the caller's contract.
        unsafe { ((*m).deleter.expect("export sets the deleter"))(m) }
    }
}

/// What one exported view keeps alive until its consumer lets go: the
/// shape and strides the tensor points into, and whatever `keep` holds
/// (the buffer, and the record that the view is live). `repr(C)`: the
/// managed tensor sits at the holder's address, which is what the capsule
/// carries.
#[repr(C)]
struct Holder<M, K> {
    managed: M,
    shape: Vec<i64>,
    strides: Vec<i64>,
    _keep: K,
}

/// A view to export: where, what, how it is laid out.
pub(crate) struct View {
    pub data: u64,
    pub device: DLDevice,
    pub dtype: DLDataType,
    pub shape: Vec<i64>,
    pub strides: Vec<i64>,
}

fn tensor(v: &View, shape: &mut [i64], strides: &mut [i64]) -> DLTensor {
    DLTensor {
        data: v.data as usize as *mut c_void,
        device: v.device,
        ndim: shape.len() as i32,
        dtype: v.dtype,
        shape: shape.as_mut_ptr(),
        strides: strides.as_mut_ptr(),
        byte_offset: 0,
    }
}

/// The deleter of a managed tensor of kind `M` held with `K`.
unsafe extern "C" fn delete<M: Managed, K: 'static>(m: *mut M) {
    // SAFETY: `m` is the `managed` field (the first, repr(C)) of the Box'd
    // Holder that `export` leaked, whose context points at that holder,
    // and its consumer calls the deleter once.
    unsafe { drop(Box::from_raw(*(*m).ctx() as *mut Holder<M, K>)) }
}

/// The destructor of a capsule of kind `M`: a capsule never consumed (still
/// named `M::NAME`) deletes its tensor; a consumer that took it renamed it
/// and calls the deleter itself.
unsafe extern "C" fn capsule_destructor<M: Managed>(capsule: *mut ffi::PyObject) {
    // SAFETY: `capsule` is a live capsule (Python calls this as it frees
    // it). PyCapsule_IsValid sets no error; GetPointer cannot fail once
    // IsValid said yes, and the pointer is the managed tensor `export`
    // made, not yet deleted.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, M::NAME.as_ptr()) == 1 {
            M::delete(ffi::PyCapsule_GetPointer(capsule, M::NAME.as_ptr()) as *mut M)
        }
    }
}

/// A DLPack capsule for `view` (versioned, DLPack 1.1, if `versioned`),
/// which keeps `keep` alive until the consumer's tensor is gone.
pub(crate) fn export<K: Send + 'static>(
    py: Python<'_>,
    view: View,
    keep: K,
    versioned: bool,
) -> PyResult<Py<PyAny>> {
    if versioned {
        capsule::<DLManagedTensorVersioned, K>(py, view, keep)
    } else {
        capsule::<DLManagedTensor, K>(py, view, keep)
    }
}

fn capsule<M: Managed, K: Send + 'static>(
    py: Python<'_>,
    view: View,
    keep: K,
) -> PyResult<Py<PyAny>> {
    let mut h = Box::new(Holder {
        managed: M::new::<K>(tensor(&view, &mut [], &mut [])),
        shape: view.shape.clone(),
        strides: view.strides.clone(),
        _keep: keep,
    });
    // The tensor points into the holder's own shape and strides, whose
    // heap buffers stay put when the Box moves.
    let t = tensor(&view, &mut h.shape, &mut h.strides);
    *h.managed.dl_tensor() = t;
    let raw = Box::into_raw(h);
    // SAFETY: `raw` is the live Box just leaked; the context points at it
    // so the deleter can take it back.
    unsafe { *(*raw).managed.ctx() = raw as *mut c_void };
    // SAFETY: `raw` is a leaked Holder, whose first field (repr(C)) is the
    // managed tensor the name announces; the name is a static C string; the
    // destructor is this kind's.
    let cap = unsafe {
        ffi::PyCapsule_New(
            raw as *mut c_void,
            M::NAME.as_ptr(),
            Some(capsule_destructor::<M>),
        )
    };
    if cap.is_null() {
        // The capsule was not made: take the holder back.
        // SAFETY: the pointer was leaked above and nothing else has it.
        unsafe { M::delete(raw as *mut M) };
        return Err(PyErr::fetch(py));
    }
    // SAFETY: a new reference PyCapsule_New returned.
    Ok(unsafe { Bound::from_owned_ptr(py, cap) }.unbind())
}
