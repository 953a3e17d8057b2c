//! Replays an allocation trace through an `Arena` and prints what it
//! reserved against what was allocated. On the GPU if there is one (CUDA
//! streams stand for the trace's streams), else on the host backend with
//! CUDA's 2 MiB granularity; it says which.
//!
//!     cargo run --release --example replay -- traces/torch-transformer-h100.csv.gz
//!
//! On the host, `VMMBUF_REPLAY_LAG=N` makes fences pass N events after they
//! are made, as a GPU lagging behind the CPU would (the host's own fences
//! pass at once, which a device's do not); the fence queries are counted.
//! A trace recorded through the PyTorch plug-in replays as the plug-in runs
//! with `VMMBUF_CHUNK_MIB=20 VMMBUF_RELEASE_BEFORE_MAP=0 VMMBUF_DEFER_FENCES=1
//! VMMBUF_WAIT_BEFORE_GROW=1`.
//!
//! The trace in the repository was recorded from a PyTorch training run on
//! an H100 (scripts/bench/torch_trace.py).

use std::io::BufReader;
use std::sync::Arc;

use vmmbuf::{
    host::HostStream, trace::parse_trace, trace::replay_trace, trace::replay_trace_with, Arena,
    ArenaDesc, CudaBackend, HostBackend,
};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "traces/torch-transformer-h100.csv.gz".into());
    let file = std::fs::File::open(&path)?;
    let events = if path.ends_with(".gz") {
        parse_trace(BufReader::new(flate2::read::GzDecoder::new(file)))?
    } else {
        parse_trace(BufReader::new(file))?
    };
    let chunk_mib: usize = std::env::var("VMMBUF_CHUNK_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    let mut desc = ArenaDesc::new(256 << 30).max_chunk_bytes(chunk_mib << 20);
    // VMMBUF_RELEASE_BEFORE_MAP=0 keeps free chunks mapped (the PyTorch
    // plug-in's setting).
    desc.release_before_map = std::env::var("VMMBUF_RELEASE_BEFORE_MAP").as_deref() != Ok("0");
    // VMMBUF_RELEASE_OVER=P: whole free chunks go back before a mapping
    // past P% of the peak allocated (ArenaDesc::release_over_percent).
    if let Some(p) = std::env::var("VMMBUF_RELEASE_OVER")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        desc = desc.release_over_percent(p);
    }
    // VMMBUF_DEFER_FENCES=1 and VMMBUF_WAIT_BEFORE_GROW=1: the PyTorch
    // plug-in's settings (with VMMBUF_CHUNK_MIB=20 and
    // VMMBUF_RELEASE_BEFORE_MAP=0), which matter once fences lag.
    let on = |k: &str| std::env::var(k).as_deref() == Ok("1");
    desc = desc
        .defer_free_fences(on("VMMBUF_DEFER_FENCES"))
        .wait_before_grow(on("VMMBUF_WAIT_BEFORE_GROW"))
        // VMMBUF_MOVE_FREE=1: whole free chunks move to where the arena
        // grows instead of new memory (ArenaDesc::move_free_chunks).
        .move_free_chunks(on("VMMBUF_MOVE_FREE"));
    let started = std::time::Instant::now();
    let (where_, report, stats) = match CudaBackend::new(0) {
        Ok(gpu) => {
            let arena: Arena<CudaBackend, Arc<cudarc::driver::CudaStream>> =
                Arena::new(gpu.clone(), desc)?;
            let ctx = gpu.context().clone();
            let report = replay_trace(&arena, &events, |_| ctx.new_stream().unwrap())?;
            ("CUDA VMM on GPU 0".to_string(), report, arena.stats())
        }
        Err(e) => {
            vmmbuf::host::raise_fd_limit();
            let lag: u64 = std::env::var("VMMBUF_REPLAY_LAG")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            // A chunk maps at two addresses at once here, as on CUDA, so
            // that moving free chunks (VMMBUF_MOVE_FREE=1) replays too.
            let host = HostBackend::mapping_chunks_twice(2 << 20, lag)?;
            let arena: Arena<HostBackend, HostStream> = Arena::new(host.clone(), desc)?;
            let report = replay_trace_with(&arena, &events, HostStream, || host.tick())?;
            let live = vmmbuf::Backend::live(&*host);
            (
                format!(
                    "the host backend, fences passing {lag} events after they are made \
                     ({} fence queries; no GPU: {e})",
                    live.fence_queries
                ),
                report,
                arena.stats(),
            )
        }
    };
    println!(
        "replayed {} events of {path} on {where_} in {:.2} s",
        report.events,
        started.elapsed().as_secs_f64()
    );
    println!(
        "peak allocated {:.1} MiB, peak reserved (mapped + pooled) {:.1} MiB: {:.4}x; unmatched events {}",
        report.peak_allocated_bytes as f64 / (1 << 20) as f64,
        report.peak_reserved_bytes as f64 / (1 << 20) as f64,
        report.overhead(),
        report.unmatched
    );
    print!("{stats}");
    Ok(())
}
