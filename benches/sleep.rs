//! Sleep and wake of an arena at link speed (issue 22), against the pinned
//! copy in the same run.
//!
//! An arena (2 MiB chunks, as the PyTorch plug-in's) holds ~4 GiB in
//! tensors of mixed sizes, each filled with its own value. Rounds
//! interleave, in one process: `cuMemcpyDtoH` and `cuMemcpyHtoD` of the
//! same bytes between `cuMemAlloc` and `cuMemAllocHost` memory (the pinned
//! copy rate), a kept sleep and its wake, a stashed one, and a discarding
//! sleep and its wake. Reported in ms per GiB, medians over the rounds, with ratios to the
//! pinned copy. Before the rounds: the first kept sleep (host pieces pinned
//! then) with 1, 2, 4 and 8 creating threads, and the first discarding
//! sleep of memory still in 2 MiB chunks. Every wake checks the first and
//! last word of every tensor. First, a probe of what granting the GPU
//! access to host chunks costs (per mapping, or once per chunk?);
//! `VMMBUF_BENCH_ONLY_PROBE=1` stops after it. `VMMBUF_BENCH_PROBE=0` skips
//! the probe of host-chunk creation (by size, location type and threads);
//! `VMMBUF_BENCH_PIECES=16,64,...` adds kept sleeps by piece size (MiB).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{gpu_or_skip, ok, Raw, GIB, MIB};
use cudarc::driver::{sys, CudaStream};
use vmmbuf::stats::SleepReport;
use vmmbuf::{Arena, ArenaDesc, CudaBackend, Location, SleepDesc, WakeDesc};

type A = Arena<CudaBackend, Arc<CudaStream>>;
type Live = Vec<(vmmbuf::Allocation<CudaBackend, Arc<CudaStream>>, u32)>;

const TOTAL: usize = 4 * GIB;
const ROUNDS: usize = 7;

/// Tensor sizes of a model: a third of the bytes in large tensors (16-128
/// MiB), the rest in many small and mid-sized ones.
fn sizes() -> Vec<usize> {
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut out = Vec::new();
    let mut sum = 0;
    while sum < TOTAL {
        let r = next();
        let n = match r % 10 {
            0..=2 => (16 + (r >> 8) as usize % 112) * MIB,
            3..=6 => (64 << 10) + ((r >> 8) as usize % (4 * MIB)),
            _ => (1 + (r >> 8) as usize % 16) * MIB + 4096,
        } & !3;
        out.push(n);
        sum += n;
    }
    out
}

fn fill(arena: &A, s: &Arc<CudaStream>) -> Live {
    sizes()
        .into_iter()
        .enumerate()
        .map(|(i, n)| {
            let a = arena.alloc(n, s).unwrap();
            let v = 0x5EED_0000 + i as u32;
            // SAFETY: the allocation is mapped, read-write for the device,
            // and `n / 4` words long.
            ok("cuMemsetD32", unsafe {
                sys::cuMemsetD32_v2(a.address(), v, n / 4)
            });
            (a, v)
        })
        .collect()
}

fn check(live: &Live, when: &str) {
    let mut w = [0u8; 4];
    for (k, (a, v)) in live.iter().enumerate() {
        for at in [0, a.len() - 4] {
            a.read(at, &mut w).unwrap();
            assert_eq!(u32::from_ne_bytes(w), *v, "{when}: tensor {k} at {at}");
        }
    }
}

fn per_gib(d: Duration, bytes: usize) -> f64 {
    d.as_secs_f64() * 1e3 / (bytes as f64 / GIB as f64)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn show(what: &str, r: &SleepReport) {
    let g = r.bytes.max(1) as f64 / GIB as f64;
    let ms = |d: Duration| d.as_secs_f64() * 1e3 / g;
    println!(
        "  {what:<34} {:>7.1} ms/GiB  ({:.2} GiB, {} -> {} chunks; wait {:.1}, acquire {:.1}, stage {:.1}, copy wait {:.1}, swap {:.1}, dispose {:.1} ms/GiB)",
        ms(r.total_time),
        g,
        r.chunks_before,
        r.chunks_after,
        ms(r.wait_time),
        ms(r.migration.acquire_time),
        ms(r.migration.stage_time),
        ms(r.migration.copy_time),
        ms(r.migration.swap_time),
        ms(r.migration.dispose_time),
    );
}

/// What creating 1 GiB of pinned host chunks costs, by chunk size, location
/// type and creating threads (raw `cuMemCreate`, released after).
fn create_probe(backend: &Arc<CudaBackend>) {
    use sys::CUmemLocationType as T;
    let mut numa = 0i32;
    // SAFETY: valid out-pointer and device.
    ok("cuDeviceGetAttribute", unsafe {
        sys::cuDeviceGetAttribute(
            &mut numa,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID,
            0,
        )
    });
    println!("creating 1 GiB of pinned host chunks (cuMemCreate), ms per GiB:");
    println!("  | location | chunk | 1 thread | 2 threads | 4 threads | 8 threads |");
    println!("  |---|---|---|---|---|---|");
    for (name, ty, id) in [
        ("HOST_NUMA", T::CU_MEM_LOCATION_TYPE_HOST_NUMA, numa.max(0)),
        ("HOST", T::CU_MEM_LOCATION_TYPE_HOST, 0),
    ] {
        for chunk in [2 * MIB, 16 * MIB, 64 * MIB, 256 * MIB] {
            let mut row = format!("  | {name} | {} MiB |", chunk / MIB);
            for threads in [1usize, 2, 4, 8] {
                let n = GIB / chunk;
                let t = Instant::now();
                let handles: Vec<u64> = std::thread::scope(|sc| {
                    let per = n.div_ceil(threads);
                    let workers: Vec<_> = (0..threads)
                        .map(|w| {
                            sc.spawn(move || {
                                backend.context().bind_to_thread().unwrap();
                                let mut out = Vec::new();
                                for _ in (w * per)..((w + 1) * per).min(n) {
                                    // SAFETY: plain C data; zero is the default.
                                    let mut prop: sys::CUmemAllocationProp =
                                        unsafe { std::mem::zeroed() };
                                    prop.type_ =
                                        sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
                                    prop.location.type_ = ty;
                                    prop.location.__bindgen_anon_1.id = id;
                                    let mut h = 0;
                                    // SAFETY: valid out-pointer and properties.
                                    ok("cuMemCreate", unsafe {
                                        sys::cuMemCreate(&mut h, chunk, &prop, 0)
                                    });
                                    out.push(h);
                                }
                                out
                            })
                        })
                        .collect();
                    workers
                        .into_iter()
                        .flat_map(|w| w.join().unwrap())
                        .collect()
                });
                let ms = t.elapsed().as_secs_f64() * 1e3;
                for h in handles {
                    // SAFETY: created above, never mapped, released once.
                    ok("cuMemRelease", unsafe { sys::cuMemRelease(h) });
                }
                row += &format!(" {ms:.1} |");
            }
            println!("{row}");
        }
    }
}

/// What granting the GPU access to host chunks costs when the chunks are
/// mapped nowhere else, against when another mapping of them (with access)
/// stays: whether a kept second mapping makes the grant at the tensors'
/// addresses cheap. 16 host chunks of 64 MiB, ms for the 1 GiB.
fn access_probe(backend: &Arc<CudaBackend>) {
    use sys::CUmemLocationType as T;
    backend.context().bind_to_thread().unwrap();
    let mut numa = 0i32;
    // SAFETY: valid out-pointer and device.
    ok("cuDeviceGetAttribute", unsafe {
        sys::cuDeviceGetAttribute(
            &mut numa,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID,
            0,
        )
    });
    let (n, chunk) = (16usize, 64 * MIB);
    let handles: Vec<u64> = (0..n)
        .map(|_| {
            // SAFETY: plain C data; zero is the default.
            let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
            prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
            prop.location.type_ = T::CU_MEM_LOCATION_TYPE_HOST_NUMA;
            prop.location.__bindgen_anon_1.id = numa.max(0);
            let mut h = 0;
            // SAFETY: valid out-pointer and properties.
            ok("cuMemCreate", unsafe {
                sys::cuMemCreate(&mut h, chunk, &prop, 0)
            });
            h
        })
        .collect();
    let reserve = || {
        let mut p = 0;
        // SAFETY: valid out-pointer; no hint.
        ok("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&mut p, n * chunk, 0, 0, 0)
        });
        p
    };
    let (x, y) = (reserve(), reserve());
    let map_grant = |va: u64| -> f64 {
        let t = Instant::now();
        for (i, &h) in handles.iter().enumerate() {
            let at = va + (i * chunk) as u64;
            // SAFETY: `at` lies in a reservation of ours, unmapped there; `h`
            // is a live handle of `chunk` bytes, mapped whole.
            ok("cuMemMap", unsafe { sys::cuMemMap(at, chunk, 0, h, 0) });
            // SAFETY: plain C data, filled in below.
            let mut d: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
            d.location.type_ = T::CU_MEM_LOCATION_TYPE_DEVICE;
            d.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
            // SAFETY: exactly the mapping just made; one descriptor.
            ok("cuMemSetAccess", unsafe {
                sys::cuMemSetAccess(at, chunk, &d, 1)
            });
        }
        t.elapsed().as_secs_f64() * 1e3
    };
    let unmap = |va: u64| -> f64 {
        let t = Instant::now();
        for i in 0..n {
            // SAFETY: one whole mapping of ours; no work uses it.
            ok("cuMemUnmap", unsafe {
                sys::cuMemUnmap(va + (i * chunk) as u64, chunk)
            });
        }
        t.elapsed().as_secs_f64() * 1e3
    };
    let first = map_grant(x);
    let second = map_grant(y);
    let unmap_kept = unmap(y);
    let again = map_grant(y);
    let unmap_y = unmap(y);
    let unmap_last = unmap(x);
    let alone = map_grant(y);
    let unmap_alone = unmap(y);
    println!(
        "host chunks (16 x 64 MiB), map + grant the GPU, ms per GiB: first {first:.2}; a second \
         mapping while the first stays {second:.2}; again after unmapping it {again:.2}; after \
         every mapping went {alone:.2}. Unmap: with another mapping kept {unmap_kept:.2} / \
         {unmap_y:.2}, the last one {unmap_last:.2}, alone {unmap_alone:.2}"
    );
    for p in [x, y] {
        // SAFETY: our reservations, nothing mapped in them any more.
        ok("cuMemAddressFree", unsafe {
            sys::cuMemAddressFree(p, n * chunk)
        });
    }
    for h in handles {
        // SAFETY: created above, unmapped everywhere, released once.
        ok("cuMemRelease", unsafe { sys::cuMemRelease(h) });
    }
}

fn main() {
    let Some(backend) = gpu_or_skip("sleep") else {
        return;
    };
    access_probe(&backend);
    if std::env::var("VMMBUF_BENCH_ONLY_PROBE").as_deref() == Ok("1") {
        return;
    }
    if std::env::var("VMMBUF_BENCH_PROBE").as_deref() != Ok("0") {
        create_probe(&backend);
    }
    let raw = Raw::new(backend.clone());
    let s = backend.context().new_stream().unwrap();
    let streams = [s.clone()];
    let arena: A = Arena::new(backend.clone(), ArenaDesc::new(64 * GIB)).unwrap();
    let live = fill(&arena, &s);
    raw.sync();
    let bytes = arena.stats().reserved_bytes.current;
    println!(
        "sleep: {} tensors, {:.2} GiB mapped in {} chunks of 2 MiB",
        live.len(),
        bytes as f64 / GIB as f64,
        arena.snapshot().segments.len()
    );

    // The first kept sleep, its host pieces pinned then, by 1..8 threads.
    println!("first kept sleep (host pieces created), by creating threads:");
    for threads in [1, 2, 4, 8] {
        std::env::set_var("VMMBUF_CREATE_THREADS", threads.to_string());
        arena.pool().trim_at(Location::Host).unwrap();
        let r = arena.sleep(&streams, &SleepDesc::keep()).unwrap();
        show(&format!("{threads} thread(s)"), &r);
        let w = arena.wake(&streams, &WakeDesc::default()).unwrap();
        show("  its wake", &w);
        check(&live, "after a first sleep");
    }
    std::env::remove_var("VMMBUF_CREATE_THREADS");

    // The first discarding sleep of memory in 2 MiB chunks: a second arena
    // filled the same way.
    let fresh: A = Arena::new(backend.clone(), ArenaDesc::new(64 * GIB)).unwrap();
    let fresh_live = fill(&fresh, &s);
    raw.sync();
    let r = fresh.sleep(&streams, &SleepDesc::discard()).unwrap();
    show("first discarding sleep (2 MiB chunks)", &r);
    let w = fresh.wake(&streams, &WakeDesc::default()).unwrap();
    show("  its wake (pieces)", &w);
    drop(fresh_live);
    drop(fresh);

    let (dev, host) = (raw.alloc(bytes), raw.alloc_pinned(bytes));
    // Kept sleeps by piece size (`VMMBUF_BENCH_PIECES=16,32,...` in MiB):
    // one cycle to regroup, then rounds against the pinned copy.
    if let Ok(list) = std::env::var("VMMBUF_BENCH_PIECES") {
        println!("kept sleep and wake by piece size, medians of {ROUNDS} rounds, ms per GiB:");
        for mib in list
            .split(',')
            .filter_map(|x| x.trim().parse::<usize>().ok())
        {
            let desc = SleepDesc::keep().max_piece_bytes(mib * MIB);
            arena.sleep(&streams, &desc).unwrap();
            arena.wake(&streams, &WakeDesc::default()).unwrap();
            let mut c: [Vec<f64>; 4] = Default::default();
            let mut pieces = 0;
            for _ in 0..ROUNDS {
                let t = Instant::now();
                raw.dtoh(host, dev, bytes);
                c[0].push(per_gib(t.elapsed(), bytes));
                let sl = arena.sleep(&streams, &desc).unwrap();
                c[1].push(per_gib(sl.total_time, bytes));
                pieces = sl.chunks_after;
                let t = Instant::now();
                raw.htod(dev, host, bytes);
                c[2].push(per_gib(t.elapsed(), bytes));
                let wk = arena.wake(&streams, &WakeDesc::default()).unwrap();
                c[3].push(per_gib(wk.total_time, bytes));
            }
            check(&live, &format!("pieces of {mib} MiB"));
            let m: Vec<f64> = c.iter().map(|v| median(v.clone())).collect();
            println!(
                "  {mib:>4} MiB pieces ({} pieces): sleep {:.2} ({:.2}x of DtoH {:.2}), wake {:.2} ({:.2}x of HtoD {:.2})",
                pieces,
                m[1],
                m[0] / m[1],
                m[0],
                m[3],
                m[2] / m[3],
                m[2]
            );
        }
    }

    // Steady state, interleaved with the pinned copy.
    let mut cols: [Vec<f64>; 10] = Default::default();
    let mut last: Option<(SleepReport, SleepReport)> = None;
    for round in 0..ROUNDS {
        let t = Instant::now();
        raw.dtoh(host, dev, bytes);
        cols[0].push(per_gib(t.elapsed(), bytes));
        let t = Instant::now();
        raw.htod(dev, host, bytes);
        cols[1].push(per_gib(t.elapsed(), bytes));

        // A sleep and its wake, their times into columns `c` and `c + 1`.
        let mut cycle = |sleep: SleepDesc, wake: WakeDesc, c: usize| {
            let sl = arena.sleep(&streams, &sleep).unwrap();
            let wk = arena.wake(&streams, &wake).unwrap();
            cols[c].push(per_gib(sl.total_time, bytes));
            cols[c + 1].push(per_gib(wk.total_time, bytes));
            (sl, wk)
        };
        let (sl, wk) = cycle(SleepDesc::keep(), WakeDesc::default(), 2);
        assert_eq!(sl.bytes, bytes);
        check(&live, &format!("round {round}"));
        // Stashed while the data is still there to check.
        let (ss, _) = cycle(SleepDesc::stash(), WakeDesc::default(), 8);
        assert_eq!(ss.bytes, bytes);
        check(&live, &format!("round {round}, stashed"));
        cycle(SleepDesc::discard(), WakeDesc::default(), 4);
        cycle(SleepDesc::discard(), WakeDesc::zeroed(), 6);
        // Refill for the next kept round's check.
        for (a, v) in &live {
            // SAFETY: as in `fill`.
            ok("cuMemsetD32", unsafe {
                sys::cuMemsetD32_v2(a.address(), *v, a.len() / 4)
            });
        }
        raw.sync();
        last = Some((sl, wk));
    }
    // Discarding with 64 MiB pieces: one cycle to regroup, then rounds.
    let big = SleepDesc::discard().max_piece_bytes(64 * MIB);
    arena.sleep(&streams, &big).unwrap();
    arena.wake(&streams, &WakeDesc::default()).unwrap();
    let mut big_cols: [Vec<f64>; 2] = Default::default();
    for _ in 0..ROUNDS {
        let ds = arena.sleep(&streams, &big).unwrap();
        let dw = arena.wake(&streams, &WakeDesc::default()).unwrap();
        big_cols[0].push(per_gib(ds.total_time, bytes));
        big_cols[1].push(per_gib(dw.total_time, bytes));
    }
    println!(
        "discarding with 64 MiB pieces ({} segments): sleep {:.3}, wake {:.3}, both {:.3} ms/GiB",
        arena.snapshot().segments.len(),
        median(big_cols[0].clone()),
        median(big_cols[1].clone()),
        median(
            big_cols[0]
                .iter()
                .zip(&big_cols[1])
                .map(|(a, b)| a + b)
                .collect()
        )
    );
    let m: Vec<f64> = cols.iter().map(|c| median(c.clone())).collect();
    let (d2h, h2d) = (m[0], m[1]);
    println!(
        "steady state, {ROUNDS} rounds, medians in ms per GiB ({:.2} GiB):",
        bytes as f64 / GIB as f64
    );
    println!("  | | ms/GiB | rate vs pinned copy |");
    println!("  |---|---|---|");
    println!("  | pinned cuMemcpyDtoH | {d2h:.2} | 1.00x |");
    println!("  | pinned cuMemcpyHtoD | {h2d:.2} | 1.00x |");
    println!("  | kept sleep | {:.2} | {:.2}x |", m[2], d2h / m[2]);
    println!("  | kept wake | {:.2} | {:.2}x |", m[3], h2d / m[3]);
    println!("  | stashed sleep | {:.2} | {:.2}x |", m[8], d2h / m[8]);
    println!("  | stashed wake | {:.2} | {:.2}x |", m[9], h2d / m[9]);
    println!("  | discarding sleep | {:.3} | |", m[4]);
    println!("  | its wake | {:.3} | |", m[5]);
    println!(
        "  | discarding sleep + wake | {:.3} | |",
        median(cols[4].iter().zip(&cols[5]).map(|(a, b)| a + b).collect())
    );
    println!(
        "  | discarding sleep + zeroed wake | {:.3} | |",
        median(cols[6].iter().zip(&cols[7]).map(|(a, b)| a + b).collect())
    );
    if let Some((sl, wk)) = last {
        show("last kept sleep", &sl);
        show("last kept wake", &wk);
    }
    println!(
        "  pool: {}; device syncs: {}",
        arena.pool().stats(),
        arena.stats().num_device_syncs
    );
    raw.free(dev);
    raw.free_pinned(host);
}
