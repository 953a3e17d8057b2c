//! Plain-data statistics and the per-chunk report.

use std::fmt;

use crate::location::{Access, Location};

/// Counters of one buffer, as plain data.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct BufferStats {
    /// Bytes of address space reserved (fixed for the buffer's life).
    pub reserved_bytes: usize,
    /// Bytes of physical memory mapped now (the capacity).
    pub mapped_bytes: usize,
    /// Bytes in use (the length).
    pub in_use_bytes: usize,
    /// Chunks mapped now.
    pub chunks: usize,
    /// Mapped bytes placed in host memory.
    pub host_bytes: usize,
    /// Mapped bytes placed on GPUs.
    pub device_bytes: usize,
    /// Growing calls that mapped at least one chunk.
    pub grows: u64,
    /// Calls that reduced the length (truncate, clear, resize down).
    pub shrinks: u64,
    /// Calls that gave back at least one chunk (shrink_to_fit, shrink_to,
    /// deferred releases).
    pub trims: u64,
    /// Chunks mapped over the buffer's life.
    pub chunks_mapped_total: u64,
    /// Chunks released over the buffer's life.
    pub chunks_released_total: u64,
    /// Chunks moved to another placement over the buffer's life.
    pub chunks_migrated_total: u64,
    /// The most bytes ever mapped at once.
    pub peak_mapped_bytes: usize,
}

impl fmt::Display for BufferStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "in use {} / mapped {} / reserved {} in {} chunks ({} on GPUs, {} on the host; peak mapped {}); \
             {} grows, {} shrinks, {} trims; {} chunks mapped, {} released",
            Bytes(self.in_use_bytes),
            Bytes(self.mapped_bytes),
            Bytes(self.reserved_bytes),
            self.chunks,
            Bytes(self.device_bytes),
            Bytes(self.host_bytes),
            Bytes(self.peak_mapped_bytes),
            self.grows,
            self.shrinks,
            self.trims,
            self.chunks_mapped_total,
            self.chunks_released_total,
        )
    }
}

/// One mapped chunk, as plain data.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ChunkInfo {
    /// Offset of the chunk from the buffer's base.
    pub offset: usize,
    /// Size of the chunk.
    pub bytes: usize,
    /// Where its physical memory lives.
    pub placement: Location,
    /// Who may touch it, and how.
    pub access: Vec<(Location, Access)>,
}

/// A buffer's chunks and counters at one moment; `Display` prints a table.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Report {
    /// The buffer's base address.
    pub base: u64,
    /// The buffer's counters.
    pub stats: BufferStats,
    /// Every mapped chunk, in address order.
    pub chunks: Vec<ChunkInfo>,
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "buffer at {:#x}: {}", self.base, self.stats)?;
        writeln!(
            f,
            "  {:>4}  {:>14}  {:>10}  {:<9} access",
            "#", "offset", "size", "placement"
        )?;
        for (i, c) in self.chunks.iter().enumerate() {
            let access: Vec<String> = c.access.iter().map(|(l, a)| format!("{l}:{a}")).collect();
            writeln!(
                f,
                "  {:>4}  {:>#14x}  {:>10}  {:<9} {}",
                i,
                c.offset,
                Bytes(c.bytes).to_string(),
                c.placement.to_string(),
                access.join(" ")
            )?;
        }
        Ok(())
    }
}

/// Formats a byte count with a binary unit, e.g. `2.0 MiB`.
#[derive(Clone, Copy, Debug)]
pub struct Bytes(pub usize);

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
        let mut v = self.0 as f64;
        let mut u = 0;
        while v >= 1024.0 && u + 1 < UNITS.len() {
            v /= 1024.0;
            u += 1;
        }
        if u == 0 {
            write!(f, "{} B", self.0)
        } else {
            write!(f, "{v:.1} {}", UNITS[u])
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_and_report_read_well() {
        assert_eq!(Bytes(512).to_string(), "512 B");
        assert_eq!(Bytes(3 << 20).to_string(), "3.0 MiB");
        let r = Report {
            base: 0x7000_0000,
            stats: BufferStats {
                in_use_bytes: 5,
                mapped_bytes: 4096,
                chunks: 1,
                ..BufferStats::default()
            },
            chunks: vec![ChunkInfo {
                offset: 0,
                bytes: 4096,
                placement: Location::Host,
                access: vec![(Location::Host, Access::ReadWrite)],
            }],
        };
        let s = r.to_string();
        assert!(s.contains("buffer at 0x70000000"), "{s}");
        assert!(s.contains("4.0 KiB") && s.contains("host:rw"), "{s}");
    }
}
