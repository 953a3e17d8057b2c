//! One growth step N -> 2N keeping the data, N in {64 MiB, 1 GiB, 8 GiB}.
//!
//! In criterion's steady churn (grow, then shrink back, thousands of times):
//! - `vmmbuf_default_pool`: `GrowableBuffer::new`, whose chunks go to the
//!   backend's default pool at the shrink and come back at the growth;
//! - `vmmbuf_no_pool`: `BufferDesc::pooled(false)`, every chunk created and
//!   released;
//! - `raw_create_map_access`: the driver calls vmmbuf makes without a pool;
//! - `cuMemAlloc_copy_free`: what a user would otherwise write;
//! - `cuMemAllocAsync_copy_free`: stream-ordered, from the device's default
//!   pool with CUDA's default release threshold 0 (what candle and cubecl use);
//! - `cuMemAllocAsync_warm_copy_free`: the same pool with its release
//!   threshold at the maximum, as PyTorch and JAX keep memory: the baseline a
//!   user would really pick.
//!
//! After criterion, *isolated* steps: each growth comes after other work
//! freed memory and a pause, as a real growth does, instead of right after
//! its own release. Printed as medians and worst of 15, with ratios.

mod common;

use std::time::{Duration, Instant};

use common::{gpu_or_skip, Raw, GIB, MIB};
use criterion::BenchmarkId;
use vmmbuf::{BufferDesc, CudaBackend, GrowableBuffer};

fn label(n: usize) -> String {
    if n >= GIB {
        format!("{}GiB", n / GIB)
    } else {
        format!("{}MiB", n / MIB)
    }
}

/// One growth N -> 2N of `buf` (holding N), timed; back to N untimed.
/// Returns the growths made (1 when a filter skipped the bench).
fn bench_vmmbuf(
    g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    id: BenchmarkId,
    mut buf: GrowableBuffer<CudaBackend>,
    n: usize,
) -> u64 {
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
    buf.stats().grows
}

/// `cuMemAllocAsync(2N)` + copy + `cuMemFreeAsync(old)` + sync, timed; back
/// to N untimed. The pool's release threshold is set by the caller.
fn bench_async(
    g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    id: BenchmarkId,
    raw: &Raw,
    n: usize,
) {
    let mut old = raw.alloc_async(n);
    raw.stream_sync();
    g.bench_function(id, |b| {
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

fn main() {
    let Some(backend) = gpu_or_skip("grow_step") else {
        return;
    };
    let raw = Raw::new(backend.clone());
    let pool = backend.default_pool();
    let mut c = common::criterion(20, 3);
    let mut g = c.benchmark_group("grow_step");
    for n in [64 * MIB, GIB, 8 * GIB] {
        let id = |who| BenchmarkId::new(who, label(n));
        let desc = BufferDesc::new(2 * n);
        let pooled = GrowableBuffer::new(backend.clone(), desc.clone()).unwrap();
        let hits = pool.stats().hits;
        if bench_vmmbuf(&mut g, id("vmmbuf_default_pool"), pooled, n) > 1 {
            assert!(
                pool.stats().hits > hits,
                "the default pool served the growth"
            );
        }
        pool.trim().unwrap();
        let plain = GrowableBuffer::new(backend.clone(), desc.pooled(false)).unwrap();
        bench_vmmbuf(&mut g, id("vmmbuf_no_pool"), plain, n);
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
        raw.set_pool_release_threshold(0);
        bench_async(&mut g, id("cuMemAllocAsync_copy_free"), &raw, n);
        raw.keep_pool_memory();
        bench_async(&mut g, id("cuMemAllocAsync_warm_copy_free"), &raw, n);
        raw.set_pool_release_threshold(0);
    }
    g.finish();
    c.final_summary();
    for n in [GIB, 8 * GIB] {
        isolated(&backend, &raw, n);
    }
}

const REPS: usize = 15;
/// The pause between the other work and the growth.
const PAUSE: Duration = Duration::from_millis(20);

fn summary(name: &str, n: usize, mut t: Vec<Duration>) -> f64 {
    t.sort();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let p50 = us(t[t.len() / 2]);
    println!(
        "isolated {:<5} {name:<34} median {p50:9.1} us  worst {:9.1} us",
        label(n),
        us(*t.last().unwrap())
    );
    p50
}

/// Growth N -> 2N after other work freed memory and a pause (REPS times).
/// Warm: vmmbuf's default pool, into which another buffer of N was just
/// dropped, against a `cuMemAllocAsync` pool that keeps memory, into which
/// other work freed 2N. Cold: no pool on either side; the other work took
/// and gave back 2N through cuMemAlloc/cuMemFree.
fn isolated(backend: &std::sync::Arc<CudaBackend>, raw: &Raw, n: usize) {
    let pool = backend.default_pool();
    let time = |f: &mut dyn FnMut()| {
        let t = Instant::now();
        f();
        t.elapsed()
    };
    // Warm, vmmbuf.
    let mut buf = GrowableBuffer::new(backend.clone(), BufferDesc::new(2 * n)).unwrap();
    buf.grow_to(n).unwrap();
    let mut warm_vmm = Vec::new();
    for _ in 0..REPS {
        let other = GrowableBuffer::new(backend.clone(), BufferDesc::new(n)).unwrap();
        other.grow_to(n).unwrap();
        drop(other);
        std::thread::sleep(PAUSE);
        let hits = pool.stats().hits;
        warm_vmm.push(time(&mut || buf.grow_to(2 * n).unwrap()));
        assert!(pool.stats().hits > hits, "the growth took the pooled chunk");
        buf.truncate(n);
        buf.shrink_to_fit().unwrap();
    }
    drop(buf);
    pool.trim().unwrap();
    // Warm, cuMemAllocAsync with the threshold at max.
    raw.keep_pool_memory();
    let mut warm_async = Vec::new();
    for _ in 0..REPS {
        let other = raw.alloc_async(2 * n);
        raw.free_async(other);
        let old = raw.alloc_async(n);
        raw.stream_sync();
        std::thread::sleep(PAUSE);
        warm_async.push(time(&mut || {
            let new = raw.alloc_async(2 * n);
            raw.copy_async(new, old, n);
            raw.free_async(old);
            raw.stream_sync();
            raw.free_async(new);
        }));
        raw.stream_sync();
    }
    raw.set_pool_release_threshold(0);
    // Cold, vmmbuf without a pool.
    let mut buf =
        GrowableBuffer::new(backend.clone(), BufferDesc::new(2 * n).pooled(false)).unwrap();
    buf.grow_to(n).unwrap();
    let mut cold_vmm = Vec::new();
    for _ in 0..REPS {
        raw.free(raw.alloc(2 * n));
        std::thread::sleep(PAUSE);
        cold_vmm.push(time(&mut || buf.grow_to(2 * n).unwrap()));
        buf.truncate(n);
        buf.shrink_to_fit().unwrap();
    }
    // The same without the pause.
    let mut cold_now = Vec::new();
    for _ in 0..REPS {
        raw.free(raw.alloc(2 * n));
        cold_now.push(time(&mut || buf.grow_to(2 * n).unwrap()));
        buf.truncate(n);
        buf.shrink_to_fit().unwrap();
    }
    drop(buf);
    summary("vmmbuf_no_pool, no pause", n, cold_now);
    // Cold, cuMemAlloc + copy + free.
    let mut cold_alloc = Vec::new();
    for _ in 0..REPS {
        raw.free(raw.alloc(2 * n));
        let old = raw.alloc(n);
        std::thread::sleep(PAUSE);
        cold_alloc.push(time(&mut || {
            let new = raw.alloc(2 * n);
            raw.copy(new, old, n);
            raw.sync();
            raw.free(old);
            raw.free(new);
        }));
    }
    // What makes an isolated growth slower than one in the churn: the same
    // pooled growth with the pause alone (this buffer's own chunk back, no
    // other buffer), and with the other buffer alone (no pause).
    let mut buf = GrowableBuffer::new(backend.clone(), BufferDesc::new(2 * n)).unwrap();
    buf.grow_to(n).unwrap();
    let (mut pause_only, mut other_only) = (Vec::new(), Vec::new());
    for _ in 0..REPS {
        buf.grow_to(2 * n).unwrap();
        buf.truncate(n);
        buf.shrink_to_fit().unwrap();
        std::thread::sleep(PAUSE);
        pause_only.push(time(&mut || buf.grow_to(2 * n).unwrap()));
        buf.truncate(n);
        buf.shrink_to_fit().unwrap();
        let other = GrowableBuffer::new(backend.clone(), BufferDesc::new(n)).unwrap();
        other.grow_to(n).unwrap();
        drop(other);
        other_only.push(time(&mut || buf.grow_to(2 * n).unwrap()));
        buf.truncate(n);
        buf.shrink_to_fit().unwrap();
    }
    drop(buf);
    pool.trim().unwrap();
    summary("vmmbuf_default_pool, pause only", n, pause_only);
    summary("vmmbuf_default_pool, other only", n, other_only);
    let a = summary("vmmbuf_default_pool", n, warm_vmm);
    let b = summary("cuMemAllocAsync_warm_copy_free", n, warm_async);
    let c = summary("vmmbuf_no_pool", n, cold_vmm);
    let d = summary("cuMemAlloc_copy_free", n, cold_alloc);
    println!(
        "isolated {:<5} warm: {:.1}x faster than cuMemAllocAsync_warm_copy_free; cold: {:.1}x faster than cuMemAlloc_copy_free",
        label(n),
        b / a,
        d / c
    );
}
