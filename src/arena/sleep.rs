//! Sleep and wake: every chunk of an arena moves to pinned host memory and
//! back, at the same addresses, with the data. The device memory goes back
//! to the driver while the allocations stay valid (kernels still reach them,
//! over the bus). What an inference server's sleep mode needs.

use std::collections::{BTreeMap, BTreeSet};

use super::{Arena, ArenaStream};
use crate::backend::Backend;
use crate::error::Result;
use crate::location::Location;
use crate::migration::{MigrationReport, Mover};

impl<B: Backend, S: ArenaStream<B>> Arena<B, S> {
    /// Moves every chunk of the arena, allocated or free, to pinned host
    /// memory, keeping its data and address; then gives the device memory
    /// they held, and the device chunks the arena's pool kept, back to the
    /// driver. Until [`restore`](Self::restore), new chunks are placed in
    /// host memory too, so allocating still works without device memory.
    ///
    /// Every allocation stays valid: the CPU and kernels reach it at the same
    /// address (kernels over the bus, more slowly). Whole free chunks go to
    /// the driver instead of moving.
    ///
    /// First it waits for the work queued so far on each of `streams` (pass
    /// every stream that may still use the arena's allocations), for the
    /// uses recorded on live allocations (views on any stream,
    /// [`Allocation::record_use`](crate::Allocation::record_use)) and for the
    /// frees the arena holds fences for; never for the whole device. Other
    /// work that reaches the allocations must have finished.
    ///
    /// All or nothing: on error nothing moved, unless undoing failed too,
    /// which poisons the arena ([`Error::Poisoned`](crate::Error::Poisoned)). A host-backend arena
    /// is already in host memory: nothing moves.
    pub fn offload(&self, streams: &[S]) -> Result<MigrationReport> {
        self.move_all(Location::Host, streams)
    }

    /// Moves every chunk back to the arena's placement, keeping data and
    /// addresses, and gives the host memory back to the driver. The
    /// counterpart of [`offload`](Self::offload), with its waiting rules.
    pub fn restore(&self, streams: &[S]) -> Result<MigrationReport> {
        self.move_all(self.shared.placement, streams)
    }

    /// Whether new chunks go to the host because of [`offload`](Self::offload)
    /// (false for an arena placed there).
    pub fn is_offloaded(&self) -> bool {
        let sh = &*self.shared;
        sh.state.lock().placement != sh.placement
    }

    fn move_all(&self, to: Location, streams: &[S]) -> Result<MigrationReport> {
        let sh = &*self.shared;
        let backend = &*sh.backend;
        crate::migration::check_placement(backend, sh.granularity, to)?;
        let fences = streams
            .iter()
            .map(|s| s.fence(backend))
            .collect::<Result<Vec<_>>>()?;
        let mut guard = sh.state.lock();
        let st = &mut *guard;
        st.region.check_poison()?;
        for f in &fences {
            backend.wait(f)?;
        }
        // The uses recorded on live allocations (views, `record_use`) and the
        // frees the arena holds: their chunks move or go now.
        sh.wait_live_uses(st)?;
        sh.wait_pending_frees(st)?;
        sh.release_free_chunks(st)?;
        // Where chunks are now, and where new ones went: what the pool may
        // hold that nobody here needs after the move.
        let mut from = BTreeSet::from([st.placement]);
        let targets: BTreeMap<usize, Location> = st
            .region
            .table
            .iter()
            .filter(|(_, e)| e.placement != to)
            .inspect(|(_, e)| {
                from.insert(e.placement);
            })
            .map(|(o, _)| (o, to))
            .collect();
        let _span =
            tracing::debug_span!("vmmbuf.arena.move", chunks = targets.len(), %to).entered();
        let mover = Mover {
            backend,
            granularity: sh.granularity,
            source: &*sh.pool,
            shareable: false,
            release_old: false,
        };
        let report = mover.run(&mut st.region, &targets)?;
        // A move keeps every chunk's offset and size: the per-chunk
        // allocated bytes (the inactive split) stand as they are.
        st.placement = to;
        sh.count(st);
        drop(guard);
        // What was left behind goes back to the driver; the move stands if
        // that fails (logged by the pool).
        for p in from.into_iter().filter(|&p| p != to) {
            let _ = sh.pool.trim_at(p);
        }
        tracing::debug!(
            chunks = report.chunks_moved,
            bytes = report.bytes_moved,
            "vmmbuf: arena moved to {to}"
        );
        Ok(report)
    }
}
