//! Sharing a growing buffer with other processes: the exporter's side
//! ([`Exporter`], [`GrowableBuffer::publish`](crate::GrowableBuffer::publish)) and the importer's
//! ([`SharedBuffer`]).
//!
//! A shareable buffer ([`BufferDesc::shareable`](crate::BufferDesc::shareable))
//! creates every chunk exportable as a file descriptor (CUDA's POSIX-fd
//! handle type; the host backend's sealed memfds). An exporter sends new
//! chunks as one [`HandleKind`]: descriptors by default, or fabric handles
//! ([`Exporter::with_handles`]; chunks made with the fabric handle type,
//! for importers across an NVLink fabric). Each `publish` sends one
//! *generation* over a Unix socket: the reservation's size, the granularity,
//! the length in use and every chunk (offset, size, placement), with the
//! descriptors of the chunks this peer has not had yet (SCM_RIGHTS, at most
//! [`FDS_PER_MESSAGE`] a message). The importer reserves its own range of the
//! same size, maps each chunk at the same offset and sets access for its own
//! device; [`SharedBuffer::sync`] applies the next generation: it maps new
//! chunks and unmaps the ones the exporter gave up.
//!
//! The rule for shrinking: once a buffer was published, every chunk it gives
//! up (shrinking, migrating, drop) is *released*, never pooled. The driver
//! (and the kernel, for memfds) keeps a chunk's memory alive while any
//! process holds it, a descriptor of it or a mapping; so an exporter's
//! shrink never frees memory under an importer, and no other buffer of the
//! exporter gets memory an importer still reads. The memory goes back when
//! the last importer has synced past the generation that dropped it (or
//! exited). Until then the importer reads the old bytes there.
//!
//! The wire format, for other implementations and for tests: every message
//! starts with a head of eight little-endian `u64`s: the magic
//! `b"vmmbufv1"`, the kind (1: a description, 2: a descriptor batch), the
//! generation, the reservation's bytes, the granularity, the length in use,
//! a count, and (descriptions) how many descriptors follow. A description
//! carries `count` records of five `u64`s: offset, bytes, placement
//! (`u64::MAX` for host memory, else the GPU's ordinal), the exporter's chunk
//! id, and how its handle follows: 0 not at all (the peer has it), 1 its
//! descriptor in a batch, 2 its 64-byte fabric handle after the records
//! (in record order). A batch carries `count` record indices, one per
//! descriptor attached to it (SCM_RIGHTS).
//!
//! Safe code over the backend trait and rustix's socket calls, in three
//! files: `wire.rs` (the format, pure: `describe`, `validate`), `socket.rs`
//! (frames and the [`Exporter`]) and `import.rs` ([`SharedBuffer`]).

mod import;
mod socket;
mod wire;

pub use crate::backend::handle::{ChunkHandle, FabricHandle, HandleKind};
pub use import::SharedBuffer;
pub use socket::Exporter;
pub use wire::{FDS_PER_MESSAGE, MAX_RECORDS};

pub(crate) use socket::send_frame;
pub(crate) use wire::{describe, Chunk, Head, Record, KIND_FDS, MAGIC};
