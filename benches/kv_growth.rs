//! A KV cache filling up: grow to 2 GiB in 2 MiB steps. vmmbuf's default
//! policy, the exact 2 MiB policy, and Vec-style doubling with
//! cuMemAlloc + copy. Besides criterion's totals, prints the worst step, the
//! peak physical memory and the over-commit of each.

mod common;

use std::time::{Duration, Instant};

use common::{gpu_or_skip, Raw, GIB, MIB};
use vmmbuf::{BufferDesc, CudaBackend, GrowableBuffer, GrowthPolicy};

const STEP: usize = 2 * MIB;
const TOTAL: usize = 2 * GIB;

struct Run {
    total: Duration,
    worst: Duration,
    peak: usize,
    max_overcommit: f64,
    mappings: usize,
}

fn vmmbuf_run(backend: &std::sync::Arc<CudaBackend>, policy: GrowthPolicy) -> Run {
    // Reserve twice the target, as a real cache would, so the last chunk is not
    // cut to fit and the peak shows the policy's true over-commit.
    let buf =
        GrowableBuffer::new(backend.clone(), BufferDesc::new(2 * TOTAL).growth(policy)).unwrap();
    let (mut total, mut worst, mut max_over) = (Duration::ZERO, Duration::ZERO, 0f64);
    for len in (STEP..=TOTAL).step_by(STEP) {
        let t = Instant::now();
        buf.grow_to(len).unwrap();
        let d = t.elapsed();
        total += d;
        worst = worst.max(d);
        max_over = max_over.max((buf.capacity() - len) as f64 / len as f64);
    }
    let s = buf.stats();
    Run {
        total,
        worst,
        peak: s.peak_mapped_bytes,
        max_overcommit: max_over,
        mappings: s.chunks,
    }
}

fn doubling_run(raw: &Raw) -> Run {
    let (mut total, mut worst, mut peak) = (Duration::ZERO, Duration::ZERO, 0usize);
    let mut cap = STEP;
    let t = Instant::now();
    let mut ptr = raw.alloc(cap);
    total += t.elapsed();
    let mut allocs = 1;
    for len in (2 * STEP..=TOTAL).step_by(STEP) {
        let t = Instant::now();
        if len > cap {
            let new = raw.alloc(2 * cap);
            raw.copy(new, ptr, len - STEP);
            raw.sync();
            raw.free(ptr);
            peak = peak.max(3 * cap);
            ptr = new;
            cap *= 2;
            allocs += 1;
        }
        let d = t.elapsed();
        total += d;
        worst = worst.max(d);
    }
    raw.free(ptr);
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
    // One plain pass of each, for the figures criterion does not keep.
    report(
        "vmmbuf_default",
        &vmmbuf_run(&backend, GrowthPolicy::default()),
    );
    report(
        "vmmbuf_exact_2MiB",
        &vmmbuf_run(&backend, GrowthPolicy::Exact),
    );
    report("cuMemAlloc_doubling", &doubling_run(&raw));

    let mut c = common::criterion(10, 4);
    let mut g = c.benchmark_group("kv_growth");
    let sum =
        |f: &mut dyn FnMut() -> Run, iters: u64| (0..iters).map(|_| f().total).sum::<Duration>();
    g.bench_function("vmmbuf_default", |b| {
        b.iter_custom(|i| sum(&mut || vmmbuf_run(&backend, GrowthPolicy::default()), i))
    });
    g.bench_function("vmmbuf_exact_2MiB", |b| {
        b.iter_custom(|i| sum(&mut || vmmbuf_run(&backend, GrowthPolicy::Exact), i))
    });
    g.bench_function("cuMemAlloc_doubling", |b| {
        b.iter_custom(|i| sum(&mut || doubling_run(&raw), i))
    });
    g.finish();
    c.final_summary();
}
