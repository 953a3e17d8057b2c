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

use std::collections::VecDeque;

use crate::backend::Backend;
use crate::error::Result;
use crate::order::{FenceSet, NotYet, Stamped, StreamKey};

/// Frees owed on one stream before the next call on it records a cover.
pub(in crate::arena) const BATCH: usize = 32;

/// A free block of at least this many bytes that an owed free joined is
/// covered at once (`Allocation`'s drop): all of it would otherwise wait for
/// the stream's next call before another stream may take it. Replaying
/// FSDP's trace, 16 MiB (with a cover also at every 16 MiB owed) recorded
/// a fence for 2 frees in 5; 64 MiB alone, 1 in 5, with the same memory
/// taken (`lag::two_streams_with_a_lagging_gpu_cost_little`).
pub(in crate::arena) const JOINED_BYTES: usize = 64 << 20;

/// Covers kept per stream: a newer one replaces the newest, which stands
/// for nothing the newer one does not (recorded later on the same stream,
/// it covers every free the other did). Without a bound, a stream no other
/// stream waits for (nothing asks whether its covers passed) would keep
/// one event per cover for ever.
const MAX_COVERS: usize = 16;

/// What a free leaves to wait for on one stream: a recorded fence, or a
/// fence owed (a cover with a larger number will stand for it).
#[derive(Debug)]
pub(crate) enum Mark<F> {
    /// A fence recorded when the free was made (or a use's).
    Fence(F),
    /// A free numbered in its stream's order, with no fence yet.
    Owed,
}

/// A mark owed on `key`, numbered `seq` in its order: a cover recorded on
/// `key` with a larger number stands for it.
pub(crate) fn owed_at<F>(key: StreamKey, seq: u64) -> Stamped<Mark<F>> {
    Stamped {
        key,
        seq,
        fence: Mark::Owed,
    }
}

/// Every stream's debts.
#[derive(Debug)]
pub(in crate::arena) struct Owed<F> {
    /// Consulted at every alloc and free of an arena that defers, so keyed
    /// with the quick hasher (with SipHash, hashing was 9% of the
    /// instructions of a replay of the FSDP trace).
    streams: crate::hash::QuickMap<StreamKey, Debt<F>>,
}

impl<F> Default for Owed<F> {
    fn default() -> Self {
        Self {
            streams: Default::default(),
        }
    }
}

/// One stream's debts.
#[derive(Debug)]
struct Debt<F> {
    /// Frees owed since the last cover.
    uncovered: usize,
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
            wanted: false,
            covers: VecDeque::new(),
            passed_below: 0,
        }
    }
}

impl<F> Owed<F> {
    /// Counts a free owed on `key` (numbered by the caller).
    pub(in crate::arena) fn owe(&mut self, key: StreamKey) {
        self.streams.entry(key).or_default().uncovered += 1;
    }

    /// Counts a free owed on `key` that no batch should wait for: the next
    /// call on `key` covers it (a free whose fence could not be recorded,
    /// or made while the stream could take none).
    pub(in crate::arena) fn owe_wanted(&mut self, key: StreamKey) {
        let d = self.streams.entry(key).or_default();
        d.uncovered += 1;
        d.wanted = true;
    }

    /// Whether a call on `key` should record a cover now.
    #[inline]
    pub(in crate::arena) fn needs_cover(&self, key: StreamKey) -> bool {
        // Most arenas never owe a free: no lookup then.
        !self.streams.is_empty()
            && self
                .streams
                .get(&key)
                .is_some_and(|d| d.uncovered > 0 && (d.uncovered >= BATCH || d.wanted))
    }

    /// Whether a wait for the free numbered `seq` on `key` needs no device
    /// synchronisation: it has passed, or a cover numbered above it was
    /// recorded (a wait on that one event suffices).
    pub(in crate::arena) fn covered(&self, key: StreamKey, seq: u64) -> bool {
        self.streams
            .get(&key)
            .is_some_and(|d| d.passed_below > seq || d.covers.back().is_some_and(|c| c.seq > seq))
    }

    /// Whether `key` owes any free no cover stands for yet.
    pub(in crate::arena) fn needs_any_cover(&self, key: StreamKey) -> bool {
        self.streams.get(&key).is_some_and(|d| d.uncovered > 0)
    }

    /// Keeps `cover`, recorded on its stream after the frees owed there.
    pub(in crate::arena) fn cover(&mut self, cover: Stamped<F>) {
        let d = self.streams.entry(cover.key).or_default();
        d.uncovered = 0;
        d.wanted = false;
        if d.covers.len() >= MAX_COVERS {
            d.covers.pop_back();
        }
        d.covers.push_back(cover);
    }

    /// `cover`, recorded on its stream after the frees owed there, has
    /// been waited for: they have passed.
    pub(in crate::arena) fn cover_passed(&mut self, cover: Stamped<F>) {
        let d = self.streams.entry(cover.key).or_default();
        d.uncovered = 0;
        d.wanted = false;
        d.passed_below = d.passed_below.max(cover.seq);
        d.covers.retain(|c| c.seq > cover.seq);
    }

    /// A stream other than `key` found no block: every stream with frees
    /// owed covers them at its next call.
    pub(in crate::arena) fn want_all_but(&mut self, key: StreamKey) {
        for (k, d) in &mut self.streams {
            if *k != key && d.uncovered > 0 {
                d.wanted = true;
            }
        }
    }

    /// Whether the free numbered `seq` on `key` has passed: it has once a
    /// cover numbered above it has. Asks only of the oldest such cover
    /// (an older one stands for nothing here; a younger one passes after
    /// it), and not if `not_yet` knows it has not passed. Once it has, so
    /// have the covers before it (one stream, in order): they go.
    pub(in crate::arena) fn done_in<B: Fences<Fence = F>>(
        &mut self,
        backend: &B,
        key: StreamKey,
        seq: u64,
        not_yet: &mut NotYet,
    ) -> bool {
        let Some(d) = self.streams.get_mut(&key) else {
            return false;
        };
        if d.passed_below > seq {
            return true;
        }
        let Some(i) = d.covers.iter().position(|c| c.seq > seq) else {
            return false;
        };
        let c = &d.covers[i];
        if !not_yet.ask(key, c.seq, || backend.fence_done(&c.fence).unwrap_or(false)) {
            return false;
        }
        d.passed_below = d.passed_below.max(c.seq);
        d.covers.drain(..=i);
        true
    }

    /// Waits until the free numbered `seq` on `key` has passed: on the
    /// first cover numbered above it, or, if none was recorded yet, on the
    /// whole device.
    pub(in crate::arena) fn wait<B: Fences<Fence = F>>(
        &mut self,
        backend: &B,
        key: StreamKey,
        seq: u64,
    ) -> Result<()> {
        if self.done_in(backend, key, seq, &mut NotYet::default()) {
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
    pub(in crate::arena) fn any_uncovered(&self) -> bool {
        self.streams.values().any(|d| d.uncovered > 0)
    }

    /// Waits for the whole device: every free owed so far has passed.
    /// Refused, with nothing changed, while a CUDA graph capture may be
    /// under way ([`Error::CaptureUnderway`](crate::Error::CaptureUnderway)):
    /// CUDA would refuse the synchronisation and invalidate the capture.
    /// This is the arena's one device synchronisation.
    pub(in crate::arena) fn synchronize<B: Fences<Fence = F>>(
        &mut self,
        backend: &B,
    ) -> Result<()> {
        if backend.capture_underway() {
            return Err(crate::Error::CaptureUnderway {
                what: "waiting for the frees whose fence is not recorded yet",
            });
        }
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
            d.wanted = false;
        }
        Ok(())
    }

    /// Whether one mark has passed, within a pass over many (`not_yet`:
    /// what the pass has seen not passed, which is not asked again).
    pub(in crate::arena) fn stamp_done<B: Fences<Fence = F>>(
        &mut self,
        backend: &B,
        x: &Stamped<Mark<F>>,
        not_yet: &mut NotYet,
    ) -> bool {
        match &x.fence {
            Mark::Fence(f) => not_yet.ask(x.key, x.seq, || backend.fence_done(f).unwrap_or(false)),
            Mark::Owed => self.done_in(backend, x.key, x.seq, not_yet),
        }
    }

    /// Waits for every mark of `set`.
    pub(in crate::arena) fn wait_set<B: Fences<Fence = F>>(
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

/// What the frees owed ask of a backend, and nothing more: whether a fence
/// has passed, a wait for one, whether a CUDA graph capture may be under
/// way, and a device synchronisation. Every [`Backend`] is one.
pub(in crate::arena) trait Fences {
    /// The backend's fence.
    type Fence;
    /// Whether `fence` has passed (an error counts as not yet).
    fn fence_done(&self, fence: &Self::Fence) -> Result<bool>;
    /// Waits until `fence` has passed.
    fn wait(&self, fence: &Self::Fence) -> Result<()>;
    /// Whether a capture may be under way (no synchronisation then).
    fn capture_underway(&self) -> bool;
    /// Waits for all the device's work.
    fn synchronize(&self) -> Result<()>;
}

impl<B: Backend> Fences for B {
    type Fence = B::Fence;
    fn fence_done(&self, fence: &B::Fence) -> Result<bool> {
        Backend::fence_done(self, fence)
    }
    fn wait(&self, fence: &B::Fence) -> Result<()> {
        Backend::wait(self, fence)
    }
    fn capture_underway(&self) -> bool {
        Backend::capture_underway(self)
    }
    fn synchronize(&self) -> Result<()> {
        Backend::synchronize(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cover(key: StreamKey, seq: u64) -> Stamped<u64> {
        Stamped {
            key,
            seq,
            fence: seq,
        }
    }

    /// A stream nobody waits for keeps at most `MAX_COVERS` covers, the
    /// oldest and the newest among them; the other streams' are apart.
    #[test]
    fn covers_stay_bounded_and_keep_the_newest() {
        let (a, b) = ((0, 1), (0, 2));
        let mut o: Owed<u64> = Owed::default();
        for seq in 1..=1000u64 {
            o.owe(a);
            o.cover(cover(a, 2 * seq));
        }
        o.owe(b);
        o.cover(cover(b, 7));
        let seqs: Vec<u64> = o.streams[&a].covers.iter().map(|c| c.seq).collect();
        assert_eq!(seqs.len(), MAX_COVERS);
        assert_eq!(seqs[0], 2, "the oldest stays");
        assert_eq!(*seqs.last().unwrap(), 2000, "the newest stays");
        assert!(seqs.windows(2).all(|w| w[0] < w[1]), "in order: {seqs:?}");
        assert_eq!(o.streams[&b].covers.len(), 1);
        assert!(!o.needs_any_cover(a) && !o.needs_any_cover(b));
    }
}
