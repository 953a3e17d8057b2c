//! torch_memory_saver's preload mode: `cudaMalloc` and `cudaFree` of the
//! whole process reach vmmbuf through the preload library (src/preload.c),
//! once the Python package attaches it and turns the mode on.

use std::sync::atomic::{AtomicBool, Ordering};

use vmmbuf::Backend;

use super::*;

/// Whether the preload library's calls are answered (off: every call goes
/// on to the CUDA runtime).
static ON: AtomicBool = AtomicBool::new(false);

/// Turns preload mode on or off for the process.
#[cfg_attr(not(feature = "python"), allow(dead_code))]
pub(crate) fn set_preload(on: bool) {
    ON.store(on, Ordering::Release);
}

/// A `cudaMalloc` of `size` bytes the preload library passed on: vmmbuf's
/// address when preload mode is on and this thread allocates under a tag
/// (a torch_memory_saver region, or `TMS_INIT_ENABLE`'s default tag), on
/// the device of the current context, for work on the legacy default
/// stream; `None` to leave the call to the CUDA runtime.
pub(crate) fn preload_malloc(size: usize) -> Result<Option<u64>> {
    if !ON.load(Ordering::Acquire) || size == 0 || tag().is_empty() {
        return Ok(None);
    }
    let Some(dev) = vmmbuf::cuda::current_device()? else {
        return Ok(None);
    };
    let dev = c_int::try_from(dev).map_err(|_| Error::InvalidArgument(format!("device {dev}")))?;
    malloc(size, dev, std::ptr::null_mut()).map(Some)
}

/// A `cudaFree` the preload library passed on: true if `ptr` was a live
/// allocation of the plug-in, now freed as `cudaFree` frees (after the
/// device's work has finished: `cudaFree` synchronises the device, and the
/// memory may have been used on any stream); false to leave the call to
/// the CUDA runtime.
pub(crate) fn preload_free(ptr: u64) -> Result<bool> {
    for (dev, d) in all_devices() {
        let backend = {
            let d = d.lock();
            if !d.live.contains_key(&(ptr as usize)) {
                continue;
            }
            d.backend.clone()
        };
        backend.synchronize()?;
        free(ptr, dev, std::ptr::null_mut())?;
        // The memory goes back to the device, as cudaFree's does: PyTorch's
        // caching allocator above is the cache (see `free_segment`).
        give_back_cached(dev)?;
        return Ok(true);
    }
    Ok(false)
}
