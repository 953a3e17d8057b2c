//! Sharing with other processes: `publish`, the exporter's side of
//! [`crate::ipc`].

use std::os::fd::OwnedFd;

use super::GrowableBuffer;
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::ipc::{
    describe, send_frame, Chunk, ChunkHandle, Exporter, HandleKind, Head, FDS_PER_MESSAGE,
    KIND_FDS, MAGIC,
};

impl<B: Backend> GrowableBuffer<B> {
    /// Sends the buffer's current layout to the importer on `to`, as its
    /// next generation, and returns that generation. Only the chunks `to`
    /// has not had yet go with a descriptor each; the importer's
    /// [`SharedBuffer::sync`](crate::ipc::SharedBuffer::sync) maps them and unmaps what the buffer gave up.
    /// From the first call on, chunks the buffer gives up are released,
    /// never pooled (see the module's rule for shrinking).
    ///
    /// The bytes the importer sees are the buffer's memory itself: what was
    /// written before `publish` returns is there to read (synchronous writes;
    /// order kernels before it yourself).
    ///
    /// Errors: [`Error::Unsupported`] for a buffer not created
    /// [`shareable`](crate::BufferDesc::shareable); [`Error::PeerGone`] when
    /// the importer's end is closed (after which `to` stays unusable);
    /// the buffer is unchanged either way.
    pub fn publish(&self, to: &mut Exporter) -> Result<u64> {
        self.check_publish(to)?;
        let g = self.inner.lock();
        g.check_poison()?;
        let d = describe(
            to.generation + 1,
            self.reserved as u64,
            self.granularity as u64,
            g.region.table.len() as u64,
            g.region.table.iter().map(|(offset, e)| Chunk {
                offset: offset as u64,
                bytes: e.bytes as u64,
                placement: e.placement,
                id: self.backend.chunk_id(&e.chunk),
            }),
            &to.sent,
            to.kind,
        );
        // Made before anything is sent: a chunk that cannot be exported so
        // fails the publish unsent.
        let (fds, inline) =
            self.export_fresh(&g.region.table, &d.records, d.fresh_at.len(), to.kind)?;
        // From here chunks given up are released, never pooled (an importer
        // may hold them); not before: a publish refused above sent nothing.
        self.published
            .store(true, std::sync::atomic::Ordering::Release);
        let (head, records, generation) = (d.head, d.records, d.head.generation);
        // Descriptor batches name the fresh records by index; fabric handles
        // went in the description.
        let fresh_at: Vec<u64> = match to.kind {
            HandleKind::PosixFd => d.fresh_at,
            HandleKind::Fabric => Vec::new(),
        };
        drop(g);
        let mut payload = bytemuck::cast_slice::<_, u8>(&records).to_vec();
        payload.extend_from_slice(&inline);
        if let Err(e) = send_generation(to, &head, &payload, &fresh_at, fds) {
            to.broken = true;
            return Err(e);
        }
        to.sent_now(&records, generation);
        tracing::debug!(
            generation,
            chunks = records.len(),
            fresh = fresh_at.len(),
            "vmmbuf: published"
        );
        Ok(generation)
    }

    /// Refuses a publish to a peer an earlier one failed part-way to, or of
    /// a buffer not created shareable.
    fn check_publish(&self, to: &Exporter) -> Result<()> {
        if to.broken {
            return Err(Error::PeerGone {
                reason: "an earlier publish to this peer failed part-way".into(),
            });
        }
        if !self.shareable {
            return Err(Error::Unsupported {
                what: "publishing a buffer not created shareable (BufferDesc::shareable)".into(),
            });
        }
        Ok(())
    }
}

impl<B: Backend> GrowableBuffer<B> {
    /// The handles of the fresh chunks (`records` has one per chunk of
    /// `table`, in its order), in record order: descriptors for the
    /// batches that follow the description, or fabric handles appended to
    /// it.
    fn export_fresh(
        &self,
        table: &crate::table::ChunkTable<B::Chunk>,
        records: &[crate::ipc::Record],
        fresh: usize,
        kind: HandleKind,
    ) -> Result<(Vec<OwnedFd>, Vec<u8>)> {
        let mut fds = Vec::with_capacity(fresh);
        let mut inline: Vec<u8> = Vec::new();
        for ((_, e), r) in table.iter().zip(records) {
            if r.fresh != 0 {
                let h = self.backend.export_handle(&e.chunk, kind)?;
                if h.kind() != kind {
                    return Err(Error::invalid(format!(
                        "the backend exported {} where {} was asked for",
                        h.kind(),
                        kind
                    )));
                }
                match h {
                    ChunkHandle::PosixFd(fd) => fds.push(fd),
                    ChunkHandle::Fabric(h) => inline.extend_from_slice(&h.0),
                }
            }
        }
        Ok((fds, inline))
    }
}

/// Sends one generation: the description (`head`, then `payload`: the
/// records and any fabric handles), then the descriptors in batches that
/// name their records by index (`fresh_at`). Our copies of the
/// descriptors close as they go; the peer holds its own.
fn send_generation(
    to: &Exporter,
    head: &Head,
    payload: &[u8],
    fresh_at: &[u64],
    fds: Vec<OwnedFd>,
) -> Result<()> {
    send_frame(&to.socket, head, payload, &[])?;
    let mut fds = fds.into_iter();
    for batch in fresh_at.chunks(FDS_PER_MESSAGE) {
        let these: Vec<OwnedFd> = fds.by_ref().take(batch.len()).collect();
        let h = Head {
            magic: MAGIC,
            kind: KIND_FDS,
            generation: head.generation,
            count: batch.len() as u64,
            ..Head::default()
        };
        send_frame(&to.socket, &h, bytemuck::cast_slice(batch), &these)?;
    }
    Ok(())
}
