//! The arena under its lock as a sleep's [`Host`]: its region, what its
//! sleep keeps, and the verbs of its heap and mapper a sleep and a wake
//! need; the sleep sees nothing else of it.

use super::owed::Mark;
use super::{Shared, State};
use crate::backend::Backend;
use crate::error::Result;
use crate::location::Location;
use crate::order::FenceSet;
use crate::region::Region;
use crate::sleep::{Host, SleepState};

/// The arena under its lock, as a sleep's [`Host`].
pub(super) struct Held<'a, B: Backend> {
    pub(super) sh: &'a Shared<B>,
    pub(super) st: &'a mut State<B>,
}

impl<B: Backend> Host<B> for Held<'_, B> {
    type Fence = Mark<B::Fence>;

    fn region(&self) -> &Region<B> {
        &self.st.region
    }

    fn region_mut(&mut self) -> &mut Region<B> {
        &mut self.st.region
    }

    fn state(&self) -> &SleepState<B, Self::Fence> {
        &self.st.sleep
    }

    fn state_mut(&mut self) -> &mut SleepState<B, Self::Fence> {
        &mut self.st.sleep
    }

    fn parts(&mut self) -> (&mut Region<B>, &mut SleepState<B, Self::Fence>) {
        (&mut self.st.region, &mut self.st.sleep)
    }

    fn zone_border(&self) -> usize {
        self.st.heap.zone_border()
    }

    fn free_ranges(&self) -> Vec<(usize, usize)> {
        let mut blocks: Vec<(usize, usize)> = self
            .st
            .heap
            .free_blocks()
            .map(|(o, f)| (o, f.size))
            .collect();
        blocks.sort_unstable();
        // Adjacent free blocks merged (once their frees have passed, they
        // have merged in the heap too).
        crate::ranges::adjacent_runs(blocks)
            .into_iter()
            .map(|(o, b)| (o, o + b))
            .collect()
    }

    fn live_ranges(&self) -> Vec<(usize, usize)> {
        // The heap's map is not ordered.
        let mut live: Vec<(usize, usize)> = self.st.heap.live_ranges().collect();
        live.sort_unstable();
        live
    }

    fn graph_held(&self) -> Vec<(usize, usize)> {
        self.st.heap.graph_held().collect()
    }

    fn forget_free(&mut self, range: std::ops::Range<usize>) {
        self.st.heap.remove_free_within(range);
    }

    fn free_again(&mut self, offset: usize, bytes: usize) {
        let State { heap, region, .. } = &mut *self.st;
        heap.insert_fresh(offset, bytes, &region.walls());
    }

    fn wait_frees(&mut self, fences: &FenceSet<Self::Fence>) -> Result<()> {
        self.st.heap.wait_fences(&*self.sh.backend, fences)
    }

    fn synchronize(&mut self) -> Result<()> {
        self.st.heap.synchronize(&*self.sh.backend)
    }

    fn map_fresh(&mut self, at: usize, sizes: &[usize]) -> Result<std::time::Duration> {
        self.sh.map_fresh(self.st, at, sizes)
    }

    fn check_room(&self, bytes: usize) -> Result<()> {
        self.sh.check_room(self.st, bytes, bytes)
    }

    fn out_of_memory(&self, bytes: usize) -> crate::error::Error {
        self.sh.out_of_memory(self.st, bytes, None)
    }

    fn placement(&self) -> Location {
        self.st.placement
    }

    fn set_placement(&mut self, at: Location) {
        self.st.placement = at;
    }
}
