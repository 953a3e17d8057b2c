//! Shrink to zero, then grow back to 1 GiB in 64 MiB steps: without a pool
//! (every cycle releases and re-creates each chunk), with the backend's
//! default pool (what `GrowableBuffer::new` gives), and with a pool of its own.

mod common;

use std::time::Instant;

use common::{gpu_or_skip, GIB, MIB};
use vmmbuf::{BufferDesc, ChunkPool, CudaBackend, GrowableBuffer, PoolDesc};

fn cycle(buf: &mut GrowableBuffer<CudaBackend>) {
    buf.truncate(0);
    buf.shrink_to_fit().unwrap();
    for len in (64 * MIB..=GIB).step_by(64 * MIB) {
        buf.grow_to(len).unwrap();
    }
}

fn main() {
    let Some(backend) = gpu_or_skip("regrow") else {
        return;
    };
    let mut c = common::criterion(20, 3);
    let mut g = c.benchmark_group("regrow");
    let pool = ChunkPool::new(backend.clone(), PoolDesc::default()).unwrap();
    for (name, mut buf) in [
        (
            "no_pool",
            GrowableBuffer::new(backend.clone(), BufferDesc::new(2 * GIB).pooled(false)).unwrap(),
        ),
        (
            "default_pool",
            GrowableBuffer::new(backend.clone(), BufferDesc::new(2 * GIB)).unwrap(),
        ),
        (
            "pool",
            GrowableBuffer::with_pool(&pool, BufferDesc::new(2 * GIB)).unwrap(),
        ),
    ] {
        cycle(&mut buf);
        println!("regrow/{name}: {} chunks per cycle", buf.chunk_count());
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let t = Instant::now();
                for _ in 0..iters {
                    cycle(&mut buf);
                }
                t.elapsed()
            })
        });
    }
    println!("regrow: {}", pool.stats());
    g.finish();
    c.final_summary();
}
