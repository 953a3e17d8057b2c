//! The chunk table: which physical chunks are mapped where in one reservation.
//!
//! Pure, safe bookkeeping, generic over the chunk token `C` (a backend's chunk
//! for a buffer, `()` inside a backend's reservation token and in the tests).
//! Entries are keyed by offset and may leave unmapped holes between them (a
//! range mapped, a hole, a range mapped), as an arena that unmaps free chunks
//! in the middle of its reservation needs. Every question "which chunks touch
//! this range" is answered here, once.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::location::{driver_access_for, Access, AccessDesc, Location};
use crate::report::ChunkInfo;

mod query;

/// One mapped chunk.
#[derive(Debug)]
pub(crate) struct Entry<C> {
    /// The chunk's token.
    pub(crate) chunk: C,
    /// Its size in bytes (a multiple of the table's granularity).
    pub(crate) bytes: usize,
    /// Where its physical memory lives.
    pub(crate) placement: Location,
    /// Who may touch it, and how (exactly what the driver was told, but
    /// see `cpu`).
    pub(crate) access: Arc<[AccessDesc]>,
    /// Whether the driver was given the host's entry of `access` too, for a
    /// chunk placed in host memory. Migration to the host leaves it out (a
    /// host descriptor costs ~40 ms per GiB to set, and only CPU pointers
    /// need it); a CPU view grants it first.
    pub(crate) cpu: bool,
}

impl<C> Entry<C> {
    /// A chunk with no access granted yet (as every fresh mapping starts).
    pub(crate) fn new(chunk: C, bytes: usize, placement: Location) -> Self {
        Self {
            chunk,
            bytes,
            placement,
            access: Arc::from([]),
            cpu: true,
        }
    }

    /// What `who` may do with this chunk. The host can touch only chunks
    /// placed in host memory, whatever the list says.
    pub(crate) fn access_of(&self, who: Location) -> Access {
        if who == Location::Host && self.placement != Location::Host {
            return Access::None;
        }
        self.access
            .iter()
            .find(|d| d.location == who)
            .map_or(Access::None, |d| d.access)
    }

    /// The access list the driver gets for this chunk: a list may name the
    /// host for any chunk (what it gets once the chunk is in host memory),
    /// but the driver takes a host entry only on host-placed chunks.
    pub(crate) fn driver_access(&self) -> Vec<AccessDesc> {
        driver_access_for(&self.access, self.placement, self.cpu)
    }
}

/// Derived figures of a table, as plain data.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct TableStats {
    pub(crate) chunks: usize,
    pub(crate) mapped_bytes: usize,
    pub(crate) host_bytes: usize,
    /// End of the last chunk: mapped bytes plus holes.
    pub(crate) span_bytes: usize,
    /// Unmapped gaps below the span's end.
    pub(crate) holes: usize,
}

/// The chunks mapped in one reservation of `reserved` bytes, and the length
/// in use: `[0, len)` is always mapped without a hole.
#[derive(Debug)]
pub(crate) struct ChunkTable<C> {
    reserved: usize,
    granularity: usize,
    entries: BTreeMap<usize, Entry<C>>,
    /// Per granule of the reservation, the chunk over it: `0` for none,
    /// else its first granule plus one, and its length in granules in the
    /// high half. `chunk_at` reads one word instead of searching the tree
    /// (an allocator call asks it at both ends of its range: with cold
    /// caches a tree search is a handful of misses). Kept only for up to
    /// [`INDEX_MAX`] granules; larger tables search.
    index: Option<Vec<u64>>,
    len: usize,
    mapped_bytes: usize,
    host_bytes: usize,
}

/// The most granules a table keeps a flat index for: 16 MiB of words at
/// most, touched only where chunks are mapped (a 1 TiB reservation at
/// 2 MiB granularity is 512 Ki granules).
const INDEX_MAX: usize = 1 << 21;

/// The flat index's word for a granule of the chunk that starts at granule
/// `g` and spans `n`: `g + 1` in the low half (0 means no chunk), `n` in
/// the high half. Both fit in 32 bits: an index has at most [`INDEX_MAX`]
/// granules.
fn index_word(g: usize, n: usize) -> u64 {
    (g as u64 + 1) | ((n as u64) << 32)
}

impl<C> ChunkTable<C> {
    /// An empty table over a reservation of `reserved` bytes whose chunks are
    /// multiples of `granularity` (a power of two dividing `reserved`).
    pub(crate) fn new(reserved: usize, granularity: usize) -> Result<Self> {
        if !granularity.is_power_of_two() || !reserved.is_multiple_of(granularity) {
            return Err(Error::invalid(format!(
                "a table of {reserved} bytes with granularity {granularity}"
            )));
        }
        let granules = reserved / granularity;
        Ok(Self {
            reserved,
            granularity,
            entries: BTreeMap::new(),
            index: (granules <= INDEX_MAX).then(|| vec![0u64; granules]),
            len: 0,
            mapped_bytes: 0,
            host_bytes: 0,
        })
    }

    pub(crate) fn reserved(&self) -> usize {
        self.reserved
    }

    /// Bytes in use: `[0, len)` is mapped without a hole.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Bytes mapped in host memory (constant time).
    pub(crate) fn host_bytes(&self) -> usize {
        self.host_bytes
    }

    /// Bytes mapped (constant time).
    pub(crate) fn mapped_bytes(&self) -> usize {
        self.mapped_bytes
    }

    pub(crate) fn chunk_count(&self) -> usize {
        self.entries.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The end of the last chunk (0 when empty).
    pub(crate) fn span_end(&self) -> usize {
        self.entries
            .last_key_value()
            .map_or(0, |(&o, e)| o + e.bytes)
    }

    /// The end of the mapped prefix: the first byte from 0 that is not mapped.
    pub(crate) fn mapped_prefix(&self) -> usize {
        let mut at = 0;
        for (&o, e) in &self.entries {
            if o != at {
                break;
            }
            at += e.bytes;
        }
        at
    }

    /// Every chunk in address order.
    pub(crate) fn iter(&self) -> impl DoubleEndedIterator<Item = (usize, &Entry<C>)> + '_ {
        self.entries.iter().map(|(&o, e)| (o, e))
    }

    pub(crate) fn get(&self, offset: usize) -> Option<&Entry<C>> {
        self.entries.get(&offset)
    }

    pub(crate) fn get_mut(&mut self, offset: usize) -> Option<&mut Entry<C>> {
        self.entries.get_mut(&offset)
    }

    /// Checks that `[offset, offset + bytes)` is a non-empty range inside the
    /// reservation.
    pub(crate) fn check_range(&self, offset: usize, bytes: usize) -> Result<()> {
        match offset.checked_add(bytes) {
            Some(end) if bytes > 0 && end <= self.reserved => Ok(()),
            _ => Err(Error::invalid(format!(
                "range {offset:#x}+{bytes:#x} is empty or outside the {:#x}-byte reservation",
                self.reserved
            ))),
        }
    }

    /// Checks that a chunk of `bytes` can be mapped at `offset`: inside the
    /// reservation, granular, over no other chunk.
    pub(crate) fn check_insert(&self, offset: usize, bytes: usize) -> Result<()> {
        self.check_range(offset, bytes)?;
        if !offset.is_multiple_of(self.granularity) || !bytes.is_multiple_of(self.granularity) {
            return Err(Error::invalid(format!(
                "a chunk of {bytes:#x} bytes at {offset:#x} is not a multiple of the granularity {:#x}",
                self.granularity
            )));
        }
        if let Some((k, _)) = self.overlapping(offset..offset + bytes).next() {
            return Err(Error::invalid(format!(
                "{offset:#x}+{bytes:#x} overlaps the chunk at {k:#x}"
            )));
        }
        Ok(())
    }

    /// Records a chunk mapped at `offset` (see [`check_insert`](Self::check_insert)).
    pub(crate) fn insert(&mut self, offset: usize, entry: Entry<C>) -> Result<()> {
        self.check_insert(offset, entry.bytes)?;
        self.mapped_bytes += entry.bytes;
        if entry.placement == Location::Host {
            self.host_bytes += entry.bytes;
        }
        self.index_set(offset, entry.bytes, true);
        self.entries.insert(offset, entry);
        Ok(())
    }

    /// Marks the granules of the chunk `[offset, offset + bytes)` in the
    /// flat index as its (`mapped`) or as no chunk's.
    fn index_set(&mut self, offset: usize, bytes: usize, mapped: bool) {
        let shift = self.granularity.trailing_zeros();
        let Some(index) = self.index.as_mut() else {
            return;
        };
        let (g, n) = (offset >> shift, bytes >> shift);
        index[g..g + n].fill(if mapped { index_word(g, n) } else { 0 });
    }

    /// Forgets every chunk that starts at or past `from` (none of them may
    /// hold bytes in use), in address order.
    pub(crate) fn split_off(&mut self, from: usize) -> Vec<(usize, Entry<C>)> {
        let offsets: Vec<usize> = self.entries.range(from..).map(|(&o, _)| o).collect();
        offsets
            .into_iter()
            .filter_map(|o| self.remove(o).map(|e| (o, e)))
            .collect()
    }

    /// Forgets the chunk at `offset`. Refused (`None`) while it holds bytes
    /// in use.
    pub(crate) fn remove(&mut self, offset: usize) -> Option<Entry<C>> {
        if offset < self.len {
            return None;
        }
        let e = self.entries.remove(&offset)?;
        self.index_set(offset, e.bytes, false);
        self.mapped_bytes -= e.bytes;
        if e.placement == Location::Host {
            self.host_bytes -= e.bytes;
        }
        Some(e)
    }

    /// Replaces the chunks that tile `[offset, offset + bytes)` with `new`
    /// (entries that tile the same range, mapped there now) and returns the
    /// old ones. The range stays mapped, so the length in use stands (a
    /// migration may regroup chunks under it). The caller has checked that
    /// both tile the range exactly.
    pub(crate) fn replace(
        &mut self,
        offset: usize,
        bytes: usize,
        new: Vec<(usize, Entry<C>)>,
    ) -> Vec<(usize, Entry<C>)> {
        let keys: Vec<usize> = self
            .overlapping(offset..offset + bytes)
            .map(|(o, _)| o)
            .collect();
        let mut old = Vec::with_capacity(keys.len());
        for k in keys {
            let e = self.entries.remove(&k).expect("listed");
            self.index_set(k, e.bytes, false);
            self.mapped_bytes -= e.bytes;
            if e.placement == Location::Host {
                self.host_bytes -= e.bytes;
            }
            old.push((k, e));
        }
        for (o, e) in new {
            self.index_set(o, e.bytes, true);
            self.mapped_bytes += e.bytes;
            if e.placement == Location::Host {
                self.host_bytes += e.bytes;
            }
            self.entries.insert(o, e);
        }
        old
    }

    /// Sets where the chunk at `offset` lives, keeping the counters right.
    #[cfg(test)]
    pub(crate) fn set_placement(&mut self, offset: usize, placement: Location) {
        let Some(e) = self.entries.get_mut(&offset) else {
            return;
        };
        if e.placement == Location::Host {
            self.host_bytes -= e.bytes;
        }
        if placement == Location::Host {
            self.host_bytes += e.bytes;
        }
        e.placement = placement;
    }

    /// Records that the chunks at `keys` now grant exactly `access`.
    pub(crate) fn set_access(&mut self, keys: &[usize], access: &[AccessDesc]) {
        let list: Arc<[AccessDesc]> = access.into();
        for k in keys {
            if let Some(e) = self.entries.get_mut(k) {
                e.access = list.clone();
                e.cpu = true;
            }
        }
    }

    /// Records the chunk at `offset` as granting `access` (what it
    /// records, host entry included) with the host's entry given to the
    /// driver only if `cpu`: after a backend's `set_access` with the
    /// driver's list, which records that list as if the host's entry were
    /// given.
    pub(crate) fn record_access(&mut self, offset: usize, access: Arc<[AccessDesc]>, cpu: bool) {
        if let Some(e) = self.entries.get_mut(&offset) {
            e.access = access;
            e.cpu = cpu;
        }
    }

    /// Checks that `[offset, offset + n)` lies within the bytes in use.
    pub(crate) fn check_in_use(&self, offset: usize, n: usize) -> Result<()> {
        match offset.checked_add(n) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::invalid(format!(
                "bytes {offset}+{n} are outside the {} bytes in use",
                self.len
            ))),
        }
    }

    /// Sets the length in use. [`Error::InvalidArgument`] unless `[0, len)`
    /// is mapped without a hole.
    pub(crate) fn set_len(&mut self, len: usize) -> Result<()> {
        if len > self.mapped_prefix() {
            return Err(Error::invalid(format!(
                "length {len:#x} is past the mapped prefix {:#x}",
                self.mapped_prefix()
            )));
        }
        self.len = len;
        Ok(())
    }
}

#[cfg(test)]
mod tests;
