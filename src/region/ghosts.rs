//! Chunks moved to new addresses (`ArenaDesc::move_free_chunks`): the old
//! mappings stay as ghosts, fenced by the uses before the move, until
//! their uses have passed and the mover unmaps them.

use super::*;

impl<B: Backend> Region<B> {
    /// Maps the chunks at the `from` of `moves` a second time at their `to`
    /// (holes of the table, each as large as its chunk), in order, with
    /// the access each has: every chunk's map, then one access call for
    /// each run of adjacent destinations whose chunks share their access
    /// (under load a 2 MiB chunk's access call costs ~39 us alone and
    /// ~27 us a chunk over 16: `benches/busy_vmm.rs`). Their entries move
    /// there; each old address stays mapped, a ghost kept with its `mark`
    /// (what must pass before it goes), until
    /// [`unmap_ghosts`](Self::unmap_ghosts): work queued before may still
    /// use it. Only for a backend that [maps a chunk
    /// twice](Backend::maps_a_chunk_twice) and a region without a hook (a
    /// hook's ranges follow the table). No memory is taken, so no budget.
    ///
    /// Returns how many of `moves`, from the first, moved, and the error
    /// that stopped the others, which are as they were.
    pub(crate) fn move_chunks(&mut self, moves: &[Move]) -> (usize, Option<Error>) {
        if let Err(e) = self.check_poison() {
            return (0, Some(e));
        }
        debug_assert!(self.hook.is_none() && self.backend.maps_a_chunk_twice());
        let backend = self.backend.clone();
        let res = self
            .res
            .as_mut()
            .expect("a region's reservation lives until it closes");
        // (to, bytes, driver access) of each chunk mapped at its `to`.
        let mut mapped: Vec<(usize, usize, Vec<AccessDesc>)> = Vec::with_capacity(moves.len());
        let mut err = None;
        for &(from, to, _) in moves {
            let Some(entry) = self.table.get(from) else {
                err = Some(Error::invalid(format!("no chunk at offset {from} to move")));
                break;
            };
            if let Err(e) = backend.map(res, to, &entry.chunk) {
                err = Some(e);
                break;
            }
            mapped.push((to, entry.bytes, entry.driver_access()));
        }
        // Access for each run; the first run that fails, and every one
        // after, is unmapped again (no access was granted there: nothing
        // could use it).
        let mut done = 0;
        for run in mapped.chunk_by(|a, b| a.0 + a.1 == b.0 && a.2 == b.2) {
            let bytes: usize = run.iter().map(|m| m.1).sum();
            if let Err(e) = backend.set_access(res, run[0].0, bytes, &run[0].2) {
                err = Some(e);
                break;
            }
            done += run.len();
        }
        // Empty unless an access call failed.
        for (to, bytes) in crate::ranges::adjacent_runs(mapped[done..].iter().map(|m| (m.0, m.1))) {
            if let Err(u) = backend.unmap(res, to, bytes) {
                self.poison(
                    format!("undoing a failed move: unmap failed: {u}"),
                    std::iter::empty(),
                );
                break;
            }
        }
        for &(from, to, mark) in &moves[..done] {
            let entry = self.table.remove(from).expect("found above");
            let bytes = entry.bytes;
            self.table
                .insert(to, entry)
                .expect("moved to a hole of the table");
            self.ghosts.insert(from, (bytes, mark));
        }
        (done, err)
    }

    /// Unmaps the ghosts at `offsets` left by
    /// [`move_chunks`](Self::move_chunks) (the caller has waited for their
    /// uses), one driver call for each run of adjacent ones. Their memory
    /// stays, mapped where it moved. On error the run that failed and those
    /// after it stay ghosts.
    pub(crate) fn unmap_ghosts(&mut self, offsets: &[usize]) -> Result<()> {
        let mut sorted = offsets.to_vec();
        sorted.sort_unstable();
        let ghosts = sorted
            .into_iter()
            .map(|o| match self.ghosts.get(&o) {
                Some(&(bytes, _)) => Ok((o, bytes)),
                None => Err(Error::invalid(format!("no ghost at offset {o}"))),
            })
            .collect::<Result<Vec<_>>>()?;
        let backend = self.backend.clone();
        for (o, bytes) in crate::ranges::adjacent_runs(ghosts) {
            backend.unmap(self.res(), o, bytes)?;
            let gone: Vec<usize> = self.ghosts.range(o..o + bytes).map(|(&g, _)| g).collect();
            for g in gone {
                self.ghosts.remove(&g);
            }
        }
        Ok(())
    }

    /// The ghosts, `(offset, bytes)` (see [`move_chunks`](Self::move_chunks)).
    pub(crate) fn ghosts(&self) -> impl Iterator<Item = (usize, usize)> + Clone + '_ {
        self.ghosts.iter().map(|(&o, &(b, _))| (o, b))
    }

    /// The ghosts' marks, `(offset, mark)`: what must pass before each goes.
    pub(crate) fn ghost_marks(
        &self,
    ) -> impl Iterator<Item = (usize, Option<(crate::StreamKey, u64)>)> + '_ {
        self.ghosts.iter().map(|(&o, &(_, m))| (o, m))
    }

    /// `gaps` less the ghosts: where new chunks may be mapped.
    pub(crate) fn without_ghosts(
        &self,
        gaps: Vec<std::ops::Range<usize>>,
    ) -> Vec<std::ops::Range<usize>> {
        if self.ghosts.is_empty() {
            return gaps;
        }
        crate::ranges::subtract(gaps, self.ghosts())
    }
}
