//! The few driver operations a buffer needs, behind one trait, and its two
//! real implementations: [`CudaBackend`] (CUDA VMM) and [`HostBackend`] (the
//! host's own virtual memory).
//!
//! The trait is safe: a backend hands out owned tokens for what it creates
//! (an address reservation, a physical chunk), and every call names the token
//! it acts on, so no call can reach memory the caller does not own. Tokens
//! that are dropped instead of being given back free their resource in their
//! own `Drop` (errors are logged, never panicked).
//!
//! Semantics follow CUDA's: a fresh mapping has *no* access until
//! [`Backend::set_access`]; a chunk maps whole; an unmap covers whole mappings;
//! a reservation can be freed only when nothing in it is mapped.

use crate::error::Result;
use crate::location::{AccessDesc, Location};

pub mod cuda;
pub mod cuda_interop;
pub mod host;

pub use cuda::CudaBackend;
pub use host::HostBackend;

/// Counts of what a backend has live now, for leak checks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LiveCounts {
    /// Address reservations not yet freed.
    pub reservations: usize,
    /// Bytes in those reservations.
    pub reserved_bytes: usize,
    /// Physical chunks not yet released.
    pub chunks: usize,
    /// Bytes in those chunks.
    pub chunk_bytes: usize,
    /// Bytes mapped into reservations.
    pub mapped_bytes: usize,
}

/// The operations a [`GrowableBuffer`](crate::GrowableBuffer) needs from a
/// memory system.
pub trait Backend: Send + Sync + 'static {
    /// An owned range of reserved address space.
    type Reservation: Send + Sync + 'static;
    /// An owned physical chunk, mappable whole into a reservation.
    type Chunk: Send + Sync + 'static;
    /// A point in the device's work: everything submitted before it has
    /// finished once [`Backend::fence_done`] says so. See
    /// [`GrowableBuffer::shrink_to_after`](crate::GrowableBuffer::shrink_to_after).
    type Fence: Send + Sync + 'static;

    /// A short name for messages: `"cuda"`, `"host"`.
    fn name(&self) -> &'static str;

    /// Where memory goes when nothing else is asked for: the backend's GPU, or
    /// the host for the host backend.
    fn home(&self) -> Location;

    /// The mapping granularity for chunks placed at `placement`: every chunk
    /// size and every mapping offset is a multiple of it. A power of two.
    fn granularity(&self, placement: Location) -> Result<usize>;

    /// Reserves `bytes` (a multiple of the granularity) of address space,
    /// aligned to at least `align` bytes; no physical memory is used.
    fn reserve(&self, bytes: usize, align: usize) -> Result<Self::Reservation>;

    /// The first address of a reservation.
    fn base(&self, res: &Self::Reservation) -> u64;

    /// Frees a reservation. Fails, and drops the token (which tries again and
    /// logs), if anything in it is still mapped.
    fn free(&self, res: Self::Reservation) -> Result<()>;

    /// Creates a physical chunk of `bytes` (a multiple of the granularity) at
    /// `placement`.
    fn create(&self, bytes: usize, placement: Location) -> Result<Self::Chunk>;

    /// Releases a chunk. Its memory goes back once it is no longer mapped.
    fn release(&self, chunk: Self::Chunk) -> Result<()>;

    /// Maps `chunk`, whole, at `offset` into `res`. The mapping starts with no
    /// access for anyone.
    fn map(&self, res: &mut Self::Reservation, offset: usize, chunk: &Self::Chunk) -> Result<()>;

    /// Unmaps `[offset, offset + bytes)` of `res`, which must cover whole
    /// mappings. Does not wait for the GPU: see [`Backend::synchronize`].
    fn unmap(&self, res: &mut Self::Reservation, offset: usize, bytes: usize) -> Result<()>;

    /// Sets access for `[offset, offset + bytes)` of `res`, which must be
    /// mapped, to exactly the listed locations (one call for all of them).
    fn set_access(
        &self,
        res: &mut Self::Reservation,
        offset: usize,
        bytes: usize,
        access: &[AccessDesc],
    ) -> Result<()>;

    /// Waits until no work the backend's device has been given is still
    /// running, so a range can be unmapped safely.
    fn synchronize(&self) -> Result<()>;

    /// Copies `bytes` from `src` at `src_offset` to `dst` at `dst_offset`,
    /// ordered on the backend's own stream: complete once
    /// [`Backend::synchronize`] returns. Both ranges must be mapped; the
    /// backend's device needs access to both.
    fn copy(
        &self,
        dst: &mut Self::Reservation,
        dst_offset: usize,
        src: &Self::Reservation,
        src_offset: usize,
        bytes: usize,
    ) -> Result<()>;

    /// Whether `device` can be given access to memory placed on `peer`.
    fn can_access_peer(&self, device: u32, peer: u32) -> Result<bool>;

    /// True once all work before `fence` has finished. Never blocks.
    fn fence_done(&self, fence: &Self::Fence) -> Result<bool>;

    /// Copies `dst.len()` bytes from `res` at `offset` to host memory.
    fn read(&self, res: &Self::Reservation, offset: usize, dst: &mut [u8]) -> Result<()>;

    /// Copies `src` into `res` at `offset`.
    fn write(&self, res: &mut Self::Reservation, offset: usize, src: &[u8]) -> Result<()>;

    /// What this backend has live now.
    fn live(&self) -> LiveCounts;
}

/// Live counters shared by the real backends.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    inner: parking_lot::Mutex<LiveCounts>,
}

impl Counters {
    pub(crate) fn get(&self) -> LiveCounts {
        *self.inner.lock()
    }
    pub(crate) fn update(&self, f: impl FnOnce(&mut LiveCounts)) {
        f(&mut self.inner.lock())
    }
}

/// What is mapped in one reservation: the bookkeeping each backend's
/// reservation token keeps so that every call is checked before it reaches
/// the OS or the driver. Pure code.
#[derive(Debug, Default)]
pub(crate) struct MapTable {
    /// Bytes in the reservation.
    pub(crate) bytes: usize,
    /// offset -> (bytes, host access, placement) of each live mapping.
    mapped: std::collections::BTreeMap<
        usize,
        (usize, crate::location::Access, crate::location::Location),
    >,
}

impl MapTable {
    pub(crate) fn new(bytes: usize) -> Self {
        Self {
            bytes,
            mapped: Default::default(),
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.mapped.is_empty()
    }

    pub(crate) fn mapped_bytes(&self) -> usize {
        self.mapped.values().map(|m| m.0).sum()
    }

    /// Every live mapping as (offset, bytes).
    pub(crate) fn mappings(&self) -> Vec<(usize, usize)> {
        self.mapped.iter().map(|(&k, &(b, _, _))| (k, b)).collect()
    }

    fn check_range(&self, offset: usize, bytes: usize) -> Result<()> {
        match offset.checked_add(bytes) {
            Some(end) if bytes > 0 && end <= self.bytes => Ok(()),
            _ => Err(crate::Error::invalid(format!(
                "range {offset:#x}+{bytes:#x} is empty or outside the {:#x}-byte reservation",
                self.bytes
            ))),
        }
    }

    /// Checks that a chunk of `bytes` can be mapped at `offset`.
    pub(crate) fn check_map(&self, offset: usize, bytes: usize, granularity: usize) -> Result<()> {
        self.check_range(offset, bytes)?;
        if offset % granularity != 0 {
            return Err(crate::Error::invalid(format!(
                "map offset {offset:#x} is not granular"
            )));
        }
        if let Some((&k, &(len, _, _))) = self.mapped.range(..offset + bytes).next_back() {
            if k + len > offset {
                return Err(crate::Error::invalid(format!(
                    "{offset:#x} overlaps the mapping at {k:#x}"
                )));
            }
        }
        Ok(())
    }

    pub(crate) fn insert(
        &mut self,
        offset: usize,
        bytes: usize,
        placement: crate::location::Location,
    ) {
        self.mapped
            .insert(offset, (bytes, crate::location::Access::None, placement));
    }

    /// Splits `[offset, offset + bytes)` (which `covering` has checked) into
    /// runs of mappings with the same placement: (offset, bytes) each.
    pub(crate) fn placement_runs(&self, offset: usize, bytes: usize) -> Vec<(usize, usize)> {
        let end = offset + bytes;
        let mut runs: Vec<(usize, usize, crate::location::Location)> = Vec::new();
        let start = self
            .mapped
            .range(..=offset)
            .next_back()
            .map_or(offset, |(&k, _)| k);
        for (&k, &(len, _, place)) in self.mapped.range(start..end) {
            let (a, b) = (k.max(offset), (k + len).min(end));
            match runs.last_mut() {
                Some(r) if r.2 == place && r.0 + r.1 == a => r.1 += b - a,
                _ => runs.push((a, b - a, place)),
            }
        }
        runs.into_iter().map(|(a, n, _)| (a, n)).collect()
    }

    /// Offsets of the mappings that together cover `[offset, offset + bytes)`
    /// without a gap, each granting the host at least `need`; with `exact`,
    /// the range must start and end on mapping boundaries.
    pub(crate) fn covering(
        &self,
        offset: usize,
        bytes: usize,
        exact: bool,
        need: crate::location::Access,
    ) -> Result<Vec<usize>> {
        self.check_range(offset, bytes)?;
        let end = offset + bytes;
        let mut at = match self.mapped.range(..=offset).next_back() {
            Some((&k, &(len, _, _))) if k + len > offset && (!exact || k == offset) => k,
            _ => return Err(crate::Error::invalid(format!("{offset:#x} is not mapped"))),
        };
        let mut keys = Vec::new();
        while at < end {
            match self.mapped.get(&at) {
                Some(&(len, access, _)) if access >= need => {
                    keys.push(at);
                    at += len;
                }
                Some(_) => {
                    return Err(crate::Error::invalid(format!(
                        "the mapping at {at:#x} does not grant the host {need:?} access"
                    )))
                }
                None => return Err(crate::Error::invalid(format!("{at:#x} is not mapped"))),
            }
        }
        if exact && at != end {
            return Err(crate::Error::invalid(format!(
                "{end:#x} falls inside a mapping"
            )));
        }
        Ok(keys)
    }

    pub(crate) fn remove(&mut self, keys: &[usize]) {
        for k in keys {
            self.mapped.remove(k);
        }
    }

    pub(crate) fn set_host_access(&mut self, keys: &[usize], access: crate::location::Access) {
        for k in keys {
            if let Some(m) = self.mapped.get_mut(k) {
                m.1 = access;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::MapTable;
    use crate::location::{Access, Location};

    #[test]
    fn map_table_checks_overlap_coverage_and_bounds() {
        let mut t = MapTable::new(64);
        t.check_map(0, 16, 8).unwrap();
        t.insert(0, 16, Location::Device(0));
        t.insert(16, 8, Location::Host);
        assert!(t.check_map(8, 8, 8).is_err(), "overlap");
        assert!(t.check_map(20, 8, 4).is_err(), "overlap inside");
        assert!(t.check_map(60, 8, 4).is_err(), "past the end");
        assert!(t.check_map(25, 8, 8).is_err(), "not granular");
        assert_eq!(t.covering(0, 24, true, Access::None).unwrap(), vec![0, 16]);
        assert!(
            t.covering(0, 20, true, Access::None).is_err(),
            "ends inside a mapping"
        );
        assert_eq!(t.covering(4, 16, false, Access::None).unwrap(), vec![0, 16]);
        assert!(t.covering(4, 30, false, Access::None).is_err(), "gap");
        assert!(
            t.covering(0, 8, false, Access::Read).is_err(),
            "no access yet"
        );
        t.set_host_access(&[0], Access::Read);
        assert!(t.covering(0, 8, false, Access::Read).is_ok());
        assert!(t.covering(0, 8, false, Access::ReadWrite).is_err());
        assert_eq!(t.mapped_bytes(), 24);
        assert_eq!(
            t.placement_runs(4, 18),
            vec![(4, 12), (16, 6)],
            "split where the placement changes"
        );
        t.insert(24, 8, Location::Host);
        assert_eq!(
            t.placement_runs(16, 16),
            vec![(16, 16)],
            "equal placements merge"
        );
        t.remove(&[24]);
        t.remove(&[0, 16]);
        assert!(t.is_empty());
        assert!(t.check_range(0, 0).is_err() && t.check_range(usize::MAX, 2).is_err());
    }
}
