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

const NAME: &CStr = c"dltensor";
const NAME_VERSIONED: &CStr = c"dltensor_versioned";

/// What one exported view keeps alive until its consumer lets go: the
/// shape and strides the tensor points into, and whatever `keep` holds
/// (the buffer, and the record that the view is live). `repr(C)`: the
/// managed tensor sits at the holder's address, which is what the capsule
/// carries.
#[repr(C)]
struct Holder<M, K> {
    managed: M,
    _shape: Vec<i64>,
    _strides: Vec<i64>,
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

unsafe extern "C" fn delete_legacy<K>(m: *mut DLManagedTensor) {
    // SAFETY: `m` is the `managed` field (the first, repr(C)) of the Box'd
    // Holder that `export` leaked, and its consumer calls the deleter once.
    unsafe {
        drop(Box::from_raw(
            (*m).manager_ctx as *mut Holder<DLManagedTensor, K>,
        ))
    }
}

unsafe extern "C" fn delete_versioned<K>(m: *mut DLManagedTensorVersioned) {
    // SAFETY: as in `delete_legacy`.
    unsafe {
        drop(Box::from_raw(
            (*m).manager_ctx as *mut Holder<DLManagedTensorVersioned, K>,
        ))
    }
}

/// The capsule's destructor: a capsule never consumed (still named
/// `dltensor`) deletes its tensor; a consumer that took it renamed it and
/// calls the deleter itself.
unsafe extern "C" fn capsule_destructor(capsule: *mut ffi::PyObject) {
    // SAFETY: `capsule` is a live capsule (Python calls this as it frees
    // it). PyCapsule_IsValid sets no error; GetPointer cannot fail once
    // IsValid said yes.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, NAME.as_ptr()) == 1 {
            let m = ffi::PyCapsule_GetPointer(capsule, NAME.as_ptr()) as *mut DLManagedTensor;
            if let Some(d) = (*m).deleter {
                d(m)
            }
        } else if ffi::PyCapsule_IsValid(capsule, NAME_VERSIONED.as_ptr()) == 1 {
            let m = ffi::PyCapsule_GetPointer(capsule, NAME_VERSIONED.as_ptr())
                as *mut DLManagedTensorVersioned;
            if let Some(d) = (*m).deleter {
                d(m)
            }
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
    let (ptr, name) = if versioned {
        let mut h = Box::new(Holder {
            managed: DLManagedTensorVersioned {
                version: DLPackVersion { major: 1, minor: 1 },
                manager_ctx: std::ptr::null_mut(),
                deleter: Some(delete_versioned::<K>),
                flags: 0,
                dl_tensor: tensor(&view, &mut [], &mut []),
            },
            _shape: view.shape.clone(),
            _strides: view.strides.clone(),
            _keep: keep,
        });
        h.managed.dl_tensor = tensor(&view, &mut h._shape, &mut h._strides);
        let raw = Box::into_raw(h);
        // SAFETY: `raw` is the live Box just leaked; the context points at
        // it so the deleter can take it back.
        unsafe { (*raw).managed.manager_ctx = raw as *mut c_void };
        (raw as *mut c_void, NAME_VERSIONED)
    } else {
        let mut h = Box::new(Holder {
            managed: DLManagedTensor {
                dl_tensor: tensor(&view, &mut [], &mut []),
                manager_ctx: std::ptr::null_mut(),
                deleter: Some(delete_legacy::<K>),
            },
            _shape: view.shape.clone(),
            _strides: view.strides.clone(),
            _keep: keep,
        });
        h.managed.dl_tensor = tensor(&view, &mut h._shape, &mut h._strides);
        let raw = Box::into_raw(h);
        // SAFETY: as above.
        unsafe { (*raw).managed.manager_ctx = raw as *mut c_void };
        (raw as *mut c_void, NAME)
    };
    // SAFETY: `ptr` is a leaked Holder, whose first field (repr(C)) is the
    // managed tensor the name announces; the name is a static C string; the
    // destructor handles both names.
    let cap = unsafe { ffi::PyCapsule_New(ptr, name.as_ptr(), Some(capsule_destructor)) };
    if cap.is_null() {
        // The capsule was not made: take the holder back.
        // SAFETY: the pointer was leaked above and nothing else has it.
        unsafe {
            if versioned {
                delete_versioned::<K>(ptr as *mut DLManagedTensorVersioned)
            } else {
                delete_legacy::<K>(ptr as *mut DLManagedTensor)
            }
        }
        return Err(PyErr::fetch(py));
    }
    // SAFETY: a new reference PyCapsule_New returned.
    Ok(unsafe { Bound::from_owned_ptr(py, cap) }.unbind())
}
