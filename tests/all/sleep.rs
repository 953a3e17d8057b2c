//! Arena sleep and wake (`offload`/`restore`): every chunk moves to host
//! memory and back at the same addresses, with its data, and the memory it
//! left goes back to the driver. Without a GPU on a backend that emulates
//! one (GPU 0 plus host placement, both host memory underneath).

use std::sync::Arc;

use vmmbuf::{Allocation, Arena, ArenaDesc, ArenaStream, Backend, CudaBackend, HostBackend};

use crate::common::{gpu, host, random_bytes};
use crate::cuda_only::{pattern, Kernels};
use crate::fault::{fail_each_call, injected, FaultBackend, TestFence};

crate::register! {
    host: [
        sleep_and_wake_keep_every_byte_and_address,
        every_failed_call_of_a_sleep_or_wake_is_undone,
    ],
    gpu: [sleep_gives_the_device_memory_back_and_kernels_still_read],
}

type Fb = FaultBackend<HostBackend>;

/// A stream of the emulated GPU; its work has always finished.
#[derive(Clone)]
struct Q(u64);

impl ArenaStream<Fb> for Q {
    fn key(&self) -> (u64, u64) {
        (0, self.0)
    }
    fn fence(&self, _: &Fb) -> vmmbuf::Result<TestFence> {
        Ok(TestFence::passed())
    }
}

type EmuArena = Arena<Fb, Q>;
type Live = Vec<(Allocation<Fb, Q>, Vec<u8>)>;

/// Sizes across both zones, of several chunks (256 KiB) each and less.
const SIZES: [usize; 9] = [
    100,
    4000,
    300 << 10,
    900 << 10,
    (1500 << 10) + 7,
    5 << 20,
    64 << 10,
    (7 << 20) + 3,
    2 << 20,
];

fn emulated() -> (Arc<Fb>, EmuArena) {
    let fb = FaultBackend::emulating_gpu(host());
    let arena = Arena::new(
        fb.clone(),
        ArenaDesc::new(1 << 30).max_chunk_bytes(256 << 10),
    )
    .unwrap();
    (fb, arena)
}

/// Allocations of every size holding random data; every third one freed
/// again, so free blocks and whole free chunks sit among them.
fn fill(arena: &EmuArena, seed: u64, count: usize) -> Live {
    let mut live = Vec::new();
    for (i, &n) in SIZES.iter().cycle().take(count).enumerate() {
        let mut a = arena.alloc(n, &Q(i as u64 % 2)).unwrap();
        let data = random_bytes(seed + i as u64, n);
        a.write(0, &data).unwrap();
        live.push((a, data));
    }
    let mut i = 0;
    live.retain(|_| {
        i += 1;
        i % 3 != 0
    });
    live
}

fn assert_intact(live: &Live, addresses: &[u64], when: &str) {
    for (k, ((a, data), &at)) in live.iter().zip(addresses).enumerate() {
        assert_eq!(a.address(), at, "{when}: allocation {k} moved");
        let mut got = vec![0u8; data.len()];
        a.read(0, &mut got).unwrap();
        assert!(got == *data, "{when}: allocation {k} lost bytes");
    }
}

fn sleep_and_wake_keep_every_byte_and_address() {
    let (fb, arena) = emulated();
    let mut live = fill(&arena, 11, 27);
    let addresses: Vec<u64> = live.iter().map(|(a, _)| a.address()).collect();
    let before = arena.stats();
    assert!(
        before.device_bytes > 0 && before.host_bytes == 0,
        "{before}"
    );

    let report = arena.offload(&[Q(0), Q(1)]).unwrap();
    let s = arena.stats();
    assert!(arena.is_offloaded());
    assert_eq!(s.device_bytes, 0, "every chunk left the GPU: {s}");
    assert_eq!(s.host_bytes, s.reserved_bytes.current);
    assert_eq!(
        report.bytes_moved, s.host_bytes,
        "what moved is what is mapped"
    );
    assert!(
        s.reserved_bytes.current < before.reserved_bytes.current,
        "whole free chunks were given back, not moved"
    );
    assert_eq!(s.pooled_bytes, 0, "the GPU chunks went back to the driver");
    assert_eq!(
        fb.live().chunk_bytes,
        s.host_bytes,
        "no chunk is held beyond those mapped"
    );
    assert_intact(&live, &addresses, "asleep");

    // Asleep, allocations still work, in host memory, and writes land.
    let mut extra = arena.alloc(3 << 20, &Q(0)).unwrap();
    let extra_data = random_bytes(99, 3 << 20);
    extra.write(0, &extra_data).unwrap();
    assert_eq!(
        arena.stats().device_bytes,
        0,
        "a new chunk went to the host"
    );
    let patch = random_bytes(7, 1000);
    live[3].0.write(17, &patch).unwrap();
    live[3].1[17..1017].copy_from_slice(&patch);

    let report = arena.restore(&[Q(0), Q(1)]).unwrap();
    let s = arena.stats();
    assert!(!arena.is_offloaded());
    assert_eq!(s.host_bytes, 0, "every chunk came back: {s}");
    assert_eq!(s.device_bytes, s.reserved_bytes.current);
    assert_eq!(report.bytes_moved, s.device_bytes);
    assert_eq!(
        fb.live().chunk_bytes,
        s.device_bytes,
        "the host memory went back"
    );
    assert_intact(&live, &addresses, "awake");
    let mut got = vec![0u8; 3 << 20];
    extra.read(0, &mut got).unwrap();
    assert!(
        got == extra_data,
        "the allocation made asleep kept its bytes"
    );

    // A second cycle, then everything back to the driver.
    arena.offload(&[Q(0)]).unwrap();
    arena.restore(&[Q(0)]).unwrap();
    assert_intact(&live, &addresses, "after a second cycle");
    drop((live, extra, arena));
    assert_eq!(fb.live().chunks, 0);
    assert_eq!(fb.live().reservations, 0);
}

/// Fails each driver call of a sleep, then of a wake, in turn: the arena
/// stays where it was with every byte, and the same call then succeeds.
fn every_failed_call_of_a_sleep_or_wake_is_undone() {
    let (fb, arena) = emulated();
    let live = fill(&arena, 23, 12);
    let addresses: Vec<u64> = live.iter().map(|(a, _)| a.address()).collect();
    let mut state = (arena, live);
    for waking in [false, true] {
        let calls = fail_each_call(
            &fb,
            &mut state,
            |(arena, _)| {
                if waking {
                    arena.restore(&[Q(0)])
                } else {
                    arena.offload(&[Q(0)])
                }
            },
            |(arena, live), k, r| {
                let s = arena.stats();
                match r {
                    Err(e) => {
                        assert!(injected(&e), "call {k}: {e}");
                        assert_eq!(arena.is_offloaded(), waking, "call {k}: it stayed");
                        let (stay, gone) = if waking {
                            (s.host_bytes, s.device_bytes)
                        } else {
                            (s.device_bytes, s.host_bytes)
                        };
                        assert_eq!(gone, 0, "call {k}: nothing moved: {s}");
                        assert_eq!(stay, s.reserved_bytes.current);
                        assert_intact(live, &addresses, &format!("call {k} failed"));
                    }
                    // The fault hit a release after the move, which stands
                    // (the pool logs it): go back for the next round.
                    Ok(_) => {
                        assert_eq!(arena.is_offloaded(), !waking, "call {k}");
                        assert_intact(live, &addresses, &format!("call {k} (late)"));
                        if waking {
                            arena.offload(&[Q(0)]).unwrap();
                        } else {
                            arena.restore(&[Q(0)]).unwrap();
                        }
                    }
                }
            },
        );
        eprintln!(
            "{}: {calls} calls, each failed once",
            if waking { "wake" } else { "sleep" }
        );
        assert!(calls > 20, "a sleep or wake makes many calls: {calls}");
        assert_eq!(state.0.is_offloaded(), !waking);
        assert_intact(&state.1, &addresses, "after the loop");
    }
    drop(state);
    assert_eq!(fb.live().chunks, 0, "and nothing leaked");
}

type CudaArena = Arena<CudaBackend, Arc<cudarc::driver::CudaStream>>;

/// On the GPU: sleeping gives the device memory back (`cuMemGetInfo`),
/// a kernel still reads the offloaded allocations at their addresses, and
/// waking brings every word back.
fn sleep_gives_the_device_memory_back_and_kernels_still_read() {
    let b = gpu();
    let k = Kernels::load(&b);
    let s = k.stream.clone();
    let arena: CudaArena = Arena::new(b.clone(), ArenaDesc::new(64 << 30)).unwrap();
    let free0 = b.mem_info().unwrap().0;
    let words: Vec<u64> = vec![1 << 8, 3 << 18, 1 << 24, (5 << 22) + 11, 1 << 26];
    let live: Vec<_> = words
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let a = arena.alloc(n as usize * 4, &s).unwrap();
            k.fill(a.address(), 0, n, 1000 + i as u32);
            a
        })
        .collect();
    let addresses: Vec<u64> = live.iter().map(|a| a.address()).collect();
    let taken = free0 - b.mem_info().unwrap().0;
    let mapped = arena.stats().reserved_bytes.current;
    assert!(taken >= mapped, "taken {taken}, mapped {mapped}");

    arena.offload(std::slice::from_ref(&s)).unwrap();
    let asleep = free0.saturating_sub(b.mem_info().unwrap().0);
    eprintln!("device memory taken: {taken} B awake, {asleep} B asleep ({mapped} B mapped)");
    assert!(
        asleep * 20 <= taken,
        "sleeping gave back at least 95%: {asleep} of {taken} B still taken"
    );
    assert_eq!(arena.stats().device_bytes, 0);
    for (i, (a, &n)) in live.iter().zip(&words).enumerate() {
        assert_eq!(a.address(), addresses[i]);
        assert_eq!(
            k.mismatches(a.address(), 0, n, 1000 + i as u32),
            0,
            "a kernel reads allocation {i} in host memory"
        );
    }
    // A synchronous copy from host memory runs on the CPU inside the
    // driver: the arena grants the host's entry first (it segfaulted in
    // libcuda without it).
    let mut bytes = vec![0u8; 4096];
    live[2].read(0, &mut bytes).unwrap();
    for (i, w) in bytes.chunks_exact(4).enumerate() {
        let w = u32::from_ne_bytes(w.try_into().unwrap());
        assert_eq!(w, pattern(i as u64, 1002), "word {i} read asleep");
    }
    // A kernel writes one asleep; the write survives the wake.
    k.fill(live[1].address(), 0, words[1], 77);
    arena.restore(std::slice::from_ref(&s)).unwrap();
    assert_eq!(arena.stats().host_bytes, 0);
    for (i, (a, &n)) in live.iter().zip(&words).enumerate() {
        let seed = if i == 1 { 77 } else { 1000 + i as u32 };
        assert_eq!(a.address(), addresses[i]);
        assert_eq!(
            k.mismatches(a.address(), 0, n, seed),
            0,
            "allocation {i} after waking"
        );
    }
    assert_eq!(arena.stats().num_device_syncs, 0);
    drop(live);
    drop(arena);
    assert_eq!(b.live().chunks, 0, "every chunk back to the driver");
}
