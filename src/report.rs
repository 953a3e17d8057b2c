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
            "in use {} / mapped {} / reserved {} in {} ({} on GPUs, {} on the host; peak mapped {}); \
             {} grows, {} shrinks, {} trims; {} chunks mapped, {} released",
            Bytes(self.in_use_bytes),
            Bytes(self.mapped_bytes),
            Bytes(self.reserved_bytes),
            Count(self.chunks, "chunk"),
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

/// `n` things, singular or plural: "1 chunk", "3 chunks".
struct Count(usize, &'static str);

impl fmt::Display for Count {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = if self.0 == 1 { "" } else { "s" };
        write!(f, "{} {}{s}", self.0, self.1)
    }
}

impl fmt::Display for Report {
    /// The counters, then a row per run of chunks that follow one another
    /// with the same size, placement and access (a buffer of a thousand
    /// equal chunks prints one row).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "buffer at {:#x}: {}", self.base, self.stats)?;
        writeln!(
            f,
            "  {:>11}  {:>14}  {:>16}  {:<9} access",
            "chunks", "offset", "size", "placement"
        )?;
        let mut i = 0;
        while i < self.chunks.len() {
            let c = &self.chunks[i];
            let run = self.chunks[i..]
                .windows(2)
                .take_while(|w| {
                    w[1].offset == w[0].offset + w[0].bytes
                        && w[1].bytes == c.bytes
                        && w[1].placement == c.placement
                        && w[1].access == c.access
                })
                .count()
                + 1;
            let access: Vec<String> = c.access.iter().map(|(l, a)| format!("{l}:{a}")).collect();
            let (which, size) = if run == 1 {
                (i.to_string(), Bytes(c.bytes).to_string())
            } else {
                (
                    format!("{i}-{}", i + run - 1),
                    format!("{run} x {}", Bytes(c.bytes)),
                )
            };
            writeln!(
                f,
                "  {:>11}  {:>#14x}  {:>16}  {:<9} {}",
                which,
                c.offset,
                size,
                c.placement.to_string(),
                access.join(" ")
            )?;
            i += run;
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
        assert!(s.contains("in 1 chunk ("), "{s}");
        assert!(s.contains("4.0 KiB") && s.contains("host:rw"), "{s}");
    }

    /// A run of equal chunks that follow one another is one row; a chunk
    /// of another size, placement or access, or after a gap, starts a row.
    #[test]
    fn a_report_summarises_runs_of_equal_chunks() {
        let chunk = |offset: usize, bytes: usize, placement: Location| ChunkInfo {
            offset,
            bytes,
            placement,
            access: vec![(Location::Host, Access::ReadWrite)],
        };
        let g = 2 << 20;
        let mut chunks: Vec<ChunkInfo> =
            (0..1000).map(|i| chunk(i * g, g, Location::Host)).collect();
        chunks.push(chunk(1000 * g, 4 * g, Location::Host));
        chunks.push(chunk(1004 * g, g, Location::Device(0)));
        chunks.push(chunk(1010 * g, g, Location::Device(0)));
        let r = Report {
            base: 0,
            stats: BufferStats {
                chunks: chunks.len(),
                ..BufferStats::default()
            },
            chunks,
        };
        let s = r.to_string();
        let rows: Vec<&str> = s.lines().skip(2).collect();
        assert_eq!(rows.len(), 4, "{s}");
        assert!(
            rows[0].contains("0-999") && rows[0].contains("1000 x 2.0 MiB"),
            "{s}"
        );
        assert!(
            rows[1].contains("1000") && rows[1].contains("8.0 MiB"),
            "{s}"
        );
        assert!(rows[2].trim_start().starts_with("1001 "), "{s}");
        assert!(
            rows[3].trim_start().starts_with("1002 "),
            "a gap starts a row: {s}"
        );
        assert!(s.contains("in 1003 chunks"), "{s}");
    }
}
