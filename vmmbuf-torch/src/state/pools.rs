//! PyTorch's private memory pools, as its CUDA graph trees see them.
//!
//! Process-wide, vmmbuf is PyTorch's whole allocator, and PyTorch does not
//! route its pool calls to a pluggable allocator. Graph trees
//! (`torch.compile(mode="reduce-overhead")`) need three answers about a
//! pool: which allocations live in it (`checkPoolLiveAllocations`), a
//! checkpoint of that (`getCheckpointState`), and the checkpoint made true
//! again (`setCheckpointPoolState`: the outputs of the graphs replayed
//! since live again at their addresses). The Python package answers them
//! from what is kept here:
//!
//! - which allocations were made into which pool: those of a capture whose
//!   pool the package named ([`capture_pool`], from its `capture_begin`
//!   hook), and those of a thread between `beginAllocateCurrentThreadToPool`
//!   and `endAllocateToPool` ([`begin`], [`end`]: graph trees' warm-up);
//! - a retake request ([`retake_next`]): the thread's next allocation takes
//!   the block graphs hold at that address again ([`vmmbuf::Arena::retake`])
//!   instead of new memory, so that it goes through PyTorch's own
//!   allocation call (which keeps its own record of it).
//!
//! Captures that name one pool share one vmmbuf graph pool, as they share
//! PyTorch's private pool ([`capture_pool`]): a block freed during one
//! capture may be taken by a later capture into the same pool on the same
//! stream. That is PyTorch's contract for a shared pool (the graphs are
//! replayed in the order they were captured, never concurrently), which
//! graph trees and `make_graphed_callables` rely on to save memory; the
//! memory still stays mapped until every graph of the pool is destroyed.
//! `VMMBUF_TORCH_SHARE_GRAPH_POOLS=0` gives every capture a pool of its own
//! instead (no graph ever takes another's blocks, at the cost of the memory
//! sharing saves).

use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::{c_int, c_void};

use vmmbuf::{Error, GraphPoolId, Result};

use super::{device, existing, CudaAllocation, Device};

/// PyTorch's id of a memory pool (`MempoolId_t`, a pair).
pub(crate) type PoolId = (u64, u64);

/// A device's pool bookkeeping (see the module).
#[derive(Default)]
pub(super) struct Pools {
    /// Live allocations made into a pool: address -> (pool, bytes asked).
    members: HashMap<usize, (PoolId, usize)>,
    /// The PyTorch pool each graph pool is.
    of_graph: HashMap<GraphPoolId, PoolId>,
    /// The graph pool of each PyTorch pool that captures share.
    shared: HashMap<PoolId, GraphPoolId>,
}

/// A graph pool id no capture has: CUDA's capture ids count up from 1, so
/// ids with the top bit set are free for pools that captures share.
fn new_shared_id() -> GraphPoolId {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    GraphPoolId(1 << 63 | NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
}

thread_local! {
    /// The pool this thread allocates into, on which device.
    static THREAD_POOL: Cell<Option<(c_int, PoolId)>> = const { Cell::new(None) };
    /// The block this thread's next allocation takes again, and its pool.
    static RETAKE: Cell<Option<(u64, PoolId)>> = const { Cell::new(None) };
}

/// This thread allocates into `pool` on `dev` (outside captures too) until
/// [`end`], as PyTorch's `beginAllocateCurrentThreadToPool`.
#[cfg_attr(not(feature = "python"), allow(dead_code))]
pub(crate) fn begin(dev: c_int, pool: PoolId) {
    THREAD_POOL.with(|t| t.set(Some((dev, pool))));
}

/// This thread no longer allocates into `pool` on `dev` (another pool
/// begun since stays).
#[cfg_attr(not(feature = "python"), allow(dead_code))]
pub(crate) fn end(dev: c_int, pool: PoolId) {
    THREAD_POOL.with(|t| {
        if t.get() == Some((dev, pool)) {
            t.set(None)
        }
    });
}

/// The capture under way on `stream` allocates into PyTorch's `pool`: the
/// graph pool the pool's other captures not yet destroyed allocate into,
/// or a new one (see the module). False if the stream is not being
/// captured (nothing is noted).
#[cfg_attr(not(feature = "python"), allow(dead_code))]
pub(crate) fn capture_pool(dev: c_int, stream: *mut c_void, pool: PoolId) -> Result<bool> {
    let d = device(dev)?;
    let mut d = d.lock();
    let s = d.stream(stream);
    let Some(c) = vmmbuf::cuda::capture_state(&s)?.into_active() else {
        return Ok(false);
    };
    let share = super::Settings::get().share_graph_pools;
    let g = match share {
        true => d
            .pools
            .shared
            .get(&pool)
            .copied()
            .unwrap_or_else(new_shared_id),
        false => c.pool(),
    };
    d.join_pool(&c, g)?;
    if share {
        d.pools.shared.insert(pool, g);
    }
    d.pools.of_graph.insert(g, pool);
    Ok(true)
}

/// The live allocations of `pool` on `dev`: (address, bytes asked), by
/// address.
#[cfg_attr(not(feature = "python"), allow(dead_code))]
pub(crate) fn live(dev: c_int, pool: PoolId) -> Vec<(u64, usize)> {
    let Some(d) = existing(dev) else {
        return Vec::new();
    };
    let d = d.lock();
    let mut v: Vec<(u64, usize)> = d
        .pools
        .members
        .iter()
        .filter(|(_, m)| m.0 == pool)
        .map(|(&a, m)| (a as u64, m.1))
        .collect();
    v.sort_unstable();
    v
}

/// This thread's next allocation takes the block graphs hold at `address`
/// again, into `pool` (`None` withdraws the request).
#[cfg_attr(not(feature = "python"), allow(dead_code))]
pub(crate) fn retake_next(request: Option<(u64, PoolId)>) {
    RETAKE.with(|r| r.set(request));
}

/// The retake request of this thread, withdrawn.
pub(super) fn take_retake() -> Option<(u64, PoolId)> {
    RETAKE.with(|r| r.take())
}

impl Device {
    /// The block graphs hold at `address`, live again for `size` bytes on
    /// stream `s`, from whichever of the device's arenas has it.
    pub(super) fn retake(
        &self,
        address: u64,
        size: usize,
        s: &std::sync::Arc<cudarc::driver::CudaStream>,
    ) -> Result<CudaAllocation> {
        let mut last = None;
        for a in self.arenas.values() {
            match a.retake(address, size, s) {
                Ok(x) => return Ok(x),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| {
            Error::InvalidArgument(format!("retake of {address:#x}: no arena on this device"))
        }))
    }

    /// The pool a new allocation on `dev` goes into: its capture's
    /// (`graph`), else the thread's, if any.
    pub(super) fn pool_for(&self, dev: c_int, graph: Option<GraphPoolId>) -> Option<PoolId> {
        if self.pools.of_graph.is_empty() && THREAD_POOL.with(Cell::get).is_none() {
            return None;
        }
        graph
            .and_then(|g| self.pools.of_graph.get(&g).copied())
            .or_else(|| {
                THREAD_POOL
                    .with(Cell::get)
                    .and_then(|(d, p)| (d == dev).then_some(p))
            })
    }

    /// Notes the allocation at `address` of `size` bytes asked in `pool`.
    pub(super) fn note_pool(&mut self, address: u64, size: usize, pool: PoolId) {
        self.pools.members.insert(address as usize, (pool, size));
    }

    /// The allocation at `address` was freed: it leaves its pool.
    pub(super) fn forget_pool(&mut self, address: u64) {
        if !self.pools.members.is_empty() {
            self.pools.members.remove(&(address as usize));
        }
    }

    /// Graph pool `g` is gone (every graph of it destroyed): the PyTorch
    /// pool it was is forgotten; a later capture into that pool starts a
    /// new graph pool, as PyTorch makes a new private pool.
    pub(super) fn forget_graph(&mut self, g: GraphPoolId) {
        if let Some(p) = self.pools.of_graph.remove(&g) {
            if self.pools.shared.get(&p) == Some(&g) {
                self.pools.shared.remove(&p);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_threads_pool_begins_and_ends_on_its_device_only() {
        begin(0, (1, 7));
        assert_eq!(THREAD_POOL.with(Cell::get), Some((0, (1, 7))));
        end(1, (1, 7));
        assert!(
            THREAD_POOL.with(Cell::get).is_some(),
            "another device's end"
        );
        end(0, (1, 8));
        assert!(THREAD_POOL.with(Cell::get).is_some(), "another pool's end");
        end(0, (1, 7));
        assert_eq!(THREAD_POOL.with(Cell::get), None);
        let other = std::thread::spawn(|| THREAD_POOL.with(Cell::get));
        begin(0, (2, 0));
        assert_eq!(other.join().unwrap(), None, "per thread");
        end(0, (2, 0));
    }

    #[test]
    fn a_retake_request_is_taken_once() {
        retake_next(Some((0x1000, (0, 3))));
        assert_eq!(take_retake(), Some((0x1000, (0, 3))));
        assert_eq!(take_retake(), None);
        retake_next(Some((0x2000, (0, 3))));
        retake_next(None);
        assert_eq!(take_retake(), None, "withdrawn");
    }
}
