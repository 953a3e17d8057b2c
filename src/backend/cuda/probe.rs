//! What the machine's CUDA driver and GPUs support, read through the thin
//! [`driver`](super::driver) layer without allocating memory.
#![allow(unsafe_code)]

use cudarc::driver::sys;

use super::driver::{self, LAZY};
use super::CudaBackend;
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
    let driver_version = driver::driver_version()?;
    let handles: Vec<sys::CUdevice> = (0..driver::device_count()?)
        .map(driver::device_get)
        .collect::<Result<_>>()?;
    let devices = handles
        .iter()
        .enumerate()
        .map(|(i, &dev)| probe_device(i as u32, dev))
        .collect::<Result<_>>()?;
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

/// What device `ordinal` (handle `dev`, from cuDeviceGet) supports.
fn probe_device(ordinal: u32, dev: sys::CUdevice) -> Result<DeviceProbe> {
    use sys::CUdevice_attribute as A;
    // SAFETY: `dev` is a valid device handle from cuDeviceGet.
    let attr = |a| unsafe { driver::device_attribute(dev, a) };
    let flag = |a| attr(a).map(|v| v != 0);
    let vmm = flag(A::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)?;
    let granularity = if vmm {
        let b = CudaBackend::new(ordinal)?;
        let place = Location::Device(ordinal);
        use sys::CUmemAllocationGranularity_flags as F;
        (
            b.query_granularity(place, F::CU_MEM_ALLOC_GRANULARITY_MINIMUM)?,
            b.query_granularity(place, F::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)?,
        )
    } else {
        (0, 0)
    };
    let host_numa_node =
        if flag(A::CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)? {
            Some(attr(A::CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID)?)
        } else {
            None
        };
    Ok(DeviceProbe {
        ordinal,
        name: driver::device_name(dev)?,
        compute_capability: (
            attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        ),
        // SAFETY: a valid device handle.
        total_bytes: unsafe { driver::device_total_mem(dev) }?,
        vmm,
        host_numa_node,
        granularity,
        posix_fd_handles: flag(A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)?,
        fabric_handles: flag(A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED)?,
        rdma_with_vmm: flag(A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED)?,
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

    /// A guard that reads nothing now: the context current on this thread
    /// is read only if vmmbuf is about to switch it (every such place
    /// calls `before_switch` first), and put back at the drop if it was.
    /// A call that touches no context (an allocation served from cached
    /// memory) makes no driver call for it. A guard made while another is
    /// armed on the thread leaves the work to that one.
    pub fn lazy() -> LazyKeepCurrentContext {
        let outer = LAZY
            .try_with(|l| {
                if l.get().is_none() {
                    l.set(Some(None));
                    true
                } else {
                    false
                }
            })
            .unwrap_or(false);
        LazyKeepCurrentContext { outer }
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

/// A [`KeepCurrentContext::lazy`] guard: puts back the caller's context
/// if vmmbuf read it before switching, and nothing otherwise.
#[must_use = "the context is put back when the guard is dropped"]
pub struct LazyKeepCurrentContext {
    /// Whether this guard armed the thread's (an inner one leaves it to the
    /// outer).
    outer: bool,
}

impl Drop for LazyKeepCurrentContext {
    fn drop(&mut self) {
        if !self.outer {
            return;
        }
        let saved = LAZY.try_with(|l| l.take()).ok().flatten().flatten();
        if let Some(ctx) = saved {
            drop(KeepCurrentContext {
                ctx: ctx as cudarc::driver::sys::CUcontext,
            });
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

#[cfg(test)]
mod lazy_tests {
    use super::KeepCurrentContext;
    use crate::backend::cuda::driver::{before_switch, LAZY};

    /// The lazy guard's bookkeeping, without a driver call where nothing
    /// switches: armed by the outer guard only, disarmed at its drop, a
    /// hook outside any guard changes nothing, and (on a host without a
    /// driver) a hook inside one saves nothing, so the drop restores
    /// nothing.
    #[test]
    fn a_lazy_guard_arms_once_and_disarms_at_its_drop() {
        let state = || LAZY.with(|l| l.get());
        before_switch();
        assert_eq!(state(), None, "no guard: the hook does nothing");
        let outer = KeepCurrentContext::lazy();
        assert_eq!(state(), Some(None), "armed, nothing read");
        {
            let _inner = KeepCurrentContext::lazy();
            assert_eq!(state(), Some(None));
        }
        assert_eq!(state(), Some(None), "an inner guard leaves the outer's");
        if !crate::backend::cuda::driver::driver_present() {
            before_switch();
            assert_eq!(state(), Some(None), "no driver: nothing saved");
        }
        drop(outer);
        assert_eq!(state(), None, "the outer guard disarms");
        let again = KeepCurrentContext::lazy();
        assert_eq!(state(), Some(None), "a later call arms again");
        drop(again);
    }

    /// What may make another context current on the calling thread: the
    /// cudarc calls that bind their context first, and the driver's own
    /// context switches.
    const SWITCHES: &[&str] = &[
        ".bind_to_thread(",
        ".synchronize()",
        ".record_event(",
        ".new_stream(",
        ".new_event(",
        ".memcpy_",
        ".alloc_zeros",
        ".launch",
        ".fork(",
        ".join(&",
        ".wait(&",
        "CudaContext::new(",
        "cuCtxSetCurrent(",
        "cuCtxPushCurrent",
    ];

    /// The lazy guard saves the caller's context only where a call says
    /// it may switch: every place in the CUDA backend that may make another
    /// context current calls `before_switch` first (in its function, or
    /// through `relaxed`), or says on the line above why it needs no hook
    /// (a line starting `// No hook:`). A new call that skipped the hook
    /// would leave another GPU's context current after a plug-in call, the
    /// bug CuPy's two-GPU copies found; this reads the sources so that it
    /// fails here, on any machine, rather than on two GPUs.
    #[test]
    fn every_context_switch_in_the_cuda_backend_calls_the_hook_first() {
        fn files(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
            for e in std::fs::read_dir(dir).expect("the backend's sources") {
                let p = e.unwrap().path();
                if p.is_dir() {
                    files(&p, out);
                } else if p.extension().is_some_and(|x| x == "rs") {
                    out.push(p);
                }
            }
        }
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/backend/cuda");
        let mut paths = Vec::new();
        files(&root, &mut paths);
        assert!(
            paths.len() >= 10,
            "found {} files under {}",
            paths.len(),
            root.display()
        );
        let (mut hits, mut missing) = (0, Vec::new());
        for p in &paths {
            let text = std::fs::read_to_string(p).unwrap();
            let lines: Vec<&str> = text.lines().collect();
            // Up to this file's test module: tests may switch as they like.
            let end = lines
                .iter()
                .position(|l| l.trim_start().starts_with("#[cfg(test)]"))
                .unwrap_or(lines.len());
            for (i, line) in lines[..end].iter().enumerate() {
                let code = line.split("//").next().unwrap_or("");
                if !SWITCHES.iter().any(|s| code.contains(s)) {
                    continue;
                }
                hits += 1;
                // The lines above, nearest first.
                let above = || lines[..i].iter().rev();
                let excused = above()
                    .take_while(|l| l.trim_start().starts_with("//"))
                    .any(|l| l.trim_start().starts_with("// No hook:"));
                let hooked = code.contains("relaxed(")
                    || above()
                        .take_while(|l| !l.contains("fn "))
                        .any(|l| l.contains("before_switch()"));
                if !(excused || hooked) {
                    missing.push(format!("{}:{}: {}", p.display(), i + 1, line.trim()));
                }
            }
        }
        assert!(
            hits >= 8,
            "the scan found only {hits} switches: it no longer reads the backend"
        );
        assert!(
            missing.is_empty(),
            "context switches without driver::before_switch first:\n{}",
            missing.join("\n")
        );
    }
}
