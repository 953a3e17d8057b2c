//! Stream order as numbers. Every fence vmmbuf keeps carries its stream's key
//! and a sequence number taken in the same critical section as the fence was
//! recorded, so that of two fences of one stream the one with the larger
//! number is the later: it covers the other. Merging fence sets keeps, for
//! each stream, the fence with the largest number: never the one that
//! happens to sit on the left or was inserted last.
//!
//! Why a lock and not an atomic counter: two threads that record fences on
//! one stream (two tensors of one stream freed at once) may record them in
//! one order and number them in the other, if recording and numbering are
//! two steps. Under a lock per stream shard, the order of the numbers is the
//! order of the recordings, which is the order on the stream.
#![deny(unsafe_code)]

use parking_lot::Mutex;

use crate::error::Result;

/// A stream's key, what tells two queues apart: (context, stream handle)
/// for CUDA; (0, n) for the host backend's streams.
pub type StreamKey = (u64, u64);

/// Locks (each with its counter) that order the recording of fences: a
/// stream always maps to the same shard.
static SHARDS: [Mutex<u64>; 16] = [const { Mutex::new(0) }; 16];

fn shard(key: StreamKey) -> &'static Mutex<u64> {
    let h = key.0.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ key.1.wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    &SHARDS[(h >> 60) as usize]
}

/// A fence with its stream and its place in that stream's order.
#[derive(Debug)]
pub(crate) struct Stamped<F> {
    pub(crate) key: StreamKey,
    pub(crate) seq: u64,
    pub(crate) fence: F,
}

impl<F> Stamped<F> {
    /// The same stamp around `f(fence)`.
    pub(crate) fn map<G>(self, f: impl FnOnce(F) -> G) -> Stamped<G> {
        Stamped {
            key: self.key,
            seq: self.seq,
            fence: f(self.fence),
        }
    }
}

/// Records a fence on stream `key` with `record` and numbers it, both under
/// the stream's shard lock: a later recording on the stream gets a larger
/// number.
pub(crate) fn record<F>(key: StreamKey, record: impl FnOnce() -> Result<F>) -> Result<Stamped<F>> {
    let mut n = shard(key).lock();
    let fence = record()?;
    *n += 1;
    Ok(Stamped {
        key,
        seq: *n,
        fence,
    })
}

/// Numbers a free on stream `key` that records no fence (a deferred free
/// fence, `arena::owed`): a fence recorded on the stream later gets a
/// larger number, and covers it.
pub(crate) fn stamp(key: StreamKey) -> u64 {
    let mut n = shard(key).lock();
    *n += 1;
    *n
}

/// The largest number handed out on `key`'s shard so far: every free
/// numbered up to it was made before this call.
pub(crate) fn current(key: StreamKey) -> u64 {
    *shard(key).lock()
}

/// Re-records in place (`rerecord`) the fence of `slot`, and renumbers it.
pub(crate) fn rerecord<F>(
    slot: &mut Stamped<F>,
    rerecord: impl FnOnce(&F) -> Result<()>,
) -> Result<()> {
    let mut n = shard(slot.key).lock();
    rerecord(&slot.fence)?;
    *n += 1;
    slot.seq = *n;
    Ok(())
}

/// A fence a caller recorded itself, numbered when it is handed over: of two
/// fences of one stream handed over, the later-handed is taken as the later
/// (callers hand a stream's fences over in the order they recorded them).
pub(crate) fn given<F>(key: StreamKey, fence: F) -> Stamped<F> {
    let mut n = shard(key).lock();
    *n += 1;
    Stamped {
        key,
        seq: *n,
        fence,
    }
}

/// At most one fence per stream, the latest by number: what must pass
/// before memory is reused by another stream, unmapped or released. One
/// fence is held inline: a free used by its own stream alone (the common
/// case) allocates nothing for its set, which with cold caches is a malloc
/// at the free and a free when the block is taken again.
#[derive(Debug)]
pub(crate) struct FenceSet<F>(smallvec::SmallVec<[Stamped<F>; 1]>);

impl<F> Default for FenceSet<F> {
    fn default() -> Self {
        Self(smallvec::SmallVec::new())
    }
}

impl<F> FenceSet<F> {
    /// Adds `f`, keeping the later of it and the fence held for its stream.
    pub(crate) fn add(&mut self, f: Stamped<F>) {
        match self.0.iter_mut().find(|s| s.key == f.key) {
            Some(slot) if slot.seq < f.seq => *slot = f,
            Some(_) => {}
            None => self.0.push(f),
        }
    }

    /// Adds every fence of `other` (see [`add`](Self::add)).
    pub(crate) fn merge(&mut self, other: FenceSet<F>) {
        for f in other.0 {
            self.add(f);
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The same set with each fence changed by `f` (keys and numbers kept).
    pub(crate) fn map<G>(self, mut f: impl FnMut(F) -> G) -> FenceSet<G> {
        FenceSet(self.0.into_iter().map(|s| s.map(&mut f)).collect())
    }

    pub(crate) fn clear(&mut self) {
        self.0.clear();
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = &Stamped<F>> + '_ {
        self.0.iter()
    }

    pub(crate) fn iter_mut(&mut self) -> impl Iterator<Item = &mut Stamped<F>> + '_ {
        self.0.iter_mut()
    }

    /// True if every fence is on stream `key` (and there is at least one).
    pub(crate) fn only_on(&self, key: StreamKey) -> bool {
        !self.0.is_empty() && self.0.iter().all(|s| s.key == key)
    }

    /// Calls `f` on every fence, stopping at the first error.
    pub(crate) fn each(&self, mut f: impl FnMut(&F) -> Result<()>) -> Result<()> {
        self.0.iter().try_for_each(|s| f(&s.fence))
    }

    /// True if `done` says so of every fence.
    pub(crate) fn all(&self, mut done: impl FnMut(&F) -> Result<bool>) -> Result<bool> {
        for s in &self.0 {
            if !done(&s.fence)? {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

/// What one pass over many fences (at one instant: settling a zone) has
/// seen not passed: per stream, the lowest number found so. A fence of that
/// stream numbered at or above it has not passed either, and is answered
/// without a query. Why: a fence numbered when recorded (`record`,
/// `rerecord`, a cover) with a larger number was recorded after it on the
/// same stream, and finishes after it. A fence numbered when handed over
/// (`given`) was recorded before its number was taken, so the inference
/// from it to a larger number still holds; from a smaller number to it, it
/// may be wrong, but only in the safe direction: a fence taken as not
/// passed waits for a later pass. So the answer "not passed" is never
/// wrong where it matters, and "passed" always comes from a query.
#[derive(Debug, Default)]
pub(crate) struct NotYet(Vec<(StreamKey, u64)>);

impl NotYet {
    /// Whether a fence numbered `seq` on `key` is known not to have passed.
    pub(crate) fn known(&self, key: StreamKey, seq: u64) -> bool {
        self.0.iter().any(|&(k, s)| k == key && seq >= s)
    }

    /// A fence numbered `seq` on `key` was found not passed.
    pub(crate) fn note(&mut self, key: StreamKey, seq: u64) {
        match self.0.iter_mut().find(|(k, _)| *k == key) {
            Some(e) => e.1 = e.1.min(seq),
            None => self.0.push((key, seq)),
        }
    }

    /// Whether the fence numbered `seq` on `key` has passed: false without
    /// asking if it is known not to have, else `query`'s answer, noted
    /// when it is no.
    pub(crate) fn ask(&mut self, key: StreamKey, seq: u64, query: impl FnOnce() -> bool) -> bool {
        if self.known(key, seq) {
            return false;
        }
        let done = query();
        if !done {
            self.note(key, seq);
        }
        done
    }
}

impl<F> FromIterator<Stamped<F>> for FenceSet<F> {
    fn from_iter<I: IntoIterator<Item = Stamped<F>>>(iter: I) -> Self {
        let mut s = Self::default();
        for f in iter {
            s.add(f);
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(key: StreamKey, seq: u64, v: u32) -> Stamped<u32> {
        Stamped { key, seq, fence: v }
    }

    /// RT-8: an allocation's own free fence and an older view fence on the
    /// same stream: whichever order they are added in, the later one stays.
    #[test]
    fn one_fence_per_stream_the_latest_by_number() {
        let s = (1, 1);
        for order in [[7u64, 3], [3, 7]] {
            let set: FenceSet<u32> = order.iter().map(|&q| at(s, q, q as u32)).collect();
            let v: Vec<_> = set.iter().map(|f| (f.seq, f.fence)).collect();
            assert_eq!(v, vec![(7, 7)], "added as {order:?}");
        }
        let mut a: FenceSet<u32> = [at(s, 9, 9), at((1, 2), 1, 1)].into_iter().collect();
        a.merge([at(s, 4, 4), at((1, 2), 5, 5)].into_iter().collect());
        let v: Vec<_> = a.iter().map(|f| (f.key, f.seq)).collect();
        assert_eq!(v, vec![(s, 9), ((1, 2), 5)]);
        assert!(!a.only_on(s));
    }

    /// Recording and numbering are one step: threads that record on one
    /// stream get numbers in the order of their recordings.
    #[test]
    #[cfg_attr(
        miri,
        ignore = "parking_lot_core's futex call fails miri's variadic-argument check (the dependency's, not this code's)"
    )]
    fn numbers_follow_the_recording_order_across_threads() {
        let key = (7, 7);
        let clock = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let clock = clock.clone();
                std::thread::spawn(move || {
                    (0..200)
                        .map(|_| {
                            let s = record(key, || {
                                // The recording's place on the "stream".
                                let pos = clock.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                                std::thread::yield_now();
                                Ok(pos)
                            })
                            .unwrap();
                            (s.seq, s.fence)
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let mut all: Vec<(u64, u64)> = threads
            .into_iter()
            .flat_map(|t| t.join().unwrap())
            .collect();
        all.sort();
        assert_eq!(all.len(), 1600);
        for w in all.windows(2) {
            assert!(
                w[0].1 < w[1].1,
                "numbered {w:?}: a later number for an earlier recording"
            );
        }
        let a = record(key, || Ok(0u8)).unwrap();
        let b = given(key, 0u8);
        assert!(a.seq < b.seq);
    }
}
