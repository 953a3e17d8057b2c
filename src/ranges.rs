//! Placements for byte ranges of a buffer: non-overlapping intervals, later
//! settings overwriting earlier ones, adjacent equal ones merged. Its size is
//! bounded by the number of distinct intervals, however often a range is set.

use std::collections::BTreeMap;
use std::ops::{Bound, Range, RangeBounds};

use crate::location::Location;

/// `ranges` (`(offset, bytes)`, in offset order) with each run of adjacent
/// ones joined: one `(offset, bytes)` a run (for one driver call a run, or
/// the arena's free bytes as merged ranges).
pub(crate) fn adjacent_runs(
    ranges: impl IntoIterator<Item = (usize, usize)>,
) -> Vec<(usize, usize)> {
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for (o, bytes) in ranges {
        match runs.last_mut() {
            Some(r) if r.0 + r.1 == o => r.1 += bytes,
            _ => runs.push((o, bytes)),
        }
    }
    runs
}

/// The indices `range` names within `0..len`, or `None` if it is not a
/// range there (reversed, past `len`, or overflowing).
pub(crate) fn within(range: &impl RangeBounds<usize>, len: usize) -> Option<Range<usize>> {
    let start = match range.start_bound() {
        Bound::Included(&s) => Some(s),
        Bound::Excluded(&s) => s.checked_add(1),
        Bound::Unbounded => Some(0),
    };
    let end = match range.end_bound() {
        Bound::Included(&e) => e.checked_add(1),
        Bound::Excluded(&e) => Some(e),
        Bound::Unbounded => Some(len),
    };
    match (start, end) {
        (Some(s), Some(e)) if s <= e && e <= len => Some(s..e),
        _ => None,
    }
}

/// `gaps` with the ranges `cuts` (`(offset, bytes)`, in offset order) taken
/// out: what is left of each gap, in order.
pub(crate) fn subtract(
    gaps: Vec<Range<usize>>,
    cuts: impl Iterator<Item = (usize, usize)> + Clone,
) -> Vec<Range<usize>> {
    let mut out = Vec::with_capacity(gaps.len());
    for g in gaps {
        let mut at = g.start;
        for (o, b) in cuts.clone() {
            if o >= g.end {
                break;
            }
            if o + b <= at {
                continue;
            }
            if o > at {
                out.push(at..o);
            }
            at = at.max(o + b);
        }
        if at < g.end {
            out.push(at..g.end);
        }
    }
    out
}

/// `range` as a person writes it: "0..8192", "16..=31", "4096..", "..".
pub(crate) fn words(range: &impl RangeBounds<usize>) -> String {
    let start = match range.start_bound() {
        Bound::Included(s) => s.to_string(),
        Bound::Excluded(s) => format!("{}", s.saturating_add(1)),
        Bound::Unbounded => String::new(),
    };
    match range.end_bound() {
        Bound::Included(e) => format!("{start}..={e}"),
        Bound::Excluded(e) => format!("{start}..{e}"),
        Bound::Unbounded => format!("{start}.."),
    }
}

/// start -> (end, placement); intervals never overlap and are never empty.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct PlacementRanges {
    map: BTreeMap<usize, (usize, Location)>,
}

impl PlacementRanges {
    /// Places `range` at `to`, over whatever was set there before.
    pub(crate) fn set(&mut self, range: Range<usize>, to: Location) {
        if range.is_empty() {
            return;
        }
        // Cut every interval that overlaps the range, keeping what lies outside.
        let overlapping: Vec<(usize, (usize, Location))> = self
            .map
            .range(..range.end)
            .filter(|(_, (end, _))| *end > range.start)
            .map(|(&s, &v)| (s, v))
            .collect();
        for (s, (e, l)) in overlapping {
            self.map.remove(&s);
            if s < range.start {
                self.map.insert(s, (range.start, l));
            }
            if e > range.end {
                self.map.insert(range.end, (e, l));
            }
        }
        let (mut start, mut end) = (range.start, range.end);
        // Merge with equal neighbours.
        if let Some((&s, &(e, l))) = self.map.range(..start).next_back() {
            if e == start && l == to {
                self.map.remove(&s);
                start = s;
            }
        }
        if let Some(&(e, l)) = self.map.get(&end) {
            if l == to {
                self.map.remove(&end);
                end = e;
            }
        }
        self.map.insert(start, (end, to));
    }

    /// The placement set for `offset`, if any.
    pub(crate) fn get(&self, offset: usize) -> Option<Location> {
        self.map
            .range(..=offset)
            .next_back()
            .filter(|(_, (end, _))| *end > offset)
            .map(|(_, &(_, l))| l)
    }

    pub(crate) fn clear(&mut self) {
        self.map.clear();
    }

    /// Every interval in address order.
    pub(crate) fn to_vec(&self) -> Vec<(Range<usize>, Location)> {
        self.map.iter().map(|(&s, &(e, l))| (s..e, l)).collect()
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn subtracting_ranges_leaves_what_lies_between() {
        let cuts = [(10, 5), (20, 10), (40, 5)];
        let left = super::subtract(vec![0..12, 15..35, 38..50, 60..70], cuts.iter().copied());
        assert_eq!(left, vec![0..10, 15..20, 30..35, 38..40, 45..50, 60..70]);
        // Cuts over a whole gap, and none at all.
        let whole: Vec<std::ops::Range<usize>> = std::iter::once(20..30).collect();
        assert!(super::subtract(whole, cuts.iter().copied()).is_empty());
        assert_eq!(
            super::subtract(vec![0..5, 7..9], std::iter::empty()),
            vec![0..5, 7..9]
        );
    }

    #[test]
    fn ranges_read_as_written() {
        assert_eq!(words(&(0..8192)), "0..8192");
        assert_eq!(words(&(16..=31)), "16..=31");
        assert_eq!(words(&(4096..)), "4096..");
        assert_eq!(words(&(..)), "..");
        assert_eq!(words(&(..10)), "..10");
    }

    use super::*;
    use proptest::prelude::*;

    const H: Location = Location::Host;
    const D: Location = Location::Device(0);

    #[test]
    fn overwrites_split_and_merge() {
        let mut r = PlacementRanges::default();
        r.set(0..100, H);
        r.set(40..60, D);
        assert_eq!(r.to_vec(), vec![(0..40, H), (40..60, D), (60..100, H)]);
        r.set(40..60, H);
        assert_eq!(r.to_vec(), vec![(0..100, H)], "merged back");
        // Fewer under miri, which interprets every step.
        for _ in 0..if cfg!(miri) { 2_000 } else { 200_000 } {
            r.set(10..20, D);
        }
        assert_eq!(r.to_vec().len(), 3, "repeating a setting adds nothing");
        assert_eq!(
            (r.get(9), r.get(10), r.get(19), r.get(20), r.get(100)),
            (Some(H), Some(D), Some(D), Some(H), None)
        );
    }

    proptest! {
        #[test]
        fn matches_a_per_byte_model(sets in prop::collection::vec((0..64usize, 0..64usize, any::<bool>()), 0..30)) {
            let mut r = PlacementRanges::default();
            let mut model = [None; 64];
            for (a, b, h) in sets {
                let (a, b) = (a.min(b), a.max(b));
                let l = if h { H } else { D };
                r.set(a..b, l);
                for m in &mut model[a..b] {
                    *m = Some(l);
                }
                for (i, m) in model.iter().enumerate() {
                    prop_assert_eq!(r.get(i), *m);
                }
                let v = r.to_vec();
                for w in v.windows(2) {
                    prop_assert!(w[0].0.end <= w[1].0.start);
                    prop_assert!(w[0].0.end < w[1].0.start || w[0].1 != w[1].1, "adjacent equal intervals merge");
                }
            }
        }
    }
}
