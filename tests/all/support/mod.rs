//! What the suites share, and no test of its own: GPU and host fixtures
//! (`common`), a backend that fails any call on request (`failing_backend`)
//! and NCCL's loader and communicators for the NCCL suites (`nccl_support`).

pub(crate) mod common;
pub(crate) mod failing_backend;
pub(crate) mod nccl_support;
