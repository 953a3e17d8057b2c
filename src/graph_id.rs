//! [`GraphPoolId`]: names a CUDA graph's pool. At the bottom of the crate:
//! the arena keeps the pools, the CUDA backend's capture code names them,
//! and neither imports the other for it.
#![deny(unsafe_code)]

/// Names the pool of one CUDA graph (CUDA's capture id serves: it is unique
/// in a process). See [`Arena::alloc_in_graph`](crate::Arena::alloc_in_graph).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GraphPoolId(pub u64);

impl std::fmt::Display for GraphPoolId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "graph pool {}", self.0)
    }
}
