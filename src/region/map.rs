//! Mapping and unmapping: a batch all or nothing, a swap undone on failure,
//! access widened for peers, and one way to give everything back at the
//! close.

use std::sync::Arc;

use super::*;

impl<B: Backend> Region<B> {
    /// Widens every mapped chunk's access with the entries of `extra` it
    /// lacks (a peer device, say), one driver call per chunk, as PyTorch's
    /// `ExpandableSegment::addPeer` does for its mapped handles; later
    /// mappings are the caller's to widen. Work queued on the chunks is
    /// not waited for: access only grows. Returns how many chunks it
    /// granted. On an error the chunks before it keep the new access, and
    /// a second call grants the rest.
    pub(crate) fn grant(&mut self, extra: &[AccessDesc]) -> Result<usize> {
        self.check_poison()?;
        let lacking: Vec<_> = self
            .table
            .iter()
            .filter_map(|(o, e)| {
                let list = crate::location::with_entries(&e.access, extra);
                (list.len() > e.access.len()).then_some((o, e.bytes, e.placement, e.cpu, list))
            })
            .collect();
        let granted = lacking.len();
        let backend = self.backend.clone();
        let (res, table) = self.parts();
        for (o, bytes, placement, cpu, list) in lacking {
            let driver = crate::location::driver_access_for(&list, placement, cpu);
            backend.set_access(res, o, bytes, &driver)?;
            table.record_access(o, list.into(), cpu);
        }
        Ok(granted)
    }

    /// Maps `chunks` in order from `at`, grants each run of one placement
    /// the driver's list of `grants`, and records them in the table with
    /// what `grants` records as their access and whether the host's entry
    /// went to the driver. All or nothing: on an
    /// error the chunks come back unmapped, for the caller to pool or
    /// release; if the undo fails too the region is poisoned, the chunks are
    /// quarantined and none come back.
    pub(crate) fn map_batch(
        &mut self,
        at: usize,
        chunks: Vec<NewChunk<B::Chunk>>,
        grants: &Grants,
    ) -> std::result::Result<(), Failed<B::Chunk>> {
        let backend = self.backend.clone();
        let res = self
            .res
            .as_mut()
            .expect("a region's reservation lives until it closes");
        let mut mapped = 0usize;
        let attempt = (|| {
            for c in &chunks {
                backend.map(res, at + mapped, &c.chunk)?;
                mapped += c.bytes;
            }
            // One access call per run of chunks with the same placement.
            let mut run_at = at;
            for run in chunks.chunk_by(|a, b| a.placement == b.placement) {
                let run_bytes: usize = run.iter().map(|c| c.bytes).sum();
                backend.set_access(res, run_at, run_bytes, &grants.driver(run[0].placement))?;
                run_at += run_bytes;
            }
            Ok(())
        })();
        if let Err(e) = attempt {
            // Nothing can have used the new chunks (no access was granted, or
            // the call granting it failed): unmapping them needs no wait.
            if mapped > 0 {
                if let Err(u) = backend.unmap(res, at, mapped) {
                    self.poison(
                        format!("undoing a failed mapping: unmap failed: {u}"),
                        chunks.into_iter().map(|c| c.chunk),
                    );
                    return Err((e, Vec::new()));
                }
            }
            return Err((e, chunks));
        }
        let mut o = at;
        for c in chunks {
            let mut entry = Entry::new(c.chunk, c.bytes, c.placement);
            entry.access = grants.recorded(c.placement);
            entry.cpu = grants.cpu();
            self.table
                .insert(o, entry)
                .expect("mapped where the table had a hole");
            o += c.bytes;
        }
        self.report_mapped(&[(at, o - at)]);
        self.debug_check_spans();
        Ok(())
    }

    /// Unmaps the chunks at the offsets `gone` (the caller has waited for
    /// their uses) and maps `fresh` (offset, chunk) each with the driver's
    /// list of `grants`, recording what `grants` records as its access.
    /// All or nothing: on an error what was unmapped is mapped back with its
    /// access and what was mapped is unmapped, and the fresh chunks come back
    /// to the caller; if that undo fails the region is poisoned and the fresh
    /// chunks are quarantined (none come back). On success, returns the
    /// entries that went. The table's length is the caller's.
    #[cfg(unix)]
    pub(crate) fn swap(
        &mut self,
        gone: &[usize],
        fresh: Vec<(usize, NewChunk<B::Chunk>)>,
        grants: &Grants,
    ) -> std::result::Result<Vec<Removed<B::Chunk>>, Failed<B::Chunk>> {
        let mut touched: Vec<(usize, usize)> = gone
            .iter()
            .filter_map(|&o| self.table.get(o).map(|e| (o, e.bytes)))
            .collect();
        touched.extend(fresh.iter().map(|(o, c)| (*o, c.bytes)));
        self.with_spans_cut(&touched, |r| r.swap_unhooked(gone, fresh, grants))
    }

    #[cfg(unix)]
    fn swap_unhooked(
        &mut self,
        gone: &[usize],
        fresh: Vec<(usize, NewChunk<B::Chunk>)>,
        grants: &Grants,
    ) -> std::result::Result<Vec<Removed<B::Chunk>>, Failed<B::Chunk>> {
        let backend = self.backend.clone();
        let res = self
            .res
            .as_mut()
            .expect("a region's reservation lives until it closes");
        let table = &mut self.table;
        let mut removed: Vec<(usize, Entry<B::Chunk>)> = Vec::new();
        let mut mapped: Vec<(usize, usize)> = Vec::new();
        let step = (|| {
            for &o in gone {
                let bytes = table.get(o).expect("a chunk the region holds").bytes;
                backend.unmap(res, o, bytes)?;
                removed.push((o, table.remove(o).expect("listed")));
            }
            for (o, c) in &fresh {
                backend.map(res, *o, &c.chunk)?;
                mapped.push((*o, c.bytes));
                backend.set_access(res, *o, c.bytes, &grants.driver(c.placement))?;
            }
            Ok::<(), Error>(())
        })();
        if let Err(e) = step {
            let fresh: Vec<NewChunk<B::Chunk>> = fresh.into_iter().map(|(_, c)| c).collect();
            return match put_back(&*backend, res, table, mapped, removed) {
                Ok(()) => Err((e, fresh)),
                Err(u) => {
                    self.poison(
                        format!("undoing a failed swap: {u}"),
                        fresh.into_iter().map(|c| c.chunk),
                    );
                    Err((e, Vec::new()))
                }
            };
        }
        for (o, c) in fresh {
            let mut entry = Entry::new(c.chunk, c.bytes, c.placement);
            entry.access = grants.recorded(c.placement);
            table
                .insert(o, entry)
                .expect("mapped where the table had a hole");
        }
        Ok(removed)
    }

    /// Unmaps `[offset, offset + bytes)`, which must be whole chunks, in one
    /// driver call, and takes them out of the table. The caller has waited
    /// for every use. On error nothing changed.
    pub(crate) fn unmap(
        &mut self,
        offset: usize,
        bytes: usize,
    ) -> Result<Vec<(usize, Entry<B::Chunk>)>> {
        self.with_spans_cut(&[(offset, bytes)], |r| r.unmap_unhooked(offset, bytes))
    }

    fn unmap_unhooked(
        &mut self,
        offset: usize,
        bytes: usize,
    ) -> Result<Vec<(usize, Entry<B::Chunk>)>> {
        let backend = self.backend.clone();
        backend.unmap(self.res(), offset, bytes)?;
        if let Some(b) = &self.budget {
            b.give(bytes);
        }
        let end = offset + bytes;
        let offsets: Vec<usize> = self
            .table
            .overlapping(offset..end)
            .map(|(o, _)| o)
            .collect();
        Ok(offsets
            .into_iter()
            .map(|o| (o, self.table.remove(o).expect("listed")))
            .collect())
    }

    /// Gives everything back. With `unmap` (the caller has waited for
    /// every use), each chunk is unmapped and, if all went well, handed to
    /// `dispose` (a pool, or the driver), and the reservation freed. Without
    /// it, or if the region is poisoned or an unmap fails, no chunk is
    /// pooled: each is released, and the reservation's own token unmaps what
    /// it still holds as it drops (the CUDA backend waits for the device
    /// first). Quarantined chunks are released last. Idempotent.
    pub(crate) fn close(
        &mut self,
        unmap: bool,
        mut dispose: impl FnMut(B::Chunk, usize, Location),
    ) {
        let backend = self.backend.clone();
        if self.res.is_none() {
            return;
        }
        // The hook hears of every range before anything is unmapped, and
        // of nothing after.
        let all = self.table.reserved();
        self.cut_spans(0, all);
        self.hook = None;
        let Some(mut res) = self.res.take() else {
            return;
        };
        // The memory goes with the region, unmapped or released below.
        if let Some(b) = self.budget.take() {
            b.give(self.table.mapped_bytes());
        }
        let _ = self.table.set_len(0);
        let ok = unmap && self.poisoned.is_none() && self.unmap_everything(&backend, &mut res);
        let gone = self.table.split_off(0);
        if ok {
            for (_, e) in gone {
                dispose(e.chunk, e.bytes, e.placement);
            }
            if let Err(e) = backend.free(res) {
                tracing::error!(error = %e, "vmmbuf: freeing a reservation failed");
            }
        } else {
            drop(res);
            for (_, e) in gone {
                let _ = backend.release(e.chunk);
            }
        }
        for c in self.quarantine.drain(..) {
            let _ = backend.release(c);
        }
    }

    /// Unmaps every moved chunk's old address and every run of chunks (one
    /// call per run of adjacent chunks: the cost is per call and mapping,
    /// and one call unmaps several whole mappings, so a buffer's chunks,
    /// which tile its capacity, go in one). False at the first failure
    /// (logged).
    fn unmap_everything(&mut self, backend: &Arc<B>, res: &mut B::Reservation) -> bool {
        for (o, (b, _)) in std::mem::take(&mut self.ghosts) {
            if let Err(e) = backend.unmap(res, o, b) {
                tracing::error!(error = %e, "vmmbuf: unmapping a moved chunk's old address while closing failed");
                return false;
            }
        }
        for (o, b) in self.table.runs() {
            if let Err(e) = backend.unmap(res, o, b) {
                tracing::error!(error = %e, "vmmbuf: unmapping a chunk while closing failed");
                return false;
            }
        }
        true
    }
}

/// A failed swap put back as it was: what was `mapped` unmapped, what was
/// `removed` mapped again with its access and back in the `table`, last
/// first. The first failure of that undo (the caller poisons the region).
#[cfg(unix)]
fn put_back<B: Backend>(
    backend: &B,
    res: &mut B::Reservation,
    table: &mut ChunkTable<B::Chunk>,
    mapped: Vec<(usize, usize)>,
    removed: Vec<Removed<B::Chunk>>,
) -> Result<()> {
    let mut undo = Ok(());
    for (o, bytes) in mapped.into_iter().rev() {
        undo = undo.and(backend.unmap(res, o, bytes));
    }
    for (o, entry) in removed.into_iter().rev() {
        let list = entry.driver_access();
        undo = undo
            .and_then(|()| backend.map(res, o, &entry.chunk))
            .and_then(|()| backend.set_access(res, o, entry.bytes, &list));
        table.insert(o, entry).expect("it was there");
    }
    undo
}
