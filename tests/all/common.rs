//! Helpers shared by the test modules: backend selection, the GPU gate, data.

use std::sync::Arc;

use rand::{Rng, SeedableRng};
use vmmbuf::{Backend, CudaBackend, GrowableBuffer, HostBackend, LiveCounts};

/// Tests in this binary run one at a time: the GPU ones read the device's
/// free memory and the host ones read the process's maps and descriptors,
/// which a test running beside them would disturb.
pub fn serial() -> parking_lot::MutexGuard<'static, ()> {
    static LOCK: parking_lot::Mutex<()> = parking_lot::Mutex::new(());
    LOCK.lock()
}

/// A host backend with a 64 KiB granularity: fine enough to exercise many
/// chunks, coarse enough to keep the number of memfds small.
pub fn host() -> Arc<HostBackend> {
    HostBackend::with_granularity(64 << 10).expect("64 KiB is a valid host granularity")
}

/// The CUDA backend on GPU 0, or `None` with a printed reason. With
/// `VMMBUF_REQUIRE_GPU=1` a missing GPU fails the test instead.
pub fn gpu() -> Option<Arc<CudaBackend>> {
    match CudaBackend::new(0) {
        Ok(b) => Some(b),
        Err(e) if require_gpu() => {
            panic!("VMMBUF_REQUIRE_GPU=1 but the CUDA backend is unusable: {e}")
        }
        Err(e) => {
            // Once per run, past libtest's capture (which only takes the print
            // macros), so the reason shows in every CI log.
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| {
                use std::io::Write;
                let _ = writeln!(
                    std::io::stderr(),
                    "vmmbuf tests: skipping GPU tests: {e} (set VMMBUF_REQUIRE_GPU=1 to fail instead)"
                );
            });
            None
        }
    }
}

pub fn require_gpu() -> bool {
    std::env::var("VMMBUF_REQUIRE_GPU").as_deref() == Ok("1")
}

/// `len` bytes of seeded random data (never all zeros).
pub fn random_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut v = vec![0u8; len];
    rng.fill(&mut v[..]);
    v
}

/// The whole in-use contents of a buffer, read through the backend.
pub fn contents<B: Backend>(buf: &GrowableBuffer<B>) -> Vec<u8> {
    let mut v = vec![0u8; buf.len()];
    buf.read(0, &mut v).expect("reading the bytes in use");
    v
}

/// Asserts the buffer's own bookkeeping agrees with what the backend has live:
/// one reservation, one live chunk per mapped chunk, mapped bytes = capacity.
pub fn assert_consistent<B: Backend>(buf: &GrowableBuffer<B>, baseline: LiveCounts) {
    let live = buf.backend().live();
    let report = buf.report();
    assert_eq!(live.reservations, baseline.reservations + 1, "{live:?}");
    assert_eq!(
        live.chunks,
        baseline.chunks + report.chunks.len(),
        "{live:?}\n{report}"
    );
    assert_eq!(
        live.mapped_bytes,
        baseline.mapped_bytes + buf.capacity(),
        "{live:?}\n{report}"
    );
    assert!(buf.len() <= buf.capacity() && buf.capacity() <= buf.reserved());
    let mut at = 0;
    for c in &report.chunks {
        assert_eq!(c.offset, at, "chunks tile the capacity\n{report}");
        assert_eq!(c.bytes % buf.granularity(), 0);
        at += c.bytes;
    }
    assert_eq!(at, buf.capacity());
}

/// Generates one `#[test]` per backend for each named generic test function
/// in `$module`: `host::name` on the host backend, `cuda::name` on GPU 0.
#[macro_export]
macro_rules! for_each_backend {
    ($module:ident: $($name:ident),* $(,)?) => {
        mod host {
            $(
                #[test]
                fn $name() {
                    let _g = $crate::common::serial();
                    super::$name($crate::common::host());
                }
            )*
        }
        mod cuda {
            $(
                #[test]
                fn $name() {
                    let _g = $crate::common::serial();
                    if let Some(b) = $crate::common::gpu() {
                        super::$name(b);
                    }
                }
            )*
        }
    };
}
