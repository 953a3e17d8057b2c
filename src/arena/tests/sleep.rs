//! An arena put to sleep and woken: runs across the zones' border, a
//! graph's blocks across a sleep, a prepared stash.

use super::*;

/// A run of chunks that spans both zones (the small zone full up to its
/// border, a large allocation right after it): a discarding or stashing
/// sleep takes the free bytes of both zones out, so nothing is handed out
/// of the unmapped run, and the wake gives them back to their own zones.
#[test]
fn a_run_across_the_zones_border_sleeps_and_wakes_whole() {
    for mode in [SleepMode::Discard, SleepMode::Stash] {
        let b = HostBackend::with_granularity(G).unwrap();
        let a: HostArena =
            Arena::new(b, ArenaDesc::new(64 << 20).max_chunk_bytes(4 << 20)).unwrap();
        let s = HostStream(0);
        let small: Vec<_> = (0..8).map(|_| a.alloc(1 << 20, &s).unwrap()).collect();
        // One 3 MiB chunk, half of it allocated: a free tail that stays
        // mapped in the large zone.
        drop(a.alloc(3 << 20, &s).unwrap());
        let mut large = a.alloc(3 << 19, &s).unwrap();
        let border = a.shared.state.lock().heap.zone_border();
        assert_eq!(
            large.address() - a.base(),
            border as u64,
            "right after the small zone"
        );
        let data = pattern(7, 3 << 19);
        large.write(0, &data).unwrap();
        let runs = a.snapshot().segments;
        assert_eq!(
            runs,
            vec![(0, border + (3 << 20))],
            "one run across the border"
        );
        let desc = SleepDesc {
            mode,
            ..SleepDesc::default()
        };
        a.sleep(&[s], &desc).unwrap();
        // The large zone's free tail of the run is not handed out asleep.
        let mut extra = a.alloc(3 << 19, &s).unwrap();
        assert!(
            extra.address() - a.base() >= (border + (3 << 20)) as u64,
            "{mode}: mapped past the sleeping run"
        );
        extra.write(0, &pattern(9, 3 << 19)).unwrap();
        a.wake(&[s], &WakeDesc::default()).unwrap();
        if mode == SleepMode::Stash {
            let mut got = vec![0u8; 3 << 19];
            large.read(0, &mut got).unwrap();
            assert!(got == data, "stashed bytes came back");
        }
        // Awake, the tail is free again, in the large zone.
        let reserved = a.stats().reserved_bytes.current;
        let again = a.alloc(3 << 19, &s).unwrap();
        assert_eq!(a.stats().reserved_bytes.current, reserved, "{mode}");
        assert!(again.address() - a.base() > border as u64);
        a.shared.state.lock().heap.check().unwrap();
        drop((small, large, extra, again));
    }
}

/// A graph's allocation still live at the release is an ordinary one from
/// then on; a discarding sleep's wake keeps a graph's held bytes its own.
#[test]
fn a_graph_outlived_by_its_output_and_a_sleep_between() {
    let a = arena(1 << 30);
    let (cap, other) = (HostStream(1), HostStream(2));
    let g = GraphPoolId(1);
    let out = a.alloc_in_graph(4 * G, &cap, g).unwrap();
    let tmp = a.alloc_in_graph(4 * G, &cap, g).unwrap();
    let tmp_at = tmp.address();
    tmp.free_into_graph(g);
    a.sleep(&[cap, other], &SleepDesc::discard()).unwrap();
    a.wake(&[cap, other], &WakeDesc::default()).unwrap();
    assert_eq!(
        a.stats().graph_bytes,
        4 * G,
        "still the graph's after the wake"
    );
    let y = a.alloc(4 * G, &other).unwrap();
    assert_ne!(
        y.address(),
        tmp_at,
        "the wake did not free the graph's block"
    );
    assert_eq!(a.release_graph(g).unwrap(), 4 * G);
    assert_eq!(a.graph_pools(), vec![]);
    drop(out); // an ordinary free now
    drop(y);
    let s = a.stats();
    assert_eq!((s.allocated_bytes.current, s.graph_bytes), (0, 0));
    a.empty_cache().unwrap();
    assert_eq!(a.stats().reserved_bytes.current, 0);
}

/// `prepare_sleep` maps a stash's pieces a batch at a time (1 MiB under
/// unit tests): an arena of several MiB stages in several holds of its
/// lock, the stash then holds every piece, and the stashing sleep maps no
/// piece and creates none (the stash and the host pool are as prepared).
#[test]
fn a_prepared_stash_is_staged_in_batches_and_the_sleep_maps_nothing() {
    let b = HostBackend::with_granularity(G).unwrap();
    let a: HostArena = Arena::new(b, ArenaDesc::new(64 << 20).max_chunk_bytes(4 * G)).unwrap();
    let s = HostStream(0);
    let mut live = Vec::new();
    for i in 0..24 {
        let n = (i % 5 + 1) * G + 123 * i;
        let mut x = a.alloc(n, &s).unwrap();
        let data = pattern(i, n);
        x.write(0, &data).unwrap();
        live.push((x, data));
    }
    // Holes: whole free chunks the sleep gives back.
    for i in [3, 9, 10, 17] {
        live.remove(i);
    }
    let desc = SleepDesc::stash().max_piece_bytes(5 * G);
    let made = a.prepare_sleep(&desc).unwrap();
    assert!(
        made > 2 * crate::sleep::STAGE_BATCH_BYTES,
        "several batches: {made}"
    );
    assert_eq!(a.stats().stash_bytes, made);
    assert_eq!(a.pool().stats().pooled_host_bytes, 0);
    let stash_pieces = || {
        let st = a.shared.state.lock();
        st.sleep.stash_pieces()
    };
    let pieces = stash_pieces();
    let hits = a.pool().stats().hits;
    let r = a.sleep(&[s], &desc).unwrap();
    assert_eq!(r.bytes, made, "the sleep copied what was staged");
    assert_eq!(r.chunks_after, pieces, "one staged piece each");
    assert_eq!(a.stats().stash_bytes, made, "no piece added");
    assert_eq!(stash_pieces(), pieces, "none mapped anew");
    assert_eq!(a.pool().stats().hits, hits, "none taken from the pool");
    a.wake(&[s], &WakeDesc::default()).unwrap();
    for (k, (x, data)) in live.iter().enumerate() {
        let mut got = vec![0u8; data.len()];
        x.read(0, &mut got).unwrap();
        assert!(got == *data, "allocation {k} came back whole");
    }
}

/// A graph's held bytes joined across the border of two discarding sleeps'
/// runs (one block freed into the graph in the first sleep's run, one in
/// the second's, joined by the graph) stay the graph's through the wake:
/// the wake cuts every held range to each run, not only those that start
/// in it, so no later request gets the second run's part.
#[test]
fn a_graphs_block_across_two_sleeps_runs_stays_its_own() {
    let a = arena(1 << 30);
    let (cap, other) = (HostStream(1), HostStream(2));
    let g = GraphPoolId(3);
    let streams = [cap, other];
    let first = a.alloc_in_graph(4 * G, &cap, g).unwrap();
    // The first sleep gives the first block's memory back; what is mapped
    // while asleep lies past it.
    a.sleep(&streams, &SleepDesc::discard()).unwrap();
    let second = a.alloc_in_graph(4 * G, &cap, g).unwrap();
    let (lo, hi) = (first.address(), second.address());
    assert_eq!(hi, lo + 4 * G as u64, "the second block follows the first");
    first.free_into_graph(g);
    second.free_into_graph(g);
    // The second sleep gives the second block's memory back: two runs side
    // by side, one held range over both.
    a.sleep(&streams, &SleepDesc::discard()).unwrap();
    a.wake(&streams, &WakeDesc::default()).unwrap();
    assert_eq!(a.stats().graph_bytes, 8 * G, "the graph holds both blocks");
    let mut taken = Vec::new();
    for _ in 0..4 {
        let y = a.alloc(2 * G, &other).unwrap();
        assert!(
            y.address() + y.capacity() as u64 <= lo || y.address() >= lo + 8 * G as u64,
            "{:#x} handed out from the graph's bytes {lo:#x}..{:#x}",
            y.address(),
            lo + 8 * G as u64
        );
        taken.push(y);
    }
    assert_eq!(a.release_graph(g).unwrap(), 8 * G);
    drop(taken);
    a.empty_cache().unwrap();
    assert_eq!(a.stats().reserved_bytes.current, 0);
}
