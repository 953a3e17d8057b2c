//! vmmbuf's cost to map one 2 MiB chunk (a growth by one granule under the
//! exact policy) against the raw cuMemCreate + cuMemMap + cuMemSetAccess.

mod common;

use std::time::{Duration, Instant};

use common::{gpu_or_skip, Raw, MIB};
use criterion::Criterion;
use vmmbuf::{BufferDesc, GrowableBuffer, GrowthPolicy};

fn main() {
    let Some(backend) = gpu_or_skip("overhead") else {
        return;
    };
    let raw = Raw::new(backend.clone());
    let mut c = Criterion::default()
        .sample_size(50)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    let mut g = c.benchmark_group("overhead");
    let chunk = 2 * MIB;
    {
        let mut buf = GrowableBuffer::new(
            backend.clone(),
            BufferDesc::new(64 * MIB).growth(GrowthPolicy::Exact),
        )
        .unwrap();
        buf.grow_to(chunk).unwrap();
        g.bench_function("vmmbuf_map_2MiB", |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let t = Instant::now();
                    buf.grow_to(2 * chunk).unwrap();
                    total += t.elapsed();
                    buf.shrink_to(chunk).unwrap();
                }
                total
            })
        });
    }
    let va = raw.reserve(64 * MIB);
    g.bench_function("raw_map_2MiB", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let t = Instant::now();
                let h = raw.create_map_access(va + chunk as u64, chunk);
                total += t.elapsed();
                raw.unmap_release(va + chunk as u64, chunk, h);
            }
            total
        })
    });
    raw.address_free(va, 64 * MIB);
    g.finish();
    c.final_summary();
}
