//! The arena on the host backend: real mappings, the same code as on CUDA.

use proptest::prelude::*;

use super::*;
use crate::{HostBackend, SleepDesc, SleepMode, WakeDesc};

type HostArena = Arena<HostBackend, HostStream>;
const G: usize = 64 << 10;

fn arena(max: usize) -> HostArena {
    let b = HostBackend::with_granularity(G).unwrap();
    Arena::new(b, ArenaDesc::new(max).max_chunk_bytes(4 * G)).unwrap()
}

fn pattern(seed: usize, n: usize) -> Vec<u8> {
    (0..n)
        .map(|i| (i.wrapping_mul(31) ^ seed.wrapping_mul(2_654_435_761)) as u8 ^ 0x5a)
        .collect()
}

#[derive(Clone, Debug)]
enum Op {
    Alloc(usize, u64),
    Free(usize),
    Release,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (1..(3 * G), 0..3u64).prop_map(|(n, s)| Op::Alloc(n, s)),
        4 => (0..64usize).prop_map(Op::Free),
        1 => Just(Op::Release),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// Allocations never overlap, stay aligned and keep every byte, in any
    /// order of alloc and free across streams; when everything is freed, the
    /// mapped memory goes back to the pool.
    #[test]
    fn allocations_are_disjoint_aligned_and_keep_their_bytes(ops in prop::collection::vec(op(), 1..120)) {
        let a = arena(1 << 30);
        let mut live: Vec<(Allocation<HostBackend, HostStream>, Vec<u8>)> = Vec::new();
        for (i, op) in ops.into_iter().enumerate() {
            match op {
                Op::Alloc(n, s) => {
                    let mut al = a.alloc(n, &HostStream(s)).unwrap();
                    prop_assert_eq!(al.address() % 256, 0);
                    prop_assert!(al.capacity() >= n && al.len() == n);
                    let data = pattern(i, n);
                    al.write(0, &data).unwrap();
                    for (other, _) in &live {
                        let (x, y) = (al.address(), other.address());
                        prop_assert!(x + al.capacity() as u64 <= y || y + other.capacity() as u64 <= x,
                            "{:#x}+{} overlaps {:#x}+{}", x, al.capacity(), y, other.capacity());
                    }
                    live.push((al, data));
                }
                Op::Free(k) => {
                    if !live.is_empty() {
                        let (al, data) = live.swap_remove(k % live.len());
                        let mut back = vec![0u8; data.len()];
                        al.read(0, &mut back).unwrap();
                        prop_assert!(back == data, "bytes changed while allocated");
                    }
                }
                Op::Release => {
                    a.release_cached().unwrap();
                }
            }
            let s = a.stats();
            let allocated: usize = live.iter().map(|(al, _)| al.capacity()).sum();
            prop_assert_eq!(s.allocated_bytes.current, allocated);
            prop_assert!(s.reserved_bytes.current >= allocated);
            let st = a.shared.state.lock();
            st.region.table.check().map_err(TestCaseError::fail)?;
        }
        for (al, data) in &live {
            let mut back = vec![0u8; data.len()];
            al.read(0, &mut back).unwrap();
            prop_assert!(&back == data);
        }
        drop(live);
        let (before, pooled) = (a.stats().reserved_bytes.current, a.stats().pooled_bytes);
        let released = a.release_cached().unwrap();
        let s = a.stats();
        prop_assert_eq!(released, before);
        prop_assert_eq!(s.reserved_bytes.current, 0, "everything went back to the pool");
        prop_assert_eq!(s.pooled_bytes, pooled + before);
        prop_assert_eq!(s.allocated_bytes.current, 0);
    }
}

#[test]
fn a_stream_reuses_its_own_frees_at_once_and_others_after_settling() {
    let a = arena(1 << 30);
    let x = a.alloc(1000, &HostStream(1)).unwrap();
    let at = x.address();
    drop(x);
    // Stream 1 reuses its own free at once, without asking the fence.
    let z = a.alloc(1000, &HostStream(1)).unwrap();
    assert_eq!(z.address(), at, "the same stream reuses its free at once");
    drop(z);
    // Stream 2 gets it only once the free's fence is seen to have passed
    // (host fences pass at once: settled on the first miss). The pending
    // case, where it must not, is `blocks::tests` and the GPU tests.
    let y = a.alloc(1000, &HostStream(2)).unwrap();
    assert_eq!(y.address(), at, "settled, then reused by another stream");
    drop(y);
    let s = a.stats();
    assert_eq!((s.num_allocs, s.num_frees), (3, 3));
    assert_eq!(s.num_device_syncs, 0);
}

#[test]
fn freed_chunks_in_the_middle_go_back_to_the_pool_and_are_mapped_again() {
    let a = arena(1 << 30);
    let s = HostStream(0);
    let blocks: Vec<_> = (0..6).map(|_| a.alloc(4 * G, &s).unwrap()).collect();
    let reserved = a.stats().reserved_bytes.current;
    assert_eq!(reserved, 24 * G);
    assert_eq!(a.stats().num_device_alloc, 6, "one chunk mapped per block");
    let mut blocks = blocks.into_iter();
    let (b0, b1, b2) = (
        blocks.next().unwrap(),
        blocks.next().unwrap(),
        blocks.next().unwrap(),
    );
    let rest: Vec<_> = blocks.collect();
    drop(b1); // a whole chunk in the middle
    assert_eq!(a.release_cached().unwrap(), 4 * G);
    assert_eq!(a.stats().num_device_free, 1, "one range unmapped");
    let snap = a.snapshot();
    assert_eq!(snap.segments.len(), 2, "a hole in the middle:\n{snap}");
    assert_eq!(a.stats().pooled_bytes, 4 * G);
    // The next mapping takes the pooled chunk, at the lowest hole.
    let again = a.alloc(4 * G, &s).unwrap();
    assert_eq!(again.address(), b0.address() + (4 * G) as u64);
    assert_eq!(a.stats().pooled_bytes, 0);
    assert_eq!(a.stats().reserved_bytes.current, 24 * G);
    assert_eq!(a.stats().num_device_alloc, 7, "mapped again");
    drop((b0, b2, rest, again));
    assert!(a.snapshot().to_string().contains("free"));
}

/// Larger than the budget of 16 chunks, or than the reservation's large
/// zone: no retry can succeed, and the error says so.
fn refuses_what_never_fits(a: &HostArena, s: &HostStream) {
    // Larger than the budget: no retry can succeed, and the error says so.
    match a.alloc(17 * G, s) {
        Err(
            e @ Error::ArenaOutOfMemory {
                never_fits: true,
                budget_bytes: Some(b),
                ..
            },
        ) => {
            assert_eq!(b, 16 * G);
            assert!(!e.is_transient());
            assert!(e.to_string().contains("no retry can succeed"), "{e}");
        }
        other => panic!("over the budget, never fits: {other:?}"),
    }
    // Larger than the reservation's large zone too.
    assert!(matches!(
        a.alloc(2 << 30, s),
        Err(Error::ArenaOutOfMemory {
            never_fits: true,
            ..
        })
    ));
}

/// Whether `al` holds `want` from its start.
fn holds(al: &Allocation<HostBackend, HostStream>, want: &[u8]) -> bool {
    let mut back = vec![0u8; want.len()];
    al.read(0, &mut back).unwrap();
    back == want
}

#[test]
fn out_of_memory_leaves_existing_allocations_intact() {
    let b = HostBackend::with_granularity(G).unwrap();
    let a: HostArena = Arena::new(
        b,
        ArenaDesc::new(1 << 30)
            .max_chunk_bytes(4 * G)
            .max_reserved_bytes(16 * G),
    )
    .unwrap();
    let s = HostStream(0);
    let mut kept = Vec::new();
    for i in 0..3 {
        let mut al = a.alloc(4 * G, &s).unwrap();
        al.write(0, &pattern(i, 4 * G)).unwrap();
        kept.push(al);
    }
    let r = a.alloc(8 * G, &s);
    match r {
        Err(Error::ArenaOutOfMemory {
            requested_bytes,
            reserved_bytes,
            ..
        }) => {
            assert_eq!(requested_bytes, 8 * G);
            assert_eq!(reserved_bytes, 12 * G);
        }
        other => panic!("over the budget: {other:?}"),
    }
    assert!(
        a.alloc(8 * G, &s).unwrap_err().is_transient(),
        "fits the budget once memory is freed: worth a retry"
    );
    refuses_what_never_fits(&a, &s);
    assert_eq!(a.stats().num_ooms, 4);
    let st = a.stats();
    assert_eq!((st.num_ooms, st.allocated_bytes.current), (4, 12 * G));
    for (i, al) in kept.iter().enumerate() {
        assert!(
            holds(al, &pattern(i, 4 * G)),
            "allocation {i} intact after the OOM"
        );
    }
    // A free makes room; the retry path gives whole free chunks back first.
    kept.remove(1);
    let big = a.alloc(8 * G, &s).unwrap();
    assert_eq!(big.capacity(), 8 * G);
    let st = a.stats();
    assert_eq!(st.reserved_bytes.current, 16 * G, "within the budget");
    assert_eq!(
        st.pooled_bytes, 0,
        "the freed middle chunk went to the pool and was mapped again"
    );
    assert!(matches!(a.alloc(0, &s), Err(Error::InvalidArgument(_))));
}

#[test]
fn stats_have_peaks_and_reset() {
    let a = arena(1 << 30);
    let s = HostStream(0);
    let x = a.alloc(3 * G + 1, &s).unwrap();
    let y = a.alloc(100, &s).unwrap();
    drop(x);
    let st = a.stats();
    assert_eq!(st.allocated_bytes.peak, 3 * G + 256 + 256);
    assert_eq!(st.requested_bytes.peak, 3 * G + 1 + 100);
    assert_eq!(st.allocated_bytes.current, 256);
    // So far: both allocated, the first freed (PyTorch's allocated and
    // freed totals; reset_peak leaves them).
    assert_eq!(
        (st.allocated_bytes_total, st.freed_bytes_total),
        ((3 * G + 256 + 256) as u64, (3 * G + 256) as u64)
    );
    assert_eq!(
        (st.requested_bytes_total, st.requested_freed_total),
        ((3 * G + 1 + 100) as u64, (3 * G + 1) as u64)
    );
    a.reset_peak();
    assert_eq!(a.stats().allocated_bytes.peak, 256);
    assert!(st.fragmentation >= 0.0 && st.fragmentation < 1.0);
    let text = a.snapshot().to_string();
    assert!(
        text.contains("allocated_bytes") && text.contains("allocated"),
        "{text}"
    );
    drop(y);
}

/// A budget shared by two arenas and a buffer (a PyTorch process's tags on
/// one device share one): together they never map past it; what one gives
/// back the others can take; a request past the whole limit never fits.
#[test]
fn a_shared_budget_bounds_arenas_and_buffers_together() {
    let b = HostBackend::with_granularity(G).unwrap();
    let budget = crate::Budget::new(16 * G);
    let desc = || {
        ArenaDesc::new(1 << 30)
            .max_chunk_bytes(4 * G)
            .shared_budget(budget.clone())
    };
    let (a1, a2): (HostArena, HostArena) = (
        Arena::new(b.clone(), desc()).unwrap(),
        Arena::new(b.clone(), desc()).unwrap(),
    );
    let s = HostStream(0);
    let mut x = a1.alloc(10 * G, &s).unwrap();
    x.write(0, &pattern(1, 10 * G)).unwrap();
    assert_eq!(budget.used(), 10 * G);
    let r = a2.alloc(8 * G, &s);
    assert!(
        matches!(&r, Err(e @ Error::ArenaOutOfMemory { never_fits: false, .. }) if e.is_transient()),
        "past the shared budget, for now: {r:?}"
    );
    let buf = crate::GrowableBuffer::new(
        b.clone(),
        crate::BufferDesc::new(64 * G)
            .growth(crate::GrowthPolicy::Exact)
            .pooled(false)
            .budget(budget.clone()),
    )
    .unwrap();
    buf.grow_to(4 * G).unwrap();
    assert_eq!(budget.used(), 14 * G);
    assert!(matches!(buf.grow_to(8 * G), Err(Error::OutOfMemory { .. })));
    assert_eq!(
        (buf.len(), buf.capacity()),
        (4 * G, 4 * G),
        "a failed growth changes nothing"
    );
    assert!(matches!(
        a2.alloc(17 * G, &s),
        Err(Error::ArenaOutOfMemory {
            never_fits: true,
            ..
        })
    ));
    // a1 gives its memory back: a2 may take it.
    let mut back = vec![0u8; 10 * G];
    x.read(0, &mut back).unwrap();
    assert!(back == pattern(1, 10 * G));
    drop(x);
    a1.release_cached().unwrap();
    assert_eq!(budget.used(), 4 * G);
    let y = a2.alloc(8 * G, &s).unwrap();
    assert_eq!(budget.used(), 12 * G);
    drop(y);
    drop(buf);
    drop((a1, a2));
    assert_eq!(budget.used(), 0, "everything given back");
    assert_eq!(b.live().chunks, 0);
}

/// Whether `b` lies apart from `[at, at + bytes)`.
fn apart(b: &Allocation<HostBackend, HostStream>, at: u64, bytes: u64) -> bool {
    b.address() + b.capacity() as u64 <= at || b.address() >= at + bytes
}

/// The snapshot and `graph_pools` show `bytes` held by graph `g`, and
/// nothing held by another.
fn shows_graph_blocks(a: &HostArena, g: GraphPoolId, bytes: usize) {
    let snap = a.snapshot();
    let held: usize = snap
        .blocks
        .iter()
        .filter(|b| b.graph == Some(g))
        .map(|b| b.bytes)
        .sum();
    assert_eq!(
        held, bytes,
        "the snapshot shows the graph's blocks:\n{snap}"
    );
    assert_eq!(a.graph_pools(), vec![(g, bytes, 0)]);
}

/// A CUDA graph's pool: what a capture allocates and frees stays the
/// graph's (retaken only by the same capture on the same stream) until the
/// release; then it is free memory again and goes back to the pool.
#[test]
fn a_graphs_blocks_stay_its_own_until_released() {
    let a = arena(1 << 30);
    let (cap, other) = (HostStream(1), HostStream(2));
    let g = GraphPoolId(7);
    let before = a.stats().reserved_bytes.current;
    // A block freed before the capture is settled (host fences pass at
    // once): the capture may take it.
    let x = a.alloc(3000, &other).unwrap();
    let x_at = x.address();
    drop(x);
    let t1 = a.alloc_in_graph(3000, &cap, g).unwrap();
    assert_eq!(t1.graph(), Some(g));
    assert_eq!(t1.address(), x_at, "settled memory serves a capture");
    let out = a.alloc_in_graph(5000, &cap, g).unwrap();
    let (t1_at, out_at) = (t1.address(), out.address());
    // A temporary freed in the capture comes back to the same capture...
    t1.free_into_graph(g);
    assert_eq!(a.stats().graph_bytes, 3072);
    let t2 = a.alloc_in_graph(1000, &cap, g).unwrap();
    assert_eq!(t2.address(), t1_at, "the capture retakes its own free");
    t2.free_into_graph(g);
    // ...but nothing else does: another stream, or another graph.
    let y = a.alloc(1000, &other).unwrap();
    let z = a.alloc_in_graph(1000, &cap, GraphPoolId(8)).unwrap();
    for b in [&y, &z] {
        assert!(
            apart(b, t1_at, 3072),
            "a graph's block went to another user"
        );
    }
    drop(z);
    assert_eq!(a.release_graph(GraphPoolId(8)).unwrap(), 1024);
    // The graph's output, freed after the capture, stays the graph's.
    drop(out);
    let s = a.stats();
    assert_eq!(s.graph_bytes, 3072 + 5120);
    assert_eq!(s.allocated_bytes.current, y.capacity());
    assert_eq!(
        s.active_bytes.current, s.allocated_bytes.current,
        "free blocks graphs hold are not active"
    );
    shows_graph_blocks(&a, g, 3072 + 5120);
    // Nothing the graph holds goes back to the pool.
    a.empty_cache().unwrap();
    assert!(a.stats().reserved_bytes.current >= 3072 + 5120);
    let w = a.alloc(5000, &other).unwrap();
    assert!(apart(&w, out_at, 5120));
    drop(w);
    drop(y);
    // Released: free memory, reused and given back as any other.
    assert_eq!(a.release_graph(g).unwrap(), 3072 + 5120);
    assert_eq!(a.release_graph(g).unwrap(), 0, "released once");
    let s = a.stats();
    assert_eq!((s.graph_bytes, s.allocated_bytes.current), (0, 0));
    let again = a.alloc(5000, &other).unwrap();
    drop(again);
    a.empty_cache().unwrap();
    assert_eq!(a.stats().reserved_bytes.current, before);
    assert!(a.graph_pools().is_empty());
}

#[test]
fn granting_peer_access_where_there_are_no_peers_changes_nothing() {
    // The host backend has no peers: the grant finds nothing to add, and
    // the chunks keep the access they had (a write and a read still work).
    let a = arena(1 << 30);
    let s = HostStream(0);
    let mut x = a.alloc(3 * G, &s).unwrap();
    let data = pattern(5, 3 * G);
    x.write(0, &data).unwrap();
    assert!(!a.grants_peer_access());
    assert_eq!(a.grant_peer_access().unwrap(), 0);
    assert!(!a.grants_peer_access());
    let mut back = vec![0u8; 3 * G];
    x.read(0, &mut back).unwrap();
    assert!(back == data, "bytes kept");
    let y = a.alloc(8 * G, &s).unwrap();
    assert_eq!(a.stats().num_device_alloc, 3, "mapped as before");
    drop((x, y));
}

mod sleep;
