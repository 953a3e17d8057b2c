//! The host backend's fences on a virtual clock: a GPU's lag behind the CPU,
//! for replays that should see what a real device sees (frees whose fences
//! have not passed yet), without a device.
//!
//! With a lag of 0 (the default) every fence has passed when it is made, as
//! the host has no queued work. With a lag of `n`, a fence made at tick `t`
//! passes at tick `t + n`; [`HostBackend::tick`](super::host::HostBackend::tick)
//! advances the clock (a replay ticks once per event), a wait on a fence
//! brings the clock to it, and a synchronisation to the latest fence made.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::StreamKey;

/// The host backend's fence: the tick at which it passes, and its stream.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostFence {
    /// Passed once the clock reaches it (0: at once).
    at: u64,
    /// The stream it was made on (`(0, n)` for `HostStream(n)`).
    key: StreamKey,
}

/// The virtual clock of one host backend.
#[derive(Debug, Default)]
pub(crate) struct Clock {
    /// Ticks between a fence's making and its passing.
    lag: u64,
    /// The clock.
    now: AtomicU64,
    /// The tick at which every fence made so far has passed.
    horizon: AtomicU64,
}

impl Clock {
    /// A clock whose fences pass `lag` ticks after they are made.
    pub(crate) fn new(lag: u64) -> Self {
        Self {
            lag,
            ..Self::default()
        }
    }

    /// A fence made now on the stream of `key`.
    pub(crate) fn fence(&self, key: StreamKey) -> HostFence {
        if self.lag == 0 {
            return HostFence { at: 0, key };
        }
        let at = self.now.load(Ordering::Acquire).saturating_add(self.lag);
        self.horizon.fetch_max(at, Ordering::AcqRel);
        HostFence { at, key }
    }

    /// Whether `f` has passed.
    pub(crate) fn done(&self, f: &HostFence) -> bool {
        self.now.load(Ordering::Acquire) >= f.at
    }

    /// Waits for `f`: the clock moves on to it.
    pub(crate) fn wait(&self, f: &HostFence) {
        self.now.fetch_max(f.at, Ordering::AcqRel);
    }

    /// Waits for every fence made so far.
    pub(crate) fn synchronize(&self) {
        let h = self.horizon.load(Ordering::Acquire);
        self.now.fetch_max(h, Ordering::AcqRel);
    }

    /// One tick on.
    pub(crate) fn tick(&self) {
        self.now.fetch_add(1, Ordering::AcqRel);
    }

    /// The stream `f` was made on.
    pub(crate) fn key(f: &HostFence) -> StreamKey {
        f.key
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fence_passes_lag_ticks_after_it_is_made_or_when_waited_for() {
        let c = Clock::new(3);
        let f = c.fence((0, 7));
        assert_eq!(Clock::key(&f), (0, 7));
        for _ in 0..2 {
            c.tick();
            assert!(!c.done(&f));
        }
        c.tick();
        assert!(c.done(&f));
        let g = c.fence((0, 1));
        let h = c.fence((0, 2));
        assert!(!c.done(&g) && !c.done(&h));
        c.wait(&g);
        assert!(
            c.done(&g) && c.done(&h),
            "made at the same tick, they pass together"
        );
        c.tick();
        let late = c.fence((0, 1));
        assert!(!c.done(&late));
        c.synchronize();
        assert!(c.done(&late));
    }

    #[test]
    fn without_lag_every_fence_has_passed_when_made() {
        let c = Clock::default();
        let f = c.fence((0, 3));
        assert!(c.done(&f));
        assert_eq!(Clock::key(&f), (0, 3));
        assert!(c.done(&HostFence::default()));
    }
}
