//! The arena against a real workload: a trace recorded from PyTorch training
//! (scripts/bench/torch_trace.py on an H100), replayed on the host backend with
//! CUDA's 2 MiB granularity, so it runs in CI.

use std::sync::Arc;

use cudarc::driver::{CudaStream, PushKernelArg};
use vmmbuf::{
    host::HostStream, trace::replay_trace, trace::TraceEvent, Arena, ArenaDesc, Backend,
    CudaBackend, HostBackend,
};

use crate::common::gpu;
use crate::cuda_only::{counted, pattern, Kernels};

crate::register! {
    host: [a_pytorch_training_trace_takes_at_most_1_01x_its_peak, a_recorded_trace_holds_exactly_the_calls_made_while_recording, allocations_are_send_and_sync_and_hold_the_arena, a_device_margin_refuses_growth_that_leaves_less_free, a_deferred_free_goes_back_to_another_arena_of_the_budget, a_budget_changed_in_use_holds_from_the_next_mapping],
    gpu: [owned_typed_tensors_behave_as_cudarc_slices, gpu_statistics_keep_pytorchs_invariants_at_every_step, cuda_frees_are_stream_ordered, the_pytorch_trace_on_the_gpu, at_the_budget_the_arena_waits_for_frees_in_flight],
}

fn a_pytorch_training_trace_takes_at_most_1_01x_its_peak() {
    let events = torch_trace();
    // Host chunks are memfds: about two thousand of them at the peak.
    vmmbuf::host::raise_fd_limit();
    let host = HostBackend::with_granularity(2 << 20).unwrap();
    let arena: Arena<HostBackend, HostStream> =
        Arena::new(host.clone(), ArenaDesc::new(256 << 30)).unwrap();
    let report = replay_trace(&arena, &events, HostStream).unwrap();
    let stats = arena.stats();
    drop(arena);
    eprintln!(
        "replay: {} events, peak allocated {} B, peak taken {} B: {:.4}x",
        report.events,
        report.peak_allocated_bytes,
        report.peak_reserved_bytes,
        report.overhead()
    );
    assert!(
        report.peak_allocated_bytes > 4_000_000_000,
        "the trace peaks at 4.3 GB"
    );
    assert!(report.overhead() <= 1.01, "{:.4}x", report.overhead());
    assert_eq!(
        stats.allocated_bytes.current, 0,
        "every block freed at the end"
    );
    assert_eq!(
        host.live().chunks,
        0,
        "and every chunk back to the driver with the arena"
    );
}

fn torch_trace() -> Vec<TraceEvent> {
    let events = crate::lag::trace("torch-transformer-h100.csv.gz");
    assert!(events.len() > 40_000, "{} events", events.len());
    events
}

type CudaArena = Arena<CudaBackend, Arc<CudaStream>>;

/// A block freed on stream A while A's kernel still reads it: A may reuse it
/// at once (its new work is queued after the kernel), B may not until the
/// kernel is done; nothing waits for the device, and the kernel reads
/// intact data. Two allocations are written at once through two views.
fn cuda_frees_are_stream_ordered() {
    let b = gpu();
    let k = Kernels::load(&b);
    let arena: CudaArena = Arena::new(b.clone(), ArenaDesc::new(64 << 30)).unwrap();
    let (sa, sb) = (
        b.context().new_stream().unwrap(),
        b.context().new_stream().unwrap(),
    );
    let words = 1u64 << 20; // 4 MiB
    for round in 0..20u32 {
        let mut x = arena.alloc(words as usize * 4, &sa).unwrap();
        let mut y = arena.alloc(words as usize * 4, &sa).unwrap();
        {
            // Two live allocations, both mutable at once.
            let (mut vx, mut vy) = (
                x.view_mut::<u32>(&sa).unwrap(),
                y.view_mut::<u32>(&sa).unwrap(),
            );
            let fill = |v: &mut vmmbuf::cuda::ViewMut<'_, u32>, seed: u32| {
                let mut l = sa.launch_builder(&k.fill);
                let zero = 0u64;
                l.arg(v).arg(&zero).arg(&words).arg(&seed);
                // SAFETY: test code; writes `words` u32s of the view.
                unsafe { l.launch(Kernels::cfg(words)) }.unwrap();
            };
            fill(&mut vx, round);
            fill(&mut vy, round + 1000);
        }
        let mut bad = sa.alloc_zeros::<u32>(1).unwrap();
        {
            let v = x.view::<u32>(&sa).unwrap();
            let mut l = sa.launch_builder(&k.spin_check);
            let (zero, spin) = (0u64, 5_000_000u64);
            l.arg(&v)
                .arg(&zero)
                .arg(&words)
                .arg(&round)
                .arg(&mut bad)
                .arg(&spin);
            // SAFETY: test code; reads `words` u32s of the view.
            unsafe { l.launch(Kernels::cfg(words)) }.unwrap();
        }
        let at = x.address();
        drop(x); // freed on A while A's kernel still reads it
        let other = arena.alloc(words as usize * 4, &sb).unwrap();
        assert_ne!(
            other.address(),
            at,
            "round {round}: B got A's block before A's kernel finished"
        );
        let again = arena.alloc(words as usize * 4, &sa).unwrap();
        if round == 0 {
            // (Later rounds have other free blocks of the same size to pick.)
            assert_eq!(again.address(), at, "A reuses its own free at once");
        }
        assert_eq!(
            counted(&sa, &bad, &format!("round {round}: A")),
            0,
            "round {round}: the kernel read intact data"
        );
        let got = sa.clone_dtoh(&y.view::<u32>(&sa).unwrap()).unwrap();
        assert!(got
            .iter()
            .enumerate()
            .all(|(i, &v)| v == pattern(i as u64, round + 1000)));
        drop((other, again, y));
    }
    let s = arena.stats();
    assert_eq!(s.num_device_syncs, 0, "{s}");
    assert_eq!(s.allocated_bytes.current, 0);
}

/// The PyTorch trace through a CUDA arena: the same bound as on the host.
fn the_pytorch_trace_on_the_gpu() {
    let b = gpu();
    let free_before = b.mem_info().unwrap().0;
    let arena: CudaArena = Arena::new(b.clone(), ArenaDesc::new(256 << 30)).unwrap();
    let s = b.context().new_stream().unwrap();
    let t = std::time::Instant::now();
    let report = replay_trace(&arena, &torch_trace(), |_| s.clone()).unwrap();
    let stats = arena.stats();
    eprintln!(
        "replay on the GPU: {} events in {:.2} s, peak allocated {} B, peak taken {} B: {:.4}x\n{stats}",
        report.events,
        t.elapsed().as_secs_f64(),
        report.peak_allocated_bytes,
        report.peak_reserved_bytes,
        report.overhead()
    );
    assert!(report.overhead() <= 1.01, "{:.4}x", report.overhead());
    assert_eq!(stats.num_device_syncs, 0);
    // PyTorch's invariants (issue 19): peaks kept at every operation, not
    // when read (before: peak active 517 MiB against peak allocated 4.0 GiB).
    let (a, act, r) = (
        stats.allocated_bytes,
        stats.active_bytes,
        stats.reserved_bytes,
    );
    assert!(a.peak <= act.peak && act.peak <= r.peak, "{stats}");
    assert!(a.peak >= report.peak_allocated_bytes, "{stats}");
    s.synchronize().unwrap();
    let after = arena.stats();
    assert_eq!(
        (
            after.allocated_bytes.current,
            after.active_bytes.current,
            after.inactive_split_bytes.current
        ),
        (0, 0, 0),
        "all freed, the stream synchronised: {after}"
    );
    assert_eq!(after.fragmentation, 0.0);
    drop(arena);
    s.synchronize().unwrap();
    assert_eq!(b.live().chunks, 0, "every chunk released");
    assert_eq!(b.live().reservations, 0, "and the reservation freed");
    let free_after = b.mem_info().unwrap().0;
    eprintln!("device free before {free_before}, after {free_after}");
    // The driver keeps one 2 MiB granule after this much VMM traffic (the
    // offload test sees the same); more would be ours.
    assert!(
        free_before - free_after <= 2 << 20,
        "every byte back to the driver: {} short",
        free_before - free_after
    );
}

/// `Allocation` is what a tensor stores: `Send + Sync`, no borrow of the
/// arena, which it keeps alive.
fn allocations_are_send_and_sync_and_hold_the_arena() {
    fn check<T: Send + Sync + 'static>() {}
    check::<vmmbuf::Allocation<HostBackend, HostStream>>();
    check::<vmmbuf::cuda::CudaAllocation>();
    check::<Arena<HostBackend, HostStream>>();
    let host = HostBackend::with_granularity(2 << 20).unwrap();
    let arena: Arena<HostBackend, HostStream> =
        Arena::new(host.clone(), ArenaDesc::new(1 << 30)).unwrap();
    let mut a = arena.alloc(1000, &HostStream(0)).unwrap();
    drop(arena); // the allocation keeps it alive
    a.write(0, b"still here").unwrap();
    let t = std::thread::spawn(move || {
        let mut back = [0u8; 10];
        a.read(0, &mut back).unwrap();
        back
    });
    assert_eq!(&t.join().unwrap(), b"still here");
    assert_eq!(
        host.live().chunks,
        0,
        "the last allocation took the arena with it"
    );
}

/// At its budget, an arena whose free memory is still in use by a kernel on
/// another stream waits for that stream (not the device) and serves the
/// request; it failed with out-of-memory before.
fn at_the_budget_the_arena_waits_for_frees_in_flight() {
    let b = gpu();
    let k = Kernels::load(&b);
    let budget = 64 << 20;
    let mut desc = ArenaDesc::new(1 << 30).max_reserved_bytes(budget);
    desc.release_before_map = false;
    let arena: CudaArena = Arena::new(b.clone(), desc).unwrap();
    let (sa, sb) = (
        b.context().new_stream().unwrap(),
        b.context().new_stream().unwrap(),
    );
    let words = 12u64 << 20; // 48 MiB
    let x = arena.alloc(words as usize * 4, &sa).unwrap();
    k.fill(x.address(), 0, words, 5);
    k.stream.synchronize().unwrap();
    // A kernel on A reads x for a while; x is freed meanwhile.
    let bad = k.spin_then_check(&sa, x.address(), 0, words, 5, 200_000_000);
    drop(x);
    // B needs 60 MiB: only possible once A's kernel is done with x.
    let y = arena.alloc(60 << 20, &sb).unwrap();
    assert!(arena.stats().reserved_bytes.current <= budget);
    assert_eq!(
        sa.clone_dtoh(&bad).unwrap()[0],
        0,
        "the kernel read x intact"
    );
    drop(y);
    assert_eq!(arena.stats().num_device_syncs, 0);
}

/// Issue 19: the arena's statistics on the GPU, after every step of random
/// allocs and frees over three streams with kernels in flight:
/// allocated <= active <= reserved for current values and peaks; with
/// nothing allocated and the streams synchronised, active, inactive split
/// and fragmentation read 0.
fn gpu_statistics_keep_pytorchs_invariants_at_every_step() {
    use rand::{Rng, SeedableRng};
    let b = gpu();
    let k = Kernels::load(&b);
    let streams: Vec<_> = (0..3).map(|_| b.context().new_stream().unwrap()).collect();
    for keep_mapped in [false, true] {
        let mut desc = ArenaDesc::new(16 << 30);
        desc.release_before_map = !keep_mapped;
        let arena: CudaArena = Arena::new(b.clone(), desc).unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(19 + keep_mapped as u64);
        let mut live = Vec::new();
        for step in 0..3000 {
            if live.is_empty() || rng.gen_bool(0.55) {
                let s = &streams[rng.gen_range(0..3)];
                let bytes = if rng.gen_bool(0.8) {
                    rng.gen_range(1..1 << 20)
                } else {
                    rng.gen_range(1 << 20..24 << 20)
                };
                let x = arena.alloc(bytes, s).unwrap();
                // Work on it, so frees really wait on the stream.
                let words = (bytes / 4).min(1 << 16) as u64;
                if words > 0 {
                    k.fill_on(s, x.address(), 0, words, step as u32);
                }
                live.push(x);
            } else {
                let i = rng.gen_range(0..live.len());
                drop(live.swap_remove(i));
            }
            if step % 500 == 0 {
                arena.release_cached().unwrap();
            }
            let st = arena.stats();
            let (a, act, r) = (st.allocated_bytes, st.active_bytes, st.reserved_bytes);
            assert!(
                a.current <= act.current && act.current <= r.current,
                "step {step}: {st}"
            );
            assert!(
                a.peak <= act.peak && act.peak <= r.peak,
                "step {step}: {st}"
            );
            assert!(
                st.inactive_split_bytes.current <= r.current - a.current,
                "step {step}: {st}"
            );
        }
        live.clear();
        for s in &streams {
            s.synchronize().unwrap();
        }
        let st = arena.stats();
        assert_eq!(
            (
                st.allocated_bytes.current,
                st.active_bytes.current,
                st.inactive_split_bytes.current
            ),
            (0, 0, 0),
            "keep mapped {keep_mapped}: {st}"
        );
        assert_eq!(st.fragmentation, 0.0);
        eprintln!(
            "keep mapped {keep_mapped}: 3000 steps; peaks: allocated {}, active {}, reserved {}",
            st.allocated_bytes.peak, st.active_bytes.peak, st.reserved_bytes.peak
        );
    }
}

/// Issue 20, item 6: `CudaTensor<T>`, the owned typed tensor, does what an
/// engine does with a `CudaSlice<T>`: copies both ways (every element
/// checked), kernel arguments, `slice`, `split_at_mut`, `alloc_zeros` (over
/// memory that held data), copies on another stream, typed errors, and a
/// stream-ordered free on drop.
fn owned_typed_tensors_behave_as_cudarc_slices() {
    use rand::{Rng, SeedableRng};
    let b = gpu();
    let k = Kernels::load(&b);
    let arena: vmmbuf::cuda::CudaArena = Arena::new(b.clone(), ArenaDesc::new(8 << 30)).unwrap();
    let (s, other) = (
        b.context().new_stream().unwrap(),
        b.context().new_stream().unwrap(),
    );
    let mut rng = rand::rngs::StdRng::seed_from_u64(20);
    for round in 0..10u32 {
        let n = rng.gen_range(1..3_000_000usize);
        let data: Vec<u32> = (0..n).map(|_| rng.gen()).collect();
        let mut t = arena.alloc_tensor::<u32>(n, &s).unwrap();
        assert_eq!((t.len(), t.num_bytes()), (n, n * 4));
        s.memcpy_htod(&data, &mut t).unwrap();
        assert_eq!(
            s.clone_dtoh(&t).unwrap(),
            data,
            "round {round}: a round trip"
        );
        let (a, z) = (n / 3, n - n / 7);
        assert_eq!(s.clone_dtoh(&t.slice(a..z).unwrap()).unwrap(), data[a..z]);
        assert_eq!(
            other.clone_dtoh(&t).unwrap(),
            data,
            "a copy on another stream"
        );
        // Kernel argument: fill writes pattern(i, seed) through the tensor.
        let mut l = s.launch_builder(&k.fill);
        let (zero, words) = (0u64, n as u64);
        l.arg(&mut t).arg(&zero).arg(&words).arg(&round);
        // SAFETY: test code; writes `n` u32s of the tensor.
        unsafe { l.launch(Kernels::cfg(words)) }.unwrap();
        let got = s.clone_dtoh(&t).unwrap();
        assert!(got
            .iter()
            .enumerate()
            .all(|(i, &v)| v == pattern(i as u64, round)));
        // Two halves written at once.
        let mid = n / 2;
        {
            let (mut lo, mut hi) = t.split_at_mut(mid).unwrap();
            s.memcpy_htod(&data[mid..], &mut hi).unwrap();
            s.memcpy_htod(&data[..mid], &mut lo).unwrap();
        }
        assert_eq!(
            s.clone_dtoh(&t).unwrap(),
            data,
            "round {round}: both halves"
        );
        assert!(t.split_at_mut(n + 1).is_err());
        assert!(t.slice(..n + 1).is_err());
        drop(t);
        // s may reuse its free at once (memory that held data): cleared.
        let zeros = arena.alloc_zeros::<u32>(n, &s).unwrap();
        assert!(
            s.clone_dtoh(&zeros).unwrap().iter().all(|&v| v == 0),
            "round {round}: zeroed"
        );
    }
    assert!(matches!(
        arena.alloc_tensor::<u32>(0, &s),
        Err(vmmbuf::Error::InvalidArgument(_))
    ));
    assert!(matches!(
        arena.alloc_tensor::<u64>(usize::MAX / 4, &s),
        Err(vmmbuf::Error::InvalidArgument(_))
    ));
    s.synchronize().unwrap();
    let st = arena.stats();
    assert_eq!((st.allocated_bytes.current, st.num_device_syncs), (0, 0));
}

/// `Arena::set_device_margin` (torch_memory_saver's `memory_margin_bytes`):
/// growth that would leave the device less free than the margin is out of
/// memory, in words naming the device's free bytes, and maps nothing; a
/// request served from free memory still succeeds; 0 turns it off. On a
/// backend emulating GPU 0 whose free bytes the test sets.
fn a_device_margin_refuses_growth_that_leaves_less_free() {
    use crate::failing_backend::{DoneStream, FaultBackend};
    let fb = FaultBackend::emulating_gpu(crate::common::host());
    let g = fb.granularity(vmmbuf::Location::Device(0)).unwrap();
    let arena: Arena<FaultBackend<vmmbuf::HostBackend>, DoneStream> =
        Arena::new(fb.clone(), ArenaDesc::new(1 << 30).max_chunk_bytes(g)).unwrap();
    *fb.device_free.lock() = Some((15 * g, 100 * g));
    arena.set_device_margin(10 * g);
    let a = arena.alloc(4 * g, &DoneStream(0)).unwrap();
    let b = arena.alloc(g, &DoneStream(0)).unwrap();
    *fb.device_free.lock() = Some((11 * g, 100 * g));
    let mapped = arena.stats().reserved_bytes.current;
    let e = arena.alloc(2 * g, &DoneStream(0)).unwrap_err();
    assert!(
        matches!(e, vmmbuf::Error::ArenaOutOfMemory { free_bytes: Some(f), .. } if f == 11 * g),
        "{e}"
    );
    assert_eq!(
        arena.stats().reserved_bytes.current,
        mapped,
        "nothing mapped"
    );
    // From free memory: no mapping, no margin to keep.
    drop(b);
    let b = arena.alloc(g, &DoneStream(0)).unwrap();
    arena.set_device_margin(0);
    let c = arena.alloc(2 * g, &DoneStream(0)).unwrap();
    assert!(arena.stats().reserved_bytes.current > mapped);
    drop((a, b, c));
}

/// Two arenas under one budget with deferred free fences (the PyTorch
/// plug-in's tags): what one frees on a stream it sees no call on again owes
/// its fence for ever, so `release_cached` cannot prove it passed and keeps
/// it; `release_all_cached` synchronises, gives it back to the budget, and
/// the other arena's allocation fits. Found on 4x
/// H200 when deferred fences became the plug-in's default.
fn a_deferred_free_goes_back_to_another_arena_of_the_budget() {
    use crate::failing_backend::{DoneStream, FaultBackend};
    let fb = FaultBackend::emulating_gpu(crate::common::host());
    let g = fb.granularity(vmmbuf::Location::Device(0)).unwrap();
    let budget = vmmbuf::Budget::new(4 * g);
    let desc = || {
        ArenaDesc::new(1 << 30)
            .max_chunk_bytes(g)
            .defer_free_fences(true)
            .shared_budget(budget.clone())
    };
    type Fa = Arena<FaultBackend<vmmbuf::HostBackend>, DoneStream>;
    let (a, b): (Fa, Fa) = (
        Arena::new(fb.clone(), desc()).unwrap(),
        Arena::new(fb.clone(), desc()).unwrap(),
    );
    let x = a.alloc(3 * g, &DoneStream(1)).unwrap();
    drop(x);
    let e = b.alloc(3 * g, &DoneStream(2)).unwrap_err();
    assert!(e.is_transient(), "{e}");
    assert_eq!(
        a.release_cached().unwrap(),
        0,
        "an owed free is not proven passed"
    );
    assert!(b.alloc(3 * g, &DoneStream(2)).is_err(), "still held by a");
    let syncs = fb.live().device_syncs;
    assert_eq!(a.release_all_cached().unwrap(), 3 * g);
    assert_eq!(fb.live().device_syncs, syncs + 1, "one synchronisation");
    assert_eq!(a.stats().reserved_bytes.current, 0);
    assert_eq!(budget.used(), 0, "the budget got it back");
    // Nothing left to give: it still synchronises (every call does).
    assert_eq!(a.release_all_cached().unwrap(), 0);
    assert_eq!(fb.live().device_syncs, syncs + 2);
    let y = b.alloc(3 * g, &DoneStream(2)).unwrap();
    assert_eq!(budget.used(), 3 * g);
    drop(y);
    b.empty_cache().unwrap();
    a.empty_cache().unwrap();
    assert_eq!(fb.live().mapped_bytes, 0, "everything back to the driver");
    assert_eq!(budget.used(), 0);
}

/// A shared budget changed while memory is mapped (PyTorch's
/// `set_per_process_memory_fraction` after the model is made): what is
/// mapped stays mapped and intact, a limit below it refuses every new
/// mapping, with the limit named, until enough goes back; raised again, the
/// same request fits. Unlimited (`usize::MAX`) names no budget.
fn a_budget_changed_in_use_holds_from_the_next_mapping() {
    let g = 2 << 20;
    let host = HostBackend::with_granularity(g).unwrap();
    let budget = vmmbuf::Budget::unlimited();
    assert_eq!(budget.limit_set(), None);
    let arena: Arena<HostBackend, HostStream> = Arena::new(
        host.clone(),
        ArenaDesc::new(1 << 30)
            .max_chunk_bytes(g)
            .shared_budget(budget.clone()),
    )
    .unwrap();
    let s = HostStream(0);
    let mut a = arena.alloc(3 * g, &s).unwrap();
    let data: Vec<u8> = (0..3 * g).map(|i| (i * 7 + i / 4093) as u8).collect();
    a.write(0, &data).unwrap();
    let e = arena.alloc(1 << 31, &s).unwrap_err();
    assert!(
        !e.to_string().contains(", budget "),
        "none set, none named: {e}"
    );
    budget.set_limit(2 * g);
    assert_eq!((budget.limit_set(), budget.used()), (Some(2 * g), 3 * g));
    let e = arena.alloc(g, &s).unwrap_err();
    assert!(e.to_string().contains(", budget 4.0 MiB"), "{e}");
    let mut back = vec![0u8; 3 * g];
    a.read(0, &mut back).unwrap();
    assert!(back == data, "what was mapped stays intact");
    budget.set_limit(4 * g);
    let b = arena.alloc(g, &s).unwrap();
    assert_eq!(budget.used(), 4 * g);
    drop((a, b));
    arena.empty_cache().unwrap();
    assert_eq!(budget.used(), 0, "everything went back");
}

/// `Arena::record_trace` writes every alloc and free made while it records,
/// and nothing before or after: an allocation made before recording began
/// leaves no free line, one made while recording keeps its free line after
/// the recording stopped only if freed before, and the trace parses back
/// to the same sizes, streams and pairs.
fn a_recorded_trace_holds_exactly_the_calls_made_while_recording() {
    use std::io::Write;
    use vmmbuf::trace::parse_trace;
    /// A writer into a buffer the test keeps.
    #[derive(Clone, Default)]
    struct Shared(Arc<parking_lot::Mutex<Vec<u8>>>);
    impl Write for Shared {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let host = HostBackend::with_granularity(2 << 20).unwrap();
    let arena: Arena<HostBackend, HostStream> = Arena::new(host, ArenaDesc::new(64 << 20)).unwrap();
    let (one, two) = (HostStream(1), HostStream(2));
    let before = arena.alloc(4096, &one).unwrap();
    let buf = Shared::default();
    arena.record_trace(Box::new(buf.clone())).unwrap();
    let a = arena.alloc(1000, &one).unwrap();
    let b = arena.alloc(3 << 20, &two).unwrap();
    let c = arena.alloc(77, &one).unwrap();
    drop(before); // allocated before recording: no line
    drop(b);
    drop(a);
    arena.stop_trace().unwrap();
    drop(c); // freed after the recording stopped: no line
    drop(arena.alloc(5000, &one).unwrap()); // after: no lines
    let text = buf.0.lock().clone();
    let events = parse_trace(std::io::BufReader::new(&text[..])).unwrap();
    let want = |id, bytes, stream| TraceEvent::Alloc { id, bytes, stream };
    assert_eq!(
        events,
        vec![
            want(1, 1000, 1),
            want(2, 3 << 20, 2),
            want(3, 77, 1),
            TraceEvent::Free { id: 2 },
            TraceEvent::Free { id: 1 },
        ],
        "{}",
        String::from_utf8_lossy(&text)
    );
}
