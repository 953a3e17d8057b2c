//! Arena alloc + free latency against `cuMemAllocAsync` + `cuMemFreeAsync`
//! from a warm pool (release threshold at its maximum, as PyTorch and JAX
//! keep memory), for 512 B, 64 KiB, 4 MiB and 256 MiB, in one run. Criterion
//! gives the mean per pair; a second pass times 20,000 single pairs each and
//! prints p50 and p99, since the issue is tail latency.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{gpu_or_skip, Raw};
use criterion::BenchmarkId;
use cudarc::driver::CudaStream;
use vmmbuf::{Arena, ArenaDesc, CudaBackend};

const SIZES: [(usize, &str); 4] = [
    (512, "512B"),
    (64 << 10, "64KiB"),
    (4 << 20, "4MiB"),
    (256 << 20, "256MiB"),
];

fn percentiles(mut v: Vec<Duration>) -> (f64, f64) {
    v.sort();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    (us(v[v.len() / 2]), us(v[v.len() * 99 / 100]))
}

fn main() {
    let Some(backend) = gpu_or_skip("arena") else {
        return;
    };
    let raw = Raw::new(backend.clone());
    raw.keep_pool_memory();
    let stream = backend.context().new_stream().unwrap();
    let arena: Arena<CudaBackend, Arc<CudaStream>> =
        Arena::new(backend.clone(), ArenaDesc::new(64 << 30)).unwrap();
    // Warm both: one pair of each size first.
    for (size, _) in SIZES {
        drop(arena.alloc(size, &stream).unwrap());
        let p = raw.alloc_async(size);
        raw.free_async(p);
    }
    raw.stream_sync();
    let mut c = common::criterion(20, 2);
    let mut g = c.benchmark_group("arena_alloc_free");
    for (size, label) in SIZES {
        g.bench_function(BenchmarkId::new("vmmbuf_arena", label), |b| {
            b.iter(|| drop(arena.alloc(size, &stream).unwrap()))
        });
        g.bench_function(BenchmarkId::new("cuMemAllocAsync_warm_pool", label), |b| {
            b.iter(|| {
                let p = raw.alloc_async(size);
                raw.free_async(p);
            })
        });
    }
    g.finish();
    println!("per-pair latency over 20000 pairs, us (p50 / p99):");
    for (size, label) in SIZES {
        let (mut a, mut r) = (Vec::with_capacity(20_000), Vec::with_capacity(20_000));
        for _ in 0..20_000 {
            let t = Instant::now();
            drop(arena.alloc(size, &stream).unwrap());
            a.push(t.elapsed());
            let t = Instant::now();
            let p = raw.alloc_async(size);
            raw.free_async(p);
            r.push(t.elapsed());
        }
        let ((a50, a99), (r50, r99)) = (percentiles(a), percentiles(r));
        println!(
            "  {label:>7}: arena {a50:7.2} / {a99:7.2}   cuMemAllocAsync warm pool {r50:7.2} / {r99:7.2}   p50 ratio {:.2}, p99 ratio {:.2}",
            a50 / r50,
            a99 / r99
        );
    }
    // The PyTorch training trace, replayed through a fresh arena each time;
    // last, since each sample takes seconds on a GPU and a run cut short has
    // printed the tables above. From the working directory (the GPU
    // runner's is the repository), else from where the bench was built.
    let name = "traces/torch-transformer-h100.csv.gz";
    let file = std::fs::File::open(name)
        .or_else(|_| std::fs::File::open(format!("{}/{name}", env!("CARGO_MANIFEST_DIR"))));
    if let Ok(file) = file {
        let events =
            vmmbuf::trace::parse_trace(std::io::BufReader::new(flate2::read::GzDecoder::new(file)))
                .unwrap();
        let mut g = c.benchmark_group("arena_replay");
        g.sample_size(10);
        g.bench_function("torch_transformer_trace", |b| {
            b.iter(|| {
                let a: Arena<CudaBackend, Arc<CudaStream>> =
                    Arena::new(backend.clone(), ArenaDesc::new(64 << 30)).unwrap();
                vmmbuf::trace::replay_trace(&a, &events, |_| stream.clone()).unwrap()
            })
        });
        g.finish();
    }
    raw.stream_sync();
    let s = arena.stats();
    println!(
        "arena after the bench: {} allocs, {} device syncs",
        s.num_allocs, s.num_device_syncs
    );
}
