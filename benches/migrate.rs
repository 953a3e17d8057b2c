//! Migration throughput: a 1 GiB buffer (16 chunks of 64 MiB) moved to pinned
//! host memory and back with vmmbuf (new chunks, copy, remap, release, all at
//! the same addresses), against a plain cuMemcpy between cuMemAlloc'd memory
//! and pinned host memory of the same size, in the same run. Criterion
//! reports the throughput (bytes per second). The pooled variant takes its new
//! chunks from a pool (after the first round trip), so it measures copy and
//! remap without acquiring memory from the driver.

mod common;

use std::time::{Duration, Instant};

use common::{gpu_or_skip, Raw, GIB, MIB};
use criterion::Throughput;
use vmmbuf::{BufferDesc, ChunkPool, GrowableBuffer, GrowthPolicy, Location, PoolDesc};

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
    let pool = ChunkPool::new(backend.clone(), PoolDesc::default()).unwrap();
    let plain = GrowableBuffer::new(backend.clone(), desc.clone()).unwrap();
    let pooled = GrowableBuffer::with_pool(&pool, desc).unwrap();
    for (prefix, mut buf) in [("vmmbuf", plain), ("vmmbuf_pooled", pooled)] {
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
    breakdown(&backend, n, &desc_for(n));
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
    let show = |what: &str, r: &vmmbuf::MigrationReport| {
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
        GrowableBuffer::new(backend.clone(), desc.clone()).unwrap(),
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
