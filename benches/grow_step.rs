//! One growth step N -> 2N keeping the data, N in {64 MiB, 1 GiB, 8 GiB}:
//! vmmbuf vs cuMemAlloc(2N)+copy+free vs cuMemAllocAsync(2N)+copy+free vs the
//! raw VMM sequence (cuMemCreate + cuMemMap + cuMemSetAccess of N bytes), and
//! vmmbuf with a chunk pool (the chunk of N comes back from the pool).
//!
//! A criterion loop releases and re-acquires physical memory thousands of
//! times; the driver scrubs released memory before handing it out again, so
//! in this steady state every variant pays that per byte it acquires (see
//! BENCHMARKS.md and the `breakdown` diagnostic). The pooled variant acquires
//! nothing from the driver.

mod common;

use std::time::{Duration, Instant};

use common::{gpu_or_skip, Raw, GIB, MIB};
use criterion::BenchmarkId;
use vmmbuf::{BufferDesc, ChunkPool, GrowableBuffer, PoolDesc};

fn label(n: usize) -> String {
    if n >= GIB {
        format!("{}GiB", n / GIB)
    } else {
        format!("{}MiB", n / MIB)
    }
}

/// One growth N -> 2N of `buf` (holding N), timed; back to N untimed.
fn bench_vmmbuf(
    g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    id: BenchmarkId,
    mut buf: GrowableBuffer<vmmbuf::CudaBackend>,
    n: usize,
) {
    buf.grow_to(n).unwrap();
    let base = buf.base();
    g.bench_function(id, |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let t = Instant::now();
                buf.grow_to(2 * n).unwrap();
                total += t.elapsed();
                buf.truncate(n);
                buf.shrink_to_fit().unwrap();
            }
            total
        })
    });
    assert_eq!(buf.base(), base);
}

fn main() {
    let Some(backend) = gpu_or_skip("grow_step") else {
        return;
    };
    let raw = Raw::new(backend.clone());
    let mut c = common::criterion(20, 3);
    let mut g = c.benchmark_group("grow_step");
    for n in [64 * MIB, GIB, 8 * GIB] {
        let id = |who| BenchmarkId::new(who, label(n));
        let plain = GrowableBuffer::new(backend.clone(), BufferDesc::new(2 * n)).unwrap();
        bench_vmmbuf(&mut g, id("vmmbuf"), plain, n);
        let pool = ChunkPool::new(backend.clone(), PoolDesc::default()).unwrap();
        let pooled = GrowableBuffer::with_pool(&pool, BufferDesc::new(2 * n)).unwrap();
        bench_vmmbuf(&mut g, id("vmmbuf_pooled"), pooled, n);
        assert!(pool.stats().hits > 0);
        {
            let va = raw.reserve(2 * n);
            g.bench_function(id("raw_create_map_access"), |b| {
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        let t = Instant::now();
                        let h = raw.create_map_access(va + n as u64, n);
                        total += t.elapsed();
                        raw.unmap_release(va + n as u64, n, h);
                    }
                    total
                })
            });
            raw.address_free(va, 2 * n);
        }
        {
            let mut old = raw.alloc(n);
            g.bench_function(id("cuMemAlloc_copy_free"), |b| {
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        let t = Instant::now();
                        let new = raw.alloc(2 * n);
                        raw.copy(new, old, n);
                        raw.sync();
                        raw.free(old);
                        total += t.elapsed();
                        raw.free(new);
                        old = raw.alloc(n);
                    }
                    total
                })
            });
            raw.free(old);
        }
        {
            let mut old = raw.alloc_async(n);
            raw.stream_sync();
            g.bench_function(id("cuMemAllocAsync_copy_free"), |b| {
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        let t = Instant::now();
                        let new = raw.alloc_async(2 * n);
                        raw.copy_async(new, old, n);
                        raw.free_async(old);
                        raw.stream_sync();
                        total += t.elapsed();
                        raw.free_async(new);
                        old = raw.alloc_async(n);
                        raw.stream_sync();
                    }
                    total
                })
            });
            raw.free_async(old);
            raw.stream_sync();
        }
    }
    g.finish();
    c.final_summary();
}
