//! The arena against a real workload: a trace recorded from PyTorch training
//! (scripts/torch_trace.py on an H100), replayed on the host backend with
//! CUDA's 2 MiB granularity, so it runs in CI.

use std::io::BufReader;

use vmmbuf::{parse_trace, replay_trace, Arena, ArenaDesc, Backend, HostBackend, HostStream};

crate::register! {
    host: [a_pytorch_training_trace_takes_at_most_1_01x_its_peak],
}

fn a_pytorch_training_trace_takes_at_most_1_01x_its_peak() {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/traces/torch-transformer-h100.csv.gz"
    );
    let file = std::fs::File::open(path).unwrap();
    let events = parse_trace(BufReader::new(flate2::read::GzDecoder::new(file))).unwrap();
    assert!(events.len() > 40_000, "{} events", events.len());
    // Host chunks are memfds: about two thousand of them at the peak.
    let old = getrlimit(Resource::Nofile);
    let _ = setrlimit(
        Resource::Nofile,
        Rlimit {
            current: old.maximum,
            maximum: old.maximum,
        },
    );
    let host = HostBackend::with_granularity(2 << 20).unwrap();
    let arena: Arena<HostBackend, HostStream> =
        Arena::new(host.clone(), ArenaDesc::new(256 << 30)).unwrap();
    let report = replay_trace(&arena, &events, HostStream).unwrap();
    let stats = arena.stats();
    drop(arena);
    setrlimit(Resource::Nofile, old).unwrap();
    eprintln!(
        "replay: {} events, peak allocated {} B, peak taken {} B: {:.4}x",
        report.events,
        report.peak_allocated_bytes,
        report.peak_reserved_bytes,
        report.overhead()
    );
    assert!(
        report.peak_allocated_bytes > 4_000_000_000,
        "the trace peaks at 4.3 GB"
    );
    assert!(report.overhead() <= 1.01, "{:.4}x", report.overhead());
    assert_eq!(
        stats.allocated_bytes.current, 0,
        "every block freed at the end"
    );
    assert_eq!(
        host.live().chunks,
        0,
        "and every chunk back to the driver with the arena"
    );
}
