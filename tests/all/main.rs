//! vmmbuf's integration tests: one binary, one link step. Generic tests run
//! against the host backend everywhere and against CUDA where there is a GPU
//! (skipping with a printed reason otherwise, failing under
//! `VMMBUF_REQUIRE_GPU=1`).

mod bad_input;
mod common;
mod cuda_only;
mod fault;
mod faults;
mod fuzz;
mod host_only;
mod interop;
mod peer;
mod placement;
mod pool;
mod props;
mod soak;
mod suite;
