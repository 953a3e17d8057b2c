//! The capture findings of a review (RT4), and the frees they led to: a
//! block freed into a graph it does not own (RT4-1), a graph id used again
//! (RT4-2), frees on a stream that cannot take a fence now (a capture
//! invalidated, a fence that fails) and on a stream already destroyed. Each
//! test checks which stream may take the freed bytes, when, and that none
//! are lost. And a graph's output taken again after its free (PyTorch's
//! CUDA graph trees restore a pool's checkpoint so).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use vmmbuf::{Arena, ArenaDesc, GraphPoolId, HostBackend};

use crate::failing_backend::{Ctl, FaultBackend};

crate::register! {
    host: [
        rt4_1_pre_capture_block_freed_into_a_graph_waits_for_its_streams_work,
        rt4_2_a_released_graph_id_used_again_keeps_the_pools_apart,
        a_deferred_free_is_covered_at_the_streams_next_call,
        a_free_whose_fence_fails_is_owed_not_lost,
        a_destroyed_streams_free_waits_for_a_device_synchronisation,
        a_retaken_graph_output_waits_for_its_earlier_uses_and_goes_back_to_its_graph,
        a_retaken_output_of_a_released_graph_is_not_kept_for_a_new_graph_of_its_id,
    ],
    gpu: [
        cuda_frees_in_every_capture_state_wait_for_the_pre_capture_work,
    ],
}

type Fb = FaultBackend<HostBackend>;
const G: usize = 64 << 10;

/// An arena of room for `chunks` granules, and its backend. The backend's
/// device synchronisations fail until `fail_every(None)`: a test then sees
/// which hand-outs needed one (on the host backend one always succeeds, and
/// would stand for every owed free).
fn arena(chunks: usize) -> (Arc<Fb>, Arena<Fb, Ctl>) {
    let fb = FaultBackend::new(HostBackend::with_granularity(G).unwrap());
    fb.fail_every(Some("synchronize"));
    let a = Arena::new(
        fb.clone(),
        ArenaDesc::new(64 << 20).max_reserved_bytes(chunks * G),
    )
    .unwrap();
    (fb, a)
}

/// RT4-1: an allocation made before a capture on s1, with work queued on s1
/// before the capture began, is freed during the capture. No fence can be
/// recorded on s1 then; after the graph's release another stream must not
/// get the bytes before a fence recorded on s1 after the capture passes.
fn rt4_1_pre_capture_block_freed_into_a_graph_waits_for_its_streams_work() {
    let (_fb, arena) = arena(2);
    let (s1, s2) = (Ctl::new(1), Ctl::new(2));
    let a = arena.alloc(G, &s1).unwrap();
    let at = a.address();
    let g = GraphPoolId(7);
    // s1 is captured into graph 7: a later allocation of the capture does
    // not take A's bytes (work queued before the capture may use them).
    a.free_into_graph(g);
    assert_eq!(s1.fences(), 0, "nothing recorded on a captured stream");
    let in_capture = arena.alloc_in_graph(G, &s1, g).unwrap();
    assert_ne!(
        in_capture.address(),
        at,
        "the capture retook a pre-capture block"
    );
    in_capture.free_into_graph(g);
    assert_eq!(arena.release_graph(g).unwrap(), 2 * G);
    // Both granules are free; A's only for s1 until s1's work is fenced.
    let b = arena.alloc(G, &s2).unwrap();
    assert_ne!(
        b.address(),
        at,
        "s2 got A's bytes with s1's pre-capture work unfenced"
    );
    assert!(
        arena.alloc(G, &s2).is_err(),
        "a second request on s2 fits only in A's bytes, which s2 must not take \
         before s1's work is fenced or the device synchronised"
    );
    // s1's next call, outside the capture, records a cover for the free.
    let c = arena.alloc(1, &s1).unwrap();
    assert_eq!(s1.fences(), 1, "s1's next call records one cover");
    drop(c);
    assert!(arena.alloc(G, &s2).is_err(), "the cover has not passed");
    s1.finish();
    let d = arena
        .alloc(G, &s2)
        .expect("A's bytes, once s1's cover passed");
    assert_eq!(d.address(), at);
    drop((b, d));
    s2.finish();
    s1.finish();
    let st = arena.stats();
    assert_eq!(st.allocated_bytes.current, 0);
}

/// RT4-2: a graph id used again after its release: the old allocation is
/// an ordinary one (its block goes to the free index, not to the new
/// graph), and the new pool's live count stays right.
fn rt4_2_a_released_graph_id_used_again_keeps_the_pools_apart() {
    let (_fb, arena) = arena(16);
    let s1 = Ctl::new(1);
    let g = GraphPoolId(9);
    let old = arena.alloc_in_graph(G, &s1, g).unwrap();
    assert_eq!(old.graph(), Some(g));
    arena.release_graph(g).unwrap();
    assert_eq!(old.graph(), None, "released: an ordinary allocation");
    let new = arena.alloc_in_graph(G, &s1, g).unwrap();
    assert_eq!(arena.graph_pools(), vec![(g, 0, 1)]);
    drop(old);
    assert_eq!(
        arena.graph_pools(),
        vec![(g, 0, 1)],
        "the old allocation's drop touched the new pool"
    );
    drop(new);
    assert_eq!(arena.graph_pools(), vec![(g, G, 0)]);
    assert_eq!(arena.release_graph(g).unwrap(), G);
    assert!(arena.graph_pools().is_empty());
    s1.finish();
    assert_eq!(arena.stats().allocated_bytes.current, 0);
}

/// `free_deferred`: no fence at the free; the stream's own next call
/// records one; other streams take the bytes once it passed, the own
/// stream at once.
fn a_deferred_free_is_covered_at_the_streams_next_call() {
    let (_fb, arena) = arena(2);
    let (s1, s2) = (Ctl::new(1), Ctl::new(2));
    let a = arena.alloc(G, &s1).unwrap();
    let at = a.address();
    a.free_deferred();
    assert_eq!(s1.fences(), 0);
    let b = arena.alloc(G, &s2).unwrap();
    assert_ne!(b.address(), at);
    // s1 itself may take it again at once (its work is in order).
    let again = arena.alloc(G, &s1).unwrap();
    assert_eq!(again.address(), at);
    assert_eq!(s1.fences(), 1, "the call covered the owed free");
    drop(again);
    assert_eq!(s1.fences(), 2, "an ordinary free records its fence");
    assert!(arena.alloc(G, &s2).is_err());
    s1.finish();
    assert_eq!(arena.alloc(G, &s2).unwrap().address(), at);
    drop(b);
    s2.finish();
}

/// A fence that cannot be recorded (a capture invalidated under the free):
/// the free is owed, and the bytes come back after the stream's next
/// successful fence, instead of being kept from every stream for ever.
fn a_free_whose_fence_fails_is_owed_not_lost() {
    let (_fb, arena) = arena(2);
    let (s1, s2) = (Ctl::new(1), Ctl::new(2));
    let a = arena.alloc(G, &s1).unwrap();
    let at = a.address();
    s1.broken.store(true, Ordering::SeqCst);
    drop(a);
    let b = arena.alloc(G, &s2).unwrap();
    assert_ne!(b.address(), at);
    assert!(arena.alloc(G, &s2).is_err(), "s1's work was never fenced");
    s1.broken.store(false, Ordering::SeqCst);
    let c = arena.alloc(G, &s1).unwrap();
    assert_eq!(c.address(), at, "its own stream takes it");
    assert_eq!(s1.fences(), 1, "the first call that can records the cover");
    drop(c);
    s1.finish();
    assert_eq!(arena.alloc(G, &s2).unwrap().address(), at);
    drop(b);
    s2.finish();
    // Nothing lost: every byte can be handed out again.
    let (x, y) = (arena.alloc(G, &s2).unwrap(), arena.alloc(G, &s2).unwrap());
    assert_ne!(x.address(), y.address());
}

/// `free_stream_destroyed`: no stream takes the bytes, not even a new
/// stream with the old one's handle, until a device synchronisation.
fn a_destroyed_streams_free_waits_for_a_device_synchronisation() {
    let (fb, arena) = arena(2);
    let s1 = Ctl::new(1);
    let a = arena.alloc(G, &s1).unwrap();
    let at = a.address();
    a.free_stream_destroyed();
    drop(s1);
    // A new stream that got the destroyed one's handle.
    let reborn = Ctl::new(1);
    let b = arena.alloc(G, &reborn).unwrap();
    assert_ne!(
        b.address(),
        at,
        "a new stream with the old handle took its bytes"
    );
    assert_eq!(reborn.fences(), 0, "nothing is owed on the new stream");
    // Out of room, the arena must synchronise the device before any stream
    // takes the bytes: refused while it cannot, then handed out.
    assert!(arena.alloc(G, &Ctl::new(3)).is_err());
    fb.fail_every(None);
    let c = arena
        .alloc(G, &Ctl::new(3))
        .expect("out of room, the arena waits for the destroyed stream's work");
    assert_eq!(c.address(), at);
    drop((b, c));
    arena.empty_cache().unwrap();
}

/// On the GPU, through the arena of CUDA streams: in each capture state
/// (a capture active in global, thread-local and relaxed mode; one
/// invalidated and not yet ended; after its failed end) a block that s1's
/// pre-capture work still reads (a kernel spinning first) is freed the way
/// the PyTorch plug-in frees it, the graph is released, and s2 asks for the
/// same size: it must get other bytes while that work runs; the kernel
/// sees every word it expects; and every byte comes back in the end.
fn cuda_frees_in_every_capture_state_wait_for_the_pre_capture_work() {
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode as M};
    use vmmbuf::cuda::{capture_state, CaptureState};

    let backend = crate::common::gpu();
    let k = crate::cuda_only::Kernels::load(&backend);
    let arena: vmmbuf::cuda::CudaArena =
        Arena::new(backend.clone(), ArenaDesc::new(1 << 30)).unwrap();
    let ctx = backend.context();
    let words = 1u64 << 20;
    let bytes = (words * 4) as usize;
    for (case, mode) in [
        ("active, global", M::CU_STREAM_CAPTURE_MODE_GLOBAL),
        (
            "active, thread-local",
            M::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        ),
        ("active, relaxed", M::CU_STREAM_CAPTURE_MODE_RELAXED),
        ("invalidated", M::CU_STREAM_CAPTURE_MODE_GLOBAL),
        ("after a failed end", M::CU_STREAM_CAPTURE_MODE_GLOBAL),
    ] {
        let (s1, s2) = (ctx.new_stream().unwrap(), ctx.new_stream().unwrap());
        let seed = 0x5eed ^ case.len() as u32;
        let a = arena.alloc(bytes, &s1).unwrap();
        let at = a.address();
        k.fill_on(&s1, at, 0, words, seed);
        // Queued before the capture: spins ~200 ms, then reads every word.
        let bad = k.spin_then_check(&s1, at, 0, words, seed, 200_000_000);
        s1.begin_capture(mode).unwrap();
        let invalid =
            case != "active, global" && case != "active, thread-local" && case != "active, relaxed";
        if invalid {
            // A synchronising call during a global-mode capture invalidates it.
            assert!(ctx.synchronize().is_err(), "{case}: the sync was allowed");
        }
        let state = capture_state(&s1).unwrap();
        match (&state, invalid) {
            (CaptureState::Active(c), false) => {
                let g = c.pool();
                let released = Arc::new(AtomicBool::new(false));
                let r = released.clone();
                c.on_release(move || r.store(true, Ordering::SeqCst))
                    .unwrap();
                // The capture allocates and frees a block of its own too.
                let own = arena.alloc_in_graph(bytes, &s1, g).unwrap();
                assert_ne!(
                    own.address(),
                    at,
                    "{case}: the capture took a pre-capture block"
                );
                own.free_into_graph(g);
                a.free_into_graph(g);
                let graph = s1
                    .end_capture(
                        CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
                    )
                    .unwrap();
                drop(graph);
                // CUDA runs the release callback on a thread of its own.
                let t0 = std::time::Instant::now();
                while !released.load(Ordering::SeqCst) {
                    assert!(
                        t0.elapsed().as_secs() < 10,
                        "{case}: the graph was never released"
                    );
                    std::thread::yield_now();
                }
                arena.release_graph(g).unwrap();
            }
            (CaptureState::Invalidated, true) if case == "invalidated" => {
                a.free_deferred();
                assert!(s1
                    .end_capture(
                        CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH
                    )
                    .is_err());
            }
            (CaptureState::Invalidated, true) => {
                assert!(s1
                    .end_capture(
                        CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH
                    )
                    .is_err());
                assert!(matches!(capture_state(&s1).unwrap(), CaptureState::None));
                // The stream is an ordinary one again: an ordinary free.
                drop(a);
            }
            (other, _) => panic!("{case}: the stream is {other:?}"),
        }
        // s2 asks for the same size while s1's kernel spins.
        let b = arena.alloc(bytes, &s2).unwrap();
        assert_ne!(
            b.address(),
            at,
            "{case}: s2 got the bytes s1's pre-capture work reads"
        );
        k.fill_on(&s2, b.address(), 0, words, !seed);
        let got = s1.clone_dtoh(&bad).unwrap()[0];
        assert_eq!(
            got, 0,
            "{case}: s1's pre-capture kernel saw {got} words changed"
        );
        s2.synchronize().unwrap();
        drop(b);
        // s1's next call covers its owed free: then s2 may take the bytes.
        drop(arena.alloc(4096, &s1).unwrap());
        s1.synchronize().unwrap();
        assert_eq!(arena.stats().allocated_bytes.current, 0, "{case}");
    }
    arena.empty_cache().unwrap();
    let st = arena.stats();
    assert_eq!(st.active_bytes.current, 0);
    assert_eq!(st.reserved_bytes.current, 0, "every chunk back to the pool");
}

/// `Arena::retake`: a graph's output, freed with work still queued on two
/// streams, lives again at its address for a third; freed again, the
/// block is its graph's once more, and after the graph's release no
/// stream gets it before the work of its first life has finished.
fn a_retaken_graph_output_waits_for_its_earlier_uses_and_goes_back_to_its_graph() {
    let (_fb, arena) = arena(2);
    let (s1, s2, s3) = (Ctl::new(1), Ctl::new(2), Ctl::new(3));
    let g = GraphPoolId(11);
    let out = arena.alloc_in_graph(G, &s1, g).unwrap();
    let at = out.address();
    let other = arena.alloc(G, &s1).unwrap();
    assert!(
        arena.retake(at, G, &s3).is_err(),
        "a live allocation is not retaken"
    );
    out.record_stream(&s2);
    drop(out);
    assert_eq!(arena.graph_pools(), vec![(g, G, 0)], "held for its graph");
    let again = arena.retake(at, G, &s3).expect("the held output");
    assert_eq!((again.address(), again.len()), (at, G));
    assert_eq!(arena.graph_pools(), vec![(g, 0, 0)], "live again");
    assert!(arena.retake(at, G, &s3).is_err(), "retaken twice");
    assert_eq!(arena.stats().allocated_bytes.current, 2 * G);
    drop(again);
    assert_eq!(arena.graph_pools(), vec![(g, G, 0)], "its graph's again");
    assert_eq!(arena.release_graph(g).unwrap(), G);
    drop(other);
    s1.finish();
    s3.finish();
    // Free now, but s2's work from the output's first life is pending.
    let first = arena.alloc(G, &s3).unwrap();
    assert_ne!(first.address(), at, "s3 got bytes s2's work still uses");
    assert!(
        arena.alloc(G, &s3).is_err(),
        "only the retaken block is left"
    );
    s2.finish();
    let last = arena.alloc(G, &s3).expect("once s2's work has finished");
    assert_eq!(last.address(), at);
    drop((first, last));
    s3.finish();
    assert_eq!(arena.stats().allocated_bytes.current, 0);
    assert!(
        arena.retake(at + 1, G, &s3).is_err() && arena.retake(0, G, &s3).is_err(),
        "no block held there"
    );
}

/// A graph's output retaken, then the graph released and its id used again
/// by a new capture: the retaken allocation is an ordinary one now (as any
/// allocation of a released graph), and its free does not keep the block
/// for the new graph of the same id.
fn a_retaken_output_of_a_released_graph_is_not_kept_for_a_new_graph_of_its_id() {
    let (_fb, arena) = arena(4);
    let s1 = Ctl::new(1);
    let g = GraphPoolId(12);
    let out = arena.alloc_in_graph(G, &s1, g).unwrap();
    let at = out.address();
    drop(out);
    let again = arena.retake(at, G, &s1).expect("the held output");
    assert_eq!(
        arena.release_graph(g).unwrap(),
        0,
        "nothing held: it is live"
    );
    // The id comes back with a new capture, which allocates.
    let new = arena.alloc_in_graph(G, &s1, g).unwrap();
    assert_eq!(arena.graph_pools(), vec![(g, 0, 1)]);
    drop(again);
    assert_eq!(
        arena.graph_pools(),
        vec![(g, 0, 1)],
        "the old graph's block was kept for the new graph of its id"
    );
    drop(new);
    assert_eq!(
        arena.release_graph(g).unwrap(),
        G,
        "only the new graph's block"
    );
    s1.finish();
    assert_eq!(arena.stats().allocated_bytes.current, 0);
}
