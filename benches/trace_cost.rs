//! Diagnostic, not a claim: what the arena's own bookkeeping costs the CPU
//! per alloc and per free on a recorded trace, on the host backend (no
//! driver calls in the steady state: only the arena's work is timed).
//!
//!     cargo bench --bench trace_cost [-- traces/torch-fsdp-h100.csv.gz]
//!
//! The trace is replayed once to grow the arena (the plug-in's setting:
//! free chunks stay mapped; `VMMBUF_DEFER_FENCES=1` and
//! `VMMBUF_WAIT_BEFORE_GROW=1` add its other two), then `PASSES` times
//! more, each event timed.
//! The default trace is FSDP on one H100 (`scripts/bench/dist_train.py --nproc 1
//! --modes fsdp`, `VMMBUF_TORCH_TRACE`): 721 allocs and frees a step.
//!
//! `--cold MIB` writes MIB MiB of other memory before every fourth call,
//! which alone is timed (one timed pass): the caches a training step's
//! Python and launches evict between two allocator calls.
//!
//! `VMMBUF_TRACE_RESERVE_GIB=16 valgrind --tool=cachegrind --cache-sim=yes
//! --D1=2048,2,64 --LL=16384,4,64 <bench binary>` counts, per function, the
//! cache lines the calls miss when little stays cached between them.

use std::collections::HashMap;
use std::io::BufReader;
use std::time::Instant;

use vmmbuf::host::HostStream;
use vmmbuf::trace::{parse_trace, TraceEvent};
use vmmbuf::{Allocation, Arena, ArenaDesc, HostBackend};

const PASSES: usize = 5;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let cold_at = args.iter().position(|a| a == "--cold");
    let cold_mib: usize = cold_at
        .and_then(|i| args.get(i + 1)?.parse().ok())
        .unwrap_or(0);
    // The first argument that is neither a flag nor --cold's value.
    let path = args
        .iter()
        .enumerate()
        .find(|&(i, a)| !a.starts_with('-') && cold_at.map(|c| c + 1) != Some(i))
        .map_or_else(
            || "traces/torch-fsdp-h100.csv.gz".into(),
            |(_, a)| a.clone(),
        );
    let file = std::fs::File::open(&path)?;
    let events = parse_trace(BufReader::new(flate2::read::GzDecoder::new(file)))?;
    let passes = if cold_mib > 0 { 1 } else { PASSES };
    let mut evict = vec![0u64; cold_mib << 17];
    let (mut calls, mut round) = (0usize, 0u64);
    // Before a call of pass `pass`: whether to time it (every call of a
    // timed pass warm; cold, every fourth, after evicting the caches).
    let mut before_call = |pass: usize| {
        if pass == 0 {
            return false;
        }
        if cold_mib == 0 {
            return true;
        }
        calls += 1;
        if !calls.is_multiple_of(4) {
            return false;
        }
        round += 1;
        for (i, w) in evict.iter_mut().enumerate().step_by(8) {
            *w = w.wrapping_add(round ^ i as u64);
        }
        std::hint::black_box(&evict);
        true
    };
    vmmbuf::host::raise_fd_limit();
    let host = HostBackend::with_granularity(2 << 20)?;
    // VMMBUF_TRACE_RESERVE_GIB=16: a smaller reservation, under which the
    // bench runs in valgrind (its mmap refuses 256 GiB), e.g. cachegrind
    // with a small D1 to count the lines a call touches.
    let gib = std::env::var("VMMBUF_TRACE_RESERVE_GIB")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(256);
    let mut desc = ArenaDesc::new(gib << 30);
    desc.release_before_map = false;
    // VMMBUF_DEFER_FENCES=1 and VMMBUF_WAIT_BEFORE_GROW=1: the PyTorch
    // plug-in's settings.
    let on = |k: &str| std::env::var(k).as_deref() == Ok("1");
    desc = desc
        .defer_free_fences(on("VMMBUF_DEFER_FENCES"))
        .wait_before_grow(on("VMMBUF_WAIT_BEFORE_GROW"));
    let arena: Arena<HostBackend, HostStream> = Arena::new(host, desc)?;
    let mut streams: HashMap<u64, HostStream> = HashMap::new();
    let mut alloc_ns = Vec::new();
    let mut free_ns = Vec::new();
    let mut grown = 0;
    for pass in 0..=passes {
        if pass == 1 {
            grown = arena.stats().num_device_alloc;
        }
        let mut live: HashMap<u64, Allocation<HostBackend, HostStream>> = HashMap::new();
        for ev in &events {
            match *ev {
                TraceEvent::Alloc { id, bytes, stream } => {
                    let n = streams.len() as u64;
                    let s = streams.entry(stream).or_insert(HostStream(n));
                    let timed = before_call(pass);
                    let t = Instant::now();
                    let a = arena.alloc(bytes.max(1), s)?;
                    let dt = t.elapsed().as_nanos() as u64;
                    if timed {
                        alloc_ns.push(dt);
                    }
                    live.insert(id, a);
                }
                TraceEvent::Free { id } => {
                    if let Some(a) = live.remove(&id) {
                        let timed = before_call(pass);
                        let t = Instant::now();
                        drop(a);
                        let dt = t.elapsed().as_nanos() as u64;
                        if timed {
                            free_ns.push(dt);
                        }
                    }
                }
            }
        }
    }
    let stats = arena.stats();
    println!(
        "{path}: {} events, {passes} timed passes (caches evicted before each timed call: {cold_mib} MiB) after one that grows; chunks mapped in the timed passes: {}",
        events.len(),
        stats.num_device_alloc - grown
    );
    for (what, v) in [("alloc", &mut alloc_ns), ("free", &mut free_ns)] {
        v.sort_unstable();
        let mean = v.iter().sum::<u64>() as f64 / v.len().max(1) as f64;
        let q = |f: f64| v[((v.len() - 1) as f64 * f) as usize];
        println!(
            "{what}: {} calls, mean {:.0} ns, median {} ns, p90 {} ns, p99 {} ns",
            v.len(),
            mean,
            q(0.5),
            q(0.9),
            q(0.99)
        );
    }
    Ok(())
}
