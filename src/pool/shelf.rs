//! Where a pool's chunks wait: shelves by placement, shareability and
//! size, the one place the pool's counters change, and shedding past the
//! watermarks. Bookkeeping only: the pool gives what is shed back.

use std::collections::BTreeMap;
use std::fmt;

use parking_lot::Mutex;

use super::{PoolDesc, PoolStats};
use crate::error::Result;
use crate::location::Location;

pub(super) struct PoolInner<C> {
    pub(super) desc: PoolDesc,
    /// (placement, shareable, bytes) -> chunks of exactly that kind and
    /// size. A shareable buffer takes only shareable chunks, and the others
    /// only the others.
    pub(super) free: BTreeMap<(Location, bool, usize), Vec<C>>,
    pub(super) stats: PoolStats,
}

/// Where a pool keeps its chunks: owned by one [`ChunkPool`], or by a
/// backend's [`PoolSlot`](crate::backend::PoolSlot) for its default pool. Chunks
/// still here when it drops free themselves (their tokens do, in `Drop`).
pub(crate) struct Shelf<C> {
    pub(super) inner: Mutex<PoolInner<C>>,
}

impl<C> Shelf<C> {
    pub(crate) fn new(desc: PoolDesc) -> Result<Self> {
        desc.check()?;
        Ok(Self {
            inner: Mutex::new(PoolInner {
                desc,
                free: BTreeMap::new(),
                stats: PoolStats::default(),
            }),
        })
    }
}

impl<C> fmt::Debug for Shelf<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let g = self.inner.lock();
        f.debug_struct("Shelf")
            .field("desc", &g.desc)
            .field("stats", &g.stats)
            .finish()
    }
}

impl<C> PoolInner<C> {
    /// Past the high watermark, takes out the largest chunks until at most
    /// the low watermark is held: the chunks to give back.
    pub(super) fn shed(&mut self) -> Vec<C> {
        let mut shed = Vec::new();
        while self.stats.pooled_host_bytes > self.desc.max_host_bytes {
            let Some(key) = self
                .free
                .keys()
                .filter(|k| k.0 == Location::Host)
                .max_by_key(|k| k.2)
                .copied()
            else {
                break;
            };
            shed.push(self.pop(key));
        }
        if self.stats.pooled_bytes > self.desc.high_water_bytes {
            while self.stats.pooled_bytes > self.desc.low_water_bytes {
                let Some(key) = self.free.keys().max_by_key(|k| k.2).copied() else {
                    break;
                };
                shed.push(self.pop(key));
            }
        }
        shed
    }

    /// Keeps one chunk of `key` (placement, shareable, bytes), counting it.
    pub(super) fn add(&mut self, key: (Location, bool, usize), chunk: C) {
        self.free.entry(key).or_default().push(chunk);
        self.tally(key, 1, true);
    }

    /// Takes one chunk of `key` out (the key is there), counting it.
    pub(super) fn pop(&mut self, key: (Location, bool, usize)) -> C {
        let list = self.free.get_mut(&key).expect("the key was just found");
        let c = list.pop().expect("pool lists are never empty");
        if list.is_empty() {
            self.free.remove(&key);
        }
        self.tally(key, 1, false);
        c
    }

    /// Counts `n` chunks of `key` in (`into`) or out: the one place the
    /// pooled byte, host byte and chunk counters change, but `trim`.
    pub(super) fn tally(&mut self, key: (Location, bool, usize), n: usize, into: bool) {
        let bytes = key.2 * n;
        let host = if key.0 == Location::Host { bytes } else { 0 };
        let s = &mut self.stats;
        if into {
            s.pooled_bytes += bytes;
            s.pooled_host_bytes += host;
            s.pooled_chunks += n;
        } else {
            s.pooled_bytes -= bytes;
            s.pooled_host_bytes -= host;
            s.pooled_chunks -= n;
        }
    }
}
