//! Deferred free fences ([`ArenaDesc::defer_free_fences`](super::ArenaDesc)).
//!
//! A free on its own stream records no event: it takes a number on the
//! stream's order (`order::stamp`) and owes a fence. The block is its
//! stream's to reuse at once, as any pending block is; other streams wait
//! until a fence recorded on that stream *after* the free has passed. Such a
//! fence (a "cover") is recorded at a later call on the same stream, the
//! only time the stream is known to be alive: once `BATCH` frees are owed,
//! or at once when another stream missed (it may want the memory). One
//! event then stands for many frees, as PyTorch's cache records none for a
//! free on the allocation's own stream.
//!
//! Where the arena must know every use has finished and a stream's frees
//! have no cover yet (a wait for pending frees on out of memory, a sleep,
//! the arena's drop), it synchronises the device: that covers streams
//! destroyed since, which no fence could be recorded on.
//!
//! Correctness rests on the numbering: a cover numbered `c` on stream `K`
//! was recorded after every free on `K` numbered below `c`, so once it has
//! passed, so has all work those frees were ordered after.
#![deny(unsafe_code)]

use std::collections::{HashMap, VecDeque};

use crate::backend::Backend;
use crate::error::Result;
use crate::order::{FenceSet, Stamped, StreamKey};

/// Frees owed on one stream before the next call on it records a cover.
pub(super) const BATCH: usize = 32;

/// Bytes owed on one stream before the next call on it records a cover:
/// large frees are what other streams wait for.
pub(super) const BATCH_BYTES: usize = 16 << 20;

/// What a free leaves to wait for on one stream: a recorded fence, or a
/// fence owed (a cover with a larger number will stand for it).
#[derive(Debug)]
pub(crate) enum Mark<F> {
    /// A fence recorded when the free was made (or a use's).
    Fence(F),
    /// A free numbered in its stream's order, with no fence yet.
    Owed,
}

/// Every stream's debts.
#[derive(Debug)]
pub(super) struct Owed<F> {
    streams: HashMap<StreamKey, Debt<F>>,
}

impl<F> Default for Owed<F> {
    fn default() -> Self {
        Self {
            streams: HashMap::new(),
        }
    }
}

/// One stream's debts.
#[derive(Debug)]
struct Debt<F> {
    /// Frees owed since the last cover, and their bytes.
    uncovered: usize,
    uncovered_bytes: usize,
    /// Another stream missed since the last cover: cover at the next call.
    wanted: bool,
    /// Covers recorded and not yet seen to pass, oldest first.
    covers: VecDeque<Stamped<F>>,
    /// Every free on the stream numbered below this has passed.
    passed_below: u64,
}

impl<F> Default for Debt<F> {
    fn default() -> Self {
        Self {
            uncovered: 0,
            uncovered_bytes: 0,
            wanted: false,
            covers: VecDeque::new(),
            passed_below: 0,
        }
    }
}

impl<F> Owed<F> {
    /// Counts a free of `bytes` owed on `key` (numbered by the caller).
    pub(super) fn owe(&mut self, key: StreamKey, bytes: usize) {
        let d = self.streams.entry(key).or_default();
        d.uncovered += 1;
        d.uncovered_bytes += bytes;
    }

    /// Whether a call on `key` should record a cover now.
    pub(super) fn needs_cover(&self, key: StreamKey) -> bool {
        self.streams.get(&key).is_some_and(|d| {
            d.uncovered > 0
                && (d.uncovered >= BATCH || d.uncovered_bytes >= BATCH_BYTES || d.wanted)
        })
    }

    /// Whether `key` owes any free no cover stands for yet.
    pub(super) fn needs_any_cover(&self, key: StreamKey) -> bool {
        self.streams.get(&key).is_some_and(|d| d.uncovered > 0)
    }

    /// Keeps `cover`, recorded on its stream after the frees owed there.
    pub(super) fn cover(&mut self, cover: Stamped<F>) {
        let d = self.streams.entry(cover.key).or_default();
        d.uncovered = 0;
        d.uncovered_bytes = 0;
        d.wanted = false;
        d.covers.push_back(cover);
    }

    /// `cover`, recorded on its stream after the frees owed there, has
    /// been waited for: they have passed.
    pub(super) fn cover_passed(&mut self, cover: Stamped<F>) {
        let d = self.streams.entry(cover.key).or_default();
        d.uncovered = 0;
        d.uncovered_bytes = 0;
        d.wanted = false;
        d.passed_below = d.passed_below.max(cover.seq);
        d.covers.retain(|c| c.seq > cover.seq);
    }

    /// A stream other than `key` found no block: every stream with frees
    /// owed covers them at its next call.
    pub(super) fn want_all_but(&mut self, key: StreamKey) {
        for (k, d) in &mut self.streams {
            if *k != key && d.uncovered > 0 {
                d.wanted = true;
            }
        }
    }

    /// Whether the free numbered `seq` on `key` has passed: it has once a
    /// cover numbered above it has. Queries the oldest covers only (they
    /// pass in order).
    pub(super) fn done<B: Backend<Fence = F>>(
        &mut self,
        backend: &B,
        key: StreamKey,
        seq: u64,
    ) -> bool {
        let Some(d) = self.streams.get_mut(&key) else {
            return false;
        };
        while d.passed_below <= seq {
            let Some(c) = d.covers.front() else {
                return false;
            };
            if !backend.fence_done(&c.fence).unwrap_or(false) {
                return false;
            }
            d.passed_below = d.passed_below.max(c.seq);
            d.covers.pop_front();
        }
        true
    }

    /// Waits until the free numbered `seq` on `key` has passed: on the
    /// first cover numbered above it, or, if none was recorded yet, on the
    /// whole device.
    pub(super) fn wait<B: Backend<Fence = F>>(
        &mut self,
        backend: &B,
        key: StreamKey,
        seq: u64,
    ) -> Result<()> {
        if self.done(backend, key, seq) {
            return Ok(());
        }
        let d = self.streams.entry(key).or_default();
        if let Some(i) = d.covers.iter().position(|c| c.seq > seq) {
            backend.wait(&d.covers[i].fence)?;
            d.passed_below = d.passed_below.max(d.covers[i].seq);
            d.covers.drain(..=i);
            return Ok(());
        }
        self.synchronize(backend)
    }

    /// Whether some stream owes frees no cover stands for yet.
    pub(super) fn any_uncovered(&self) -> bool {
        self.streams.values().any(|d| d.uncovered > 0)
    }

    /// Waits for the whole device: every free owed so far has passed.
    pub(super) fn synchronize<B: Backend<Fence = F>>(&mut self, backend: &B) -> Result<()> {
        // Numbers taken before the synchronisation starts: frees numbered
        // up to them were queued before it.
        let marks: Vec<(StreamKey, u64)> = self
            .streams
            .keys()
            .map(|&k| (k, crate::order::current(k)))
            .collect();
        backend.synchronize()?;
        for (k, m) in marks {
            let d = self.streams.get_mut(&k).expect("listed");
            d.passed_below = d.passed_below.max(m + 1);
            d.covers.retain(|c| c.seq > m);
            d.uncovered = 0;
            d.uncovered_bytes = 0;
            d.uncovered_bytes = 0;
            d.wanted = false;
        }
        Ok(())
    }

    /// Whether one mark has passed.
    pub(super) fn stamp_done<B: Backend<Fence = F>>(
        &mut self,
        backend: &B,
        x: &Stamped<Mark<F>>,
    ) -> bool {
        match &x.fence {
            Mark::Fence(f) => backend.fence_done(f).unwrap_or(false),
            Mark::Owed => self.done(backend, x.key, x.seq),
        }
    }

    /// Waits for every mark of `set`.
    pub(super) fn wait_set<B: Backend<Fence = F>>(
        &mut self,
        backend: &B,
        set: &FenceSet<Mark<F>>,
    ) -> Result<()> {
        for x in set.iter() {
            match &x.fence {
                Mark::Fence(f) => backend.wait(f)?,
                Mark::Owed => self.wait(backend, x.key, x.seq)?,
            }
        }
        Ok(())
    }
}
