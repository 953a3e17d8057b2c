//! Arena sleep and wake (`offload`/`restore`): every chunk moves to host
//! memory and back at the same addresses, with its data, and the memory it
//! left goes back to the driver. Without a GPU on a backend that emulates
//! one (GPU 0 plus host placement, both host memory underneath).

use std::sync::Arc;

use vmmbuf::{
    Allocation, Arena, ArenaDesc, Backend, Budget, ChunkPool, CudaBackend, HostBackend, Location,
    PoolDesc, SleepDesc, SleepMode, WakeDesc,
};

use crate::common::{gpu, host, random_bytes};
use crate::cuda_only::{pattern, Kernels};
use crate::failing_backend::{fail_each_call, injected, FaultBackend};

crate::register! {
    host: [
        sleep_and_wake_keep_every_byte_and_address,
        every_failed_call_of_a_sleep_or_wake_is_undone,
        a_discarding_sleep_gives_everything_back_and_the_wake_maps_the_same_addresses,
        every_failed_call_of_a_discarding_wake_leaves_it_asleep,
        a_zeroed_wake_zeroes_reused_memory,
        the_host_pieces_kept_between_sleeps_are_bounded,
        prepare_sleep_pins_ahead_so_the_sleep_creates_nothing,
        a_stashing_sleep_keeps_every_byte_away_from_the_addresses,
        every_failed_call_of_a_stashing_sleep_or_wake_loses_nothing,
        a_pageable_sleep_keeps_every_byte_in_host_memory_it_gives_back,
        every_failed_call_of_a_pageable_sleep_or_wake_loses_nothing,
        a_disk_sleep_cuts_chunks_into_files_of_at_most_the_bytes_set,
        a_kept_backup_stays_readable_at_one_address_until_released,
        a_wake_restoring_free_memory_maps_back_what_the_sleep_gave,
        a_restoring_wake_stops_at_the_budget_and_loses_nothing,
    ],
    gpu: [sleep_gives_the_device_memory_back_and_kernels_still_read],
}

type Fb = FaultBackend<HostBackend>;

// A stream of the emulated GPU; its work has always finished.
use crate::failing_backend::DoneStream as Q;

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

    let chunks_awake = arena.snapshot().segments.len();
    let sr = arena.sleep(&[Q(0), Q(1)], &SleepDesc::keep()).unwrap();
    let report = sr.migration;
    let s = arena.stats();
    assert!(arena.is_offloaded());
    assert_eq!(arena.sleep_mode(), Some(SleepMode::Keep));
    assert_eq!(s.device_bytes, 0, "every chunk left the GPU: {s}");
    assert_eq!(s.host_bytes, s.reserved_bytes.current);
    assert_eq!(
        report.bytes_moved, s.host_bytes,
        "what moved is what is mapped"
    );
    assert_eq!(sr.bytes, s.host_bytes);
    assert!(
        sr.chunks_after * 4 <= sr.chunks_before,
        "runs of 256 KiB chunks were joined into pieces: {} -> {} ({chunks_awake} runs)",
        sr.chunks_before,
        sr.chunks_after
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
    assert_eq!(arena.sleep_mode(), None);
    assert_eq!(s.host_bytes, 0, "every chunk came back: {s}");
    assert_eq!(s.device_bytes, s.reserved_bytes.current);
    assert_eq!(report.bytes_moved, s.device_bytes);
    let pool = arena.pool().stats();
    // The pieces stay in the pool for the next sleep; the chunks mapped
    // while asleep, joined into a piece by the wake, went to the driver.
    assert!(
        pool.pooled_host_bytes > 0 && pool.pooled_host_bytes + (3 << 20) >= sr.bytes,
        "the host pieces stay in the pool: {} of {} B",
        pool.pooled_host_bytes,
        sr.bytes
    );
    assert_eq!(
        fb.live().chunk_bytes,
        s.device_bytes + pool.pooled_host_bytes,
        "nothing else is held"
    );
    assert_intact(&live, &addresses, "awake");
    let mut got = vec![0u8; 3 << 20];
    extra.read(0, &mut got).unwrap();
    assert!(
        got == extra_data,
        "the allocation made asleep kept its bytes"
    );

    // A second cycle takes its host pieces from the pool: it creates none.
    let hits = arena.pool().stats().hits;
    let pieces = arena.pool().stats().pooled_chunks;
    let chunks = fb.live().chunks;
    let again = arena.sleep(&[Q(0)], &SleepDesc::keep()).unwrap();
    assert_eq!(
        arena.pool().stats().hits - hits,
        pieces as u64,
        "every host piece came from the pool"
    );
    assert_eq!(
        again.chunks_before, again.chunks_after,
        "pieces stay pieces"
    );
    assert!(fb.live().chunks <= chunks, "no chunk was created");
    assert_eq!(arena.pool().stats().pooled_host_bytes, 0);
    assert_intact(&live, &addresses, "asleep again");
    arena.restore(&[Q(0)]).unwrap();
    assert_intact(&live, &addresses, "after a second cycle");
    // The explicit release gives the host pieces back.
    let device = arena.stats().device_bytes;
    arena.pool().trim_at(Location::Host).unwrap();
    assert_eq!(arena.pool().stats().pooled_host_bytes, 0);
    assert_eq!(fb.live().chunk_bytes, device, "the host memory went back");
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

/// Ranges `(address, bytes)` of the allocations.
fn ranges(live: &Live) -> Vec<(u64, usize)> {
    live.iter().map(|(a, d)| (a.address(), d.len())).collect()
}

fn disjoint(a: (u64, usize), b: (u64, usize)) -> bool {
    a.0 + a.1 as u64 <= b.0 || b.0 + b.1 as u64 <= a.0
}

/// A new 3 MiB allocation of random bytes (from `seed`), made while the
/// arena sleeps: it lies apart from every sleeping allocation of `live`.
fn alloc_apart(arena: &EmuArena, live: &Live, seed: u64) -> (Allocation<Fb, Q>, Vec<u8>) {
    let mut extra = arena.alloc(3 << 20, &Q(0)).unwrap();
    for &rg in &ranges(live) {
        assert!(disjoint((extra.address(), 3 << 20), rg), "{rg:?}");
    }
    let data = random_bytes(seed, 3 << 20);
    extra.write(0, &data).unwrap();
    (extra, data)
}

/// Asleep with a backup: every `step`-th allocation of `live` reads back
/// from it (`read_backup`), and ranges it does not hold (below the arena,
/// far past it) are refused with the buffer untouched.
fn assert_backup_holds(arena: &EmuArena, live: &Live, step: usize) {
    for (a, data) in live.iter().step_by(step) {
        let mut got = vec![0u8; data.len()];
        assert!(arena.read_backup(a.address(), &mut got).unwrap());
        assert!(got == *data, "the backup holds the allocation's bytes");
    }
    let mut none = vec![7u8; 64];
    assert!(!arena.read_backup(arena.base() - 64, &mut none).unwrap());
    assert!(!arena
        .read_backup(arena.base() + (1 << 40), &mut none)
        .unwrap());
    assert!(none.iter().all(|&b| b == 7), "untouched when refused");
}

/// A discarding sleep unmaps everything and gives it back (nothing is
/// copied, nothing kept); allocating while asleep maps fresh memory outside
/// the discarded ranges; frees while asleep are honoured; the wake maps
/// the same ranges again (zeroed on request) and their free bytes are
/// handed out again before anything new is mapped.
fn a_discarding_sleep_gives_everything_back_and_the_wake_maps_the_same_addresses() {
    for zero in [true, false] {
        let (fb, arena) = emulated();
        let mut live = fill(&arena, 31 + zero as u64, 27);
        let addresses: Vec<u64> = live.iter().map(|(a, _)| a.address()).collect();
        let before = arena.stats();
        let r = arena.sleep(&[Q(0), Q(1)], &SleepDesc::discard()).unwrap();
        let s = arena.stats();
        assert_eq!(arena.sleep_mode(), Some(SleepMode::Discard));
        assert_eq!(s.reserved_bytes.current, 0, "nothing is mapped: {s}");
        assert_eq!(
            (fb.live().chunks, fb.live().chunk_bytes),
            (0, 0),
            "every chunk went back to the driver"
        );
        assert_eq!(r.bytes, s.discarded_bytes);
        assert!(
            r.bytes < before.reserved_bytes.current,
            "free chunks went first"
        );
        assert_eq!(r.device_bytes, before.device_bytes);
        assert_eq!(s.allocated_bytes.current, before.allocated_bytes.current);
        for (a, &at) in live.iter().zip(&addresses) {
            assert_eq!(a.0.address(), at);
        }

        // Asleep: a new allocation lands outside every live one and keeps
        // its bytes; one of the discarded allocations is freed.
        let (extra, extra_data) = alloc_apart(&arena, &live, 5);
        let (freed, freed_data) = live.remove(4);
        let freed_at = (freed.address(), freed_data.len());
        drop(freed);
        let mapped_asleep = arena.stats().reserved_bytes.current;
        assert_eq!(arena.stats().discarded_bytes, r.bytes);

        let desc = if zero {
            WakeDesc::zeroed()
        } else {
            WakeDesc::default()
        };
        let w = arena.wake(&[Q(0), Q(1)], &desc).unwrap();
        let s = arena.stats();
        assert_eq!(arena.sleep_mode(), None);
        assert_eq!(w.bytes, r.bytes, "the same ranges came back");
        assert_eq!(s.reserved_bytes.current, mapped_asleep + r.bytes);
        assert_eq!(s.discarded_bytes, 0);
        assert!(
            w.chunks_after * 4 <= r.chunks_before,
            "as pieces: {} chunks -> {}",
            r.chunks_before,
            w.chunks_after
        );
        for ((a, data), &at) in live
            .iter_mut()
            .zip(addresses.iter().filter(|&&x| x != freed_at.0))
        {
            assert_eq!(a.address(), at, "same address after the wake");
            let mut got = vec![1u8; data.len()];
            a.read(0, &mut got).unwrap();
            if zero {
                assert!(got.iter().all(|&b| b == 0), "zeroed on request");
            }
            // Writable again, every byte.
            *data = random_bytes(at, data.len());
            a.write(0, data).unwrap();
        }
        let mut got = vec![0u8; 3 << 20];
        extra.read(0, &mut got).unwrap();
        assert!(
            got == extra_data,
            "the allocation made asleep kept its bytes"
        );
        assert_intact(
            &live,
            &addresses
                .iter()
                .copied()
                .filter(|&x| x != freed_at.0)
                .collect::<Vec<_>>(),
            "rewritten after the wake",
        );
        // The slowest host test (about 11 s in a debug build on 2 cores):
        // it says what it checked, round by round.
        eprintln!(
            "  discarding sleep (zeroed wake: {zero}): {} allocations, {} discarded and woken at their addresses, every byte rewritten and checked",
            live.len(),
            vmmbuf::stats::Bytes(r.bytes)
        );
        // The bytes freed while asleep are free again: the same request
        // maps nothing new.
        let again = arena.alloc(freed_at.1, &Q(0)).unwrap();
        assert_eq!(
            arena.stats().reserved_bytes.current,
            s.reserved_bytes.current,
            "the free bytes of the woken ranges were reused"
        );
        drop((again, extra, live, arena));
        assert_eq!(fb.live().chunks, 0, "and nothing leaked");
        assert_eq!(fb.live().reservations, 0);
    }
}

/// A discarding wake takes pooled chunks first, which hold another
/// arena's bytes: with `zero` every byte of the woken allocations reads 0;
/// without, the old bytes show (which is what makes the first check bite).
fn a_zeroed_wake_zeroes_reused_memory() {
    for zero in [true, false] {
        let fb = FaultBackend::emulating_gpu(host());
        let pool = ChunkPool::new(fb.clone(), PoolDesc::default()).unwrap();
        let desc = ArenaDesc::new(1 << 30).max_chunk_bytes(256 << 10);
        let a1: EmuArena = Arena::with_pool(pool.clone(), desc.clone()).unwrap();
        let a2: EmuArena = Arena::with_pool(pool.clone(), desc).unwrap();
        let live = fill(&a1, 61, 18);
        a1.sleep(&[Q(0)], &SleepDesc::discard().max_piece_bytes(256 << 10))
            .unwrap();
        // Another arena leaves dirty chunks of the same size in the pool.
        let mut other = a2.alloc(32 << 20, &Q(0)).unwrap();
        other.write(0, &random_bytes(7, 32 << 20)).unwrap();
        drop(other);
        a2.release_cached().unwrap();
        let pooled = pool.stats().pooled_chunks;
        assert!(pooled >= 100, "{pooled}");
        let desc = if zero {
            WakeDesc::zeroed()
        } else {
            WakeDesc::default()
        };
        a1.wake(&[Q(0)], &desc).unwrap();
        assert!(
            pool.stats().pooled_chunks < pooled,
            "the wake took pooled chunks"
        );
        let nonzero = live
            .iter()
            .filter(|(a, d)| {
                let mut got = vec![0u8; d.len()];
                a.read(0, &mut got).unwrap();
                got.iter().any(|&b| b != 0)
            })
            .count();
        if zero {
            assert_eq!(nonzero, 0, "every byte zeroed");
        } else {
            assert!(nonzero > 0, "reused memory shows its old bytes");
        }
    }
}

/// Fails each driver call of a discarding wake in turn: the arena stays
/// asleep with its ranges unmapped and nothing leaked, and the same wake
/// then succeeds.
fn every_failed_call_of_a_discarding_wake_leaves_it_asleep() {
    // Under a shared budget, which counts what is mapped through every
    // failure: a wake that fails part way gives back what it mapped once.
    let fb = FaultBackend::emulating_gpu(host());
    let budget = Budget::new(1 << 30);
    let arena: EmuArena = Arena::new(
        fb.clone(),
        ArenaDesc::new(1 << 30)
            .max_chunk_bytes(256 << 10)
            .shared_budget(budget.clone()),
    )
    .unwrap();
    let live = fill(&arena, 41, 12);
    arena.sleep(&[Q(0)], &SleepDesc::discard()).unwrap();
    let discarded = arena.stats().discarded_bytes;
    assert!(discarded > 0);
    let mut state = (arena, live);
    let calls = fail_each_call(
        &fb,
        &mut state,
        |(arena, _)| arena.wake(&[Q(0)], &WakeDesc::zeroed()),
        |(arena, live), k, r| match r {
            Err(e) => {
                assert!(injected(&e), "call {k}: {e}");
                let s = arena.stats();
                assert_eq!(arena.sleep_mode(), Some(SleepMode::Discard), "call {k}");
                assert_eq!(
                    s.reserved_bytes.current, 0,
                    "call {k}: nothing stays mapped"
                );
                assert_eq!(s.discarded_bytes, discarded);
                assert_eq!(fb.live().mapped_bytes, 0, "call {k}");
                assert_eq!(
                    budget.used(),
                    0,
                    "call {k}: the budget counts nothing mapped"
                );
                let _ = live;
            }
            Ok(_) => {
                let mapped = arena.stats().reserved_bytes.current;
                assert_eq!(
                    budget.used(),
                    mapped,
                    "call {k}: the budget counts the wake"
                );
                arena.sleep(&[Q(0)], &SleepDesc::discard()).unwrap();
            }
        },
    );
    eprintln!("discarding wake: {calls} calls, each failed once");
    assert!(calls >= 3, "a wake makes several calls: {calls}");
    assert_eq!(state.0.sleep_mode(), None);
    for (a, data) in &state.1 {
        let mut got = vec![1u8; data.len()];
        a.read(0, &mut got).unwrap();
        assert!(got.iter().all(|&b| b == 0), "zeroed");
    }
    assert_eq!(budget.used(), state.0.stats().reserved_bytes.current);
    drop(state);
    assert_eq!(fb.live().chunks, 0, "and nothing leaked");
    assert_eq!(budget.used(), 0, "the arena's drop gave its budget back");
}

/// `prepare_sleep` creates the host pieces a sleep will take (on another
/// thread, while the arena keeps working), for a kept sleep and for a
/// stashing one (which cuts its runs into pieces its own way, and whose
/// pieces it maps into the stash too): the sleep then creates nothing, and
/// a stashing one maps nothing either.
fn prepare_sleep_pins_ahead_so_the_sleep_creates_nothing() {
    // Pieces of 2.75 chunks: a stash cuts its runs at piece multiples,
    // across chunks, where a kept sleep joins whole chunks.
    let stash = SleepDesc::stash().max_piece_bytes(704 << 10);
    for (seed, desc) in [
        (71, SleepDesc::keep()),
        (72, SleepDesc::stash()),
        (73, stash),
    ] {
        let (fb, arena) = emulated();
        let live = fill(&arena, seed, 27);
        let addresses: Vec<u64> = live.iter().map(|(a, _)| a.address()).collect();
        let a2 = arena.clone();
        let made = std::thread::spawn(move || a2.prepare_sleep(&desc).unwrap())
            .join()
            .unwrap();
        let p = arena.pool().stats();
        let stashed = desc.mode == SleepMode::Stash;
        assert!(made > 0, "{:?}", desc.mode);
        if stashed {
            // Mapped into the stash, counted there.
            assert_eq!(p.pooled_host_bytes, 0, "{p}");
            assert_eq!(arena.stats().stash_bytes, made);
        } else {
            assert_eq!(p.pooled_host_bytes, made, "{p}");
        }
        // Preparing again creates nothing: the pool or the stash holds
        // the pieces.
        assert_eq!(arena.prepare_sleep(&desc).unwrap(), 0);
        assert_eq!(arena.prepare_sleep(&SleepDesc::discard()).unwrap(), 0);
        let hits = p.hits;
        let chunks_before = fb.live().chunks;
        // A stash maps a piece it lacks (created or pooled); a kept sleep
        // maps its pieces at the addresses, but creates none.
        fb.fail_every(Some(if stashed { "map" } else { "create" }));
        let r = arena.sleep(&[Q(0)], &desc);
        fb.fail_every(None);
        let r = r.unwrap();
        assert_eq!(
            r.bytes, made,
            "{:?}: the sleep moved what was prepared for",
            desc.mode
        );
        let took = if stashed { 0 } else { r.chunks_after as u64 };
        assert_eq!(
            arena.pool().stats().hits - hits,
            took,
            "{:?}: the pieces came from the pool (a stash's were in place)",
            desc.mode
        );
        assert_eq!(arena.pool().stats().pooled_host_bytes, 0, "{:?}", desc.mode);
        assert!(fb.live().chunks < chunks_before, "nothing was created");
        if !stashed {
            // A stash unmaps the addresses until the wake.
            assert_intact(&live, &addresses, "asleep");
        }
        arena.wake(&[Q(0)], &WakeDesc::default()).unwrap();
        assert_intact(&live, &addresses, "awake");
        // The sleep's runs stayed whole (a stash unmaps chunk by chunk as
        // its copies pass): the wake maps one device chunk per piece,
        // beside the host pieces kept for the next sleep.
        assert_eq!(fb.live().chunks, 2 * r.chunks_after, "{:?}", desc.mode);
    }
}

/// A stashing sleep copies every run to the stash and unmaps it (nothing
/// of the arena stays mapped, the device memory goes), allocating and
/// freeing still work asleep, the wake brings every byte back at its
/// address, and a second cycle reuses the stash: it creates no host chunk.
fn a_stashing_sleep_keeps_every_byte_away_from_the_addresses() {
    let (fb, arena) = emulated();
    let mut live = fill(&arena, 83, 27);
    let mut addresses: Vec<u64> = live.iter().map(|(a, _)| a.address()).collect();
    let r = arena.sleep(&[Q(0), Q(1)], &SleepDesc::stash()).unwrap();
    let s = arena.stats();
    assert_eq!(arena.sleep_mode(), Some(SleepMode::Stash));
    assert_eq!(s.reserved_bytes.current, 0, "nothing stays mapped: {s}");
    assert_eq!(s.discarded_bytes, r.bytes);
    assert_eq!(s.stash_bytes, r.bytes, "the stash holds every run");
    assert_eq!(r.migration.bytes_moved, r.bytes);
    assert_eq!(
        fb.live().chunk_bytes,
        s.stash_bytes,
        "only the stash is held: the GPU chunks went back"
    );
    assert!(!arena.is_offloaded());
    // Asleep, the stash can be read at the allocations' addresses
    // (torch_memory_saver's get_cpu_backup); a range it does not hold
    // (below the arena, past its runs) cannot.
    assert_backup_holds(&arena, &live, 4);
    // Asleep: reads of a stashed allocation fail (unmapped), new ones land
    // elsewhere and keep their bytes, and a stashed one is freed.
    let mut probe = vec![0u8; 16];
    assert!(
        live[0].0.read(0, &mut probe).is_err(),
        "unmapped while asleep"
    );
    let (extra, extra_data) = alloc_apart(&arena, &live, 9);
    let (freed, freed_data) = live.remove(5);
    addresses.remove(5);
    let freed_len = freed_data.len();
    drop(freed);
    let w = arena.wake(&[Q(0), Q(1)], &WakeDesc::default()).unwrap();
    assert_eq!(arena.sleep_mode(), None);
    let mut probe = vec![0u8; 16];
    assert!(
        !arena.read_backup(live[0].0.address(), &mut probe).unwrap(),
        "awake: no backup to read"
    );
    assert_eq!(w.bytes, r.bytes);
    assert_eq!(arena.stats().discarded_bytes, 0);
    assert_intact(&live, &addresses, "after the wake");
    let mut got = vec![0u8; 3 << 20];
    extra.read(0, &mut got).unwrap();
    assert!(got == extra_data);
    let reserved = arena.stats().reserved_bytes.current;
    let again = arena.alloc(freed_len, &Q(0)).unwrap();
    assert_eq!(
        arena.stats().reserved_bytes.current,
        reserved,
        "the bytes freed asleep were handed out again"
    );
    drop(again);
    // A second cycle: the stash is reused, no host chunk is created.
    let host_chunks = |fb: &Fb| fb.live().chunks;
    let before = host_chunks(&fb);
    let stash = arena.stats().stash_bytes;
    let r2 = arena.sleep(&[Q(0)], &SleepDesc::stash()).unwrap();
    assert!(arena.stats().stash_bytes >= stash);
    assert!(
        host_chunks(&fb) <= before,
        "no chunk was created: {} -> {}",
        before,
        host_chunks(&fb)
    );
    assert!(
        arena.release_stash().is_err(),
        "the stash holds the data now"
    );
    arena.wake(&[Q(0)], &WakeDesc::default()).unwrap();
    assert_intact(&live, &addresses, "after a second cycle");
    assert!(
        r2.bytes >= extra_data.len(),
        "the extra allocation slept too"
    );
    extra.read(0, &mut got).unwrap();
    assert!(got == extra_data, "and came back");
    // The stash goes back on request.
    let held = arena.stats().stash_bytes;
    assert_eq!(arena.release_stash().unwrap(), held);
    assert_eq!(arena.stats().stash_bytes, 0);
    arena.pool().trim_at(Location::Host).unwrap();
    assert_eq!(
        fb.live().chunk_bytes,
        arena.stats().reserved_bytes.current,
        "the stash's host memory went back"
    );
    drop((live, extra, arena));
    assert_eq!(fb.live().chunks, 0);
    assert_eq!(fb.live().reservations, 0);
}

/// Fails each driver call of a stashing sleep, then of its wake, in turn:
/// no byte is lost. A sleep that failed before unmapping leaves the arena
/// awake; one that failed part way leaves those runs asleep, and the wake
/// brings them back. A failed wake leaves the arena asleep.
fn every_failed_call_of_a_stashing_sleep_or_wake_loses_nothing() {
    failed_copying_sleep_calls(SleepMode::Stash, None);
}

/// A pageable sleep copies every run to pageable host memory of its own
/// and unmaps it: no chunk of any kind stays (no pinned host piece either),
/// the copies can be read at the allocations' addresses, allocating works
/// asleep, a second sleep in the same mode takes what was mapped since, a
/// sleep in another mode is refused, and the wake brings every byte back
/// and lets the copies go.
fn a_pageable_sleep_keeps_every_byte_in_host_memory_it_gives_back() {
    for mode in [SleepMode::Pageable, SleepMode::Disk] {
        pageable_or_disk_sleep(mode);
    }
}

/// `Arena::set_spill_file_bytes` (torch_memory_saver's
/// `TMS_DISK_BACKUP_CHUNK_MB`): a disk sleep writes no file longer than the
/// bytes set, odd sizes included, the files together hold every run, and
/// the wake brings every byte back from them and removes them; 0 is a file
/// per chunk again.
fn a_disk_sleep_cuts_chunks_into_files_of_at_most_the_bytes_set() {
    let (fb, arena) = emulated();
    let live = fill(&arena, 61, 21);
    let addresses: Vec<u64> = live.iter().map(|(a, _)| a.address()).collect();
    let dir = TempDir::new("pieces");
    arena.set_spill_dir(Some(dir.0.clone()));
    let desc = SleepDesc::from(SleepMode::Disk);
    // A wake maps each run afresh: the chunks after the first one are the
    // layout every later cycle sleeps.
    let mut per_chunk = None;
    for (cycle, most) in [0, 0, 1 << 40, 100_003usize, 64 << 10, 0]
        .into_iter()
        .enumerate()
    {
        arena.set_spill_file_bytes(most);
        let r = arena.sleep(&[Q(0)], &desc).unwrap();
        let sizes = dir.sizes();
        assert_eq!(
            sizes.iter().sum::<u64>() as usize,
            r.bytes,
            "{most}: every run"
        );
        let limit = if most == 0 { usize::MAX } else { most };
        assert!(
            sizes.iter().all(|&n| n > 0 && n as usize <= limit),
            "{most}: {sizes:?}"
        );
        if most == 0 || most == 1 << 40 {
            // The first cycle's layout is fill's; the second is the wakes'.
            if cycle <= 1 {
                per_chunk = Some(sizes.len());
            }
            assert_eq!(Some(sizes.len()), per_chunk, "{most}: a file per chunk");
        } else {
            let n = per_chunk.unwrap();
            assert!(
                sizes.len() > n,
                "{most}: chunks cut ({} files, {n} chunks)",
                sizes.len()
            );
        }
        assert_backup_holds(&arena, &live, 2);
        arena.wake(&[Q(0)], &WakeDesc::default()).unwrap();
        assert_eq!(dir.files(), (0, 0), "{most}: the files went at the wake");
        assert_intact(&live, &addresses, "after the wake");
    }
    drop((live, arena));
    assert_eq!(fb.live().chunks, 0);
}

/// A directory of its own for a test's files, removed (with them) at the
/// drop.
struct TempDir(std::path::PathBuf);

impl TempDir {
    fn new(what: &str) -> Self {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!("vmmbuf-{what}-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }

    /// The files in it and their total size.
    fn files(&self) -> (usize, u64) {
        let sizes = self.sizes();
        (sizes.len(), sizes.iter().sum())
    }

    /// The sizes of this process's spill files in it. They have no name
    /// there (made unnamed, or unlinked at once: a killed process leaves
    /// none), which this checks; they are found through the process's
    /// mappings, where `/proc/self/maps` lists them under the directory
    /// as deleted, and sized through `/proc/self/map_files`.
    fn sizes(&self) -> Vec<u64> {
        assert_eq!(
            std::fs::read_dir(&self.0).unwrap().count(),
            0,
            "a spill file has a name in the directory"
        );
        let prefix = format!("{}/", self.0.display());
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        let mut inodes = std::collections::BTreeSet::new();
        let mut out = Vec::new();
        for line in maps.lines() {
            let f: Vec<&str> = line.splitn(6, ' ').collect();
            let path = f.get(5).map_or("", |p| p.trim_start());
            if path.starts_with(&prefix) && inodes.insert(f[4].to_owned()) {
                let m = std::fs::metadata(format!("/proc/self/map_files/{}", f[0])).unwrap();
                out.push(m.len());
            }
        }
        out
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One mode of [`a_pageable_sleep_keeps_every_byte_in_host_memory_it_gives_back`]:
/// a disk sleep is refused without a spill directory (nothing changes),
/// and with one keeps one file per chunk there while asleep, none after.
fn pageable_or_disk_sleep(mode: SleepMode) {
    let (fb, arena) = emulated();
    let mut live = fill(&arena, 97, 27);
    let mut addresses: Vec<u64> = live.iter().map(|(a, _)| a.address()).collect();
    let desc = SleepDesc::from(mode);
    let dir = TempDir::new("spill");
    if mode == SleepMode::Disk {
        let chunks = fb.live().chunks;
        let e = arena.sleep(&[Q(0)], &desc).unwrap_err();
        assert!(e.to_string().contains("spill directory"), "{e}");
        assert_eq!(arena.sleep_mode(), None, "refused: nothing changed");
        assert_eq!(fb.live().chunks, chunks);
        arena.set_spill_dir(Some(dir.0.clone()));
    }
    assert_eq!(arena.prepare_sleep(&desc).unwrap(), 0, "nothing to pin");
    let r = arena.sleep(&[Q(0), Q(1)], &desc).unwrap();
    let s = arena.stats();
    assert_eq!(arena.sleep_mode(), Some(mode));
    if mode == SleepMode::Disk {
        let (n, bytes) = dir.files();
        assert_eq!(bytes as usize, r.bytes, "the files hold every run");
        assert_eq!(n, r.chunks_after, "a file per chunk");
        assert!(n >= 2, "{n}");
    } else {
        assert_eq!(dir.files().0, 0);
    }
    assert_eq!(s.reserved_bytes.current, 0, "nothing stays mapped: {s}");
    assert_eq!(s.discarded_bytes, r.bytes);
    assert_eq!(s.pageable_bytes, r.bytes, "a copy of every run");
    assert_eq!(s.stash_bytes, 0);
    assert_eq!(r.migration.bytes_moved, r.bytes);
    assert_eq!(
        fb.live().chunks,
        0,
        "no chunk is held, not even a pinned one"
    );
    assert_backup_holds(&arena, &live, 3);
    assert!(
        arena.sleep(&[Q(0)], &SleepDesc::stash()).is_err(),
        "another mode while asleep"
    );
    // Asleep: a new allocation lands elsewhere; it sleeps in a second
    // pageable sleep, beside the first sleep's runs.
    let (extra, extra_data) = alloc_apart(&arena, &live, 13);
    let (freed, _) = live.remove(4);
    addresses.remove(4);
    drop(freed);
    let r2 = arena.sleep(&[Q(0)], &desc).unwrap();
    assert!(
        r2.bytes >= r.bytes + extra_data.len(),
        "{} {}",
        r.bytes,
        r2.bytes
    );
    if mode == SleepMode::Disk {
        assert_eq!(
            dir.files().1 as usize,
            r2.bytes,
            "the second sleep's files too"
        );
    }
    let mut got = vec![0u8; 3 << 20];
    assert!(arena.read_backup(extra.address(), &mut got).unwrap());
    assert!(got == extra_data);
    let w = arena.wake(&[Q(0), Q(1)], &WakeDesc::default()).unwrap();
    assert_eq!(w.bytes, r2.bytes);
    assert_eq!(arena.sleep_mode(), None);
    let s = arena.stats();
    assert_eq!((s.pageable_bytes, s.discarded_bytes), (0, 0), "{s}");
    assert_eq!(dir.files(), (0, 0), "{mode}: the files went at the wake");
    assert_intact(&live, &addresses, "after the wake");
    extra.read(0, &mut got).unwrap();
    assert!(got == extra_data, "and the second sleep's allocation");
    let mut probe = vec![0u8; 16];
    assert!(!arena.read_backup(live[0].0.address(), &mut probe).unwrap());
    drop((live, extra, arena));
    assert_eq!(fb.live().chunks, 0);
    assert_eq!(fb.live().reservations, 0);
}

/// torch_memory_saver's `retain_cpu_backup` and `get_cpu_backup(zero_copy=
/// True)`, for both host copies (stash and pageable): the backup has one
/// host address, readable there by the CPU while asleep (a stash's after
/// the host's access is given); a wake that keeps
/// it leaves it readable (and the same) while awake, the next sleep writes
/// the new bytes at that address, and a wake that does not keep it (or
/// `release_stash`) ends it.
fn a_kept_backup_stays_readable_at_one_address_until_released() {
    for mode in [SleepMode::Stash, SleepMode::Pageable] {
        let (fb, arena) = emulated();
        let mut live = fill(&arena, 103, 9);
        let desc = SleepDesc::from(mode);
        let (x, _) = &live[3];
        let (addr, n) = (x.address(), live[3].1.len());
        assert_eq!(
            arena.backup_address(addr, n).unwrap(),
            None,
            "{mode}: awake, none"
        );
        arena.sleep(&[Q(0)], &desc).unwrap();
        if mode == SleepMode::Stash {
            // The stash's pieces are mapped for the device only: the
            // address is offered after the host's access is given, and a
            // refused grant is an error, not an address the CPU faults on.
            fb.fail_every(Some("set_access"));
            assert!(arena.backup_address(addr, n).is_err(), "{mode}");
            fb.fail_every(None);
        }
        let host = arena.backup_address(addr, n).unwrap();
        assert!(host.is_some(), "{mode}: asleep, an address");
        if mode == SleepMode::Stash {
            // Granted once: asking again calls the driver no more.
            let calls = fb.calls();
            assert_eq!(arena.backup_address(addr, n).unwrap(), host);
            assert_eq!(fb.calls(), calls, "{mode}: the grant is kept");
        }
        // What the backup holds (read by copy; the address is what a
        // zero-copy view would read, checked the same on the GPU).
        let backup = || {
            let mut got = vec![0u8; n];
            assert!(arena.read_backup(addr, &mut got).unwrap());
            got
        };
        let got = backup();
        assert!(got == live[3].1, "{mode}: the backup holds the bytes");
        assert_eq!(arena.backup_address(addr, 0).unwrap(), None);
        assert_eq!(arena.backup_address(arena.base() - 8, 8).unwrap(), None);
        arena.wake(&[Q(0)], &WakeDesc::keeping_backup()).unwrap();
        assert_eq!(arena.backup_address(addr, n).unwrap(), host, "{mode}: kept");
        let got = backup();
        assert!(got == live[3].1, "{mode}: readable awake");
        // New bytes, a second sleep: same address, the new bytes.
        let fresh = random_bytes(17, n);
        live[3].0.write(0, &fresh).unwrap();
        live[3].1 = fresh.clone();
        arena.sleep(&[Q(0)], &desc).unwrap();
        assert_eq!(
            arena.backup_address(addr, n).unwrap(),
            host,
            "{mode}: reused"
        );
        let got = backup();
        assert!(got == fresh, "{mode}: the second sleep's bytes");
        if mode == SleepMode::Pageable {
            assert!(arena.stats().pageable_bytes > 0);
        }
        // A wake that does not keep it: nothing readable awake.
        arena.wake(&[Q(0)], &WakeDesc::default()).unwrap();
        assert_eq!(arena.backup_address(addr, n).unwrap(), None, "{mode}");
        let mut probe = vec![0u8; 8];
        assert!(!arena.read_backup(addr, &mut probe).unwrap());
        assert_eq!(
            arena.stats().pageable_bytes,
            0,
            "{mode}: the copy went back"
        );
        // Kept again, then released.
        arena.sleep(&[Q(0)], &desc).unwrap();
        arena.wake(&[Q(0)], &WakeDesc::keeping_backup()).unwrap();
        assert!(arena.backup_address(addr, n).unwrap().is_some(), "{mode}");
        assert!(arena.release_stash().unwrap() > 0, "{mode}");
        assert_eq!(arena.backup_address(addr, n).unwrap(), None);
        assert_eq!(arena.stats().pageable_bytes, 0);
        assert_eq!(arena.stats().stash_bytes, 0);
        let addresses: Vec<u64> = live.iter().map(|(a, _)| a.address()).collect();
        assert_intact(&live, &addresses, "after the cycles");
        drop((live, arena));
        assert_eq!(fb.live().chunks, 0, "{mode}: nothing leaked");
    }
}

/// Fails each driver call of a pageable sleep, then of its wake, in turn:
/// no byte is lost, as for a stashing one.
fn every_failed_call_of_a_pageable_sleep_or_wake_loses_nothing() {
    for mode in [SleepMode::Pageable, SleepMode::Disk] {
        let dir = TempDir::new("faults");
        failed_copying_sleep_calls(mode, Some(&dir));
        assert_eq!(dir.files(), (0, 0), "{mode}: no file left");
    }
}

/// Each driver call of a sleep in `mode` (one that copies the data: stash,
/// pageable, disk), then of its wake, failed in turn: see
/// [`every_failed_call_of_a_stashing_sleep_or_wake_loses_nothing`]. A
/// fault in a release after the sleep leaves it standing (the pool logs
/// it); any other fails it.
fn failed_copying_sleep_calls(mode: SleepMode, dir: Option<&TempDir>) {
    let (fb, arena) = emulated();
    arena.set_spill_dir(dir.map(|d| d.0.clone()));
    let live = fill(&arena, if mode == SleepMode::Stash { 89 } else { 101 }, 14);
    let addresses: Vec<u64> = live.iter().map(|(a, _)| a.address()).collect();
    let desc = SleepDesc::from(mode);
    let mut state = (arena, live);
    let sleeps = fail_each_call(
        &fb,
        &mut state,
        |(arena, _)| arena.sleep(&[Q(0)], &desc),
        |(arena, live), k, r| {
            if let Err(e) = r {
                assert!(injected(&e), "call {k}: {e}");
            }
            if arena.sleep_mode().is_some() {
                arena.wake(&[Q(0)], &WakeDesc::default()).unwrap();
            }
            assert_intact(live, &addresses, &format!("sleep call {k} failed"));
        },
    );
    assert_eq!(state.0.sleep_mode(), Some(mode));
    let discarded = state.0.stats().discarded_bytes;
    let wakes = fail_each_call(
        &fb,
        &mut state,
        |(arena, _)| arena.wake(&[Q(0)], &WakeDesc::default()),
        |(arena, live), k, r| match r {
            Err(e) => {
                assert!(injected(&e), "call {k}: {e}");
                assert_eq!(arena.sleep_mode(), Some(mode), "call {k}");
                assert_eq!(arena.stats().discarded_bytes, discarded);
                if mode != SleepMode::Stash {
                    assert_eq!(arena.stats().pageable_bytes, discarded);
                }
                assert_eq!(arena.stats().reserved_bytes.current, 0);
            }
            Ok(_) => {
                assert_intact(live, &addresses, &format!("wake call {k} (late)"));
                arena.sleep(&[Q(0)], &desc).unwrap();
            }
        },
    );
    eprintln!("{mode}: sleep {sleeps} calls, wake {wakes} calls, each failed once");
    assert!(sleeps >= 3 && wakes >= 3, "{sleeps} / {wakes}");
    assert_eq!(state.0.sleep_mode(), None);
    assert_intact(&state.1, &addresses, "after the loops");
    drop(state);
    assert_eq!(fb.live().chunks, 0, "and nothing leaked");
}

/// The host pieces a wake leaves in the pool stay within
/// `PoolDesc::max_host_bytes`; the rest go back to the driver at once.
fn the_host_pieces_kept_between_sleeps_are_bounded() {
    let fb = FaultBackend::emulating_gpu(host());
    let bound = 6 << 20;
    let pool = ChunkPool::new(fb.clone(), PoolDesc::default().max_host_bytes(bound)).unwrap();
    let arena: EmuArena = Arena::with_pool(
        pool.clone(),
        ArenaDesc::new(1 << 30).max_chunk_bytes(256 << 10),
    )
    .unwrap();
    let live = fill(&arena, 53, 27);
    let addresses: Vec<u64> = live.iter().map(|(a, _)| a.address()).collect();
    let r = arena
        .sleep(&[Q(0)], &SleepDesc::keep().max_piece_bytes(2 << 20))
        .unwrap();
    assert!(
        r.bytes > 2 * bound,
        "more sleeps than the bound: {}",
        r.bytes
    );
    arena.wake(&[Q(0)], &WakeDesc::default()).unwrap();
    let p = pool.stats();
    assert!(
        p.pooled_host_bytes <= bound && p.pooled_host_bytes > 0,
        "kept {} of at most {bound}",
        p.pooled_host_bytes
    );
    assert_eq!(
        fb.live().chunk_bytes,
        arena.stats().device_bytes + p.pooled_host_bytes,
        "the rest went back to the driver"
    );
    assert_intact(&live, &addresses, "awake");
    // The next sleep takes what was kept and creates the rest.
    let hits = pool.stats().hits;
    arena
        .sleep(&[Q(0)], &SleepDesc::keep().max_piece_bytes(2 << 20))
        .unwrap();
    assert!(pool.stats().hits > hits, "kept pieces were reused");
    assert_intact(&live, &addresses, "asleep again");
    // Lowering the bound sheds at once; 0 keeps nothing.
    arena.wake(&[Q(0)], &WakeDesc::default()).unwrap();
    pool.set_desc(PoolDesc::default().max_host_bytes(0))
        .unwrap();
    assert_eq!(pool.stats().pooled_host_bytes, 0);
    assert_eq!(fb.live().chunk_bytes, arena.stats().device_bytes);
    drop((live, arena, pool));
    assert_eq!(fb.live().chunks, 0);
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
    // A second kept cycle pins nothing: its host pieces come from the pool.
    let hits = arena.pool().stats().hits;
    let kept = arena.pool().stats().pooled_host_bytes;
    assert!(kept > 0, "the wake kept the host pieces");
    let r = arena
        .sleep(std::slice::from_ref(&s), &SleepDesc::keep())
        .unwrap();
    assert!(arena.pool().stats().hits > hits);
    assert_eq!(r.chunks_before, r.chunks_after, "pieces stay pieces");
    arena
        .wake(std::slice::from_ref(&s), &WakeDesc::default())
        .unwrap();
    for (i, (a, &n)) in live.iter().zip(&words).enumerate() {
        let seed = if i == 1 { 77 } else { 1000 + i as u32 };
        assert_eq!(
            k.mismatches(a.address(), 0, n, seed),
            0,
            "allocation {i}, second cycle"
        );
    }

    // Stashing: the device memory goes, the data waits in the stash away
    // from the addresses, and kernels read every word after the wake.
    let awake = free0.saturating_sub(b.mem_info().unwrap().0);
    let r = arena
        .sleep(std::slice::from_ref(&s), &SleepDesc::stash())
        .unwrap();
    let stashed = free0.saturating_sub(b.mem_info().unwrap().0);
    eprintln!(
        "stash: {} B copied away, device memory taken {awake} -> {stashed} B",
        r.bytes
    );
    assert!(stashed * 20 <= awake, "gave back at least 95%");
    assert_eq!(arena.stats().stash_bytes, r.bytes);
    arena
        .wake(std::slice::from_ref(&s), &WakeDesc::default())
        .unwrap();
    for (i, (a, &n)) in live.iter().zip(&words).enumerate() {
        let seed = if i == 1 { 77 } else { 1000 + i as u32 };
        assert_eq!(a.address(), addresses[i]);
        assert_eq!(
            k.mismatches(a.address(), 0, n, seed),
            0,
            "allocation {i}, stashed"
        );
    }

    // Discarding: the device memory goes, nothing is copied, and the wake
    // maps zeroed memory at the same addresses, which kernels fill again.
    let awake = free0.saturating_sub(b.mem_info().unwrap().0);
    let r = arena
        .sleep(std::slice::from_ref(&s), &SleepDesc::discard())
        .unwrap();
    let discarded = free0.saturating_sub(b.mem_info().unwrap().0);
    eprintln!(
        "discard: {} B unmapped, device memory taken {awake} -> {discarded} B",
        r.bytes
    );
    assert!(discarded * 20 <= awake, "gave back at least 95%");
    assert_eq!(r.migration.bytes_moved, 0, "nothing copied");
    arena
        .wake(std::slice::from_ref(&s), &WakeDesc::zeroed())
        .unwrap();
    let mut buf = vec![0u8; 16 << 20];
    for (i, (a, &n)) in live.iter().zip(&words).enumerate() {
        assert_eq!(a.address(), addresses[i]);
        let bytes = n as usize * 4;
        let mut at = 0;
        while at < bytes {
            let m = buf.len().min(bytes - at);
            a.read(at, &mut buf[..m]).unwrap();
            assert!(
                buf[..m].iter().all(|&x| x == 0),
                "allocation {i} zeroed at {at}"
            );
            at += m;
        }
        k.fill(a.address(), 0, n, 500 + i as u32);
        assert_eq!(k.mismatches(a.address(), 0, n, 500 + i as u32), 0);
    }
    assert_eq!(arena.stats().num_device_syncs, 0);
    drop(live);
    drop(arena);
    assert_eq!(b.live().chunks, 0, "every chunk back to the driver");
}

fn restoring() -> WakeDesc {
    let mut desc = WakeDesc::default();
    desc.restore_free = true;
    desc
}

/// torch_memory_saver's resume: with `restore_free`, a wake in every mode
/// maps back the whole free chunks the sleep gave back, so the footprint is
/// the one before the sleep and the freed sizes are served again without
/// a mapping; every byte of every live allocation stays (but a discarding
/// sleep's), at its address. Without it only the live runs come back.
fn a_wake_restoring_free_memory_maps_back_what_the_sleep_gave() {
    let modes = [
        SleepMode::Discard,
        SleepMode::Stash,
        SleepMode::Pageable,
        SleepMode::Keep,
    ];
    for (k, mode) in modes.into_iter().enumerate() {
        for restore in [true, false] {
            let (fb, arena) = emulated();
            let live = fill(&arena, 70 + 2 * k as u64 + restore as u64, 27);
            let addresses: Vec<u64> = live.iter().map(|(a, _)| a.address()).collect();
            let before = arena.stats();
            let r = arena.sleep(&[Q(0), Q(1)], &SleepDesc::from(mode)).unwrap();
            assert!(
                r.free_bytes >= 2 << 20,
                "{mode}: the freed 2 and 5 MiB allocations left whole free chunks ({})",
                r.free_bytes
            );
            let desc = if restore {
                restoring()
            } else {
                WakeDesc::default()
            };
            let w = arena.wake(&[Q(0), Q(1)], &desc).unwrap();
            let s = arena.stats();
            if mode != SleepMode::Discard {
                assert_intact(&live, &addresses, &format!("{mode} wake"));
            }
            if !restore {
                assert_eq!(w.free_bytes, 0);
                assert_eq!(
                    s.reserved_bytes.current + r.free_bytes,
                    before.reserved_bytes.current,
                    "{mode}: only the runs came back"
                );
                continue;
            }
            assert_eq!(
                w.free_bytes, r.free_bytes,
                "{mode}: every free chunk came back"
            );
            assert_eq!(
                s.reserved_bytes.current, before.reserved_bytes.current,
                "{mode}: the footprint before the sleep"
            );
            if matches!(mode, SleepMode::Discard | SleepMode::Pageable) {
                // No host pieces stay in the pool after these wakes.
                assert_eq!(fb.live().chunk_bytes, s.reserved_bytes.current, "{mode}");
            }
            if mode != SleepMode::Keep {
                assert_eq!(w.device_bytes, w.bytes + w.free_bytes, "{mode}");
            }
            // The freed sizes are served from the restored memory.
            let mut again = Vec::new();
            for (i, n) in [2 << 20, 300 << 10, 100].into_iter().enumerate() {
                let mut a = arena.alloc(n, &Q(0)).unwrap();
                let data = random_bytes(900 + i as u64, n);
                a.write(0, &data).unwrap();
                again.push((a, data));
            }
            assert_eq!(
                arena.stats().reserved_bytes.current,
                before.reserved_bytes.current,
                "{mode}: nothing new was mapped"
            );
            for (a, data) in &again {
                for (b, d) in &live {
                    assert!(disjoint((a.address(), data.len()), (b.address(), d.len())));
                }
            }
            let again_at: Vec<u64> = again.iter().map(|(a, _)| a.address()).collect();
            assert_intact(
                &again,
                &again_at,
                &format!("{mode}: served from restored memory"),
            );
            if mode != SleepMode::Discard {
                assert_intact(&live, &addresses, &format!("{mode}: beside the new ones"));
            }
        }
    }
}

/// A restoring wake under a budget that another arena has partly taken
/// while this one slept: the live runs come back with every byte, the free
/// memory only as far as the budget allows (the wake stands), and the
/// budget is never passed.
fn a_restoring_wake_stops_at_the_budget_and_loses_nothing() {
    let fb = FaultBackend::emulating_gpu(host());
    let budget = Budget::new(160 << 20);
    let desc = ArenaDesc::new(1 << 30)
        .max_chunk_bytes(256 << 10)
        .shared_budget(budget.clone());
    let arena: EmuArena = Arena::new(fb.clone(), desc.clone()).unwrap();
    let other: EmuArena = Arena::new(fb.clone(), desc).unwrap();
    let live = fill(&arena, 501, 27);
    let addresses: Vec<u64> = live.iter().map(|(a, _)| a.address()).collect();
    let r = arena.sleep(&[Q(0), Q(1)], &SleepDesc::stash()).unwrap();
    // Asleep, the other arena takes all but the runs and half the free
    // memory of the budget.
    let target = r.bytes + r.free_bytes / 2;
    let mut held = Vec::new();
    while budget.limit() - budget.used() > target {
        let gap = budget.limit() - budget.used() - target;
        let n = if gap >= 1 << 20 { 1 << 20 } else { 256 << 10 };
        held.push(other.alloc(n, &Q(0)).unwrap());
    }
    assert!(!held.is_empty());
    let w = arena.wake(&[Q(0), Q(1)], &restoring()).unwrap();
    assert_eq!(arena.sleep_mode(), None);
    assert_intact(&live, &addresses, "a wake the budget cut short");
    assert!(
        w.free_bytes < r.free_bytes,
        "the budget left no room for all of it: {} of {}",
        w.free_bytes,
        r.free_bytes
    );
    assert!(budget.used() <= budget.limit());
    let s = arena.stats();
    assert_eq!(
        s.reserved_bytes.current,
        r.bytes + w.free_bytes,
        "what was mapped is counted, nothing more"
    );
}
