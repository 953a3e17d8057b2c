//! The CUDA backend's tokens: [`CudaReservation`] (a reserved address
//! range) and [`CudaChunk`] (a physical allocation), each giving its
//! resource back as it drops.
#![allow(unsafe_code)]

use super::*;

/// A reserved range of the process's unified (GPU) address space: the
/// [`Backend::Reservation`] of [`CudaBackend`].
#[derive(Debug)]
pub struct CudaReservation {
    pub(super) ptr: sys::CUdeviceptr,
    pub(super) table: ChunkTable<()>,
    pub(super) ctx: Arc<CudaContext>,
    pub(super) counters: Arc<Counters>,
}

impl CudaReservation {
    pub(super) fn addr(&self, offset: usize) -> sys::CUdeviceptr {
        self.ptr + offset as u64
    }
}

impl Drop for CudaReservation {
    fn drop(&mut self) {
        if self.ptr == 0 {
            return; // freed through Backend::free
        }
        let _ = driver::bind(&self.ctx);
        // A token dropped with mappings left: wait for the GPU, then take them
        // down before the range can be freed.
        let mappings: Vec<(usize, usize)> = self.table.iter().map(|(o, e)| (o, e.bytes)).collect();
        if !mappings.is_empty() {
            self.counters.update(|c| c.device_syncs += 1);
            let _ = driver::synchronize(&self.ctx);
        }
        for (off, bytes) in mappings {
            // SAFETY: (ptr + off, bytes) is one live mapping of this token, and
            // the device has been synchronised.
            match unsafe { driver::mem_unmap(self.addr(off), bytes) } {
                Ok(()) => self.counters.update(|c| c.mapped_bytes -= bytes),
                Err(e) => tracing::error!(error = %e, "vmmbuf cuda: unmap in drop failed"),
            }
        }
        // SAFETY: (ptr, bytes) is exactly this token's reservation.
        match unsafe { driver::address_free(self.ptr, self.table.reserved()) } {
            Ok(()) => {
                let bytes = self.table.reserved();
                self.counters.update(|c| {
                    c.reservations -= 1;
                    c.reserved_bytes -= bytes;
                });
            }
            Err(e) => {
                tracing::error!(error = %e, "vmmbuf cuda: freeing a reservation in drop failed; the range leaks")
            }
        }
    }
}

/// A physical allocation handle from `cuMemCreate`: the [`Backend::Chunk`] of
/// [`CudaBackend`].
#[derive(Debug)]
pub struct CudaChunk {
    pub(super) handle: sys::CUmemGenericAllocationHandle,
    /// Never reused in this process, unlike the handle (see
    /// [`Backend::chunk_id`](super::Backend::chunk_id)).
    pub(super) id: u64,
    pub(super) bytes: usize,
    pub(super) placement: Location,
    /// Created with [`Backend::create_shareable`](super::Backend::create_shareable),
    /// or imported: the pool's shareable kind.
    pub(super) shareable: bool,
    /// Has the POSIX-fd handle type (shareable, or made NCCL-ready).
    /// Read only where chunks are exported (Unix).
    #[cfg_attr(not(unix), allow(dead_code))]
    pub(super) exportable: bool,
    /// Has the fabric handle type (made NCCL-ready where the driver
    /// permits it, or imported from a fabric handle).
    #[cfg_attr(not(unix), allow(dead_code))]
    pub(super) fabric: bool,
    pub(super) released: bool,
    pub(super) ctx: Arc<CudaContext>,
    pub(super) counters: Arc<Counters>,
}

impl CudaChunk {
    pub(super) fn release_now(&mut self) -> Result<()> {
        // SAFETY: the handle came from cuMemCreate and has not been released
        // (`released` is false); releasing while mapped is allowed.
        unsafe { driver::mem_release(self.handle, self.bytes) }?;
        self.released = true;
        let bytes = self.bytes;
        self.counters.update(|c| {
            c.chunks -= 1;
            c.chunk_bytes -= bytes;
        });
        Ok(())
    }
}

impl Drop for CudaChunk {
    fn drop(&mut self) {
        if !self.released {
            let _ = driver::bind(&self.ctx);
            if let Err(e) = self.release_now() {
                tracing::error!(error = %e, "vmmbuf cuda: releasing a chunk in drop failed");
            }
        }
    }
}
