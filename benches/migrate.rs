//! Migration throughput: a 1 GiB buffer (16 chunks of 64 MiB) moved to pinned
//! host memory and back with vmmbuf (new chunks, copy, remap, release, all at
//! the same addresses), against a plain cuMemcpy between cuMemAlloc'd memory
//! and pinned host memory of the same size, in the same run. Criterion
//! reports the throughput (bytes per second). The default-pool variant (what
//! `GrowableBuffer::new` gives) takes its new chunks from the backend's pool
//! after the first round trip, so it measures copy and remap without
//! acquiring memory from the driver; the no-pool variant creates and releases
//! every chunk. After criterion: where one migration's time goes, and what
//! each driver call costs on device and host-NUMA chunks of 64 MiB.

mod common;

use std::time::{Duration, Instant};

use common::{gpu_or_skip, Raw, GIB, MIB};
use criterion::Throughput;
use vmmbuf::{
    Access, AccessDesc, Backend, BufferDesc, ChunkPool, CudaBackend, GrowableBuffer, GrowthPolicy,
    Location, PoolDesc,
};

fn main() {
    let Some(backend) = gpu_or_skip("migrate") else {
        return;
    };
    let raw = Raw::new(backend.clone());
    let mut c = common::criterion(10, 3);
    let n = GIB;
    let mut g = c.benchmark_group("migrate");
    g.throughput(Throughput::Bytes(n as u64));

    let desc = BufferDesc::new(2 * n).growth(GrowthPolicy::Fixed {
        chunk_bytes: 64 * MIB,
    });
    let home = Location::Device(0);
    let plain = GrowableBuffer::new(backend.clone(), desc.clone().pooled(false)).unwrap();
    let pooled = GrowableBuffer::new(backend.clone(), desc).unwrap();
    for (prefix, mut buf) in [("vmmbuf_no_pool", plain), ("vmmbuf_default_pool", pooled)] {
        buf.grow_to(n).unwrap();
        for (dir, to, back) in [
            ("to_host", Location::Host, home),
            ("to_device", home, Location::Host),
        ] {
            if buf.report().chunks[0].placement != back {
                buf.migrate(0..n, back).unwrap();
            }
            g.bench_function(format!("{prefix}_{dir}"), |b| {
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        let t = Instant::now();
                        let r = buf.migrate(0..n, to).unwrap();
                        total += t.elapsed();
                        assert_eq!(r.bytes_moved, n);
                        buf.migrate(0..n, back).unwrap();
                    }
                    total
                })
            });
        }
    }

    let (dev, host) = (raw.alloc(n), raw.alloc_pinned(n));
    g.bench_function("cuMemcpy_device_to_pinned", |b| {
        b.iter_custom(|iters| {
            let t = Instant::now();
            for _ in 0..iters {
                raw.dtoh(host, dev, n);
            }
            t.elapsed()
        })
    });
    g.bench_function("cuMemcpy_pinned_to_device", |b| {
        b.iter_custom(|iters| {
            let t = Instant::now();
            for _ in 0..iters {
                raw.htod(dev, host, n);
            }
            t.elapsed()
        })
    });
    raw.free(dev);
    raw.free_pinned(host);
    g.finish();
    c.final_summary();
    backend.default_pool().trim().unwrap();
    breakdown(&backend, n, &desc_for(n));
    calls(&backend);
}

/// What each driver call of a migration costs on 16 chunks of 64 MiB, in
/// ms per GiB (the sum over the 16 calls): on device chunks and host-NUMA
/// chunks, access for the device alone or for the device and the host, one
/// call per chunk or one over all; and the device calls again while a
/// device-to-host copy of another 1 GiB is in flight.
fn calls(backend: &std::sync::Arc<CudaBackend>) {
    const N: usize = 16;
    const CHUNK: usize = 64 * MIB;
    let b = &**backend;
    let home = b.home();
    let dev_rw = [AccessDesc::new(home, Access::ReadWrite)];
    let both_rw = [
        AccessDesc::new(home, Access::ReadWrite),
        AccessDesc::new(Location::Host, Access::ReadWrite),
    ];
    let ms = |d: Duration| d.as_secs_f64() * 1e3 * (GIB as f64 / (N * CHUNK) as f64);
    let time = |f: &mut dyn FnMut()| {
        let t = Instant::now();
        f();
        t.elapsed()
    };
    // A source of copies to keep the copy engine busy: 1 GiB on the device,
    // 1 GiB of host chunks, both mapped and accessible.
    let mut src = b.reserve(GIB, CHUNK).unwrap();
    let mut dst = b.reserve(GIB, CHUNK).unwrap();
    let sd: Vec<_> = (0..GIB / CHUNK)
        .map(|_| b.create(CHUNK, home).unwrap())
        .collect();
    let dh: Vec<_> = (0..GIB / CHUNK)
        .map(|_| b.create(CHUNK, Location::Host).unwrap())
        .collect();
    for (i, (c, h)) in sd.iter().zip(&dh).enumerate() {
        b.map(&mut src, i * CHUNK, c).unwrap();
        b.map(&mut dst, i * CHUNK, h).unwrap();
    }
    b.set_access(&mut src, 0, GIB, &dev_rw).unwrap();
    b.set_access(&mut dst, 0, GIB, &dev_rw).unwrap();

    for (what, place) in [("device", home), ("host", Location::Host)] {
        let chunks: Vec<_> = (0..N).map(|_| b.create(CHUNK, place).unwrap()).collect();
        for busy in [false, true] {
            let mut res = b.reserve(N * CHUNK, CHUNK).unwrap();
            if busy {
                // ~160 ms of copying at PCIe 5 speed: longer than the calls.
                for _ in 0..8 {
                    b.copy(&mut dst, 0, &src, 0, GIB).unwrap();
                }
            }
            let tag = if busy { ", copy in flight" } else { "" };
            let map = time(&mut || {
                for (i, c) in chunks.iter().enumerate() {
                    b.map(&mut res, i * CHUNK, c).unwrap();
                }
            });
            let each = time(&mut || {
                for i in 0..N {
                    b.set_access(&mut res, i * CHUNK, CHUNK, &dev_rw).unwrap();
                }
            });
            // Once over all 16, on fresh mappings (access already set would
            // cost the driver nothing).
            b.unmap(&mut res, 0, N * CHUNK).unwrap();
            for (i, c) in chunks.iter().enumerate() {
                b.map(&mut res, i * CHUNK, c).unwrap();
            }
            let once = time(&mut || b.set_access(&mut res, 0, N * CHUNK, &dev_rw).unwrap());
            let host_too = (place == Location::Host).then(|| {
                b.unmap(&mut res, 0, N * CHUNK).unwrap();
                for (i, c) in chunks.iter().enumerate() {
                    b.map(&mut res, i * CHUNK, c).unwrap();
                }
                time(&mut || {
                    for i in 0..N {
                        b.set_access(&mut res, i * CHUNK, CHUNK, &both_rw).unwrap();
                    }
                })
            });
            // Unmapped chunk by chunk: after the host's entry too (host chunks),
            // then after the device's alone; then in one call.
            let unmap_each = |res: &mut vmmbuf::cuda::CudaReservation| {
                time(&mut || {
                    for i in 0..N {
                        b.unmap(res, i * CHUNK, CHUNK).unwrap();
                    }
                })
            };
            let unmap_host = host_too.map(|_| {
                let d = unmap_each(&mut res);
                for (i, c) in chunks.iter().enumerate() {
                    b.map(&mut res, i * CHUNK, c).unwrap();
                }
                b.set_access(&mut res, 0, N * CHUNK, &dev_rw).unwrap();
                d
            });
            let unmap = unmap_each(&mut res);
            // Again, unmapped in one call.
            for (i, c) in chunks.iter().enumerate() {
                b.map(&mut res, i * CHUNK, c).unwrap();
            }
            b.set_access(&mut res, 0, N * CHUNK, &dev_rw).unwrap();
            let unmap_once = time(&mut || b.unmap(&mut res, 0, N * CHUNK).unwrap());
            let wait = time(&mut || b.wait_copies().unwrap());
            println!(
                "calls {what:<6}{tag:<18} map {:6.2}  access/chunk {:6.2}  access once {:6.2}  access+host/chunk {}  unmap/chunk after it {}  unmap/chunk {:6.2}  unmap once {:6.2}  (copy wait after {:6.2})",
                ms(map),
                ms(each),
                ms(once),
                host_too.map_or("   n/a".into(), |d| format!("{:6.2}", ms(d))),
                unmap_host.map_or("   n/a".into(), |d| format!("{:6.2}", ms(d))),
                ms(unmap),
                ms(unmap_once),
                ms(wait),
            );
            b.free(res).unwrap();
        }
        for c in chunks {
            b.release(c).unwrap();
        }
    }
    b.unmap(&mut src, 0, GIB).unwrap();
    b.unmap(&mut dst, 0, GIB).unwrap();
    b.free(src).unwrap();
    b.free(dst).unwrap();
    for c in sd.into_iter().chain(dh) {
        b.release(c).unwrap();
    }
}

fn desc_for(n: usize) -> BufferDesc {
    BufferDesc::new(2 * n).growth(GrowthPolicy::Fixed {
        chunk_bytes: 64 * MIB,
    })
}

/// Where a migration's time goes (not a criterion measurement: one move
/// each, after a warm-up move), in ms per GiB: without a pool, with a warm
/// pool, and the first offload into a pool filled by `ChunkPool::reserve`.
fn breakdown(backend: &std::sync::Arc<vmmbuf::CudaBackend>, n: usize, desc: &BufferDesc) {
    let per_gib = |d: Duration| d.as_secs_f64() * 1e3 * (GIB as f64 / n as f64);
    let show = |what: &str, r: &vmmbuf::migration::MigrationReport| {
        println!(
            "breakdown {what:<28} total {:7.1}  acquire {:7.1}  stage {:6.1}  copy {:6.1}  swap {:6.1}  dispose {:6.1}  ({} chunks)",
            per_gib(r.total_time()),
            per_gib(r.acquire_time),
            per_gib(r.stage_time),
            per_gib(r.copy_time),
            per_gib(r.swap_time),
            per_gib(r.dispose_time),
            r.chunks_moved
        );
    };
    println!(
        "breakdown: ms per GiB of one migration of {} MiB in 64 MiB chunks",
        n / MIB
    );
    let home = Location::Device(0);
    // A warm-up round trip, then one timed move each way.
    let round_trip = |what: &str, mut buf: GrowableBuffer<vmmbuf::CudaBackend>| {
        buf.grow_to(n).unwrap();
        buf.migrate(0..n, Location::Host).unwrap();
        buf.migrate(0..n, home).unwrap();
        show(
            &format!("{what}, to host"),
            &buf.migrate(0..n, Location::Host).unwrap(),
        );
        show(
            &format!("{what}, to device"),
            &buf.migrate(0..n, home).unwrap(),
        );
    };
    round_trip(
        "no pool",
        GrowableBuffer::new(backend.clone(), desc.clone().pooled(false)).unwrap(),
    );
    let pool = ChunkPool::new(backend.clone(), PoolDesc::default()).unwrap();
    round_trip(
        "warm pool",
        GrowableBuffer::with_pool(&pool, desc.clone()).unwrap(),
    );
    drop(pool);
    let pool = ChunkPool::new(backend.clone(), PoolDesc::default()).unwrap();
    let t = Instant::now();
    pool.reserve(Location::Host, 64 * MIB, n).unwrap();
    println!(
        "breakdown reserve(Host, 1 GiB) took {:.1} ms",
        per_gib(t.elapsed())
    );
    let mut fresh = GrowableBuffer::with_pool(&pool, desc.clone()).unwrap();
    fresh.grow_to(n).unwrap();
    show(
        "reserved pool, first offload",
        &fresh.migrate(0..n, Location::Host).unwrap(),
    );
}
