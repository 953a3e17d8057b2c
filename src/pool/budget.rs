//! [`Budget`]: a limit on the bytes mapped by everything that shares it.

use super::*;

/// A limit on the bytes mapped by everything that shares it: several
/// arenas (a PyTorch process's tags on one device), buffers, or both. A link
/// in the chunk supply chain: mapping takes from it before any chunk is
/// created, unmapping and drop give back. Taking past the limit fails at
/// once (an arena then gives cached memory back and retries, as it does at
/// its own budget). The limit may change at any time
/// ([`set_limit`](Budget::set_limit)). Thread-safe, lock-free.
#[derive(Debug)]
pub struct Budget {
    limit: std::sync::atomic::AtomicUsize,
    used: std::sync::atomic::AtomicUsize,
}

impl Budget {
    /// A budget of `limit` bytes, none used.
    pub fn new(limit: usize) -> Arc<Self> {
        Arc::new(Self {
            limit: std::sync::atomic::AtomicUsize::new(limit),
            used: std::sync::atomic::AtomicUsize::new(0),
        })
    }

    /// The limit in bytes.
    pub fn limit(&self) -> usize {
        self.limit.load(std::sync::atomic::Ordering::Acquire)
    }

    /// A budget with no limit yet (`usize::MAX`), for one that may be set
    /// later ([`set_limit`](Self::set_limit)).
    pub fn unlimited() -> Arc<Self> {
        Self::new(usize::MAX)
    }

    /// The limit, `None` while there is none ([`unlimited`](Self::unlimited)).
    pub fn limit_set(&self) -> Option<usize> {
        Some(self.limit()).filter(|&l| l != usize::MAX)
    }

    /// Sets the limit to `limit` bytes, at any time. What is mapped stays
    /// mapped, a new limit below it included: mapping more fails until
    /// enough goes back (as PyTorch's `set_per_process_memory_fraction`
    /// acts on memory already reserved).
    pub fn set_limit(&self, limit: usize) {
        self.limit
            .store(limit, std::sync::atomic::Ordering::Release);
    }

    /// Bytes mapped now by everything that shares it.
    pub fn used(&self) -> usize {
        self.used.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Holds `bytes` of `budget` (if there is one) for a mapping under
    /// way: `None` if they do not fit. The hold gives them back when it
    /// drops, unless [`kept`](BudgetHold::keep) once the mapping succeeded.
    pub(crate) fn hold(budget: Option<&Arc<Budget>>, bytes: usize) -> Option<BudgetHold> {
        match budget {
            Some(b) if !b.try_take(bytes) => None,
            budget => Some(BudgetHold {
                budget: budget.cloned(),
                bytes,
            }),
        }
    }

    /// Takes `bytes` if they fit under the limit.
    fn try_take(&self, bytes: usize) -> bool {
        use std::sync::atomic::Ordering;
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                u.checked_add(bytes).filter(|&n| n <= self.limit())
            })
            .is_ok()
    }

    /// Gives back `bytes` taken before.
    pub(crate) fn give(&self, bytes: usize) {
        let before = self
            .used
            .fetch_sub(bytes, std::sync::atomic::Ordering::AcqRel);
        debug_assert!(before >= bytes, "gave back more than was taken");
    }
}

/// Budgets are the same when they are one budget.
impl PartialEq for Budget {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self, other)
    }
}

impl Eq for Budget {}

/// Bytes of a [`Budget`] held for a mapping under way: given back as it
/// drops, unless kept. Once mapped, the bytes are the region's
/// ([`Region`](crate::region::Region) gives them back as it unmaps).
#[must_use = "a hold gives its bytes back as it drops"]
pub(crate) struct BudgetHold {
    budget: Option<Arc<Budget>>,
    bytes: usize,
}

impl BudgetHold {
    /// The mapping succeeded: the bytes stay taken.
    pub(crate) fn keep(mut self) {
        self.budget = None;
    }

    /// `bytes` of the hold were mapped: they stay taken, and the rest is
    /// still held (given back as the hold drops).
    pub(crate) fn keep_part(&mut self, bytes: usize) {
        debug_assert!(bytes <= self.bytes, "kept more than was held");
        self.bytes -= bytes.min(self.bytes);
    }
}

impl Drop for BudgetHold {
    fn drop(&mut self) {
        if let Some(b) = &self.budget {
            b.give(self.bytes);
        }
    }
}
