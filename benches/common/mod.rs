//! Shared by the benches: the GPU gate, and the baselines a user would
//! otherwise write (cuMemAlloc + copy, cuMemAllocAsync + copy) or the floor
//! vmmbuf sits on (cuMemCreate + cuMemMap + cuMemSetAccess), as raw driver
//! calls in the same process and run as vmmbuf. Every driver result is checked.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::sys;
use vmmbuf::CudaBackend;

/// GPU 0, or `None` after printing why the benches skip. Under
/// `VMMBUF_REQUIRE_GPU=1` (the GPU runner sets it) a missing GPU panics.
pub fn gpu_or_skip(bench: &str) -> Option<Arc<CudaBackend>> {
    match CudaBackend::new(0) {
        Ok(b) => Some(b),
        Err(e) if std::env::var("VMMBUF_REQUIRE_GPU").as_deref() == Ok("1") => {
            panic!("{bench}: VMMBUF_REQUIRE_GPU=1 but no usable GPU: {e}")
        }
        Err(e) => {
            println!("{bench}: skipped, no usable GPU: {e}");
            None
        }
    }
}

pub const MIB: usize = 1 << 20;
pub const GIB: usize = 1 << 30;

#[track_caller]
pub fn ok(call: &str, r: sys::CUresult) {
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "{call} failed");
}

/// Raw driver calls on the backend's context (bound to this thread).
pub struct Raw {
    pub backend: Arc<CudaBackend>,
    pub stream: sys::CUstream,
    _stream: Arc<cudarc::driver::CudaStream>,
}

impl Raw {
    pub fn new(backend: Arc<CudaBackend>) -> Self {
        backend.context().bind_to_thread().unwrap();
        let s = backend.context().new_stream().unwrap();
        Self {
            backend,
            stream: s.cu_stream(),
            _stream: s,
        }
    }

    pub fn sync(&self) {
        // SAFETY: a context is bound to this thread.
        ok("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() });
    }

    pub fn alloc(&self, bytes: usize) -> u64 {
        let mut p = 0;
        // SAFETY: valid out-pointer; context bound.
        ok("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut p, bytes) });
        p
    }

    pub fn free(&self, p: u64) {
        // SAFETY: p came from cuMemAlloc and is not used after this.
        ok("cuMemFree", unsafe { sys::cuMemFree_v2(p) });
    }

    pub fn copy(&self, dst: u64, src: u64, bytes: usize) {
        // SAFETY: both ranges are live allocations of at least `bytes`.
        ok("cuMemcpyDtoD", unsafe {
            sys::cuMemcpyDtoD_v2(dst, src, bytes)
        });
    }

    /// Pinned (page-locked) host memory from cuMemAllocHost.
    pub fn alloc_pinned(&self, bytes: usize) -> *mut u8 {
        let mut p = std::ptr::null_mut();
        // SAFETY: valid out-pointer; context bound.
        ok("cuMemAllocHost", unsafe {
            sys::cuMemAllocHost_v2(&mut p, bytes)
        });
        p.cast()
    }

    pub fn free_pinned(&self, p: *mut u8) {
        // SAFETY: p came from cuMemAllocHost and is not used after this.
        ok("cuMemFreeHost", unsafe { sys::cuMemFreeHost(p.cast()) });
    }

    pub fn dtoh(&self, dst: *mut u8, src: u64, bytes: usize) {
        // SAFETY: `dst` is pinned host memory and `src` device memory, both of
        // at least `bytes`.
        ok("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2(dst.cast(), src, bytes)
        });
    }

    pub fn htod(&self, dst: u64, src: *const u8, bytes: usize) {
        // SAFETY: as in `dtoh`, the other way.
        ok("cuMemcpyHtoD", unsafe {
            sys::cuMemcpyHtoD_v2(dst, src.cast(), bytes)
        });
    }

    /// Makes the device's default pool keep freed memory (release threshold
    /// at its maximum), as PyTorch and JAX keep theirs: the warm-pool
    /// baseline a user would pick for `cuMemAllocAsync`.
    pub fn keep_pool_memory(&self) {
        self.set_pool_release_threshold(u64::MAX);
    }

    /// The device default pool's release threshold: 0 (CUDA's default, which
    /// candle and cubecl keep) returns freed memory at every synchronisation.
    /// Lowering it also trims the pool down to it.
    pub fn set_pool_release_threshold(&self, mut threshold: u64) {
        let (mut pool, dev) = (std::ptr::null_mut(), self.backend.device() as i32);
        // SAFETY: valid out-pointer and device ordinal; a context is bound.
        ok("cuDeviceGetDefaultMemPool", unsafe {
            sys::cuDeviceGetDefaultMemPool(&mut pool, dev)
        });
        // SAFETY: the attribute takes a u64 threshold; it outlives the call.
        ok("cuMemPoolSetAttribute", unsafe {
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut threshold as *mut u64).cast(),
            )
        });
        self.stream_sync();
        // SAFETY: the pool is the device's default one; trimming keeps what
        // is in use.
        ok("cuMemPoolTrimTo", unsafe {
            sys::cuMemPoolTrimTo(pool, threshold.min(usize::MAX as u64) as usize)
        });
    }

    pub fn alloc_async(&self, bytes: usize) -> u64 {
        let mut p = 0;
        // SAFETY: valid out-pointer; the stream lives as long as self.
        ok("cuMemAllocAsync", unsafe {
            sys::cuMemAllocAsync(&mut p, bytes, self.stream)
        });
        p
    }

    pub fn free_async(&self, p: u64) {
        // SAFETY: p came from cuMemAllocAsync; stream-ordered after its users.
        ok("cuMemFreeAsync", unsafe {
            sys::cuMemFreeAsync(p, self.stream)
        });
    }

    pub fn copy_async(&self, dst: u64, src: u64, bytes: usize) {
        // SAFETY: both ranges are live allocations of at least `bytes`.
        ok("cuMemcpyDtoDAsync", unsafe {
            sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, self.stream)
        });
    }

    pub fn stream_sync(&self) {
        // SAFETY: the stream lives as long as self.
        ok("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(self.stream)
        });
    }

    fn prop() -> sys::CUmemAllocationProp {
        // SAFETY: plain C data; all-zero is the documented default. Device 0
        // is location id 0, which the zeroing already wrote (the id field's
        // source form differs between binding versions; its value does not).
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        prop
    }

    pub fn reserve(&self, bytes: usize) -> u64 {
        let mut p = 0;
        // SAFETY: valid out-pointer; no hint, no flags.
        ok("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&mut p, bytes, 0, 0, 0)
        });
        p
    }

    pub fn address_free(&self, p: u64, bytes: usize) {
        // SAFETY: (p, bytes) is one reservation with nothing mapped.
        ok("cuMemAddressFree", unsafe {
            sys::cuMemAddressFree(p, bytes)
        });
    }

    /// The VMM floor for one chunk: cuMemCreate + cuMemMap + cuMemSetAccess.
    pub fn create_map_access(&self, va: u64, bytes: usize) -> sys::CUmemGenericAllocationHandle {
        let h = self.create(bytes);
        self.map_access(va, bytes, h);
        h
    }

    /// A device chunk of `bytes` (cuMemCreate).
    pub fn create(&self, bytes: usize) -> sys::CUmemGenericAllocationHandle {
        let prop = Self::prop();
        let mut h = 0;
        // SAFETY: valid out-pointer and properties.
        ok("cuMemCreate", unsafe {
            sys::cuMemCreate(&mut h, bytes, &prop, 0)
        });
        h
    }

    /// cuMemMap + cuMemSetAccess (device read-write) of a handle kept.
    pub fn map_access(&self, va: u64, bytes: usize, h: sys::CUmemGenericAllocationHandle) {
        // SAFETY: va..va+bytes lies in a reservation of ours and is unmapped;
        // h is a live handle of `bytes`.
        ok("cuMemMap", unsafe { sys::cuMemMap(va, bytes, 0, h, 0) });
        // SAFETY: plain C data, then filled in.
        let mut desc: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
        desc.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        desc.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        // SAFETY: the range is exactly the mapping just made; one descriptor.
        ok("cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(va, bytes, &desc, 1)
        });
    }

    /// cuMemUnmap of one mapping, after the device is idle.
    pub fn unmap(&self, va: u64, bytes: usize) {
        self.sync();
        // SAFETY: (va, bytes) is exactly one mapping of ours; nothing uses it.
        ok("cuMemUnmap", unsafe { sys::cuMemUnmap(va, bytes) });
    }

    /// cuMemRelease of a handle no longer mapped.
    pub fn release(&self, h: sys::CUmemGenericAllocationHandle) {
        // SAFETY: h came from cuMemCreate and is released once.
        ok("cuMemRelease", unsafe { sys::cuMemRelease(h) });
    }

    /// Undoes `create_map_access`.
    pub fn unmap_release(&self, va: u64, bytes: usize, h: sys::CUmemGenericAllocationHandle) {
        self.unmap(va, bytes);
        self.release(h);
    }
}

/// Criterion as every bench here uses it: `samples` samples over
/// `measure_secs` seconds after a short warm-up, then the command line.
pub fn criterion(samples: usize, measure_secs: u64) -> criterion::Criterion {
    criterion::Criterion::default()
        .sample_size(samples)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(measure_secs))
        .configure_from_args()
}
