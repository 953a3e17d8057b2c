//! Sharing with other processes: `publish`, the exporter's side of
//! [`crate::ipc`].

use std::os::fd::OwnedFd;

use super::GrowableBuffer;
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::ipc::{describe, send_frame, Chunk, Exporter, Head, FDS_PER_MESSAGE, KIND_FDS, MAGIC};

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
        let g = self.inner.lock();
        g.check_poison()?;
        self.published
            .store(true, std::sync::atomic::Ordering::Release);
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
        );
        // The descriptors of the fresh chunks, in record order (one record
        // per chunk of the table, in its order).
        let mut fds = Vec::with_capacity(d.fresh_at.len());
        for ((_, e), r) in g.region.table.iter().zip(&d.records) {
            if r.fresh != 0 {
                fds.push(self.backend.export(&e.chunk)?);
            }
        }
        let (head, records, fresh_at, generation) =
            (d.head, d.records, d.fresh_at, d.head.generation);
        drop(g);
        let result = (|| {
            send_frame(&to.socket, &head, bytemuck::cast_slice(&records), &[])?;
            let mut fds = fds.into_iter();
            for batch in fresh_at.chunks(FDS_PER_MESSAGE) {
                let these: Vec<OwnedFd> = fds.by_ref().take(batch.len()).collect();
                let h = Head {
                    magic: MAGIC,
                    kind: KIND_FDS,
                    generation,
                    count: batch.len() as u64,
                    ..Head::default()
                };
                send_frame(&to.socket, &h, bytemuck::cast_slice(batch), &these)?;
                // Our copies close here; the peer holds its own.
            }
            Ok(())
        })();
        if let Err(e) = result {
            to.broken = true;
            return Err(e);
        }
        to.sent = records
            .iter()
            .map(|r| (r.offset, (r.bytes, r.id)))
            .collect();
        to.generation = generation;
        tracing::debug!(
            generation,
            chunks = records.len(),
            fresh = fresh_at.len(),
            "vmmbuf: published"
        );
        Ok(generation)
    }
}
