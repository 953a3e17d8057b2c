//! The moves experiment ([`ArenaDesc::move_free_chunks`]): where the arena
//! grows, whole free chunks elsewhere are mapped a second time instead of
//! new memory, and their old addresses unmapped once nothing uses them.
//! It pays where shapes repeat (causal LM) and costs where every step
//! brings new shapes (conv net): BENCHMARKS.md, "the moves experiment";
//! off by default. The heap lends the chunks (its free blocks), the region
//! moves them (`Region::move_chunks`), and a moved chunk's old address
//! stays mapped (a ghost) until its mark has passed.
//!
//! [`ArenaDesc::move_free_chunks`]: super::ArenaDesc::move_free_chunks

use super::blocks::StreamKey;
use super::mapping::timed;
use super::{Shared, State};
use crate::backend::Backend;
use crate::error::Result;
use crate::plan::round_up;

impl<B: Backend> Shared<B> {
    /// How many of `need` bytes to map for a request of `size` should be
    /// moved free memory: all of them, or with
    /// [`ArenaDesc::release_over_percent`](super::ArenaDesc::release_over_percent)
    /// only what mapping them would take past that share of the peak
    /// allocated (each move costs a mapping now and an unmapping later).
    pub(super) fn move_at_most(&self, st: &State<B>, size: usize, need: usize) -> usize {
        let Some(p) = self.release_over_percent else {
            return need;
        };
        let over = self.past_share(st, size, need, f64::from(p) / 100.0);
        round_up(over, self.granularity).map_or(need, |o| o.min(need))
    }

    /// Moves whole free chunks that `key` may take now (settled, or freed
    /// on `key` alone) to `[at, at + need)`, from its start, as far as they
    /// fit (none inside `keep`, the free block the request extends), and
    /// puts them in zone `z`'s index there: a settled chunk's old
    /// address is unmapped at once, a pending one's stays mapped (a ghost)
    /// until a fence recorded on `key` after now has passed, and the moved
    /// memory is `key`'s alone until then (a mark owed on `key`, which
    /// `key`'s next call covers). Returns the bytes moved. On an error the
    /// chunk being moved stays where it was, free, and what moved before
    /// stays moved.
    pub(super) fn move_free_for(
        &self,
        st: &mut State<B>,
        z: usize,
        keep: std::ops::Range<usize>,
        at: usize,
        need: usize,
        key: StreamKey,
    ) -> Result<usize> {
        if need == 0 || st.sleep.is_asleep() || st.region.has_hook() {
            return Ok(0);
        }
        let placement = st.placement;
        let State {
            heap,
            region,
            stats,
            ..
        } = &mut *st;
        let table = &region.table;
        let plan = heap.plan_moves(key, need, &keep, |o, size| {
            table
                .overlapping(o..o + size)
                .filter(|(co, e)| *co >= o && co + e.bytes <= o + size && e.placement == placement)
                .map(|(co, e)| (co, e.bytes))
                .collect()
        });
        if plan.is_empty() {
            return Ok(0);
        }
        let moves = plan.moves(at);
        let (n, err) = timed(&mut stats.move_ns, || region.move_chunks(&moves));
        // Nothing may still use a settled donor's old address.
        let gone = plan.settled_of(n);
        if timed(&mut stats.move_ns, || region.unmap_ghosts(&gone)).is_err() {
            // Left as ghosts with no mark: the next reap tries again.
            tracing::warn!(
                "vmmbuf arena: unmapping moved chunks' old addresses failed; tried again later"
            );
        }
        let moved = heap.commit_moves(plan, n, z, at, &keep, &region.walls());
        stats.num_chunks_moved += n as u64;
        if n > 0 {
            stats.num_moving_growths += 1;
        }
        match err {
            Some(e) => Err(e),
            None => Ok(moved),
        }
    }

    /// Unmaps the old addresses of moved chunks
    /// ([`move_free_for`](Self::move_free_for)) whose mark has passed; with
    /// `wait`, of all of them, waiting for their marks (a device
    /// synchronisation where a mark has no fence yet).
    pub(super) fn reap_ghosts(&self, st: &mut State<B>, wait: bool) -> Result<()> {
        if st.region.ghosts().next().is_none() {
            return Ok(());
        }
        let backend = &*self.backend;
        let ghosts: Vec<_> = st.region.ghost_marks().collect();
        let mut not_yet = crate::order::NotYet::default();
        let mut passed = Vec::with_capacity(ghosts.len());
        for (o, mark) in ghosts {
            if let Some((key, seq)) = mark {
                if !st.heap.mark_passed(backend, key, seq, &mut not_yet) {
                    if !wait {
                        continue;
                    }
                    st.heap.wait_mark(backend, key, seq)?;
                }
            }
            passed.push(o);
        }
        // One unmap for each run of adjacent ones.
        timed(&mut st.stats.move_ns, || st.region.unmap_ghosts(&passed))
    }
}
