//! What the machine's CUDA driver and GPUs support, read through the thin
//! [`driver`](super::driver) layer without allocating memory.
#![allow(unsafe_code)]

use cudarc::driver::sys;

use super::{driver, CudaBackend};
use crate::error::Result;
use crate::location::Location;

/// What one GPU supports, as plain data.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeviceProbe {
    /// Device ordinal.
    pub ordinal: u32,
    /// Marketing name.
    pub name: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// Total memory in bytes.
    pub total_bytes: usize,
    /// Virtual memory management supported.
    pub vmm: bool,
    /// Host (NUMA) placement of VMM chunks supported, and the node to use.
    pub host_numa_node: Option<i32>,
    /// Minimum and recommended mapping granularity for device chunks (0 without VMM).
    pub granularity: (usize, usize),
    /// Chunks exportable as POSIX file descriptors (IPC).
    pub posix_fd_handles: bool,
    /// Chunks exportable as fabric handles (multi-node).
    pub fabric_handles: bool,
    /// GPUDirect RDMA on VMM memory.
    pub rdma_with_vmm: bool,
}

/// What the machine's CUDA driver and GPUs support; see [`probe`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Probe {
    /// Driver API version, e.g. 13000 for CUDA 13.0.
    pub driver_version: i32,
    /// One entry per GPU.
    pub devices: Vec<DeviceProbe>,
    /// `peer_access[a][b]`: device `a` can map memory of device `b`.
    pub peer_access: Vec<Vec<bool>>,
}

impl std::fmt::Display for Probe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let v = self.driver_version;
        writeln!(
            f,
            "CUDA driver {}.{} ({} GPU(s))",
            v / 1000,
            v % 1000 / 10,
            self.devices.len()
        )?;
        let yes = |b: bool| if b { "yes" } else { "no" };
        for d in &self.devices {
            writeln!(
                f,
                "gpu{}: {} (sm_{}{}), {}\n  VMM: {}; granularity {} min / {} recommended\n  \
                 host placement: {}; IPC by POSIX fd: {}; fabric handles: {}; RDMA on VMM: {}",
                d.ordinal,
                d.name,
                d.compute_capability.0,
                d.compute_capability.1,
                crate::report::Bytes(d.total_bytes),
                yes(d.vmm),
                crate::report::Bytes(d.granularity.0),
                crate::report::Bytes(d.granularity.1),
                d.host_numa_node
                    .map_or("no".to_string(), |n| format!("yes (NUMA node {n})")),
                yes(d.posix_fd_handles),
                yes(d.fabric_handles),
                yes(d.rdma_with_vmm),
            )?;
        }
        if self.devices.len() > 1 {
            writeln!(f, "peer access (row maps column's memory):")?;
            for (a, row) in self.peer_access.iter().enumerate() {
                let cells: Vec<&str> = row
                    .iter()
                    .enumerate()
                    .map(|(b, &p)| if a == b { "-" } else { yes(p) })
                    .collect();
                writeln!(f, "  gpu{a}: {}", cells.join(" "))?;
            }
        }
        Ok(())
    }
}

/// How many CUDA devices the driver sees (`cuDeviceGetCount`), without
/// making any context: unlike [`probe`], it costs no context on any GPU.
/// [`Error::DriverUnavailable`](crate::Error::DriverUnavailable) without a
/// driver.
pub fn device_count() -> Result<u32> {
    CudaBackend::check_driver()?;
    let unavailable = |e: crate::Error| crate::Error::DriverUnavailable {
        reason: e.to_string(),
    };
    driver::init().map_err(unavailable)?;
    driver::device_count().map_err(unavailable)
}

/// Reads what the driver and every GPU support, without allocating memory.
/// It makes each GPU's primary context on the way (dropped after, unless
/// another holder keeps it; [`device_count`] makes none) and leaves the
/// calling thread's current context as it found it.
/// [`Error::DriverUnavailable`](crate::Error::DriverUnavailable) where there
/// is no usable driver.
pub fn probe() -> Result<Probe> {
    CudaBackend::check_driver()?;
    driver::init().map_err(|e| crate::Error::DriverUnavailable {
        reason: e.to_string(),
    })?;
    // The granularity queries go through a backend per device, which makes
    // that device's context current on this thread: the caller's (PyTorch's
    // current device, say) is put back, whatever the outcome.
    let before = driver::current_raw()?;
    let got = probe_all();
    // SAFETY: `before` was current on this thread a moment ago; its owner
    // (the caller, or the runtime's primary context) still holds it.
    let restored = unsafe { driver::restore_current(before) };
    let probe = got?;
    restored?;
    Ok(probe)
}

/// The device-by-device part of [`probe`].
fn probe_all() -> Result<Probe> {
    use sys::CUdevice_attribute as A;
    let driver_version = driver::driver_version()?;
    let handles: Vec<sys::CUdevice> = (0..driver::device_count()?)
        .map(driver::device_get)
        .collect::<Result<_>>()?;
    let mut devices = Vec::new();
    for (i, &dev) in handles.iter().enumerate() {
        // SAFETY: `dev` is a valid device handle from cuDeviceGet.
        let attr = |a| unsafe { driver::device_attribute(dev, a) };
        let vmm = attr(A::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)? != 0;
        let granularity = if vmm {
            let b = CudaBackend::new(i as u32)?;
            let place = Location::Device(i as u32);
            use sys::CUmemAllocationGranularity_flags as F;
            (
                b.query_granularity(place, F::CU_MEM_ALLOC_GRANULARITY_MINIMUM)?,
                b.query_granularity(place, F::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)?,
            )
        } else {
            (0, 0)
        };
        devices.push(DeviceProbe {
            ordinal: i as u32,
            name: driver::device_name(dev)?,
            compute_capability: (
                attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
                attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
            ),
            // SAFETY: a valid device handle.
            total_bytes: unsafe { driver::device_total_mem(dev) }?,
            vmm,
            host_numa_node: if attr(
                A::CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
            )? != 0
            {
                Some(attr(A::CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID)?)
            } else {
                None
            },
            granularity,
            posix_fd_handles: attr(
                A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
            )? != 0,
            fabric_handles: attr(A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED)? != 0,
            rdma_with_vmm: attr(A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED)?
                != 0,
        });
    }
    let mut peer_access = vec![vec![false; handles.len()]; handles.len()];
    for (a, &da) in handles.iter().enumerate() {
        for (b, &db) in handles.iter().enumerate() {
            if a != b {
                // SAFETY: both handles come from cuDeviceGet.
                peer_access[a][b] = unsafe { driver::can_access_peer(da, db) }?;
            }
        }
    }
    Ok(Probe {
        driver_version,
        devices,
        peer_access,
    })
}

/// Puts back, when dropped, the CUDA context that was current on this
/// thread when it was made (none included). vmmbuf binds the context of
/// the device it works on, and a caller that works through the CUDA
/// runtime reads its current device from the current context: a free of
/// another GPU's memory (CuPy's garbage collection, PyTorch freeing a
/// tensor of another device) would otherwise leave that GPU current, and
/// the caller's next allocation would land there. Entry points for such
/// callers hold one for the length of each call. Restores only when the
/// current context changed, and logs rather than fails if the driver
/// refuses.
#[must_use = "the context is put back when the guard is dropped"]
pub struct KeepCurrentContext {
    ctx: cudarc::driver::sys::CUcontext,
}

impl KeepCurrentContext {
    /// Notes the context current on this thread.
    /// [`Error::DriverUnavailable`](crate::Error::DriverUnavailable)
    /// without a driver.
    pub fn new() -> Result<Self> {
        CudaBackend::check_driver()?;
        Ok(Self {
            ctx: driver::current_raw()?,
        })
    }

    /// Like [`new`](Self::new), but `None` when the context current on
    /// this thread is `backend`'s own: for a call whose driver work binds
    /// no context but `backend`'s, which then leaves the current context as
    /// it found it, so that the second look at the end (a driver call,
    /// ~0.35 us with cold caches) is saved. The caller makes sure of that
    /// condition; nothing here can check it.
    pub fn unless_current(backend: &CudaBackend) -> Result<Option<Self>> {
        CudaBackend::check_driver()?;
        let ctx = driver::current_raw()?;
        // The backend's own: nothing to put back, the call keeps it current.
        Ok((ctx != backend.context().cu_ctx()).then_some(Self { ctx }))
    }
}

impl Drop for KeepCurrentContext {
    fn drop(&mut self) {
        match driver::current_raw() {
            Ok(now) if now == self.ctx => {}
            Ok(_) => {
                // SAFETY: `ctx` was current on this thread when the guard was
                // made (the guard is not Send); it is null or a context its
                // owner still holds, since nothing in between destroys a
                // context the caller had current.
                if let Err(e) = unsafe { driver::restore_current(self.ctx) } {
                    tracing::warn!(error = %e, "vmmbuf: putting the caller's CUDA context back failed");
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "vmmbuf: reading the current CUDA context failed")
            }
        }
    }
}

/// The device of the CUDA context current on this thread (the CUDA
/// runtime's current device), or `None` when no context is current (or the
/// driver was never initialised, or there is none).
pub fn current_device() -> Result<Option<u32>> {
    if CudaBackend::check_driver().is_err() {
        return Ok(None);
    }
    match driver::current_raw() {
        Ok(ctx) if ctx.is_null() => Ok(None),
        Ok(_) => driver::current_device().map(Some),
        // Not initialised: nothing is current.
        Err(_) => Ok(None),
    }
}
