//! vmmbuf's integration tests: one binary, one link step, run by
//! libtest-mimic so that a test this machine cannot run (no GPU, one GPU) is
//! reported as *ignored*, never as passed. Generic tests run against the host
//! backend everywhere and against CUDA where there is a GPU;
//! `VMMBUF_REQUIRE_GPU=1` makes GPU tests run (and fail) without one.

mod arena;
mod bad_input;
mod buffer;
mod capture_frees;
mod cuda_only;
mod failed_calls;
mod fuzz;
mod graph_and_backup_promises;
mod hooks;
mod host_only;
mod interop;
mod lag;
mod nccl;
mod oracle;
mod peer;
mod placement;
mod pool;
mod props;
mod reserve;
mod reviewed_defects;
mod share;
mod sleep;
mod soak;
mod soundness;
mod stream_order;
mod support;

use support::{common, failing_backend, nccl_support};

fn main() {
    let args = libtest_mimic::Arguments::from_args();
    if let Some(why) = common::gpu_unavailable() {
        if !common::require_gpu() {
            eprintln!(
                "vmmbuf tests: GPU tests are ignored here: {why} \
                 (VMMBUF_REQUIRE_GPU=1 runs them, and they fail)"
            );
        }
    }
    let trials = [
        arena::trials(),
        bad_input::trials(),
        buffer::trials(),
        cuda_only::trials(),
        failed_calls::trials(),
        fuzz::trials(),
        graph_and_backup_promises::trials(),
        hooks::trials(),
        host_only::trials(),
        interop::trials(),
        lag::trials(),
        nccl::trials(),
        peer::trials(),
        placement::trials(),
        pool::trials(),
        reserve::trials(),
        oracle::trials(),
        props::trials(),
        reviewed_defects::trials(),
        capture_frees::trials(),
        share::trials(),
        sleep::trials(),
        soak::trials(),
        soundness::trials(),
        stream_order::trials(),
    ]
    .into_iter()
    .flatten()
    .collect();
    libtest_mimic::run(&args, trials).exit();
}
