//! Undoing a move that failed part way: every group put back where it was
//! (last first), the staged chunks given back, and what could not be undone
//! named, with the chunks that may still be mapped, for the caller to
//! poison the region.

use super::*;

impl<B: Backend> Pipeline<'_, '_, B> {
    /// Step 4, on failure: every group is put back as it was. The
    /// temporary range is unmapped group by group; a new chunk staged there
    /// and not swapped is then pooled (released if its unmap failed); old
    /// chunks staged there (a source) stay in the table, and the temporary
    /// token unmaps them as it drops. Chunks an undo could not put back are
    /// named, with why, for the region to quarantine.
    pub(super) fn undo(mut self, failure: Failed<B::Chunk>) -> MoveFailure<B::Chunk> {
        // Copies may still be in flight into the temporary mapping.
        let _ = self.mover.backend.wait_copies();
        let mut stuck = Stuck::default();
        let error = match failure {
            Failed::Before(e) => e,
            Failed::Swap { error, stage, c } => {
                self.undo_group(stage, c, &mut stuck);
                error
            }
        };
        self.dispose_staged();
        let Self {
            mover,
            res,
            table,
            tmp,
            done,
            ..
        } = self;
        // If an unmap failed, the token unmaps what it holds as it drops.
        let _ = mover.backend.free(tmp);
        undo_done(mover, res, table, done, &mut stuck);
        tracing::debug!(error = %error, "vmmbuf: migration failed and was undone");
        MoveFailure {
            error,
            poison: stuck.why.map(|w| (w, stuck.chunks)),
        }
    }

    /// The group whose swap failed at `stage`: its old chunks (still in
    /// the table) put back, its new one disposed of, or both stuck.
    fn undo_group(&mut self, stage: SwapStage, c: Staged<B::Chunk>, stuck: &mut Stuck<B::Chunk>) {
        let olds: Vec<(usize, &B::Chunk)> = self
            .table
            .overlapping(c.offset..c.offset + c.bytes)
            .map(|(o, e)| (o, &e.chunk))
            .collect();
        let list = self
            .table
            .get(c.offset)
            .expect("a group starts at a chunk")
            .driver_access();
        let backend = self.mover.backend;
        match undo_swap(backend, self.res, c.offset, c.bytes, &olds, &list, stage) {
            Ok(()) => self.mover.dispose(c.chunk, c.bytes, c.to),
            Err(u) => stuck.note(
                format!("undoing a failed migration at {:#x}: {u}", c.offset),
                [c.chunk],
            ),
        }
    }

    /// The temporary range unmapped, and the staged new chunks disposed of
    /// (a chunk whose temporary mapping could not be unmapped, and that is
    /// not a group's old one, is released to the driver instead).
    fn dispose_staged(&mut self) {
        let backend = self.mover.backend;
        let mut stuck_at_tmp = Vec::with_capacity(self.tmp_mapped.len());
        for (k, &mapped) in self.tmp_mapped.iter().enumerate() {
            stuck_at_tmp.push(
                mapped > 0
                    && backend
                        .unmap(&mut self.tmp, self.spans[k].0, mapped)
                        .is_err(),
            );
        }
        for (k, c) in std::mem::take(&mut self.staged).into_iter().enumerate() {
            let Some(c) = c else { continue };
            if stuck_at_tmp[k] && !self.source[k] {
                let _ = backend.release(c.chunk);
            } else {
                self.mover.dispose(c.chunk, c.bytes, c.to);
            }
        }
    }
}

/// Chunks an undo could not put back, and why (the first failure).
struct Stuck<C> {
    chunks: Vec<C>,
    why: Option<String>,
}

impl<C> Default for Stuck<C> {
    fn default() -> Self {
        Self {
            chunks: Vec::new(),
            why: None,
        }
    }
}

impl<C> Stuck<C> {
    fn note(&mut self, why: String, chunks: impl IntoIterator<Item = C>) {
        self.why.get_or_insert(why);
        self.chunks.extend(chunks);
    }
}

/// The groups swapped in, last first: their old chunks put back (the new
/// ones disposed of), or stuck.
fn undo_done<B: Backend>(
    mover: &Mover<'_, B>,
    res: &mut B::Reservation,
    table: &mut ChunkTable<B::Chunk>,
    done: Vec<Swapped<B::Chunk>>,
    stuck: &mut Stuck<B::Chunk>,
) {
    for (o, bytes, old) in done.into_iter().rev() {
        let list = old[0].1.driver_access();
        let olds: Vec<(usize, &B::Chunk)> = old.iter().map(|(k, e)| (*k, &e.chunk)).collect();
        match undo_swap(
            mover.backend,
            res,
            o,
            bytes,
            &olds,
            &list,
            SwapStage::Granting,
        ) {
            Ok(()) => {
                let new = table.replace(o, bytes, old);
                for (_, e) in new {
                    mover.dispose(e.chunk, e.bytes, e.placement);
                }
            }
            Err(u) => stuck.note(
                format!("undoing a failed migration at {o:#x}: {u}"),
                old.into_iter().map(|(_, e)| e.chunk),
            ),
        }
    }
}

/// Puts the old chunks `olds` (offset, chunk) back over `[offset, offset +
/// bytes)` after a swap that got to `stage`, granting `old_access`.
fn undo_swap<B: Backend>(
    backend: &B,
    res: &mut B::Reservation,
    offset: usize,
    bytes: usize,
    olds: &[(usize, &B::Chunk)],
    old_access: &[AccessDesc],
    stage: SwapStage,
) -> Result<()> {
    if stage == SwapStage::Granting {
        backend.unmap(res, offset, bytes)?;
    }
    if stage != SwapStage::Unmapping {
        for (o, c) in olds {
            backend.map(res, *o, c)?;
        }
        backend.set_access(res, offset, bytes, old_access)?;
    }
    Ok(())
}
