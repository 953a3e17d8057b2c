//! What a migration is asked to do: [`MigrationPolicy`] (where new chunks
//! go, and where existing ones move) and [`MigrationPlan`] (explicit moves).
//! The report of what it did is [`MigrationReport`](super::MigrationReport),
//! in this module's parent: the three types of the migration API live
//! together.

use std::ops::Range;

use crate::location::Location;

/// Where chunks should live, in VMM terms (the counterpart of unified
/// memory's advice, which VMM memory does not take).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum MigrationPolicy {
    /// On the buffer's own device (the backend's home).
    Default,
    /// On GPU `d`.
    PreferDevice(u32),
    /// In pinned host memory, reachable by kernels at the same address.
    PreferHost,
    /// Read-only for every location that has access, once written: applied to
    /// a range it seals those chunks (writes then fail: a kernel write faults,
    /// a copy into them is an error) until [`GrowableBuffer::make_writable`](crate::GrowableBuffer::make_writable).
    /// New chunks are created writable on the buffer's device.
    ReadMostly,
}

impl MigrationPolicy {
    /// The policy that places chunks at `placement` on a backend whose home
    /// is `home`.
    pub(crate) fn placing_at(placement: Location, home: Location) -> Self {
        match placement {
            p if p == home => MigrationPolicy::Default,
            Location::Host => MigrationPolicy::PreferHost,
            Location::Device(d) => MigrationPolicy::PreferDevice(d),
        }
    }
}

/// Several moves, executed together: all copies are issued on one stream and
/// waited for once. The VMM counterpart of a prefetch plan.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MigrationPlan {
    moves: Vec<(Range<usize>, Location)>,
}

impl MigrationPlan {
    /// An empty plan.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a move of the chunks touching `range` (bytes) to `to`. Later moves
    /// of the same chunk win.
    pub fn add(&mut self, range: Range<usize>, to: Location) -> &mut Self {
        self.moves.push((range, to));
        self
    }

    /// The recorded moves.
    pub fn moves(&self) -> &[(Range<usize>, Location)] {
        &self.moves
    }

    /// True without moves.
    pub fn is_empty(&self) -> bool {
        self.moves.is_empty()
    }
}
