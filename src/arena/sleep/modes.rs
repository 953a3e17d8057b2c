//! What every sleep does under the arena's lock (the streams' work waited
//! for, whole free chunks given back, then its mode's work) and the pieces
//! the modes share. Each mode's own work is in a file of its own: `keep.rs`,
//! `stash.rs`, `pages.rs` (pageable and disk), `unmapped.rs` (every mode that
//! gives device memory back, and their wake).

use std::time::Instant;

use super::*;

impl<B: Backend> Shared<B> {
    /// A sleep in `mode`, under the arena's lock: the streams' work and the
    /// pending frees waited for, whole free chunks given back, then what
    /// `mode` does with the rest (see [`SleepMode`]); its figures in `r`.
    /// On an error the arena's counts are made true again.
    pub(super) fn sleep_locked<S: ArenaStream<B>>(
        &self,
        st: &mut State<B>,
        streams: &[S],
        mode: SleepMode,
        piece: usize,
        r: &mut SleepReport,
    ) -> Result<()> {
        let device_before = st.region.table.mapped_bytes() - st.region.table.host_bytes();
        let t = Instant::now();
        let freed = self.quiesce(st, streams)?;
        r.free_bytes = freed.iter().map(|x| x.1).sum();
        // A backup kept past the last wake is not readable once a sleep has
        // begun: the sleep copies into it afresh (a pageable one reuses its
        // buffers).
        st.sleep.backup_kept = false;
        r.wait_time = t.elapsed();
        let _span = tracing::debug_span!("vmmbuf.arena.sleep", mode = %mode).entered();
        let done = match mode {
            SleepMode::Keep => self.sleep_keep(st, piece, r).map(|()| {
                st.sleep
                    .asleep
                    .get_or_insert_with(|| Asleep::new(SleepMode::Keep, piece));
            }),
            _ => self.sleep_unmapping(st, mode, piece, r),
        };
        if done.is_ok() {
            r.device_bytes = device_before;
            if let Some(a) = st.sleep.asleep.as_mut() {
                a.freed.extend(freed);
            }
        }
        self.rebuild_split(st);
        self.count(st);
        done
    }

    /// Waits for `streams`' work, the uses recorded on live allocations and
    /// the pending frees; then gives whole free chunks to the pool and
    /// returns their ranges, `(offset, bytes)`.
    pub(super) fn quiesce<S: ArenaStream<B>>(
        &self,
        st: &mut State<B>,
        streams: &[S],
    ) -> Result<Vec<(usize, usize)>> {
        let backend = &*self.backend;
        // Each stream's fence, numbered: it also covers the frees owed on
        // the stream so far (no device synchronisation for those).
        let fences = streams
            .iter()
            .map(|s| crate::order::record(s.key(), || s.fence(backend)))
            .collect::<Result<Vec<_>>>()?;
        for f in &fences {
            backend.wait(&f.fence)?;
        }
        for f in fences {
            st.heap.cover_passed(f);
        }
        self.wait_live_uses(st)?;
        self.wait_pending_frees(st)?;
        self.release_free_ranges(st)
    }

    /// The piece size `desc` asks for: rounded to the granularity, never
    /// under the arena's chunk.
    pub(super) fn piece_of(&self, desc: &SleepDesc) -> Result<usize> {
        Ok(
            crate::plan::round_up(desc.max_piece_bytes.max(1), self.granularity)
                .ok_or_else(|| Error::invalid("max_piece_bytes overflows"))?
                .max(self.chunk_bytes),
        )
    }

    pub(super) fn mover(&self) -> Mover<'_, B> {
        Mover {
            backend: &*self.backend,
            granularity: self.granularity,
            source: &*self.pool,
            shareable: false,
            release_old: false,
            release_joined: true,
        }
    }

    pub(super) fn rebuild_split(&self, st: &mut State<B>) {
        // What graphs hold free counts as allocated, as it does elsewhere.
        let held: Vec<(usize, usize)> = st.heap.graph_held().collect();
        st.split = SplitCount::rebuild(&st.region.table, st.heap.live_ranges().chain(held));
    }
}
