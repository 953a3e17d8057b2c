//! Stream order (issue 10, item 3): memory is given back only after the work
//! that uses it, on whatever stream it was queued, has finished, without
//! waiting for the whole device.

use cudarc::driver::{CudaSlice, CudaStream, PushKernelArg};
use vmmbuf::{Backend, BufferDesc, CudaBackend, GrowableBuffer, GrowthPolicy, Location};

use crate::common::gpu;
use crate::cuda_only::{counted, Kernels};

crate::register! {
    gpu: [rt8_a_view_fence_never_shadows_the_free_fence, deferred_free_fences_hold_blocks_until_the_kernel_finishes, waiting_before_growth_hands_a_block_over_only_after_its_kernel, offload_waits_for_a_view_kernel_on_another_stream, a_deferred_release_waits_for_a_view_kernel_on_another_stream, shrink_migrate_and_drop_wait_for_view_kernels_100_times, reads_and_foreign_stream_copies_are_ordered],
    two_gpus: [a_peer_copy_in_flight_holds_off_the_release],
}

/// A kernel on stream B reads the tail through a view while the buffer is
/// shrunk with a fence from an idle stream A. The release must wait for B's
/// kernel (the view recorded its use), not trust A's fence. 100 rounds; a
/// release under the kernel kills it with CUDA_ERROR_ILLEGAL_ADDRESS.
fn a_deferred_release_waits_for_a_view_kernel_on_another_stream() {
    let b = gpu();
    let k = Kernels::load(&b);
    let g = b.granularity(vmmbuf::Location::Device(0)).unwrap();
    let (a, s) = (
        b.context().new_stream().unwrap(),
        b.context().new_stream().unwrap(),
    );
    let words = (2 * g / 4) as u64;
    for round in 0..100u32 {
        let mut buf = tail_filled(&b, &k, g, round);
        // The last block spins 5 ms, then reads the tail through a view.
        let bad = view_kernel(&k, &buf, &s, 2 * g, words, round, 5_000_000);
        buf.truncate(g);
        buf.shrink_to_fit_after(b.fence(&a).unwrap()).unwrap();
        assert_eq!(
            counted(&s, &bad, &format!("round {round}: B")),
            0,
            "round {round}: it read the tail intact"
        );
        buf.reclaim().unwrap();
        assert_eq!(buf.capacity(), g, "round {round}: released once B was done");
    }
}

/// A buffer of four `g` chunks whose last two hold `seed`'s pattern.
fn tail_filled(
    b: &std::sync::Arc<CudaBackend>,
    k: &Kernels,
    g: usize,
    seed: u32,
) -> GrowableBuffer<CudaBackend> {
    let buf = GrowableBuffer::new(
        b.clone(),
        BufferDesc::new(1 << 30).growth(GrowthPolicy::Exact),
    )
    .unwrap();
    buf.grow_to(4 * g).unwrap();
    k.fill(buf.base() + 2 * g as u64, 0, (2 * g / 4) as u64, seed);
    k.stream.synchronize().unwrap();
    buf
}

/// Launches, on `s`, a kernel that spins `ns` then checks `words` u32s of
/// the buffer from `at` against `seed`'s pattern, through a view that drops
/// right after the launch (recording the use on `s`).
fn view_kernel(
    k: &Kernels,
    buf: &GrowableBuffer<CudaBackend>,
    s: &std::sync::Arc<CudaStream>,
    at: usize,
    words: u64,
    seed: u32,
    ns: u64,
) -> CudaSlice<u32> {
    let mut bad = s.alloc_zeros::<u32>(1).unwrap();
    let view = buf.view::<u32>(s, at, words as usize).unwrap();
    let mut l = s.launch_builder(&k.spin_check);
    let zero = 0u64;
    l.arg(&view)
        .arg(&zero)
        .arg(&words)
        .arg(&seed)
        .arg(&mut bad)
        .arg(&ns);
    // SAFETY: test code; reads `words` u32s of the view.
    unsafe { l.launch(Kernels::cfg(words)) }.unwrap();
    bad
}

/// Shrinking (waiting), migrating and dropping while a kernel on another
/// stream still reads the tail through a view: each waits for that stream's
/// recorded use, and no call synchronises the device. 100 rounds.
fn shrink_migrate_and_drop_wait_for_view_kernels_100_times() {
    let b = gpu();
    let k = Kernels::load(&b);
    let g = b.granularity(Location::Device(0)).unwrap();
    let s = b.context().new_stream().unwrap();
    let syncs = b.live().device_syncs;
    let words = (2 * g / 4) as u64;
    for round in 0..100u32 {
        let mut buf = tail_filled(&b, &k, g, round);
        let bad = view_kernel(&k, &buf, &s, 2 * g, words, round, 5_000_000);
        match round % 3 {
            0 => {
                buf.truncate(g);
                buf.shrink_to_fit().unwrap();
                assert_eq!(buf.capacity(), g);
            }
            1 => {
                buf.migrate(2 * g..4 * g, Location::Host).unwrap();
            }
            _ => drop(buf),
        }
        assert_eq!(
            counted(&s, &bad, &format!("round {round}")),
            0,
            "round {round}"
        );
    }
    assert_eq!(
        b.live().device_syncs,
        syncs,
        "no device-wide synchronisation"
    );
}

/// `read` is ordered after recorded uses (a kernel writing through a view on
/// another stream), and a view used for a copy on a stream other than its own
/// synchronises that stream, so the copy is done before anything unmaps.
fn reads_and_foreign_stream_copies_are_ordered() {
    let b = gpu();
    let k = Kernels::load(&b);
    let g = b.granularity(Location::Device(0)).unwrap();
    let (s, other) = (
        b.context().new_stream().unwrap(),
        b.context().new_stream().unwrap(),
    );
    let mut buf = GrowableBuffer::new(b.clone(), BufferDesc::new(1 << 30)).unwrap();
    buf.grow_to(2 * g).unwrap();
    let words = (g / 4) as u64;
    for round in 0..20u32 {
        // A slow writer on `s` through a view: spin, then fill.
        k.fill(buf.base(), 0, words, round); // known contents first
        k.stream.synchronize().unwrap();
        let bad = view_kernel(&k, &buf, &s, 0, words, round, 3_000_000);
        {
            let mut w = buf.view_mut::<u32>(&s, g, words as usize).unwrap();
            let pattern: Vec<u32> = (0..words)
                .map(|i| crate::cuda_only::pattern(i, round + 1))
                .collect();
            s.memcpy_htod(&pattern, &mut w).unwrap(); // queued behind the spin
        }
        let mut out = vec![0u8; g];
        buf.read(g, &mut out).unwrap(); // waits for `s`'s recorded use
        let got: &[u32] = bytemuck::cast_slice(&out);
        assert!(
            got.iter()
                .enumerate()
                .all(|(i, &v)| v == crate::cuda_only::pattern(i as u64, round + 1)),
            "round {round}: read ran before the queued write"
        );
        assert_eq!(s.clone_dtoh(&bad).unwrap()[0], 0);
        // A view of `s` used for a copy on `other`: that stream is waited for.
        let v = buf.view::<u32>(&s, g, words as usize).unwrap();
        let copied = other.clone_dtoh(&v).unwrap();
        assert!(copied[..] == *bytemuck::cast_slice::<u8, u32>(&out));
    }
    buf.truncate(0);
    buf.shrink_to_fit().unwrap();
}

/// With peer access, a kernel and then a copy on GPU 1's stream read GPU 0's
/// buffer through views made for that stream, still in flight (behind a
/// 5 ms spin) while the buffer shrinks: the release waits for GPU 1's
/// recorded use.
fn a_peer_copy_in_flight_holds_off_the_release() {
    let b0 = gpu();
    let b1 = CudaBackend::new(1).unwrap();
    let (k0, k1) = (Kernels::load(&b0), Kernels::load(&b1));
    let g = b0.granularity(Location::Device(0)).unwrap();
    let s1 = b1.context().new_stream().unwrap();
    let words = (2 * g / 4) as u64;
    for round in 0..20u32 {
        let mut buf = GrowableBuffer::new(
            b0.clone(),
            BufferDesc::new(1 << 30).growth(GrowthPolicy::Exact),
        )
        .unwrap();
        buf.add_peer(1).unwrap();
        buf.grow_to(4 * g).unwrap();
        k0.fill(buf.base() + 2 * g as u64, 0, words, round);
        k0.stream.synchronize().unwrap();
        // GPU 1 spins, then reads GPU 0's tail, through a view of its stream;
        // then a copy of the tail to GPU 1's memory, queued behind it.
        let bad = view_kernel(&k1, &buf, &s1, 2 * g, words, round, 5_000_000);
        let mut copy = s1.alloc_zeros::<u32>(words as usize).unwrap();
        {
            let tail = buf.view::<u32>(&s1, 2 * g, words as usize).unwrap();
            s1.memcpy_dtod(&tail, &mut copy).unwrap();
        }
        buf.truncate(g);
        if round % 2 == 0 {
            buf.shrink_to_fit().unwrap();
        } else {
            buf.shrink_to_fit_after(b0.fence(&k0.stream).unwrap())
                .unwrap();
            assert_eq!(
                buf.capacity(),
                4 * g,
                "round {round}: GPU 1 still reads the tail"
            );
        }
        assert_eq!(
            counted(&s1, &bad, &format!("round {round}: GPU 1")),
            0,
            "round {round}"
        );
        let copied = s1.clone_dtoh(&copy).unwrap();
        assert!(
            copied
                .iter()
                .enumerate()
                .all(|(i, &v)| v == crate::cuda_only::pattern(i as u64, round)),
            "round {round}: the peer copy read the tail intact"
        );
        buf.reclaim().unwrap();
        assert_eq!(buf.capacity(), g);
    }
}

type CudaArena = vmmbuf::Arena<CudaBackend, std::sync::Arc<CudaStream>>;

/// RT-8 end to end (issue 19): A and B adjacent on stream s; B dropped; a
/// kernel reads A through a view (its use recorded on s), then a 50 ms
/// kernel reads and writes A by raw address on s; A dropped. A's block holds
/// two fences of s: the free's (after the 50 ms kernel) and the view's
/// (before it). Keeping the view's on the merge with B's block let s2 take
/// A's bytes, and `release_cached` unmap them, under the running kernel.
fn rt8_a_view_fence_never_shadows_the_free_fence() {
    let b = gpu();
    let k = Kernels::load(&b);
    let arena: CudaArena = vmmbuf::Arena::new(b.clone(), vmmbuf::ArenaDesc::new(8 << 30)).unwrap();
    let (s, s2) = (
        b.context().new_stream().unwrap(),
        b.context().new_stream().unwrap(),
    );
    let words = 1u64 << 20; // 4 MiB
    let bytes = words as usize * 4;
    for round in 0..5u32 {
        let x = arena.alloc(bytes, &s).unwrap();
        let y = arena.alloc(bytes, &s).unwrap();
        assert_eq!(y.address(), x.address() + bytes as u64, "adjacent");
        let (at, raw) = (x.address(), x.address());
        // Fill A, then drop B.
        k.fill_on(&s, raw, 0, words, round);
        drop(y);
        // A short kernel through a view: the view's fence on s.
        let bad = k.spin_check_view(&s, x.view::<u32>(&s).unwrap(), words, round, 0);
        // 50 ms, then a check, by raw address on s: covered by the free's
        // fence only.
        let bad_raw = k.spin_then_check(&s, raw, 0, words, round, 50_000_000);
        drop(x);
        // While the 50 ms kernel runs: nothing unmaps A, s2 gets none of it.
        arena.release_cached().unwrap();
        let z = arena.alloc(2 * bytes, &s2).unwrap();
        let (z0, z1) = (z.address(), z.address() + 2 * bytes as u64);
        assert!(
            z1 <= at || z0 >= at + bytes as u64,
            "round {round}: s2 got A's bytes before s's kernel finished"
        );
        k.fill_on(&s2, z0, 0, 2 * words, round + 77);
        let what = format!("round {round}: s");
        assert_eq!(
            (counted(&s, &bad, &what), counted(&s, &bad_raw, &what)),
            (0, 0),
            "round {round}: A read intact"
        );
        s2.synchronize().unwrap();
        drop(z);
    }
}

/// Issue 19: `Arena::offload` waits for the uses recorded on live
/// allocations. A kernel on stream B reads an allocation of stream A through
/// a view for 50 ms; the view drops (recording the use on B); offload is
/// given A only. The chunk must not move under the kernel: it reads intact
/// data, and every byte is there after restore.
fn offload_waits_for_a_view_kernel_on_another_stream() {
    let b = gpu();
    let k = Kernels::load(&b);
    let arena: CudaArena = vmmbuf::Arena::new(b.clone(), vmmbuf::ArenaDesc::new(8 << 30)).unwrap();
    let (sa, sb) = (
        b.context().new_stream().unwrap(),
        b.context().new_stream().unwrap(),
    );
    let words = 1u64 << 20;
    for round in 0..3u32 {
        let x = arena.alloc(words as usize * 4, &sa).unwrap();
        let raw = x.address();
        k.fill_on(&sa, raw, 0, words, round);
        sa.synchronize().unwrap();
        let bad = k.spin_check_view(&sb, x.view::<u32>(&sb).unwrap(), words, round, 50_000_000);
        arena.offload(std::slice::from_ref(&sa)).unwrap();
        assert_eq!(
            counted(&sb, &bad, &format!("round {round}: B")),
            0,
            "round {round}: it read intact data"
        );
        arena.restore(std::slice::from_ref(&sa)).unwrap();
        let got = sa.clone_dtoh(&x.view::<u32>(&sa).unwrap()).unwrap();
        assert!(
            got.iter()
                .enumerate()
                .all(|(i, &v)| v == crate::cuda_only::pattern(i as u64, round)),
            "round {round}: every word kept"
        );
        drop(x);
    }
}

/// Deferred free fences (`ArenaDesc::defer_free_fences`, the PyTorch
/// plug-in's option) on the GPU: a 50 ms kernel reads A by raw address on
/// s, and A is freed on s with no event recorded. While the kernel runs,
/// s2 gets none of A's bytes, `release_cached` unmaps none of them, and a
/// sleep that is not given s (s holds only frees with no fence yet)
/// synchronises the device before it unmaps: the kernel reads intact data
/// and does not die. s may reuse A at once, in stream order.
fn deferred_free_fences_hold_blocks_until_the_kernel_finishes() {
    let b = gpu();
    let k = Kernels::load(&b);
    let desc = vmmbuf::ArenaDesc::new(8 << 30).defer_free_fences(true);
    let arena: CudaArena = vmmbuf::Arena::new(b.clone(), desc).unwrap();
    let (s, s2) = (
        b.context().new_stream().unwrap(),
        b.context().new_stream().unwrap(),
    );
    let words = 1u64 << 20; // 4 MiB
    let bytes = words as usize * 4;
    let syncs = b.live().device_syncs;
    for round in 0..4u32 {
        let x = arena.alloc(bytes, &s).unwrap();
        let at = x.address();
        k.fill_on(&s, at, 0, words, round);
        let bad = k.spin_then_check(&s, at, 0, words, round, 50_000_000);
        drop(x);
        arena.release_cached().unwrap();
        let z = arena.alloc(bytes, &s2).unwrap();
        assert!(
            z.address() + bytes as u64 <= at || z.address() >= at + bytes as u64,
            "round {round}: s2 got A's bytes while s's kernel ran"
        );
        k.fill_on(&s2, z.address(), 0, words, round + 77);
        if round % 2 == 0 {
            // s may take A's bytes back at once (stream order).
            let again = arena.alloc(bytes, &s).unwrap();
            k.fill_on(&s, again.address(), 0, words, round + 5);
            let bad2 = k.spin_then_check(&s, again.address(), 0, words, round + 5, 0);
            drop(again);
            assert_eq!(
                counted(&s, &bad2, &format!("round {round}: s")),
                0,
                "round {round}: refilled"
            );
        } else {
            // Given only s2 (its allocation is live): s's free has no
            // fence, so the sleep synchronises the device before it unmaps.
            let live = [s2.clone()];
            arena.sleep(&live, &vmmbuf::SleepDesc::discard()).unwrap();
            arena.wake(&live, &vmmbuf::WakeDesc::default()).unwrap();
        }
        assert_eq!(
            counted(&s, &bad, &format!("round {round}: s")),
            0,
            "round {round}: A read intact"
        );
        s2.synchronize().unwrap();
        drop(z);
    }
    assert!(
        b.live().device_syncs > syncs,
        "the sleeps not given s synchronised the device"
    );
    arena.empty_cache().unwrap();
    assert_eq!(
        arena.stats().reserved_bytes.current,
        0,
        "everything given back"
    );
}

/// `ArenaDesc::wait_before_grow`: stream s fills A, runs a 50 ms kernel
/// that then checks A, and frees A. Stream s2 asks for as many bytes; the
/// only block is A, pending on s. The arena waits for s's fence on the CPU
/// and hands A to s2 (no growth); s2 overwrites it at once. Had the hand-out
/// not waited, the overwrite would run under the kernel's check.
fn waiting_before_growth_hands_a_block_over_only_after_its_kernel() {
    let b = gpu();
    let k = Kernels::load(&b);
    let mut desc = vmmbuf::ArenaDesc::new(8 << 30).wait_before_grow(true);
    desc.release_before_map = false;
    let arena: CudaArena = vmmbuf::Arena::new(b.clone(), desc).unwrap();
    let (s, s2) = (
        b.context().new_stream().unwrap(),
        b.context().new_stream().unwrap(),
    );
    let words = 1u64 << 20; // 4 MiB
    let bytes = words as usize * 4;
    for round in 0..4u32 {
        let x = arena.alloc(bytes, &s).unwrap();
        let at = x.address();
        let reserved = arena.stats().reserved_bytes.current;
        k.fill_on(&s, at, 0, words, round);
        let bad = k.spin_then_check(&s, at, 0, words, round, 50_000_000);
        drop(x);
        let waits = arena.stats().num_waits_before_grow;
        let z = arena.alloc(bytes, &s2).unwrap();
        let st = arena.stats();
        assert_eq!(z.address(), at, "round {round}: the waited-for block");
        assert_eq!(st.num_waits_before_grow, waits + 1, "round {round}: {st:?}");
        assert_eq!(
            st.reserved_bytes.current, reserved,
            "round {round}: no growth"
        );
        k.fill_on(&s2, z.address(), 0, words, round + 77);
        assert_eq!(
            counted(&s, &bad, &format!("round {round}: s")),
            0,
            "round {round}: A read intact"
        );
        s2.synchronize().unwrap();
        drop(z);
    }
}
