//! PyTorch's pluggable CUDA allocator on a vmmbuf [`Arena`](vmmbuf::Arena),
//! and (with the `python` feature) the `vmmbuf._native` Python module that
//! the `vmmbuf` package is built around: one library holds both, so the
//! package hands PyTorch its own path.
//!
//! One arena per device and tag, stream-ordered frees on the stream the
//! caller passes, PyTorch-named statistics, a budget per device that all its
//! tags share, and sleep/wake.
//!
//! Tags: allocations a thread makes after `vmmbuf_set_tag("weights")` live
//! in that tag's arena (untagged ones in the default arena; the tag is per
//! thread; all of a device's arenas share one chunk pool and one budget).
//! Each device has its own lock: work on one device never waits for
//! another's. Failures are logged to stderr (`VMMBUF_LOG` sets the level) and
//! kept per thread ([`vmmbuf_last_error`]). `vmmbuf_sleep(tag, 0)` moves a tag's
//! memory to pinned host memory at the same addresses and gives the device
//! memory back; kernels still reach the tensors there, more slowly.
//! `vmmbuf_sleep(tag, VMMBUF_DISCARD)` gives it back without a copy (the
//! contents are lost). `vmmbuf_wake(tag, 0)` brings it back
//! (`VMMBUF_ZERO`: discarded memory comes back zeroed).
//!
//! PyTorch calls `void* vmmbuf_malloc(ssize_t size, int device,
//! cudaStream_t stream)` (inside a `MemPool`, whose caching allocator turns
//! a null into `torch.OutOfMemoryError`) or [`vmmbuf_torch_malloc`]
//! (process-wide: it throws a failure as a C++ exception, since PyTorch's
//! pluggable allocator would wrap a null as a tensor at address 0), and
//! `void vmmbuf_free(void* ptr, ssize_t size, int device, cudaStream_t
//! stream)` (process-wide) or [`vmmbuf_segment_free`] (same arguments, for
//! a `MemPool`: its memory goes back to the driver, as `cudaFree`'s would,
//! since PyTorch's cache above is the cache); `vmmbuf.torch` loads them with
//! `torch.cuda.memory.CUDAPluggableAllocator`. No panic crosses the C
//! boundary: each entry point catches it, logs it and answers null (or
//! nothing). Zero bytes get null; an unknown pointer or a second free of
//! one pointer is logged and changes nothing.

mod capi;
#[cfg(feature = "python")]
mod python;
mod state;

pub use capi::*;

/// Failures are visible: the plug-in logs to stderr, at the level
/// `VMMBUF_LOG` names (`warn` by default; `off`, `error`, `info`, `debug`,
/// `trace`, or a tracing filter such as `vmmbuf=debug`). A process that set
/// a subscriber of its own keeps it.
pub(crate) fn init_logging() {
    use tracing_subscriber::prelude::*;
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let filter = tracing_subscriber::EnvFilter::try_from_env("VMMBUF_LOG")
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
        let fmt = tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_filter(tracing_subscriber::filter::dynamic_filter_fn(|_, _| {
                teardown::alive()
            }));
        let _ = tracing_subscriber::registry()
            .with(filter)
            .with(fmt)
            .with(teardown::Arm)
            .try_init();
    });
}

/// Logging from a thread being torn down. The fmt layer formats into a
/// thread-local buffer, which a free from another thread-local's
/// destructor (a dying worker's tensors) may find destroyed already: a
/// panic. A guard is armed right after a thread's first event, so it is
/// destroyed before that buffer (thread-locals go in the reverse order of
/// their first use); once it has gone, the thread's events are dropped.
mod teardown {
    use std::cell::Cell;

    // STATE: 0, not armed; 1, armed; 2, the guard is gone (the thread is
    // dying).
    thread_local! {
        static STATE: Cell<u8> = const { Cell::new(0) };
        static GUARD: Guard = const { Guard };
    }

    struct Guard;

    impl Drop for Guard {
        fn drop(&mut self) {
            let _ = STATE.try_with(|s| s.set(2));
        }
    }

    /// Whether this thread may still log.
    pub(super) fn alive() -> bool {
        STATE.try_with(|s| s.get() != 2).unwrap_or(false)
    }

    /// The layer after the fmt layer: arms the guard at a thread's first
    /// event (after the fmt layer made its buffer).
    pub(super) struct Arm;

    impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Arm {
        fn on_event(&self, _: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
            let _ = STATE.try_with(|s| {
                if s.get() == 0 && GUARD.try_with(|_| ()).is_ok() {
                    s.set(1);
                }
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::{c_void, CStr};
    use std::sync::Arc;

    use cudarc::driver::{CudaContext, CudaStream};
    use parking_lot::Mutex;
    use vmmbuf::CudaBackend;

    /// The plug-in's state is the process's: its tests take turns.
    static SERIAL: Mutex<()> = Mutex::new(());

    /// A context on GPU 0, or `None` with the reason printed; with
    /// `VMMBUF_REQUIRE_GPU=1` a missing GPU fails the test instead.
    fn gpu() -> Option<Arc<cudarc::driver::CudaContext>> {
        // CudaBackend::new checks for the driver library before cudarc
        // touches it (cudarc panics without one).
        let why = match CudaBackend::new(0) {
            Ok(b) => return Some(b.context().clone()),
            Err(e) => e.to_string(),
        };
        assert!(
            std::env::var("VMMBUF_REQUIRE_GPU").as_deref() != Ok("1"),
            "VMMBUF_REQUIRE_GPU=1 but no GPU: {why}"
        );
        eprintln!("skipped (needs a GPU): {why}");
        None
    }

    /// Runs `f` with this thread's tag set to `tag`, then back to none.
    fn unsafe_tagged<T>(tag: &str, f: impl FnOnce() -> T) -> T {
        let c = std::ffi::CString::new(tag).unwrap();
        // SAFETY: a NUL-terminated string that lives across the call.
        assert_eq!(unsafe { vmmbuf_set_tag(c.as_ptr()) }, 0);
        let r = f();
        // SAFETY: null is the default tag.
        assert_eq!(unsafe { vmmbuf_set_tag(std::ptr::null()) }, 0);
        r
    }

    /// Issue 19: sleep recorded a fence on every stream ever seen, one that
    /// PyTorch had destroyed since included; now it waits on the streams of
    /// live allocations. And the stats JSON of one thread was freed by the
    /// next call of another: two threads call it 100,000 times each.
    #[test]
    fn gpu_sleep_skips_destroyed_streams_and_stats_json_is_per_thread() {
        let _turn = SERIAL.lock();
        let Some(ctx) = gpu() else { return };
        let st = ctx.new_stream().unwrap();
        tags_share_the_device_budget(&st);
        tags_are_per_thread_and_sleep_in_each_mode(&ctx, &st);
        let (keep, q) = sleep_skips_a_destroyed_stream(&ctx);
        stats_json_is_per_thread();
        vmmbuf_free(q, 4 << 20, 0, raw(&keep));
        keep.synchronize().unwrap();
    }

    /// A stream's handle as the C entry points take it.
    fn raw(s: &Arc<CudaStream>) -> *mut c_void {
        s.cu_stream() as *mut c_void
    }

    /// One budget for the device, shared by every tag (was one per tag).
    fn tags_share_the_device_budget(st: &Arc<CudaStream>) {
        assert_eq!(vmmbuf_set_budget(0, 64 << 20), 0);
        let p = unsafe_tagged("a", || vmmbuf_malloc(40 << 20, 0, raw(st)));
        assert!(!p.is_null());
        let q = unsafe_tagged("b", || vmmbuf_malloc(40 << 20, 0, raw(st)));
        assert!(q.is_null(), "two tags share the 64 MiB budget");
        vmmbuf_free(p, 40 << 20, 0, raw(st));
        st.synchronize().unwrap();
        let q = unsafe_tagged("b", || vmmbuf_malloc(40 << 20, 0, raw(st)));
        assert!(!q.is_null(), "what tag a gave back, tag b may take");
        vmmbuf_free(q, 40 << 20, 0, raw(st));
        st.synchronize().unwrap();
        // SAFETY: null names every tag.
        assert!(unsafe { vmmbuf_wake(std::ptr::null(), 0) } >= 0);
    }

    /// Tags are per thread: another thread's tag does not move this one's
    /// allocations, and sleeping that tag moves only its own, kept,
    /// discarded (woken zeroed, the same bytes at the same address) and
    /// stashed (the zeros come back).
    fn tags_are_per_thread_and_sleep_in_each_mode(ctx: &Arc<CudaContext>, st: &Arc<CudaStream>) {
        let st2 = st.clone();
        let other = std::thread::spawn(move || {
            unsafe_tagged("t1", || {
                vmmbuf_malloc(2 << 20, 0, st2.cu_stream() as *mut c_void)
            }) as usize
        })
        .join()
        .unwrap() as *mut c_void;
        let mine = vmmbuf_malloc(2 << 20, 0, raw(st));
        assert!(!other.is_null() && !mine.is_null());
        st.synchronize().unwrap();
        // SAFETY: a NUL-terminated literal.
        let moved = unsafe { vmmbuf_sleep(c"t1".as_ptr(), 0) };
        assert_eq!(moved, 2 << 20, "only the other thread's tag slept");
        // SAFETY: as above.
        assert_eq!(unsafe { vmmbuf_wake(c"t1".as_ptr(), 0) }, 2 << 20);
        // SAFETY: as above.
        assert_eq!(unsafe { vmmbuf_sleep(c"t1".as_ptr(), 1) }, 2 << 20);
        let v: serde_json::Value = serde_json::from_str(
            // SAFETY: valid until this thread's next call.
            unsafe { CStr::from_ptr(vmmbuf_stats_json(0)) }
                .to_str()
                .unwrap(),
        )
        .unwrap();
        assert_eq!(v["discarded_bytes"], 2 << 20, "{v}");
        assert_eq!(v["sleep_modes"]["t1"], "discard", "{v}");
        // SAFETY: as above.
        assert_eq!(unsafe { vmmbuf_wake(c"t1".as_ptr(), 1) }, 2 << 20);
        // SAFETY: as above.
        assert_eq!(unsafe { vmmbuf_sleep(c"t1".as_ptr(), 2) }, 2 << 20);
        // SAFETY: as above.
        assert_eq!(unsafe { vmmbuf_wake(c"t1".as_ptr(), 0) }, 2 << 20);
        let mut word = [1u8; 8];
        ctx.bind_to_thread().unwrap();
        // SAFETY: `other` is a live 2 MiB allocation mapped for this device.
        let r = unsafe {
            cudarc::driver::sys::cuMemcpyDtoH_v2(word.as_mut_ptr().cast(), other as u64, 8)
        };
        assert_eq!(r, cudarc::driver::sys::CUresult::CUDA_SUCCESS);
        assert_eq!(word, [0u8; 8], "woken zeroed");
        vmmbuf_free(other, 2 << 20, 0, raw(st));
        vmmbuf_free(mine, 2 << 20, 0, raw(st));
        st.synchronize().unwrap();
    }

    /// A stream PyTorch destroyed after a free on it (as an
    /// ExternalStream's may be) is not waited on by a sleep; returns the
    /// stream that stays and its 4 MiB allocation, still live.
    fn sleep_skips_a_destroyed_stream(ctx: &Arc<CudaContext>) -> (Arc<CudaStream>, *mut c_void) {
        let keep = ctx.new_stream().unwrap();
        let gone = ctx.new_stream().unwrap();
        let p = vmmbuf_malloc(1 << 20, 0, raw(&gone));
        assert!(!p.is_null());
        vmmbuf_free(p, 1 << 20, 0, raw(&gone));
        gone.synchronize().unwrap();
        drop(gone);
        let q = vmmbuf_malloc(4 << 20, 0, raw(&keep));
        assert!(!q.is_null());
        // SAFETY: null names every tag.
        let (slept, woke) = unsafe {
            (
                vmmbuf_sleep(std::ptr::null(), 0),
                vmmbuf_wake(std::ptr::null(), 0),
            )
        };
        assert!(slept >= 0 && woke >= 0, "sleep {slept}, wake {woke}");
        (keep, q)
    }

    /// Two threads read the stats JSON 100,000 times each: one thread's
    /// text is never freed by the other's next call.
    fn stats_json_is_per_thread() {
        let threads: Vec<_> = (0..2)
            .map(|_| {
                std::thread::spawn(|| {
                    for _ in 0..100_000 {
                        let p = vmmbuf_stats_json(0);
                        assert!(!p.is_null());
                        // SAFETY: valid until this thread's next call.
                        let text = unsafe { CStr::from_ptr(p) }.to_str().unwrap();
                        let v: serde_json::Value = serde_json::from_str(text).unwrap();
                        assert!(v["allocated_bytes.all.current"].as_u64().unwrap() >= 4 << 20);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
    }

    #[test]
    fn bad_calls_are_answered_not_crashed() {
        let _turn = SERIAL.lock();
        // No GPU needed: these never reach the driver.
        assert!(vmmbuf_malloc(0, 0, std::ptr::null_mut()).is_null());
        assert!(vmmbuf_malloc(-5, 0, std::ptr::null_mut()).is_null());
        vmmbuf_free(0x1234 as *mut c_void, 16, 0, std::ptr::null_mut());
        assert!(vmmbuf_stats_json(7).is_null(), "no arena on device 7");
        assert_eq!(vmmbuf_set_budget(3, 1 << 30), 0);
        assert_eq!(vmmbuf_empty_cache(3), 0);
        vmmbuf_reset_peak(3);
        // What another test's sleep left in the process's host cache goes
        // back; then nothing is left to give.
        assert!(vmmbuf_release_host_cache() >= 0);
        assert_eq!(vmmbuf_release_host_cache(), 0);
        assert_eq!(vmmbuf_set_host_cache_limit(1 << 30), 0);
        assert_eq!(vmmbuf_set_host_cache_limit(usize::MAX), 0);
        // SAFETY: NUL-terminated literals and null.
        unsafe {
            assert_eq!(vmmbuf_set_tag(c"weights".as_ptr()), 0);
            assert_eq!(vmmbuf_set_tag(std::ptr::null()), 0);
            assert_eq!(vmmbuf_set_tag(c"\xff".as_ptr()), -1, "not UTF-8");
            assert_eq!(vmmbuf_sleep(std::ptr::null(), 0), 0, "nothing to move");
            assert_eq!(vmmbuf_wake(c"weights".as_ptr(), 0), 0);
            assert_eq!(vmmbuf_sleep(c"weights".as_ptr(), 1), 0);
            assert_eq!(vmmbuf_sleep(c"weights".as_ptr(), 2), 0);
            assert_eq!(vmmbuf_sleep(c"weights".as_ptr(), 3), 0, "pageable");
            assert_eq!(
                vmmbuf_sleep(c"weights".as_ptr(), 4),
                0,
                "disk: nothing to move"
            );
            assert_eq!(vmmbuf_sleep(c"weights".as_ptr(), 5), -1, "no mode 5");
            let said = std::ffi::CStr::from_ptr(vmmbuf_last_error()).to_string_lossy();
            assert!(
                said.contains("number 5") && said.contains("4 (disk)"),
                "the error names the numbers there are: {said}"
            );
            assert_eq!(vmmbuf_tms_pause(std::ptr::null()), 0, "no region: nothing");
            assert_eq!(vmmbuf_tms_resume(c"w".as_ptr()), 0);
            assert_eq!(vmmbuf_tms_pause(c"\xff".as_ptr()), -1, "not UTF-8");
            assert_eq!(vmmbuf_wake(c"weights".as_ptr(), 2), 0, "VMMBUF_KEEP_BACKUP");
            assert_eq!(vmmbuf_sleep(c"weights".as_ptr(), -1), -1, "no mode -1");
            assert_eq!(vmmbuf_prepare_sleep(std::ptr::null(), 0, 1), 0);
            assert_eq!(vmmbuf_prepare_sleep(std::ptr::null(), 2, 1), 0);
            assert_eq!(
                vmmbuf_prepare_sleep(std::ptr::null(), 7, 1),
                -1,
                "no mode 7"
            );
            assert_eq!(
                vmmbuf_prepare_sleep(c"\xff".as_ptr(), 0, 1),
                -1,
                "not UTF-8"
            );
        }
    }
}
