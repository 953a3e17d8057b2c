//! `vmmbuf._native.Buffer`: a [`GrowableBuffer`] on a GPU or (Linux) on the
//! host backend, exported to array libraries through DLPack. The package's
//! `GrowableTensor` is built on it.
//!
//! Stream order: writes made through the buffer's views are recorded with
//! [`Buffer::record_write`] on the writer's stream; an export to a consumer
//! stream makes that stream wait for them. Shrinking waits for every
//! recorded write and for the stream it is given, and never gives back
//! bytes a live view covers. A view's consumer stream is not recorded when
//! the view is let go (the consumer may have destroyed it by then): work
//! still queued on another stream after the view is gone must be recorded
//! (`record_write`) or passed to `shrink_to_fit`, as with PyTorch's
//! `record_stream`.

use std::collections::BTreeMap;
use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaStream};
use parking_lot::{Mutex, RwLock};
use pyo3::prelude::*;
use vmmbuf::cuda::CudaFence;
use vmmbuf::{BufferDesc, CudaBackend, Error, GrowableBuffer, Result};

use super::dlpack::{self, DLDataType, DLDevice, View};
use super::to_py;

/// Where the bytes live.
enum Mem {
    #[cfg(target_os = "linux")]
    Host(GrowableBuffer<vmmbuf::HostBackend>),
    Cuda {
        buf: GrowableBuffer<CudaBackend>,
        ctx: Arc<CudaContext>,
        /// The last recorded write, with its stream's handle.
        last_write: Option<(usize, CudaFence)>,
    },
}

/// What the Python object and every exported view share.
struct Shared {
    mem: RwLock<Mem>,
    /// Live views by the byte they end at: shrinking keeps up to the last.
    views: Mutex<BTreeMap<usize, usize>>,
}

impl Shared {
    /// The end of the furthest live view (0 for none).
    fn views_end(&self) -> usize {
        self.views.lock().keys().next_back().copied().unwrap_or(0)
    }
}

/// Kept by an exported view: the buffer, and the record that the view is
/// live until its consumer lets go.
struct ViewGuard {
    shared: Arc<Shared>,
    end: usize,
}

impl Drop for ViewGuard {
    fn drop(&mut self) {
        let mut v = self.shared.views.lock();
        if let Some(n) = v.get_mut(&self.end) {
            *n -= 1;
            if *n == 0 {
                v.remove(&self.end);
            }
        }
    }
}

/// A stream handle another library owns, wrapped without taking ownership.
fn wrap(ctx: &Arc<CudaContext>, stream: usize) -> Arc<CudaStream> {
    // SAFETY: `stream` is a stream of this context (or 0, 1, 2: the legacy
    // and per-thread default streams) that its owner keeps alive for the
    // call, and the wrapper never destroys it.
    unsafe { ctx.wrap_borrowed_stream(stream as sys::CUstream) }
}

/// A growable buffer with a stable base address, on a GPU (`device` set)
/// or in host memory (`device=None`, Linux).
#[pyclass(module = "vmmbuf._native", frozen)]
pub(crate) struct Buffer {
    shared: Arc<Shared>,
    base: u64,
    device: Option<i32>,
    reserved: usize,
}

impl Buffer {
    /// `host` or `cuda` applied to the buffer, whichever it is.
    fn read<T>(
        &self,
        #[allow(unused_variables)] host: impl FnOnce(&GrowableBuffer<vmmbuf::HostBackend>) -> T,
        cuda: impl FnOnce(&GrowableBuffer<CudaBackend>) -> T,
    ) -> T {
        match &*self.shared.mem.read() {
            #[cfg(target_os = "linux")]
            Mem::Host(b) => host(b),
            Mem::Cuda { buf, .. } => cuda(buf),
        }
    }

    /// Where a view of the buffer lives, for DLPack: the GPU, or the host
    /// (which takes no consumer stream).
    fn dl_device(&self, consumer: Option<usize>) -> Result<DLDevice> {
        Ok(match self.device {
            None => {
                if consumer.is_some() {
                    return Err(Error::InvalidArgument(
                        "a stream for a view of host memory".into(),
                    ));
                }
                DLDevice {
                    device_type: dlpack::DL_CPU,
                    device_id: 0,
                }
            }
            Some(d) => DLDevice {
                device_type: dlpack::DL_CUDA,
                device_id: d,
            },
        })
    }

    /// Registers a view up to byte `end`, once the capacity is checked,
    /// under one read lock of the memory: shrink_to_fit (the write lock)
    /// cannot unmap in between (RT4-3). The `consumer` stream first waits
    /// for the recorded writes.
    fn register_view(&self, end: usize, consumer: Option<usize>) -> Result<ViewGuard> {
        let m = self.shared.mem.read();
        // Mapped bytes past the length may be viewed too (the
        // package's append writes through a view of the capacity).
        let mapped = match &*m {
            #[cfg(target_os = "linux")]
            Mem::Host(b) => b.capacity(),
            Mem::Cuda { buf, .. } => buf.capacity(),
        };
        if end > mapped {
            return Err(Error::InvalidArgument(format!(
                "a view up to byte {end} of a buffer with {mapped} bytes mapped"
            )));
        }
        if let (
            Some(s),
            Mem::Cuda {
                ctx,
                last_write: Some((w, fence)),
                ..
            },
        ) = (consumer, &*m)
        {
            if *w != s {
                wrap(ctx, s)
                    .wait(fence.event())
                    .map_err(|e| Error::Driver {
                        call: "cuStreamWaitEvent",
                        source: e,
                    })?;
            }
        }
        *self.shared.views.lock().entry(end).or_insert(0) += 1;
        Ok(ViewGuard {
            shared: self.shared.clone(),
            end,
        })
    }
}

#[pymethods]
impl Buffer {
    /// Reserves `max_bytes` of address space on `device` (a CUDA ordinal) or
    /// in host memory (`None`); no memory until it grows. `pooled`: chunks
    /// given up stay in the backend's pool for the next growth (of any
    /// pooled buffer) instead of going back to the driver at once.
    #[new]
    #[pyo3(signature = (max_bytes, device=None, pooled=false))]
    fn new(py: Python<'_>, max_bytes: usize, device: Option<i32>, pooled: bool) -> PyResult<Self> {
        let desc = BufferDesc::new(max_bytes).pooled(pooled);
        let mem = py
            .detach(|| -> Result<Mem> {
                match device {
                    None => host(desc),
                    Some(d) => {
                        let ordinal = u32::try_from(d)
                            .map_err(|_| Error::InvalidArgument(format!("device {d}")))?;
                        let backend = CudaBackend::new(ordinal)?;
                        let ctx = backend.context().clone();
                        Ok(Mem::Cuda {
                            buf: GrowableBuffer::new(backend, desc)?,
                            ctx,
                            last_write: None,
                        })
                    }
                }
            })
            .map_err(to_py)?;
        let (base, reserved) = match &mem {
            #[cfg(target_os = "linux")]
            Mem::Host(b) => (b.base(), b.reserved()),
            Mem::Cuda { buf, .. } => (buf.base(), buf.reserved()),
        };
        Ok(Buffer {
            shared: Arc::new(Shared {
                mem: RwLock::new(mem),
                views: Mutex::new(BTreeMap::new()),
            }),
            base,
            device,
            reserved,
        })
    }

    /// The base address: never changes.
    #[getter]
    fn base(&self) -> u64 {
        self.base
    }

    /// The CUDA ordinal, or None for host memory.
    #[getter]
    fn device(&self) -> Option<i32> {
        self.device
    }

    /// Bytes of address space reserved (the most it can grow to).
    #[getter]
    fn reserved(&self) -> usize {
        self.reserved
    }

    /// Bytes in use.
    fn __len__(&self) -> usize {
        self.read(|b| b.len(), |b| b.len())
    }

    /// Bytes mapped.
    #[getter]
    fn capacity(&self) -> usize {
        self.read(|b| b.capacity(), |b| b.capacity())
    }

    /// Chunks mapped.
    #[getter]
    fn chunk_count(&self) -> usize {
        self.read(|b| b.chunk_count(), |b| b.chunk_count())
    }

    /// Bytes of live exported views' furthest end (shrinking keeps them).
    #[getter]
    fn views_end(&self) -> usize {
        self.shared.views_end()
    }

    /// Sets the length: grows (maps chunks, keeps the data, never copies,
    /// the base stays) or truncates (keeps the memory for regrowth). On an
    /// error nothing has changed.
    fn resize(&self, py: Python<'_>, bytes: usize) -> PyResult<()> {
        py.detach(|| {
            let mut m = self.shared.mem.write();
            match &mut *m {
                #[cfg(target_os = "linux")]
                Mem::Host(b) => resize(b, bytes),
                Mem::Cuda { buf, .. } => resize(buf, bytes),
            }
        })
        .map_err(to_py)
    }

    /// Records that work queued on `stream` so far writes the buffer: an
    /// export to another stream makes that one wait for it, and shrinking
    /// waits for it. A no-op in host memory.
    fn record_write(&self, py: Python<'_>, stream: usize) -> PyResult<()> {
        py.detach(|| {
            let mut m = self.shared.mem.write();
            if let Mem::Cuda {
                buf,
                ctx,
                last_write,
            } = &mut *m
            {
                let s = wrap(ctx, stream);
                buf.record_stream(&s)?;
                *last_write = Some((stream, buf.backend().fence(&s)?));
            }
            Ok(())
        })
        .map_err(to_py)
    }

    /// Gives back every chunk past the length and past every live view,
    /// after the work recorded on the buffer (and on `stream`, if given)
    /// has finished.
    #[pyo3(signature = (stream=None))]
    fn shrink_to_fit(&self, py: Python<'_>, stream: Option<usize>) -> PyResult<()> {
        py.detach(|| {
            // The end of the live views is read under the write lock: an
            // export registers its view under the read lock, after checking
            // the capacity, so either this sees the view or the export sees
            // the shrunk capacity (RT4-3).
            let mut m = self.shared.mem.write();
            let keep = self.shared.views_end();
            match &mut *m {
                #[cfg(target_os = "linux")]
                Mem::Host(b) => b.shrink_to(keep),
                Mem::Cuda { buf, ctx, .. } => {
                    if let Some(s) = stream {
                        buf.record_stream(&wrap(ctx, s))?;
                    }
                    buf.shrink_to(keep)
                }
            }
        })
        .map_err(to_py)
    }

    /// A DLPack capsule for the view at `offset` bytes with `shape` and
    /// `strides` (in elements) of dtype (`code`, `bits`, `lanes`); the
    /// versioned kind (DLPack 1.1) if `versioned`. `stream`: the consumer's
    /// CUDA stream (None or -1: no ordering), which is made to wait for
    /// the recorded writes.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (offset, shape, strides, code, bits, lanes, stream=None, versioned=false))]
    fn export(
        &self,
        py: Python<'_>,
        offset: usize,
        shape: Vec<i64>,
        strides: Vec<i64>,
        code: u8,
        bits: u8,
        lanes: u16,
        stream: Option<i64>,
        versioned: bool,
    ) -> PyResult<Py<PyAny>> {
        let item = (bits as usize * lanes as usize).div_ceil(8);
        let end = extent(offset, &shape, &strides, item).map_err(to_py)?;
        let consumer = match stream {
            None | Some(-1) => None,
            Some(s) if s < 0 => {
                return Err(to_py(Error::InvalidArgument(format!("stream {s}"))));
            }
            Some(s) => Some(s as usize),
        };
        let device = self.dl_device(consumer).map_err(to_py)?;
        let guard = py
            .detach(|| self.register_view(end, consumer))
            .map_err(to_py)?;
        let view = View {
            data: self.base + offset as u64,
            device,
            dtype: DLDataType { code, bits, lanes },
            shape,
            strides,
        };
        dlpack::export(py, view, guard, versioned)
    }
}

fn resize<B: vmmbuf::Backend>(b: &mut GrowableBuffer<B>, bytes: usize) -> Result<()> {
    if bytes >= b.len() {
        b.grow_to(bytes)
    } else {
        b.truncate(bytes);
        Ok(())
    }
}

#[cfg(target_os = "linux")]
fn host(desc: BufferDesc) -> Result<Mem> {
    Ok(Mem::Host(GrowableBuffer::new(
        vmmbuf::HostBackend::new(),
        desc,
    )?))
}

#[cfg(not(target_os = "linux"))]
fn host(_: BufferDesc) -> Result<Mem> {
    Err(Error::Unsupported {
        what: "host buffers (Linux only)".into(),
    })
}

/// The byte past the last element of a view at `offset` with `shape` and
/// `strides` (elements of `item` bytes): a typed error for a negative
/// stride or size, or an overflow.
fn extent(offset: usize, shape: &[i64], strides: &[i64], item: usize) -> Result<usize> {
    let bad = |why: &str| {
        Error::InvalidArgument(format!("view shape {shape:?}, strides {strides:?}: {why}"))
    };
    if shape.len() != strides.len() {
        return Err(bad("shape and strides differ in length"));
    }
    if item == 0 {
        return Err(bad("a zero-sized element"));
    }
    let mut last = 0usize;
    for (&n, &s) in shape.iter().zip(strides) {
        if n < 0 || s < 0 {
            return Err(bad("negative"));
        }
        if n == 0 {
            return Ok(offset);
        }
        let step = (n as usize - 1)
            .checked_mul(s as usize)
            .ok_or_else(|| bad("overflow"))?;
        last = last.checked_add(step).ok_or_else(|| bad("overflow"))?;
    }
    last.checked_add(1)
        .and_then(|n| n.checked_mul(item))
        .and_then(|n| n.checked_add(offset))
        .ok_or_else(|| bad("overflow"))
}
