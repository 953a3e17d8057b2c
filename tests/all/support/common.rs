//! Helpers shared by the test modules: backend selection, the GPU gate, data.

use std::sync::Arc;

use libtest_mimic::Trial;
use rand::{Rng, SeedableRng};
use vmmbuf::{stats::LiveCounts, Backend, CudaBackend, GrowableBuffer, HostBackend};

/// Tests in this binary run one at a time: the GPU ones read the device's
/// free memory and the host ones read the process's maps and descriptors,
/// which a test running beside them would disturb.
pub fn serial() -> parking_lot::MutexGuard<'static, ()> {
    static LOCK: parking_lot::Mutex<()> = parking_lot::Mutex::new(());
    LOCK.lock()
}

/// A host backend with a 64 KiB granularity: fine enough to exercise many
/// chunks, coarse enough to keep the number of memfds small. Its default pool
/// keeps nothing (see [`keep_nothing`]).
pub fn host() -> Arc<HostBackend> {
    keep_nothing(
        HostBackend::with_granularity(64 << 10).expect("64 KiB is a valid host granularity"),
    )
}

/// Sets `backend`'s default pool to keep nothing (release threshold 0), so
/// that what a buffer gives up goes straight back to the driver and the
/// tests' checks of live chunks against a baseline mean what they say. The
/// pooled paths are tested with pools of their own (`pool.rs`) and with the
/// default pool kept (`pool.rs`'s `default_pool_*` tests).
pub fn keep_nothing<B: Backend>(backend: Arc<B>) -> Arc<B> {
    if let Some(pool) = vmmbuf::ChunkPool::default_for(&backend) {
        pool.set_release_threshold(0)
            .expect("0 is a valid threshold");
    }
    backend
}

/// What a test needs to run. Tests whose needs this machine does not meet are
/// reported as *ignored* (never as passed), with the reason printed once;
/// `VMMBUF_REQUIRE_GPU=1` (and `VMMBUF_REQUIRE_PEERS=1` for two GPUs) runs
/// them anyway, so they fail instead.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Needs {
    Nothing,
    Gpu,
    TwoGpus,
    /// Run only by another test, in a child process (`--ignored --exact`).
    Parent,
}

/// Why GPU 0 cannot be used here, or `None` if it can. Asked once.
pub fn gpu_unavailable() -> Option<&'static str> {
    static WHY: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    WHY.get_or_init(|| CudaBackend::new(0).err().map(|e| e.to_string()))
        .as_deref()
}

/// Why two GPUs cannot be used here, or `None` if they can.
pub fn two_gpus_unavailable() -> Option<String> {
    if let Some(why) = gpu_unavailable() {
        return Some(why.to_string());
    }
    CudaBackend::new(1)
        .err()
        .map(|e| format!("a second GPU: {e}"))
}

pub fn require_gpu() -> bool {
    std::env::var("VMMBUF_REQUIRE_GPU").as_deref() == Ok("1")
}

pub fn require_peers() -> bool {
    std::env::var("VMMBUF_REQUIRE_PEERS").as_deref() == Ok("1")
}

/// One registered test: run under the serial lock; ignored where its needs
/// are not met here (and not required).
pub fn trial(module: &str, name: &str, needs: Needs, f: impl FnOnce() + Send + 'static) -> Trial {
    let module = module.trim_start_matches("all::");
    let ignored = match needs {
        Needs::Nothing => false,
        Needs::Gpu => gpu_unavailable().is_some() && !require_gpu(),
        Needs::TwoGpus => two_gpus_unavailable().is_some() && !require_peers(),
        Needs::Parent => true,
    };
    Trial::test(format!("{module}::{name}"), move || {
        let _g = serial();
        f();
        Ok(())
    })
    .with_ignored_flag(ignored)
}

/// The CUDA backend on GPU 0. Only GPU tests call it: they run where there
/// is a GPU, or under `VMMBUF_REQUIRE_GPU=1`, where a missing GPU fails them.
pub fn gpu() -> Arc<CudaBackend> {
    keep_nothing(CudaBackend::new(0).unwrap_or_else(|e| panic!("this GPU test cannot run: {e}")))
}

/// `len` bytes of seeded random data (never all zeros).
/// A sweep's points: every one under `VMMBUF_LONG_TESTS=1` (CI's long job
/// and the GPU runs), else `quick`, the few that bound it, so that
/// `cargo test` stays fast.
pub fn sweep<T: Copy>(all: &[T], quick: &[T]) -> Vec<T> {
    if std::env::var("VMMBUF_LONG_TESTS").as_deref() == Ok("1") {
        all.to_vec()
    } else {
        quick.to_vec()
    }
}

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

/// Asserts the backend holds nothing (no reservation, chunk or mapping)
/// and made no device-wide synchronisation. The fence-query count is a
/// tally over the backend's life, not a holding: it is not compared.
#[track_caller]
pub fn assert_holds_nothing(live: LiveCounts) {
    let mut holds = live;
    holds.fence_queries = 0;
    assert_eq!(holds, LiveCounts::default(), "{live:?}");
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

/// Registers a module's tests: `generic` functions run once per backend
/// (`module::host::name` on the host backend, `module::cuda::name` on GPU 0),
/// the others as named, each with what it needs. Expands to `pub fn trials()`.
#[macro_export]
macro_rules! register {
    (
        $(generic: [$($g:ident),* $(,)?],)?
        $(host: [$($h:ident),* $(,)?],)?
        $(gpu: [$($c:ident),* $(,)?],)?
        $(two_gpus: [$($p:ident),* $(,)?],)?
        $(child: [$($k:ident),* $(,)?],)?
    ) => {
        pub fn trials() -> Vec<libtest_mimic::Trial> {
            use $crate::common::{trial, Needs};
            let m = module_path!();
            vec![
                $($(
                    trial(m, concat!("host::", stringify!($g)), Needs::Nothing, || {
                        $g($crate::common::host())
                    }),
                    trial(m, concat!("cuda::", stringify!($g)), Needs::Gpu, || {
                        $g($crate::common::gpu())
                    }),
                )*)?
                $($(trial(m, stringify!($h), Needs::Nothing, $h),)*)?
                $($(trial(m, stringify!($c), Needs::Gpu, $c),)*)?
                $($(trial(m, stringify!($p), Needs::TwoGpus, $p),)*)?
                $($(trial(m, stringify!($k), Needs::Parent, $k),)*)?
            ]
        }
    };
}

/// The over-commit bound each growth policy documents: right after a growth
/// to `len` that mapped chunks, `capacity - len` stays below it.
pub fn overcommit_bound(policy: vmmbuf::GrowthPolicy, granularity: usize, len: usize) -> usize {
    match policy {
        vmmbuf::GrowthPolicy::Exact => granularity,
        vmmbuf::GrowthPolicy::Fixed { chunk_bytes } => chunk_bytes,
        vmmbuf::GrowthPolicy::Proportional { divisor } => granularity.max(len / divisor),
        other => panic!("no documented bound for {other:?}"),
    }
}
