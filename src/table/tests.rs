//! The chunk table against a model that knows nothing but granules: every
//! granule of the reservation is free or belongs to one chunk. Holes in the
//! middle are the common case here, not an afterthought.

use proptest::prelude::*;

use super::*;

const G: usize = 4096;
const GRANULES: usize = 64;

/// Granule `i` holds `Some((chunk start granule, placement))` or `None`.
#[derive(Clone, Debug)]
struct Model {
    granules: Vec<Option<(usize, Location)>>,
    len: usize,
}

impl Model {
    fn new() -> Self {
        Self {
            granules: vec![None; GRANULES],
            len: 0,
        }
    }

    fn insert(&mut self, start: usize, n: usize, place: Location) -> bool {
        if n == 0
            || start + n > GRANULES
            || self.granules[start..start + n].iter().any(|g| g.is_some())
        {
            return false;
        }
        for g in &mut self.granules[start..start + n] {
            *g = Some((start, place));
        }
        true
    }

    fn chunk_len(&self, start: usize) -> usize {
        self.granules[start..]
            .iter()
            .take_while(|g| matches!(g, Some((s, _)) if *s == start))
            .count()
    }

    fn remove(&mut self, start: usize) -> bool {
        if start >= GRANULES
            || !matches!(self.granules[start], Some((s, _)) if s == start)
            || start * G < self.len
        {
            return false;
        }
        let n = self.chunk_len(start);
        for g in &mut self.granules[start..start + n] {
            *g = None;
        }
        true
    }

    fn prefix(&self) -> usize {
        self.granules.iter().take_while(|g| g.is_some()).count() * G
    }

    /// Chunk starts (in bytes) touching `[a, b)`.
    fn touching(&self, a: usize, b: usize) -> Vec<usize> {
        let mut v: Vec<usize> = (a / G..b.div_ceil(G).min(GRANULES))
            .filter_map(|i| self.granules[i].map(|(s, _)| s * G))
            .collect();
        v.dedup();
        v
    }

    fn holes(&self) -> Vec<Range<usize>> {
        let span = self
            .granules
            .iter()
            .rposition(|g| g.is_some())
            .map_or(0, |i| i + 1);
        let mut holes = Vec::new();
        let mut i = 0;
        while i < span {
            if self.granules[i].is_none() {
                let s = i;
                while self.granules[i].is_none() {
                    i += 1;
                }
                holes.push(s * G..i * G);
            } else {
                i += 1;
            }
        }
        holes
    }
}

#[derive(Clone, Debug)]
enum Op {
    Insert(usize, usize, bool),
    Remove(usize),
    SetLen(usize),
    Place(usize, bool),
    /// Replaces the chunk at a granule and the one right after it with one
    /// chunk over both (as a sleep regroups chunks).
    Join(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..GRANULES + 2, 0..9usize, any::<bool>()).prop_map(|(s, n, h)| Op::Insert(s, n, h)),
        2 => (0..GRANULES + 2).prop_map(Op::Remove),
        1 => (0..(GRANULES + 2) * G).prop_map(Op::SetLen),
        1 => (0..GRANULES, any::<bool>()).prop_map(|(s, h)| Op::Place(s, h)),
        1 => (0..GRANULES).prop_map(Op::Join),
    ]
}

fn place(host: bool) -> Location {
    if host {
        Location::Host
    } else {
        Location::Device(0)
    }
}

/// After each step, every query agrees with the model.
fn agree(t: &ChunkTable<u32>, m: &Model) {
    t.check().unwrap();
    assert_eq!(t.len(), m.len);
    assert_eq!(t.mapped_prefix(), m.prefix());
    let mapped = m.granules.iter().filter(|g| g.is_some()).count() * G;
    let host = m
        .granules
        .iter()
        .filter(|g| matches!(g, Some((_, Location::Host))))
        .count()
        * G;
    let s = t.stats();
    assert_eq!((s.mapped_bytes, s.host_bytes), (mapped, host));
    assert_eq!(t.holes(), m.holes());
    assert_eq!(s.holes, m.holes().len());
    gaps_agree(t, m);
    for (o, e) in t.iter() {
        assert_eq!(m.granules[o / G], Some((o / G, e.placement)));
        assert_eq!(e.bytes, m.chunk_len(o / G) * G);
        assert_eq!(e.chunk as usize, o / G, "the token stays with its chunk");
    }
    // Range queries over a spread of ranges, unaligned ends included.
    for a in (0..GRANULES * G).step_by(G * 3 + 1000) {
        for len in [1, G - 1, G, 5 * G + 7, 20 * G] {
            ranges_agree(t, m, a, (a + len).min(GRANULES * G));
        }
    }
}

/// Gaps clipped to a range are the model's free granules there, in runs;
/// the lowest gap long enough is the model's lowest free run.
fn gaps_agree(t: &ChunkTable<u32>, m: &Model) {
    for (a, b) in [(0, GRANULES), (3, 17), (GRANULES / 2, GRANULES), (5, 5)] {
        let mut want: Vec<Range<usize>> = Vec::new();
        for i in a..b {
            if m.granules[i].is_none() {
                match want.last_mut() {
                    Some(r) if r.end == i * G => r.end += G,
                    _ => want.push(i * G..(i + 1) * G),
                }
            }
        }
        assert_eq!(t.gaps(a * G..b * G), want, "gaps in {a}..{b}");
    }
    for n in [1, 2, 5, 9] {
        let want = (0..=GRANULES - n)
            .find(|&i| m.granules[i..i + n].iter().all(|g| g.is_none()))
            .map(|i| i * G);
        let fit = t
            .gaps(0..GRANULES * G)
            .into_iter()
            .find(|g| g.end - g.start >= n * G)
            .map(|g| g.start);
        assert_eq!(fit, want, "lowest fit for {n} granules");
    }
}

/// `overlapping`, `chunk_at` and `covering` (loose and exact) of
/// `a..b` agree with the model.
fn ranges_agree(t: &ChunkTable<u32>, m: &Model, a: usize, b: usize) {
    let got: Vec<usize> = t.overlapping(a..b).map(|(o, _)| o).collect();
    assert_eq!(got, m.touching(a, b), "overlapping {a:#x}..{b:#x}");
    // The chunk holding one byte, from the model's granule.
    let want = m.granules[a / G].map(|(s, _)| (s * G, m.chunk_len(s) * G));
    assert_eq!(t.chunk_at(a), want, "chunk_at {a:#x}");
    let covered = (a / G..b.div_ceil(G)).all(|i| m.granules[i].is_some());
    assert_eq!(
        t.covering(a, b - a, false).is_ok(),
        covered,
        "{a:#x}..{b:#x}"
    );
    let exact = covered
        && matches!(m.granules[a / G], Some((s, _)) if s * G == a)
        && (b == GRANULES * G
            || m.granules[b / G].is_none_or(|(s, _)| s * G == b) && b.is_multiple_of(G));
    assert_eq!(
        t.covering(a, b - a, true).is_ok(),
        exact,
        "exact {a:#x}..{b:#x}"
    );
}

proptest! {
    // Fewer under miri, which interprets every step (CI's miri job).
    #![proptest_config(ProptestConfig::with_cases(if cfg!(miri) { crate::miri_cases() } else { 256 }))]
    #[test]
    #[cfg_attr(miri, ignore = "too slow interpreted: one case ran over 3 minutes (the table's unit tests run under miri)")]
    fn the_table_matches_a_granule_model(ops in prop::collection::vec(op(), 1..60)) {
        let mut t = ChunkTable::<u32>::new(GRANULES * G, G).unwrap();
        let mut m = Model::new();
        for op in ops {
            match op {
                Op::Insert(s, n, h) => {
                    let ok = m.insert(s, n, place(h));
                    let r = t.insert(s * G, Entry::new(s as u32, n * G, place(h)));
                    prop_assert_eq!(r.is_ok(), ok, "insert {} x{}", s, n);
                }
                Op::Remove(s) => {
                    let ok = m.remove(s);
                    let r = t.remove(s * G);
                    prop_assert_eq!(r.is_some(), ok, "remove {}", s);
                    if let Some(e) = r {
                        prop_assert_eq!(e.chunk as usize, s);
                    }
                }
                Op::SetLen(len) => {
                    let ok = len <= m.prefix();
                    if ok {
                        m.len = len;
                    }
                    prop_assert_eq!(t.set_len(len).is_ok(), ok, "set_len {:#x}", len);
                }
                Op::Place(s, h) => {
                    if let Some((start, _)) = m.granules[s] {
                        if start == s {
                            let n = m.chunk_len(s);
                            for g in &mut m.granules[s..s + n] {
                                *g = Some((s, place(h)));
                            }
                        }
                    }
                    t.set_placement(s * G, place(h));
                }
                Op::Join(s) => {
                    let Some((start, p)) = m.granules[s] else { continue };
                    if start != s {
                        continue;
                    }
                    let n = m.chunk_len(s);
                    let Some(Some((next, q))) = m.granules.get(s + n).copied() else { continue };
                    if next != s + n || q != p {
                        continue;
                    }
                    let k = m.chunk_len(next);
                    for g in &mut m.granules[s..s + n + k] {
                        *g = Some((s, p));
                    }
                    let old = t.replace(s * G, (n + k) * G, vec![(s * G, Entry::new(s as u32, (n + k) * G, p))]);
                    prop_assert_eq!(old.len(), 2);
                }
            }
            agree(&t, &m);
        }
    }
}

/// A reservation of more granules than the flat index keeps: `chunk_at`
/// searches the tree instead, with the same answers.
#[test]
fn a_table_too_large_for_the_flat_index_still_finds_its_chunks() {
    let granules = INDEX_MAX + 8;
    let mut t = ChunkTable::<u32>::new(granules * G, G).unwrap();
    assert!(t.index.is_none());
    let far = (granules - 4) * G;
    t.insert(G, Entry::new(1, 3 * G, Location::Device(0)))
        .unwrap();
    t.insert(far, Entry::new(2, 2 * G, Location::Host)).unwrap();
    assert_eq!(t.chunk_at(0), None);
    assert_eq!(t.chunk_at(G), Some((G, 3 * G)));
    assert_eq!(t.chunk_at(4 * G - 1), Some((G, 3 * G)));
    assert_eq!(t.chunk_at(4 * G), None);
    assert_eq!(t.chunk_at(far + G + 5), Some((far, 2 * G)));
    t.check().unwrap();
    assert!(t.remove(G).is_some());
    assert_eq!(t.chunk_at(2 * G), None);
    t.check().unwrap();
}

#[test]
fn a_table_with_a_hole_in_the_middle() {
    let mut t = ChunkTable::<()>::new(16 * G, G).unwrap();
    t.insert(0, Entry::new((), 2 * G, Location::Device(0)))
        .unwrap();
    t.insert(2 * G, Entry::new((), G, Location::Host)).unwrap();
    t.insert(6 * G, Entry::new((), 4 * G, Location::Device(0)))
        .unwrap();
    t.check().unwrap();
    assert_eq!(t.holes(), vec![3 * G..6 * G]);
    assert_eq!(t.gaps(0..16 * G), vec![3 * G..6 * G, 10 * G..16 * G]);
    assert_eq!(
        t.gaps(G..7 * G),
        vec![3 * G..6 * G],
        "clipped, chunks cut by the range"
    );
    assert_eq!(t.gaps(7 * G..9 * G), Vec::<Range<usize>>::new());
    assert_eq!(t.span_end(), 10 * G);
    assert_eq!(t.mapped_prefix(), 3 * G);
    assert!(t.set_len(3 * G + 1).is_err(), "the hole cannot be in use");
    t.set_len(3 * G).unwrap();
    assert!(t.remove(2 * G).is_none(), "a chunk in use stays");
    assert_eq!(
        t.placement_runs(G, 7 * G),
        vec![
            (G, G, Location::Device(0)),
            (2 * G, G, Location::Host),
            (6 * G, 2 * G, Location::Device(0))
        ]
    );
    assert!(t.covering(0, 3 * G, true).is_ok());
    assert!(t.covering(0, 4 * G, false).is_err(), "the hole");
    assert!(t.check_insert(5 * G, 2 * G).is_err(), "overlaps");
    assert!(
        t.check_insert(3 * G, 3 * G).is_ok(),
        "fills the hole exactly"
    );
    assert!(t.check_insert(3 * G + 1, G).is_err(), "not granular");
    assert!(
        t.check_insert(15 * G, 2 * G).is_err(),
        "past the reservation"
    );
    assert!(t.check_range(usize::MAX, 2).is_err());
    assert!(ChunkTable::<()>::new(3 * G, 3).is_err());
}
