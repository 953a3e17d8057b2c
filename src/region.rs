//! [`Region`]: one reservation and the chunks mapped in it, with the rules
//! every user of mapped memory shares: mapping a batch all or nothing,
//! unmapping, poisoning when an undo fails (the first reason stays; chunks
//! that may still be mapped are quarantined, never pooled), and one way to
//! give everything back, and the shared budget's count of what is mapped
//! (taken before chunks are made, given back as they unmap). Buffers,
//! arenas and importers hold a `Region`; what
//! differs between them (growth, free blocks, generations) stays with them.
#![deny(unsafe_code)]

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::hook::{MapHook, MappedRange};
use crate::location::{AccessDesc, Grants, Location};
use crate::pool::{Budget, BudgetHold};
use crate::table::{ChunkTable, Entry};

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

/// A failed mapping's error, and the chunks that came back unmapped (none
/// if the undo failed too and they were quarantined).
pub(crate) type Failed<C> = (Error, Vec<NewChunk<C>>);

/// A chunk a swap unmapped: its offset and table entry.
#[cfg(unix)]
pub(crate) type Removed<C> = (usize, Entry<C>);

/// A chunk to map a second time ([`Region::move_chunks`]): `(from, to,
/// the mark its old address waits for before it is unmapped)`.
pub(crate) type Move = (usize, usize, Option<(crate::StreamKey, u64)>);

/// A chunk about to be mapped: the chunk, its bytes and where it lives.
pub(crate) struct NewChunk<C> {
    pub(crate) chunk: C,
    pub(crate) bytes: usize,
    pub(crate) placement: Location,
}

/// One reservation of a backend and its chunk table.
pub(crate) struct Region<B: Backend> {
    backend: Arc<B>,
    /// `None` once closed.
    res: Option<B::Reservation>,
    /// The mapped chunks (holes allowed).
    pub(crate) table: ChunkTable<B::Chunk>,
    /// Set when a failure could not be undone: every later call answers
    /// [`Error::Poisoned`] with the first reason.
    poisoned: Option<String>,
    /// Chunks that may still be mapped: released only after the reservation
    /// is gone, never pooled.
    quarantine: Vec<B::Chunk>,
    /// The hook told of mappings, and the ranges it was told are mapped
    /// (offset -> bytes, placement): see [`crate::hook`].
    hook: Option<Arc<dyn MapHook>>,
    spans: BTreeMap<usize, (usize, Location)>,
    /// The budget shared with other regions: a mapping takes from it
    /// ([`hold`](Self::hold), before the chunks are made) and an unmapping
    /// or the close gives back.
    budget: Option<Arc<Budget>>,
    /// Ranges still mapped at the backend whose chunk was moved to another
    /// offset ([`move_chunks`](Self::move_chunks)) while work may still use
    /// the old address: offset -> (bytes, the mark after which they may
    /// go: a stream and a number in its order, `None` once nothing may use
    /// them). Not in the table (their memory is counted once, where it
    /// moved); no mapping goes there until [`unmap_ghosts`](Self::unmap_ghosts).
    ghosts: BTreeMap<usize, (usize, Option<(crate::StreamKey, u64)>)>,
}

impl<B: Backend> Region<B> {
    /// Reserves `bytes` aligned to `align`, with a table of `granularity`.
    pub(crate) fn reserve(
        backend: &Arc<B>,
        bytes: usize,
        align: usize,
        granularity: usize,
    ) -> Result<Self> {
        let table = ChunkTable::new(bytes, granularity)?;
        let res = backend.reserve(bytes, align)?;
        Ok(Self {
            backend: backend.clone(),
            res: Some(res),
            table,
            poisoned: None,
            quarantine: Vec::new(),
            hook: None,
            spans: BTreeMap::new(),
            budget: None,
            ghosts: BTreeMap::new(),
        })
    }

    /// Counts this region's mappings in `budget` from now on (set before
    /// anything is mapped).
    pub(crate) fn set_budget(&mut self, budget: Option<Arc<Budget>>) {
        debug_assert!(self.table.mapped_bytes() == 0, "a budget set after mapping");
        self.budget = budget;
    }

    /// The shared budget this region's mappings count in.
    pub(crate) fn budget(&self) -> Option<&Arc<Budget>> {
        self.budget.as_ref()
    }

    /// Holds `bytes` of the budget for a mapping about to be made (before
    /// its chunks are): `None` if they do not fit. Kept
    /// ([`BudgetHold::keep`]) once the mapping succeeded, they are this
    /// region's, given back as it unmaps them or closes; else the hold
    /// gives them back as it drops. Without a budget, always a hold.
    pub(crate) fn hold(&self, bytes: usize) -> Option<BudgetHold> {
        Budget::hold(self.budget.as_ref(), bytes)
    }

    /// The reservation's first address.
    pub(crate) fn base(&self) -> u64 {
        self.backend.base(self.res_ref())
    }

    pub(crate) fn res(&mut self) -> &mut B::Reservation {
        self.res
            .as_mut()
            .expect("a region's reservation lives until it closes")
    }

    pub(crate) fn res_ref(&self) -> &B::Reservation {
        self.res
            .as_ref()
            .expect("a region's reservation lives until it closes")
    }

    /// The reservation and the table at once (for the mover and CPU grants).
    pub(crate) fn parts(&mut self) -> (&mut B::Reservation, &mut ChunkTable<B::Chunk>) {
        (
            self.res
                .as_mut()
                .expect("a region's reservation lives until it closes"),
            &mut self.table,
        )
    }

    /// Replaces the hook: the old one is told every range it knows is
    /// unmapping, the new one every mapped run (one per placement) as
    /// mapped.
    pub(crate) fn set_hook(&mut self, hook: Option<Arc<dyn MapHook>>) {
        let all = self.table.reserved();
        self.cut_spans(0, all);
        self.hook = hook;
        let runs = self.table.runs();
        self.report_mapped(&runs);
        self.debug_check_spans();
    }

    /// Whether a hook is set: then only whole reported ranges may be
    /// unmapped while their neighbours may be in use (see [`Self::span_of`]).
    pub(crate) fn has_hook(&self) -> bool {
        self.hook.is_some()
    }

    /// Where the arena's free blocks must not join, nor a block handed out
    /// straddle: with a hook, every chunk's start (a hook registers chunk
    /// by chunk, see [`crate::hook`]); none without.
    pub(crate) fn walls(&self) -> ChunkWalls<'_, B::Chunk> {
        ChunkWalls(self.hook.is_some().then_some(&self.table))
    }

    /// The reported range `(offset, bytes)` holding `offset`, with a hook.
    pub(crate) fn span_of(&self, offset: usize) -> Option<(usize, usize)> {
        self.spans
            .range(..=offset)
            .next_back()
            .filter(|(&s, &(b, _))| s + b > offset)
            .map(|(&s, &(b, _))| (s, b))
    }

    /// `offset`, or the end of the reported range it falls strictly inside:
    /// where a release from `offset` up may start without cutting a range.
    pub(crate) fn span_boundary_at_or_after(&self, offset: usize) -> usize {
        match self.span_of(offset) {
            Some((s, b)) if s < offset => s + b,
            _ => offset,
        }
    }

    /// Tells the hook that the chunks mapped in each `(offset, bytes)` are
    /// mapped, one range per chunk (one physical allocation: an NCCL
    /// registration must not span two, see [`crate::hook`]), and records
    /// them.
    fn report_mapped(&mut self, ranges: &[(usize, usize)]) {
        let Some(hook) = self.hook.clone() else {
            return;
        };
        let base = self.base();
        for &(o, b) in ranges {
            let end = o.saturating_add(b);
            let chunks: Vec<(usize, usize, Location)> = self
                .table
                .overlapping(o..end)
                .map(|(k, e)| {
                    let at = k.max(o);
                    (at, (k + e.bytes).min(end) - at, e.placement)
                })
                .collect();
            for (at, bytes, placement) in chunks {
                self.spans.insert(at, (bytes, placement));
                call_hook("mapped", || {
                    hook.mapped(MappedRange::new(base + at as u64, bytes, placement))
                });
            }
        }
    }

    /// Tells the hook that every reported range touching
    /// `[offset, offset + bytes)` is unmapping, forgets them, and returns
    /// them `(offset, bytes)`, for [`Self::report_mapped`] to report what
    /// of them stays mapped afterwards.
    fn cut_spans(&mut self, offset: usize, bytes: usize) -> Vec<(usize, usize)> {
        let Some(hook) = self.hook.clone() else {
            return Vec::new();
        };
        let end = offset.saturating_add(bytes);
        let first = self.span_of(offset).map_or(offset, |(s, _)| s);
        let cut: Vec<(usize, usize, Location)> = self
            .spans
            .range(first..end.max(first))
            .map(|(&s, &(b, p))| (s, b, p))
            .filter(|&(s, b, _)| s + b > offset && s < end)
            .collect();
        let base = self.base();
        for &(s, b, p) in &cut {
            self.spans.remove(&s);
            call_hook("unmapping", || {
                hook.unmapping(MappedRange::new(base + s as u64, b, p))
            });
        }
        cut.into_iter().map(|(s, b, _)| (s, b)).collect()
    }

    /// Runs `op` with the reported ranges touching each of `ranges` cut
    /// first and what of them is mapped afterwards reported again (whether
    /// `op` succeeded or not).
    pub(crate) fn with_spans_cut<T>(
        &mut self,
        ranges: &[(usize, usize)],
        op: impl FnOnce(&mut Self) -> T,
    ) -> T {
        let mut cut = Vec::new();
        for &(o, b) in ranges {
            cut.extend(self.cut_spans(o, b));
        }
        let r = op(self);
        if self.hook.is_some() {
            // What was cut and what `op` may have mapped: overlapping
            // pieces joined, touching ones kept apart (each reported range
            // keeps its own bounds).
            cut.extend_from_slice(ranges);
            cut.sort_unstable();
            let mut again: Vec<(usize, usize)> = Vec::new();
            for (o, b) in cut {
                match again.last_mut() {
                    Some(l) if o < l.0 + l.1 => l.1 = l.1.max(o + b - l.0),
                    _ => again.push((o, b)),
                }
            }
            self.report_mapped(&again);
        }
        self.debug_check_spans();
        r
    }

    /// With a hook: the reported ranges are exactly the mapped bytes, each
    /// of one placement, none overlapping (debug builds).
    fn debug_check_spans(&self) {
        if cfg!(debug_assertions) && self.hook.is_some() {
            let mut at = 0;
            let mut total = 0;
            for (&s, &(b, p)) in &self.spans {
                assert!(s >= at, "reported ranges overlap at {s:#x}");
                for (_, e) in self.table.overlapping(s..s + b) {
                    assert_eq!(e.placement, p, "a reported range mixes placements");
                }
                at = s + b;
                total += b;
            }
            assert_eq!(
                total,
                self.table.mapped_bytes(),
                "reported ranges != mapped bytes"
            );
        }
    }

    /// [`Error::Poisoned`] once a failure could not be undone.
    pub(crate) fn check_poison(&self) -> Result<()> {
        match &self.poisoned {
            Some(reason) => Err(Error::Poisoned {
                reason: reason.clone(),
            }),
            None => Ok(()),
        }
    }

    /// The one rule for a failed undo: the region answers
    /// [`Error::Poisoned`] from now on (the first reason stays), and `stuck`
    /// (chunks that may still be mapped) is kept out of every pool and
    /// released only after the reservation is gone.
    pub(crate) fn poison(&mut self, what: String, stuck: impl IntoIterator<Item = B::Chunk>) {
        tracing::error!(reason = %what, "vmmbuf: poisoned");
        self.quarantine.extend(stuck);
        self.poisoned.get_or_insert(what);
    }

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
        for (to, bytes) in adjacent_runs(mapped[done..].iter().map(|m| (m.0, m.1))) {
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
        for (o, bytes) in adjacent_runs(ghosts) {
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

/// Calls a user's hook: a panic in it is caught and logged, never carried
/// through the arena or buffer (whose lock is held, and whose bookkeeping is
/// half way through an operation).
fn call_hook(what: &str, f: impl FnOnce()) {
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err() {
        tracing::error!(
            call = what,
            "vmmbuf: a map hook panicked; the panic was caught"
        );
    }
}

/// Offsets free blocks must not join across, and that no block handed out
/// may straddle: the starts of the chunks of a region whose memory a map
/// hook registers chunk by chunk (an NCCL registration holds one physical
/// allocation; a tensor across two lies in none, and NCCL then treats it
/// as unregistered on that rank alone).
pub(crate) trait Walls {
    /// Whether a wall stands at `offset`.
    fn at(&self, offset: usize) -> bool;
    /// The first wall strictly between `start` and `end`.
    fn first_inside(&self, start: usize, end: usize) -> Option<usize>;
}

/// The walls of [`Region::walls`]: chunk starts, or none.
pub(crate) struct ChunkWalls<'a, C>(Option<&'a ChunkTable<C>>);

impl<C> Walls for ChunkWalls<'_, C> {
    #[inline]
    fn at(&self, offset: usize) -> bool {
        self.0.is_some_and(|t| t.starts_at(offset))
    }
    #[inline]
    fn first_inside(&self, start: usize, end: usize) -> Option<usize> {
        self.0.and_then(|t| t.start_between(start, end))
    }
}

impl<B: Backend> Drop for Region<B> {
    /// A region its owner did not close: nothing is known to have finished
    /// with its memory, so nothing is unmapped by hand or pooled.
    fn drop(&mut self) {
        self.close(false, |_, _, _| {});
    }
}

impl<B: Backend> std::fmt::Debug for Region<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("chunks", &self.table.chunk_count())
            .field("mapped", &self.table.mapped_bytes())
            .field("poisoned", &self.poisoned)
            .finish()
    }
}

/// `ranges` (`(offset, bytes)`, in offset order) with each run of adjacent
/// ones joined: one `(offset, bytes)` a run, for one driver call a run.
fn adjacent_runs(ranges: impl IntoIterator<Item = (usize, usize)>) -> Vec<(usize, usize)> {
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for (o, bytes) in ranges {
        match runs.last_mut() {
            Some(r) if r.0 + r.1 == o => r.1 += bytes,
            _ => runs.push((o, bytes)),
        }
    }
    runs
}
