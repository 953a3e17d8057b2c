//! The table's questions: which chunks overlap or cover a range, where
//! runs, holes and gaps lie, its statistics and report, and `check`, the
//! invariants every edit keeps.

use super::*;

impl<C> ChunkTable<C> {
    /// The chunks that share at least one byte with `range`, in address order.
    pub(crate) fn overlapping(
        &self,
        range: Range<usize>,
    ) -> impl Iterator<Item = (usize, &Entry<C>)> + '_ {
        let first = self.first_touching(range.start);
        self.entries
            .range(first..range.end.max(first))
            .map(|(&o, e)| (o, e))
            .filter(move |(o, e)| o + e.bytes > range.start && *o < range.end)
    }

    /// Whether a chunk starts at `offset`.
    pub(crate) fn starts_at(&self, offset: usize) -> bool {
        self.entries.contains_key(&offset)
    }

    /// The first offset strictly between `start` and `end` where a chunk
    /// starts.
    pub(crate) fn start_between(&self, start: usize, end: usize) -> Option<usize> {
        if end <= start.saturating_add(1) {
            return None;
        }
        self.entries.range(start + 1..end).next().map(|(&o, _)| o)
    }

    /// The chunk holding `offset`, as `(its offset, its bytes)`: one search.
    pub(crate) fn chunk_at(&self, offset: usize) -> Option<(usize, usize)> {
        let Some(index) = &self.index else {
            return self.chunk_at_searched(offset);
        };
        let shift = self.granularity.trailing_zeros();
        let found = match index.get(offset >> shift) {
            None | Some(0) => None,
            Some(&w) => Some((
                ((w & 0xffff_ffff) as usize - 1) << shift,
                ((w >> 32) as usize) << shift,
            )),
        };
        debug_assert_eq!(found, self.chunk_at_searched(offset), "the flat index");
        found
    }

    /// [`chunk_at`](Self::chunk_at) by a search of the tree.
    fn chunk_at_searched(&self, offset: usize) -> Option<(usize, usize)> {
        match self.entries.range(..=offset).next_back() {
            Some((&k, e)) if k + e.bytes > offset => Some((k, e.bytes)),
            _ => None,
        }
    }

    /// The key from which chunks may touch `offset`: the chunk holding it if
    /// any, else `offset`.
    fn first_touching(&self, offset: usize) -> usize {
        match self.entries.range(..=offset).next_back() {
            Some((&k, e)) if k + e.bytes > offset => k,
            _ => offset,
        }
    }

    /// Offsets of the chunks that together cover `[offset, offset + bytes)`
    /// without a gap; with `exact`, the range must also start and end on
    /// chunk boundaries (what an unmap or an access change needs).
    pub(crate) fn covering(&self, offset: usize, bytes: usize, exact: bool) -> Result<Vec<usize>> {
        self.check_range(offset, bytes)?;
        let end = offset + bytes;
        let mut at = self.first_touching(offset);
        if !self.entries.contains_key(&at) || (exact && at != offset) {
            return Err(Error::invalid(format!(
                "{offset:#x} is not {}",
                if exact { "a chunk's start" } else { "mapped" }
            )));
        }
        let mut keys = Vec::new();
        while at < end {
            match self.entries.get(&at) {
                Some(e) => {
                    keys.push(at);
                    at += e.bytes;
                }
                None => return Err(Error::invalid(format!("{at:#x} is not mapped"))),
            }
        }
        if exact && at != end {
            return Err(Error::invalid(format!("{end:#x} falls inside a chunk")));
        }
        Ok(keys)
    }

    /// Checks that every chunk touching `[offset, offset + bytes)` grants
    /// `who` at least `need`.
    pub(crate) fn check_access(
        &self,
        offset: usize,
        bytes: usize,
        who: Location,
        need: Access,
    ) -> Result<()> {
        let end = offset.saturating_add(bytes);
        match self
            .overlapping(offset..end)
            .find(|(_, e)| e.access_of(who) < need)
        {
            Some((k, e)) => Err(Error::invalid(format!(
                "the chunk at {k:#x} grants {who} {:?} access, {need:?} is needed",
                e.access_of(who)
            ))),
            None => Ok(()),
        }
    }

    /// Splits a mapped range into runs of chunks with the same placement:
    /// `(offset, bytes, placement)` each, clipped to the range.
    pub(crate) fn placement_runs(
        &self,
        offset: usize,
        bytes: usize,
    ) -> Vec<(usize, usize, Location)> {
        let end = offset.saturating_add(bytes);
        let mut runs: Vec<(usize, usize, Location)> = Vec::new();
        for (k, e) in self.overlapping(offset..end) {
            let (a, b) = (k.max(offset), (k + e.bytes).min(end));
            match runs.last_mut() {
                Some(r) if r.2 == e.placement && r.0 + r.1 == a => r.1 += b - a,
                _ => runs.push((a, b - a, e.placement)),
            }
        }
        runs
    }

    /// The mapped runs `(offset, bytes)`: adjacent chunks joined, in address
    /// order (a buffer's chunks make one run).
    pub(crate) fn runs(&self) -> Vec<(usize, usize)> {
        self.runs_without(|_, _| false)
    }

    /// The mapped runs, as [`runs`](Self::runs), of the chunks `skip` does
    /// not name (a skipped chunk ends a run).
    pub(crate) fn runs_without(
        &self,
        skip: impl Fn(usize, &Entry<C>) -> bool,
    ) -> Vec<(usize, usize)> {
        let mut runs: Vec<(usize, usize)> = Vec::new();
        for (o, e) in self.iter().filter(|&(o, e)| !skip(o, e)) {
            match runs.last_mut() {
                Some(r) if r.0 + r.1 == o => r.1 += e.bytes,
                _ => runs.push((o, e.bytes)),
            }
        }
        runs
    }

    /// The unmapped gaps below the span's end, in address order.
    pub(crate) fn holes(&self) -> Vec<Range<usize>> {
        self.gaps(0..self.span_end())
    }

    /// The unmapped gaps within `range` (clipped to it), in address order:
    /// where an allocator that unmaps in the middle can map next (the arena
    /// takes the lowest one its request fits).
    pub(crate) fn gaps(&self, range: Range<usize>) -> Vec<Range<usize>> {
        let mut gaps = Vec::new();
        let mut at = range.start;
        for (o, e) in self.overlapping(range.clone()) {
            if o > at {
                gaps.push(at..o);
            }
            at = at.max(o + e.bytes);
        }
        if at < range.end {
            gaps.push(at..range.end);
        }
        gaps
    }

    /// Figures derived from the entries.
    pub(crate) fn stats(&self) -> TableStats {
        TableStats {
            chunks: self.entries.len(),
            mapped_bytes: self.mapped_bytes,
            host_bytes: self.host_bytes,
            span_bytes: self.span_end(),
            holes: self.holes().len(),
        }
    }

    /// Every chunk as plain data.
    pub(crate) fn report(&self) -> Vec<ChunkInfo> {
        self.iter()
            .map(|(offset, e)| ChunkInfo {
                offset,
                bytes: e.bytes,
                placement: e.placement,
                // What the chunk grants: a host-placed chunk's CPU entry is
                // given to the driver on the first CPU view, not before.
                access: crate::location::driver_access(&e.access, e.placement)
                    .iter()
                    .map(|d| (d.location, d.access))
                    .collect(),
            })
            .collect()
    }

    /// Checks every invariant; the tests call it after each operation.
    pub(crate) fn check(&self) -> std::result::Result<(), String> {
        let mut end = 0usize;
        let (mut mapped, mut host) = (0usize, 0usize);
        for (&o, e) in &self.entries {
            if o < end {
                return Err(format!("the chunk at {o:#x} overlaps the one before"));
            }
            if e.bytes == 0 || o % self.granularity != 0 || e.bytes % self.granularity != 0 {
                return Err(format!(
                    "the chunk at {o:#x} of {:#x} bytes is not granular",
                    e.bytes
                ));
            }
            end = o
                .checked_add(e.bytes)
                .filter(|&x| x <= self.reserved)
                .ok_or_else(|| format!("the chunk at {o:#x} passes the reservation"))?;
            mapped += e.bytes;
            if e.placement == Location::Host {
                host += e.bytes;
            }
        }
        if mapped != self.mapped_bytes || host != self.host_bytes {
            return Err(format!(
                "counters say {:#x} mapped, {:#x} on the host; the entries {mapped:#x}, {host:#x}",
                self.mapped_bytes, self.host_bytes
            ));
        }
        if self.len > self.mapped_prefix() {
            return Err(format!(
                "length {:#x} passes the mapped prefix {:#x}",
                self.len,
                self.mapped_prefix()
            ));
        }
        if let Some(index) = &self.index {
            let shift = self.granularity.trailing_zeros();
            let mut at = 0;
            for (&o, e) in &self.entries {
                let (g, n) = (o >> shift, e.bytes >> shift);
                let word = index_word(g, n);
                if index[at..g].iter().any(|&w| w != 0) {
                    return Err(format!("the flat index maps a hole before {o:#x}"));
                }
                if index[g..g + n].iter().any(|&w| w != word) {
                    return Err(format!("the flat index is wrong over the chunk at {o:#x}"));
                }
                at = g + n;
            }
            if index[at..].iter().any(|&w| w != 0) {
                return Err("the flat index maps a hole at the end".into());
            }
        }
        Ok(())
    }
}
