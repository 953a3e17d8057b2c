//! What a sleep needs around it: [`Env`], the arena's fixed parts (its
//! backend, pool, sizes and home), and [`Host`], the arena it puts to sleep,
//! asked under the arena's lock. The sleep's rooms know the arena only
//! through these two: the heap learns which ranges were unmapped and which
//! bytes are free again, the mapper maps fresh pieces, and nothing here
//! names a heap field.

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use super::{SleepDesc, SleepState};
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::location::Location;
use crate::migration::Mover;
use crate::order::FenceSet;
use crate::pool::ChunkPool;
use crate::region::Region;

/// An arena's fixed parts, as a sleep uses them.
pub(crate) struct Env<'a, B: Backend> {
    pub(crate) backend: &'a Arc<B>,
    /// Where unmapped chunks go, and host pieces come from.
    pub(crate) pool: &'a ChunkPool<B>,
    pub(crate) granularity: usize,
    /// The arena's chunk: no piece is smaller.
    pub(crate) chunk_bytes: usize,
    /// Where the arena's chunks live while it is awake.
    pub(crate) home: Location,
    /// The arena's own budget of mapped bytes.
    pub(crate) budget: Option<usize>,
}

/// The arena a sleep puts to sleep, under its lock: its region, its sleep's
/// state, and the verbs of its heap and mapper that a sleep and a wake need.
pub(crate) trait Host<B: Backend> {
    /// The fence a free made while asleep carries.
    type Fence;

    /// The arena's reservation and its chunks.
    fn region(&self) -> &Region<B>;
    /// See [`region`](Self::region).
    fn region_mut(&mut self) -> &mut Region<B>;
    /// What the sleep keeps.
    fn state(&self) -> &SleepState<B, Self::Fence>;
    /// See [`state`](Self::state).
    fn state_mut(&mut self) -> &mut SleepState<B, Self::Fence>;
    /// Both at once.
    fn parts(&mut self) -> (&mut Region<B>, &mut SleepState<B, Self::Fence>);

    /// The offset where the arena's small zone ends: no piece crosses it.
    fn zone_border(&self) -> usize;
    /// The free bytes as merged ranges `(start, end)`, in address order.
    fn free_ranges(&self) -> Vec<(usize, usize)>;
    /// Live allocations `(offset, bytes)`, in address order.
    fn live_ranges(&self) -> Vec<(usize, usize)>;
    /// Blocks CUDA graphs hold, `(offset, bytes)`.
    fn graph_held(&self) -> Vec<(usize, usize)>;
    /// The free bytes within `range` are gone (unmapped by a sleep).
    fn forget_free(&mut self, range: Range<usize>);
    /// `[offset, offset + bytes)` is mapped and free again (a wake).
    fn free_again(&mut self, offset: usize, bytes: usize);
    /// Waits for the fences of a free made while asleep.
    fn wait_frees(&mut self, fences: &FenceSet<Self::Fence>) -> Result<()>;
    /// Waits for the whole device.
    fn synchronize(&mut self) -> Result<()>;

    /// Maps fresh chunks of `sizes` one after the other from `at`, where
    /// the arena places them now, all or nothing; the time spent getting
    /// the chunks.
    fn map_fresh(&mut self, at: usize, sizes: &[usize]) -> Result<Duration>;
    /// Whether `bytes` more may be mapped (budgets, the device margin).
    fn check_room(&self, bytes: usize) -> Result<()>;
    /// The error for `bytes` that could not be mapped.
    fn out_of_memory(&self, bytes: usize) -> Error;
    /// Where new chunks go now.
    fn placement(&self) -> Location;
    /// Where new chunks go from now on (the host while asleep keeping the
    /// data).
    fn set_placement(&mut self, at: Location);
}

impl<B: Backend> Env<'_, B> {
    /// The piece size `desc` asks for: rounded to the granularity, never
    /// under the arena's chunk.
    pub(crate) fn piece_of(&self, desc: &SleepDesc) -> Result<usize> {
        Ok(
            crate::plan::round_up(desc.max_piece_bytes.max(1), self.granularity)
                .ok_or_else(|| Error::invalid("max_piece_bytes overflows"))?
                .max(self.chunk_bytes),
        )
    }

    /// The copy pipeline of a kept sleep and its wake.
    pub(super) fn mover(&self) -> Mover<'_, B> {
        Mover {
            backend: &**self.backend,
            granularity: self.granularity,
            source: self.pool,
            shareable: false,
            release_old: false,
            release_joined: true,
        }
    }

    /// A sleep and a wake wait for the streams' work and copy
    /// synchronously: refused, before anything changes, while a CUDA graph
    /// capture may be under way (CUDA would refuse those calls and
    /// invalidate the capture).
    pub(crate) fn refuse_under_capture(&self, what: &'static str) -> Result<()> {
        if self.backend.capture_underway() {
            return Err(Error::CaptureUnderway { what });
        }
        Ok(())
    }
}
