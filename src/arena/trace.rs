//! Allocation traces: every alloc and free as a CSV line, recorded from an
//! arena or converted from PyTorch's memory history, and replayed through
//! an arena to measure what it reserves ([`replay_trace`]).
//!
//! Format, one event a line after the header `op,id,bytes,stream,time_us`:
//! `alloc,<id>,<bytes>,<stream>,<time>` and `free,<id>,<bytes>,<stream>,<time>`.
//! Ids pair a free with its alloc; streams are numbers.

use std::collections::HashMap;
use std::io::{BufRead, Write};

use super::{Allocation, Arena, ArenaStream};
use crate::backend::Backend;
use crate::error::{Error, Result};

/// The header line of a trace.
pub const TRACE_HEADER: &str = "op,id,bytes,stream,time_us";

/// One event of a trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TraceEvent {
    /// `bytes` allocated as `id` on `stream`.
    Alloc {
        /// Pairs the free with this alloc.
        id: u64,
        /// Bytes asked for.
        bytes: usize,
        /// The stream's number.
        stream: u64,
    },
    /// `id` freed.
    Free {
        /// The alloc's id.
        id: u64,
    },
}

/// Parses a trace (the header, then one event a line).
pub fn parse_trace(input: impl BufRead) -> Result<Vec<TraceEvent>> {
    let mut events = Vec::new();
    for (n, line) in input.lines().enumerate() {
        let line = line.map_err(|e| Error::Os {
            call: "read",
            source: e,
        })?;
        let line = line.trim();
        if line.is_empty() || (n == 0 && line == TRACE_HEADER) {
            continue;
        }
        let bad = || Error::invalid(format!("trace line {}: {line:?}", n + 1));
        let f: Vec<&str> = line.split(',').collect();
        if f.len() < 4 {
            return Err(bad());
        }
        let id: u64 = f[1].parse().map_err(|_| bad())?;
        events.push(match f[0] {
            "alloc" => TraceEvent::Alloc {
                id,
                bytes: f[2].parse().map_err(|_| bad())?,
                stream: f[3].parse().map_err(|_| bad())?,
            },
            "free" => TraceEvent::Free { id },
            _ => return Err(bad()),
        });
    }
    Ok(events)
}

/// What a replay measured.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct ReplayReport {
    /// Events replayed.
    pub events: usize,
    /// The most bytes allocated at once (rounded to the arena's alignment).
    pub peak_allocated_bytes: usize,
    /// The most bytes the arena held at once: mapped plus idle in its pool.
    pub peak_reserved_bytes: usize,
    /// Frees of ids the trace never allocated (skipped), and allocs left
    /// live at the end (freed then).
    pub unmatched: usize,
}

impl ReplayReport {
    /// Peak reserved over peak allocated: 1.0 is perfect.
    pub fn overhead(&self) -> f64 {
        self.peak_reserved_bytes as f64 / self.peak_allocated_bytes.max(1) as f64
    }
}

/// Replays `events` through `arena`, stream numbers mapped by `stream`.
pub fn replay_trace<B: Backend, S: ArenaStream<B>>(
    arena: &Arena<B, S>,
    events: &[TraceEvent],
    stream: impl Fn(u64) -> S,
) -> Result<ReplayReport> {
    replay_trace_with(arena, events, stream, || {})
}

/// [`replay_trace`], calling `before_event` before each event: a lagging
/// host backend's [`tick`](crate::HostBackend::tick), so that fences pass
/// some events after they were made, as a GPU's do
/// ([`HostBackend::with_fence_lag`](crate::HostBackend::with_fence_lag)).
pub fn replay_trace_with<B: Backend, S: ArenaStream<B>>(
    arena: &Arena<B, S>,
    events: &[TraceEvent],
    stream: impl Fn(u64) -> S,
    mut before_event: impl FnMut(),
) -> Result<ReplayReport> {
    let mut live: HashMap<u64, Allocation<B, S>> = HashMap::new();
    let mut streams: HashMap<u64, S> = HashMap::new();
    let mut report = ReplayReport::default();
    for ev in events {
        before_event();
        match *ev {
            TraceEvent::Alloc {
                id,
                bytes,
                stream: s,
            } => {
                let s = streams.entry(s).or_insert_with(|| stream(s));
                let a = arena.alloc(bytes.max(1), s)?;
                if live.insert(id, a).is_some() {
                    report.unmatched += 1;
                }
            }
            TraceEvent::Free { id } => {
                if live.remove(&id).is_none() {
                    report.unmatched += 1;
                }
            }
        }
        report.events += 1;
        let (allocated, taken) = arena.taken();
        report.peak_allocated_bytes = report.peak_allocated_bytes.max(allocated);
        report.peak_reserved_bytes = report.peak_reserved_bytes.max(taken);
    }
    report.unmatched += live.len();
    Ok(report)
}

/// Where an arena writes its trace.
pub(crate) struct TraceSink {
    pub(crate) out: Box<dyn Write + Send>,
    pub(crate) start: std::time::Instant,
    pub(crate) next_id: u64,
}

impl TraceSink {
    pub(crate) fn line(&mut self, op: &str, id: u64, bytes: usize, stream: crate::StreamKey) {
        let t = self.start.elapsed().as_micros();
        // A stream's number: its handle (distinct among live streams).
        if let Err(e) = writeln!(self.out, "{op},{id},{bytes},{},{t}", stream.1) {
            tracing::warn!(error = %e, "vmmbuf arena: writing the trace failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_refuses_garbage() {
        let t = "op,id,bytes,stream,time_us\nalloc,1,512,7,0\nfree,1,512,7,3\n";
        let ev = parse_trace(t.as_bytes()).unwrap();
        assert_eq!(
            ev,
            vec![
                TraceEvent::Alloc {
                    id: 1,
                    bytes: 512,
                    stream: 7
                },
                TraceEvent::Free { id: 1 }
            ]
        );
        assert!(parse_trace("alloc,x,1,1,0".as_bytes()).is_err());
        assert!(parse_trace("grow,1,1,1,0".as_bytes()).is_err());
    }
}
