//! A region's map hook: every mapped chunk reported as its own range, and
//! every reported range touching what unmaps or swaps cut first and
//! reported again afterwards (see [`crate::hook`]).

use std::sync::Arc;

use super::*;

impl<B: Backend> Region<B> {
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
    pub(super) fn report_mapped(&mut self, ranges: &[(usize, usize)]) {
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
    pub(super) fn cut_spans(&mut self, offset: usize, bytes: usize) -> Vec<(usize, usize)> {
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
    pub(super) fn debug_check_spans(&self) {
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
