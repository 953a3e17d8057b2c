//! The free blocks' unit tests, with plain values for fences.

use super::*;
use proptest::prelude::*;

const S1: StreamKey = (1, 1);
const S2: StreamKey = (1, 2);

/// Fences whose value is also their sequence number.
fn fs(v: &[(StreamKey, u32)]) -> FenceSet<u32> {
    v.iter()
        .map(|&(key, x)| crate::order::Stamped {
            key,
            seq: u64::from(x),
            fence: x,
        })
        .collect()
}

fn listed(f: &FenceSet<u32>) -> Vec<(StreamKey, u32)> {
    f.iter().map(|s| (s.key, s.fence)).collect()
}

fn settled(size: usize) -> Free<u32> {
    Free {
        size,
        stream: None,
        fences: FenceSet::default(),
    }
}

/// The block freed last carries the fence that covers the merged block,
/// whichever side it merges on: keeping the older one would let the
/// block settle (and its chunk be unmapped) while the newer free's work
/// still runs.
#[test]
fn a_merge_keeps_the_newest_fence_on_either_side() {
    for (first, second) in [(0usize, 16usize), (16, 0)] {
        let mut b = Blocks::<u32>::default();
        b.insert(
            first,
            Free {
                size: 16,
                stream: Some(S1),
                fences: fs(&[(S1, 1)]),
            },
        );
        b.insert(
            second,
            Free {
                size: 16,
                stream: Some(S1),
                fences: fs(&[(S1, 2)]),
            },
        );
        let (_, f) = b.iter().next().unwrap();
        assert_eq!(f.size, 32);
        assert_eq!(listed(&f.fences), vec![(S1, 2)], "freed second at {second}");
        assert_eq!(
            b.settle(|x| x.fence == 1),
            0,
            "the older fence passing settles nothing"
        );
    }
}

/// The GPU lags the CPU: of two neighbours freed on S1, one has settled
/// and one not. Coalesced, S1 gets both as one block (before, it could
/// not: a conv net mapped 1.3x its peak), other streams only once the
/// fence passes.
#[test]
fn a_settled_block_joins_a_streams_pending_neighbour() {
    for settled_first in [true, false] {
        let mut b = Blocks::<u32>::default();
        let pending = || Free {
            size: 16,
            stream: Some(S1),
            fences: fs(&[(S1, 7)]),
        };
        let (s_at, p_at) = if settled_first { (0, 16) } else { (16, 0) };
        b.insert(s_at, settled(16));
        b.insert(p_at, pending());
        assert_eq!(b.check(), Ok(()));
        assert_eq!(b.take(32, S1), None, "two blocks as inserted");
        assert_eq!(b.coalesce(S2), 0, "nothing of S2's to join");
        assert_eq!(b.coalesce(S1), 1);
        assert_eq!(b.iter().count(), 1, "one block");
        assert_eq!(b.take(32, S2), None, "S2 waits for S1's fence");
        assert_eq!(b.take(32, S1), Some(0), "S1 takes both at once");
        b.insert(s_at, settled(16));
        b.insert(p_at, pending());
        b.coalesce(S1);
        assert_eq!(b.settle(|x| x.fence == 7), 1);
        assert_eq!(b.take(32, S2), Some(0), "then anyone may");
    }
}

/// RT-3: pending(S1, older) | settled | pending(S1, newer), coalesced
/// for S1: the joined block keeps S1's newer fence, so the older one
/// passing settles nothing (before, it kept the older and handed the
/// newer free's bytes to S2).
#[test]
fn coalesce_keeps_the_newest_fence_of_the_stream() {
    let mut b = Blocks::<u32>::default();
    let pending = |x| Free {
        size: 16,
        stream: Some(S1),
        fences: fs(&[(S1, x)]),
    };
    b.insert(0, pending(1));
    b.insert(16, settled(16));
    b.insert(32, pending(3));
    assert_eq!(b.coalesce(S1), 2);
    let (_, f) = b.iter().next().unwrap();
    assert_eq!((f.size, listed(&f.fences)), (48, vec![(S1, 3)]));
    assert_eq!(b.settle(|x| x.fence == 1), 0);
    assert_eq!(b.take(48, S2), None, "S2 waits for S1's newer free");
    assert_eq!(b.settle(|x| x.fence <= 3), 1);
    assert_eq!(b.take(48, S2), Some(0));
}

/// RT-4: the block freed later on the stream may be inserted first (two
/// threads); the merge still keeps the later fence, by number.
#[test]
fn insertion_order_does_not_decide_which_fence_stays() {
    for (first, second) in [((16, 5), (0, 4)), ((0, 5), (16, 4))] {
        let mut b = Blocks::<u32>::default();
        for (at, x) in [first, second] {
            b.insert(
                at,
                Free {
                    size: 16,
                    stream: Some(S1),
                    fences: fs(&[(S1, x)]),
                },
            );
        }
        let (_, f) = b.iter().next().unwrap();
        assert_eq!(listed(&f.fences), vec![(S1, 5)]);
    }
}

/// Joining blocks merge a stream's pending free with settled neighbours
/// at once; plain blocks keep them apart.
#[test]
fn joining_blocks_merge_pending_with_settled() {
    for (mut b, pieces) in [(Blocks::<u32>::joining(), 1), (Blocks::default(), 2)] {
        b.insert(0, settled(16));
        b.insert(
            16,
            Free {
                size: 16,
                stream: Some(S1),
                fences: fs(&[(S1, 3)]),
            },
        );
        assert_eq!(b.check(), Ok(()));
        assert_eq!(b.iter().count(), pieces);
        assert_eq!(b.take(32, S2), None, "S2 waits for S1's fence either way");
    }
}

/// In joining blocks a settled block keeps the stream it was pending on as
/// a tag: that stream's next pending free joins it, another stream's does
/// not take it over, and any stream may still take it.
#[test]
fn a_settled_block_stays_with_its_stream_when_joining() {
    let mut b = Blocks::<u32>::joining();
    let pending = |s, x| Free {
        size: 16,
        stream: Some(s),
        fences: fs(&[(s, x)]),
    };
    b.insert(16, pending(S1, 1));
    assert_eq!(b.settle(|_| true), 1);
    // S2's pending free beside it stays apart: S1 (or any stream) may
    // still take the settled block while S2's fence is pending.
    b.insert(32, pending(S2, 2));
    assert_eq!(b.check(), Ok(()));
    assert_eq!(b.iter().count(), 2);
    assert_eq!(b.take(16, S2), Some(16), "settled: any stream takes it");
    // S1's pending free beside its settled block joins it: S1 may use both
    // at once, S2 neither until S1's fence passes.
    let mut b = Blocks::<u32>::joining();
    b.insert(16, pending(S1, 1));
    b.settle(|_| true);
    b.insert(0, pending(S1, 3));
    assert_eq!(b.iter().count(), 1);
    assert_eq!(b.take(32, S2), None, "S2 waits for S1's fence");
    assert_eq!(b.take(32, S1), Some(0));
    // Plain blocks drop the tag: a settled block there is nobody's.
    let mut b = Blocks::<u32>::default();
    b.insert(16, pending(S1, 1));
    b.settle(|_| true);
    assert!(b.iter().all(|(_, f)| f.stream.is_none()));
}

/// Fresh memory mapped for a stream keeps that stream's tag when it merges
/// into a settled block tagged for another (`insert_fresh`'s promise), so
/// the stream's next pending free joins the whole; in both forms.
#[test]
fn fresh_memory_keeps_its_streams_tag_through_a_merge() {
    for (trees, mut b) in [
        (false, Blocks::<u32>::joining()),
        (true, Blocks::with_bounds(true, 0, 0)),
    ] {
        b.insert_fresh(0, 16, S1);
        b.insert_fresh(16, 16, S2);
        assert_eq!(b.in_trees(), trees);
        let all: Vec<_> = b.iter().map(|(o, f)| (o, f.size, f.stream)).collect();
        assert_eq!(all, vec![(0, 32, Some(S2))], "trees: {trees}");
        b.insert(
            32,
            Free {
                size: 16,
                stream: Some(S2),
                fences: fs(&[(S2, 1)]),
            },
        );
        assert_eq!(b.iter().count(), 1, "S2's pending free joined its memory");
        assert_eq!(b.check(), Ok(()));
    }
}

/// The spared block (one that can grow) goes only when nothing else fits.
#[test]
fn take_sparing_keeps_the_growing_block() {
    let mut b = Blocks::<u32>::default();
    b.insert(0, settled(40)); // ends at 40: the "tail"
    b.insert(100, settled(64));
    let tail = |end: usize| end == 40;
    assert_eq!(
        b.take_sparing(32, S1, tail),
        Some(100),
        "the bigger one, not the tail"
    );
    assert_eq!(b.take_sparing(32, S1, tail), Some(132), "its rest");
    assert_eq!(
        b.take_sparing(32, S1, tail),
        Some(0),
        "then the tail: nothing else fits"
    );
    assert_eq!(b.take_sparing(32, S1, tail), None);
    assert_eq!(b.check(), Ok(()));
}

#[test]
fn merged_blocks_keep_one_fence_per_stream() {
    let mut b = Blocks::<u32>::default();
    for i in 0..1000 {
        b.insert(
            i * 16,
            Free {
                size: 16,
                stream: Some(S1),
                fences: fs(&[(S1, i as u32)]),
            },
        );
    }
    let (o, f) = b.iter().next().unwrap();
    assert_eq!((o, f.size, b.iter().count()), (0, 16_000, 1));
    assert_eq!(
        listed(&f.fences),
        vec![(S1, 999)],
        "the latest fence covers the rest"
    );
}

#[test]
fn best_fit_split_merge_and_streams() {
    let mut b = Blocks::<u32>::default();
    b.insert(0, settled(100));
    b.insert(200, settled(50));
    b.check().unwrap();
    assert_eq!(b.take(40, S1), Some(200), "best fit, not first fit");
    assert_eq!(b.take(10, S1), Some(240));
    b.insert(
        200,
        Free {
            size: 50,
            stream: Some(S1),
            fences: fs(&[(S1, 7)]),
        },
    );
    b.check().unwrap();
    assert_eq!(b.take(50, S2), Some(0), "S1's pending block is not S2's");
    assert_eq!(b.take(50, S2), Some(50), "the settled rest is");
    assert_eq!(b.take(50, S2), None, "only S1's pending block is left");
    assert_eq!(b.take(50, S1), Some(200), "S1 reuses its own at once");
    b.insert(
        200,
        Free {
            size: 50,
            stream: Some(S1),
            fences: fs(&[(S1, 8)]),
        },
    );
    assert_eq!(b.settle(|x| x.fence == 8), 1);
    assert_eq!(b.take(40, S2), Some(200), "settled: anyone's");
    b.check().unwrap();
    b.insert(0, settled(50));
    assert!(b.carve(10, 20), "inside a settled block");
    assert!(!b.carve(240, 20), "partly outside a block");
    b.check().unwrap();
    assert_eq!(b.free_bytes(), 10 + 20 + 10);
}

/// A zone that grows past the bound moves to trees, and back to arrays once
/// few blocks are left, keeping every block as it was.
#[test]
fn a_zone_moves_between_the_forms_by_its_count() {
    let mut b = Blocks::<u32>::with_bounds(false, 4, 2);
    // Eight blocks pending on alternating streams: none merges.
    for i in 0..8u32 {
        let s = if i % 2 == 0 { S1 } else { S2 };
        b.insert(
            i as usize * 32,
            Free {
                size: 16,
                stream: Some(s),
                fences: fs(&[(s, i)]),
            },
        );
        assert_eq!(b.in_trees(), i >= 4, "after {} blocks", i + 1);
        b.check().unwrap();
    }
    let before = listing(b.iter());
    assert_eq!(before.len(), 8);
    // Taking all but one block of S1 leaves 5: still trees (not below 2).
    for _ in 0..3 {
        assert!(b.take(16, S1).is_some());
    }
    assert!(b.in_trees());
    for _ in 0..4 {
        assert!(b.take(16, S2).is_some());
    }
    assert!(!b.in_trees(), "one block left: back to arrays");
    let after = listing(b.iter());
    assert_eq!(
        after,
        vec![before[6].clone()],
        "the block left is S1's last, as it was"
    );
    b.check().unwrap();
}

/// Every block as `(offset, size, stream, fences)`.
type Listing = Vec<(usize, usize, Option<StreamKey>, Vec<(StreamKey, u32)>)>;

fn listing<'a>(it: impl Iterator<Item = (usize, &'a Free<u32>)>) -> Listing {
    it.map(|(o, f)| (o, f.size, f.stream, listed(&f.fences)))
        .collect()
}

mod props;
