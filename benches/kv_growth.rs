//! A KV cache filling up: grow to 2 GiB in 2 MiB steps.
//!
//! - `vmmbuf_default_pool`: the default policy (chunks of len/8) in the
//!   backend's default pool, warm from the run before (what a server that
//!   frees and refills caches sees);
//! - `vmmbuf_no_pool`: the same, every chunk created (the first fill);
//! - `vmmbuf_exact_2MiB`: one 2 MiB chunk per step, default pool;
//! - `vmmbuf_map_ahead`: chunks of len/16, default pool, and a helper thread
//!   that maps the next chunk (`GrowableBuffer::reserve`) once less than one
//!   chunk is left, so the growing thread rarely calls the driver; the
//!   times are the growing thread's;
//! - `cuMemAlloc_doubling`: Vec-style doubling with cuMemAlloc + copy;
//! - `cuMemAllocAsync_warm_doubling`: the same from a stream-ordered pool
//!   that keeps memory (release threshold at max), warm from the run before.
//!
//! Between steps every variant runs `GAP` of other work (a spin, untimed),
//! as a decode step would; only the growth itself is timed. Besides
//! criterion's totals, one plain pass prints the worst step, the peak
//! physical memory and the over-commit.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{gpu_or_skip, Raw, GIB, MIB};
use vmmbuf::{BufferDesc, CudaBackend, GrowableBuffer, GrowthPolicy};

const STEP: usize = 2 * MIB;
const TOTAL: usize = 2 * GIB;
/// Other work between two growth steps.
const GAP: Duration = Duration::from_micros(20);

struct Run {
    total: Duration,
    worst: Duration,
    peak: usize,
    max_overcommit: f64,
    mappings: usize,
}

fn spin(d: Duration) {
    let t = Instant::now();
    while t.elapsed() < d {
        std::hint::spin_loop();
    }
}

#[derive(Clone, Copy)]
enum Vmm {
    Pool(GrowthPolicy),
    NoPool,
    MapAhead,
}

fn vmmbuf_run(backend: &Arc<CudaBackend>, how: Vmm) -> Run {
    // Reserve twice the target, as a real cache would, so the last chunk is not
    // cut to fit and the peak shows the policy's true over-commit.
    let desc = BufferDesc::new(2 * TOTAL);
    let desc = match how {
        Vmm::Pool(p) => desc.growth(p),
        Vmm::NoPool => desc.pooled(false),
        Vmm::MapAhead => desc.growth(GrowthPolicy::Proportional { divisor: 16 }),
    };
    let buf = GrowableBuffer::new(backend.clone(), desc).unwrap();
    let (mut total, mut worst, mut max_over) = (Duration::ZERO, Duration::ZERO, 0f64);
    let (tx, rx) = std::sync::mpsc::channel::<usize>();
    std::thread::scope(|s| {
        if matches!(how, Vmm::MapAhead) {
            let buf = &buf;
            s.spawn(move || {
                for want in rx {
                    buf.reserve(want).unwrap();
                }
            });
        } else {
            drop(rx);
        }
        for len in (STEP..=TOTAL).step_by(STEP) {
            spin(GAP);
            let t = Instant::now();
            buf.grow_to(len).unwrap();
            if matches!(how, Vmm::MapAhead) {
                let chunk = STEP.max(len / 16);
                if buf.capacity() - len < chunk {
                    tx.send(chunk).unwrap();
                }
            }
            let d = t.elapsed();
            total += d;
            worst = worst.max(d);
            max_over = max_over.max((buf.capacity() - len) as f64 / len as f64);
        }
        drop(tx);
    });
    let s = buf.stats();
    Run {
        total,
        worst,
        peak: s.peak_mapped_bytes,
        max_overcommit: max_over,
        mappings: s.chunks,
    }
}

fn doubling_run(raw: &Raw, stream_ordered: bool) -> Run {
    let alloc = |b| {
        if stream_ordered {
            raw.alloc_async(b)
        } else {
            raw.alloc(b)
        }
    };
    let (mut total, mut worst, mut peak) = (Duration::ZERO, Duration::ZERO, 0usize);
    let mut cap = STEP;
    let t = Instant::now();
    let mut ptr = alloc(cap);
    if stream_ordered {
        raw.stream_sync();
    }
    total += t.elapsed();
    let mut allocs = 1;
    for len in (2 * STEP..=TOTAL).step_by(STEP) {
        spin(GAP);
        let t = Instant::now();
        if len > cap {
            let new = alloc(2 * cap);
            if stream_ordered {
                raw.copy_async(new, ptr, len - STEP);
                raw.free_async(ptr);
                raw.stream_sync();
            } else {
                raw.copy(new, ptr, len - STEP);
                raw.sync();
                raw.free(ptr);
            }
            peak = peak.max(3 * cap);
            ptr = new;
            cap *= 2;
            allocs += 1;
        }
        let d = t.elapsed();
        total += d;
        worst = worst.max(d);
    }
    if stream_ordered {
        raw.free_async(ptr);
        raw.stream_sync();
    } else {
        raw.free(ptr);
    }
    Run {
        total,
        worst,
        peak,
        max_overcommit: 0.0,
        mappings: allocs,
    }
}

fn report(name: &str, r: &Run) {
    println!(
        "kv_growth/{name}: total {:.2} ms, worst step {:.1} us, peak physical {} MiB ({:.3}x the 2 GiB of data), \
         max over-commit {:.1}%, {} mappings/allocations",
        r.total.as_secs_f64() * 1e3,
        r.worst.as_secs_f64() * 1e6,
        r.peak / MIB,
        r.peak as f64 / TOTAL as f64,
        r.max_overcommit * 100.0,
        r.mappings
    );
}

fn main() {
    let Some(backend) = gpu_or_skip("kv_growth") else {
        return;
    };
    let raw = Raw::new(backend.clone());
    raw.keep_pool_memory();
    let pool = backend.default_pool();
    let default = Vmm::Pool(GrowthPolicy::default());
    let exact = Vmm::Pool(GrowthPolicy::Exact);
    // One plain pass of each, warm where a pool is involved, for the figures
    // criterion does not keep.
    report("vmmbuf_no_pool", &vmmbuf_run(&backend, Vmm::NoPool));
    for (name, how) in [
        ("vmmbuf_default_pool", default),
        ("vmmbuf_map_ahead", Vmm::MapAhead),
        ("vmmbuf_exact_2MiB", exact),
    ] {
        vmmbuf_run(&backend, how); // warms the pool with this policy's sizes
        let hits = pool.stats().hits;
        report(name, &vmmbuf_run(&backend, how));
        assert!(pool.stats().hits > hits, "the warm run took pooled chunks");
    }
    report("cuMemAlloc_doubling", &doubling_run(&raw, false));
    doubling_run(&raw, true);
    report("cuMemAllocAsync_warm_doubling", &doubling_run(&raw, true));
    println!("kv_growth: default pool {}", pool.stats());

    let mut c = common::criterion(10, 4);
    let mut g = c.benchmark_group("kv_growth");
    let sum =
        |f: &mut dyn FnMut() -> Run, iters: u64| (0..iters).map(|_| f().total).sum::<Duration>();
    for (name, how) in [
        ("vmmbuf_default_pool", default),
        ("vmmbuf_map_ahead", Vmm::MapAhead),
        ("vmmbuf_no_pool", Vmm::NoPool),
        ("vmmbuf_exact_2MiB", exact),
    ] {
        g.bench_function(name, |b| {
            b.iter_custom(|i| sum(&mut || vmmbuf_run(&backend, how), i))
        });
    }
    g.bench_function("cuMemAlloc_doubling", |b| {
        b.iter_custom(|i| sum(&mut || doubling_run(&raw, false), i))
    });
    g.bench_function("cuMemAllocAsync_warm_doubling", |b| {
        b.iter_custom(|i| sum(&mut || doubling_run(&raw, true), i))
    });
    g.finish();
    c.final_summary();
}
