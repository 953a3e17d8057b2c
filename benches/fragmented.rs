//! Diagnostic, not a claim: what an alloc/free pair costs the arena's
//! bookkeeping (host backend, no driver calls) when its zone holds many free
//! blocks that cannot merge, as a long-lived and fragmented arena may.
//!
//!     cargo bench --bench fragmented
//!
//! For each count N, N live 4 KiB allocations are made and every other one
//! freed (N/2 free blocks between live ones); then 20,000 pairs of 4 KiB or
//! 8 KiB are timed, warm. The free blocks' form changes with their count
//! (sorted arrays for few, trees for many: `src/arena/blocks.rs`).

use std::time::Instant;

use vmmbuf::host::HostStream;
use vmmbuf::{Arena, ArenaDesc, HostBackend};

const PAIRS: usize = 20_000;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("live allocations, free blocks, ns per alloc+free pair (mean of {PAIRS})");
    for n in [64usize, 128, 256, 512, 1000, 10_000, 40_000] {
        let host = HostBackend::with_granularity(2 << 20)?;
        let mut desc = ArenaDesc::new(64 << 30);
        desc.release_before_map = false;
        let arena: Arena<HostBackend, HostStream> = Arena::new(host, desc)?;
        let s = HostStream(0);
        let all = (0..n)
            .map(|_| arena.alloc(4096, &s))
            .collect::<vmmbuf::Result<Vec<_>>>()?;
        // Every other one freed: the free blocks lie between live ones.
        let kept: Vec<_> = all.into_iter().skip(1).step_by(2).collect();
        let t = Instant::now();
        for i in 0..PAIRS {
            drop(arena.alloc(4096 * (1 + i % 2), &s)?);
        }
        let ns = t.elapsed().as_nanos() as f64 / PAIRS as f64;
        println!("{n}, {}, {ns:.0}", n - kept.len());
        drop(kept);
    }
    Ok(())
}
