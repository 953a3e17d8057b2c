//! [`GrowableBuffer`]: reserve once, map as it grows, never move.
#![deny(unsafe_code)]

use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::location::{Access, AccessDesc, Location};
use crate::plan::{round_up, GrowthPolicy};
use crate::pool::ChunkPool;
use crate::stats::{ChunkInfo, Report, Stats};

/// How to create a [`GrowableBuffer`].
///
/// ```
/// use vmmbuf::{BufferDesc, GrowthPolicy};
/// let desc = BufferDesc::new(1 << 30).growth(GrowthPolicy::Exact);
/// assert_eq!(desc.max_bytes, 1 << 30);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct BufferDesc {
    /// Bytes of address space to reserve, rounded up to the granularity. The
    /// buffer can never grow past it. Costs no physical memory.
    pub max_bytes: usize,
    /// Where new chunks are placed; `None` for the backend's home (its GPU,
    /// or the host for the host backend).
    pub placement: Option<Location>,
    /// How chunk sizes follow the buffer's size.
    pub growth: GrowthPolicy,
    /// The access that the placement's device (and the host, for host-placed
    /// chunks) gets to every new chunk.
    pub access: Access,
    /// Alignment of the sub-ranges [`GrowableBuffer::claim`] hands out: a power
    /// of two, 256 by default (what cuBLAS, cuDNN and vectorised kernels want).
    pub alignment: usize,
}

impl BufferDesc {
    /// A description reserving `max_bytes`, with the default growth policy,
    /// home placement and read-write access.
    pub fn new(max_bytes: usize) -> Self {
        Self {
            max_bytes,
            placement: None,
            growth: GrowthPolicy::default(),
            access: Access::ReadWrite,
            alignment: 256,
        }
    }

    /// Sets the alignment of sub-ranges handed out by `claim`.
    pub fn alignment(mut self, alignment: usize) -> Self {
        self.alignment = alignment;
        self
    }

    /// Sets the growth policy.
    pub fn growth(mut self, growth: GrowthPolicy) -> Self {
        self.growth = growth;
        self
    }

    /// Sets the placement of new chunks.
    pub fn placement(mut self, placement: Location) -> Self {
        self.placement = Some(placement);
        self
    }

    /// Sets the initial access to new chunks.
    pub fn access(mut self, access: Access) -> Self {
        self.access = access;
        self
    }
}

pub(crate) struct Entry<C> {
    pub(crate) chunk: C,
    pub(crate) offset: usize,
    pub(crate) bytes: usize,
    pub(crate) placement: Location,
    pub(crate) access: Arc<[AccessDesc]>,
}

/// A deferred release: chunks wholly past `high_water` (the most bytes in
/// use since the fence was given) may go once `fence` has passed.
struct Pending<F> {
    fence: F,
    high_water: usize,
}

pub(crate) struct Inner<B: Backend> {
    /// `None` only while the buffer drops.
    pub(crate) res: Option<B::Reservation>,
    /// Mapped chunks in address order; they tile `[0, capacity)`.
    pub(crate) chunks: Vec<Entry<B::Chunk>>,
    pub(crate) len: usize,
    pub(crate) capacity: usize,
    pub(crate) stats: Stats,
    pending: Vec<Pending<B::Fence>>,
}

impl<B: Backend> Inner<B> {
    pub(crate) fn res(&mut self) -> &mut B::Reservation {
        self.res.as_mut().expect("the reservation lives until drop")
    }
}

/// A byte buffer in GPU (or host) memory that grows in place.
///
/// # Guarantees
/// - **The base never moves.** [`base`](Self::base) returns the same address
///   for the buffer's whole life. Growing maps new physical chunks after the
///   existing ones in an address range reserved once at creation; no byte is
///   ever copied, and every pointer into the buffer stays valid while the
///   bytes it points to are in use.
/// - **Growing is `&self`.** [`grow_to`](Self::grow_to) takes a shared
///   reference (calls are serialised by a lock), so many threads can grow one
///   buffer while others read `base()`/`len()` or use existing bytes: growth
///   never touches mapped memory. Everything that unmaps or shrinks
///   ([`truncate`](Self::truncate), [`shrink_to`](Self::shrink_to),
///   [`trim`](Self::trim), drop) takes `&mut self`.
/// - **Growth is all or nothing.** If any driver call fails (out of memory
///   included), everything the call did is undone: the length, the data and
///   the chunks are as before, and nothing leaks.
/// - **Unmapping waits for the GPU.** `cuMemUnmap` does not wait for kernels,
///   so trim and drop synchronise the device before unmapping.
/// - Growing past the reservation is [`Error::ReservationExhausted`], never a
///   silent move.
///
/// The length (bytes in use) is at most the capacity (bytes mapped), which is
/// at most the reservation. New bytes are not zeroed by contract.
pub struct GrowableBuffer<B: Backend> {
    backend: Arc<B>,
    base: u64,
    reserved: usize,
    granularity: usize,
    policy: GrowthPolicy,
    /// Where new chunks go unless a range policy says otherwise.
    pub(crate) placement: Location,
    /// Placements for new chunks starting in these ranges (later entries win).
    pub(crate) range_placements: Vec<(std::ops::Range<usize>, Location)>,
    alignment: usize,
    /// Who gets which access to new chunks; a host entry applies to
    /// host-placed chunks only (the driver refuses it on device chunks).
    pub(crate) grants: Vec<AccessDesc>,
    pool: Option<Arc<ChunkPool<B>>>,
    pub(crate) inner: Mutex<Inner<B>>,
}

impl<B: Backend> std::fmt::Debug for GrowableBuffer<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrowableBuffer")
            .field("backend", &self.backend.name())
            .field("base", &format_args!("{:#x}", self.base))
            .field("stats", &self.stats())
            .finish()
    }
}

impl<B: Backend> GrowableBuffer<B> {
    /// Reserves the address range described by `desc`. No physical memory is
    /// mapped until the buffer grows.
    pub fn new(backend: Arc<B>, desc: BufferDesc) -> Result<Self> {
        Self::build(backend, desc, None)
    }

    /// Like [`new`](Self::new), in `pool`'s backend: growth takes pooled
    /// chunks before creating new ones, and trimmed chunks (and, at drop, all
    /// of them) go to the pool instead of back to the driver.
    pub fn with_pool(pool: &Arc<ChunkPool<B>>, desc: BufferDesc) -> Result<Self> {
        Self::build(pool.backend().clone(), desc, Some(pool.clone()))
    }

    fn build(backend: Arc<B>, desc: BufferDesc, pool: Option<Arc<ChunkPool<B>>>) -> Result<Self> {
        if desc.max_bytes == 0 {
            return Err(Error::invalid("max_bytes is 0"));
        }
        let placement = desc.placement.unwrap_or_else(|| backend.home());
        let granularity = backend.granularity(placement)?;
        let reserved = round_up(desc.max_bytes, granularity)
            .ok_or_else(|| Error::invalid(format!("max_bytes {} overflows", desc.max_bytes)))?;
        let policy = desc.growth.resolve(granularity)?;
        if !desc.alignment.is_power_of_two() || desc.alignment > granularity {
            return Err(Error::invalid(format!(
                "alignment {} is not a power of two up to the granularity {granularity}",
                desc.alignment
            )));
        }
        let mut grants = vec![AccessDesc::new(backend.home(), desc.access)];
        if backend.home() != Location::Host {
            grants.push(AccessDesc::new(Location::Host, desc.access));
        }
        let res = backend
            .reserve(reserved, granularity)
            .map_err(|e| match e {
                Error::ReservationExhausted { .. } => Error::ReservationExhausted {
                    requested_bytes: reserved,
                    reserved_bytes: 0,
                },
                e => e,
            })?;
        let base = backend.base(&res);
        tracing::debug!(
            backend = backend.name(),
            base,
            reserved,
            granularity,
            "vmmbuf: reserved"
        );
        Ok(Self {
            backend,
            base,
            reserved,
            granularity,
            policy,
            placement,
            range_placements: Vec::new(),
            alignment: desc.alignment,
            grants,
            pool,
            inner: Mutex::new(Inner {
                res: Some(res),
                chunks: Vec::new(),
                len: 0,
                capacity: 0,
                stats: Stats {
                    reserved_bytes: reserved,
                    ..Stats::default()
                },
                pending: Vec::new(),
            }),
        })
    }

    /// The first address of the buffer; the same for its whole life.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// Bytes in use.
    pub fn len(&self) -> usize {
        self.inner.lock().len
    }

    /// True when no bytes are in use.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes mapped (at least [`len`](Self::len)).
    pub fn capacity(&self) -> usize {
        self.inner.lock().capacity
    }

    /// Bytes of address space reserved: the most the buffer can ever hold.
    pub fn reserved(&self) -> usize {
        self.reserved
    }

    /// The backend's mapping granularity for this buffer's placement.
    pub fn granularity(&self) -> usize {
        self.granularity
    }

    /// Number of chunks mapped.
    pub fn chunks(&self) -> usize {
        self.inner.lock().chunks.len()
    }

    /// The growth policy in force (a fixed size already rounded).
    pub fn policy(&self) -> GrowthPolicy {
        self.policy
    }

    /// Where new chunks are placed (unless a range policy says otherwise).
    pub fn placement(&self) -> Location {
        self.placement
    }

    /// The backend this buffer lives in.
    pub fn backend(&self) -> &Arc<B> {
        &self.backend
    }

    /// The buffer's counters.
    pub fn stats(&self) -> Stats {
        Self::stats_of(&self.inner.lock())
    }

    fn stats_of(g: &Inner<B>) -> Stats {
        let host_bytes = g
            .chunks
            .iter()
            .filter(|e| e.placement == Location::Host)
            .map(|e| e.bytes)
            .sum();
        Stats {
            in_use_bytes: g.len,
            mapped_bytes: g.capacity,
            chunks: g.chunks.len(),
            host_bytes,
            device_bytes: g.capacity - host_bytes,
            ..g.stats
        }
    }

    /// Every chunk with its placement and access, and the counters.
    pub fn report(&self) -> Report {
        let g = self.inner.lock();
        Report {
            base: self.base,
            stats: Self::stats_of(&g),
            chunks: g
                .chunks
                .iter()
                .map(|e| ChunkInfo {
                    offset: e.offset,
                    bytes: e.bytes,
                    placement: e.placement,
                    access: e.access.iter().map(|d| (d.location, d.access)).collect(),
                })
                .collect(),
        }
    }

    /// Grows the length to `bytes`, mapping chunks as the policy says. Keeps
    /// every byte in use, never moves the base. A `bytes` at or below the
    /// length changes nothing (use [`truncate`](Self::truncate) to shrink).
    ///
    /// On error nothing has changed: [`Error::OutOfMemory`] is transient,
    /// [`Error::ReservationExhausted`] is not.
    pub fn grow_to(&self, bytes: usize) -> Result<()> {
        if bytes > self.reserved {
            return Err(Error::ReservationExhausted {
                requested_bytes: bytes,
                reserved_bytes: self.reserved,
            });
        }
        self.grow_locked(&mut self.inner.lock(), bytes)
    }

    /// Grows the length by `additional` bytes in one step under the lock and
    /// returns the offset where the new bytes start, so threads appending
    /// concurrently each get their own range. See [`grow_to`](Self::grow_to).
    pub fn grow_by(&self, additional: usize) -> Result<usize> {
        let mut g = self.inner.lock();
        let at = g.len;
        self.grow_at_locked(&mut g, at, additional)
    }

    /// Hands out a sub-range of `bytes` at the buffer's alignment (256 bytes
    /// unless [`BufferDesc::alignment`] says otherwise): pads the length up to
    /// the alignment, grows by `bytes`, and returns the sub-range's offset.
    /// One step under the lock, so concurrent claims never overlap. The
    /// address is `base() + offset`, aligned since the base is.
    pub fn claim(&self, bytes: usize) -> Result<usize> {
        let mut g = self.inner.lock();
        let at = round_up(g.len, self.alignment)
            .ok_or_else(|| Error::invalid(format!("aligning {} bytes overflows", g.len)))?;
        self.grow_at_locked(&mut g, at, bytes)
    }

    /// Grows the length to `at + bytes` (`at` at or past the length) and
    /// returns `at`.
    fn grow_at_locked(&self, g: &mut Inner<B>, at: usize, bytes: usize) -> Result<usize> {
        let target = at
            .checked_add(bytes)
            .ok_or_else(|| Error::invalid(format!("growing to {at} + {bytes} bytes overflows")))?;
        if target > self.reserved {
            return Err(Error::ReservationExhausted {
                requested_bytes: target,
                reserved_bytes: self.reserved,
            });
        }
        self.grow_locked(g, target)?;
        Ok(at)
    }

    fn grow_locked(&self, g: &mut Inner<B>, bytes: usize) -> Result<()> {
        if bytes <= g.len {
            return Ok(());
        }
        if bytes > g.capacity {
            let first = self.map_more(g, bytes);
            match first {
                // Out of memory with chunks idle in the pool: give them back
                // to the driver and try once more.
                Err(e)
                    if e.is_transient()
                        && self.pool.as_ref().is_some_and(|p| p.drain_for_oom()) =>
                {
                    tracing::debug!(error = %e, "vmmbuf: grow out of memory; drained the pool, retrying");
                    self.map_more(g, bytes)?
                }
                r => r?,
            }
        }
        g.len = bytes;
        for p in &mut g.pending {
            p.high_water = p.high_water.max(bytes);
        }
        if let Err(e) = self.reclaim_locked(g) {
            tracing::warn!(error = %e, "vmmbuf: deferred release failed; retried at the next trim or drop");
        }
        Ok(())
    }

    /// Maps chunks until the capacity reaches `bytes` (pooled chunks first,
    /// then new ones as the policy plans), all or nothing.
    fn map_more(&self, g: &mut Inner<B>, bytes: usize) -> Result<()> {
        let start = Instant::now();
        let span = tracing::debug_span!("vmmbuf.grow", from = g.len, to = bytes).entered();
        let backend = &*self.backend;
        let at = g.capacity;
        // (chunk, bytes, placement)
        let mut chunks: Vec<(B::Chunk, usize, Location)> = Vec::new();
        let mut end = at;
        if let Some(pool) = &self.pool {
            while end < bytes {
                let room = self.reserved - end;
                let need = round_up(bytes - end, self.granularity).map_or(room, |n| n.min(room));
                // The biggest chunk that keeps over-commit within the policy's bound.
                let fit = (bytes - end + self.policy.overcommit_bound(self.granularity, bytes) - 1)
                    / self.granularity
                    * self.granularity;
                let exact = match self.policy {
                    GrowthPolicy::Exact => Some(self.granularity),
                    GrowthPolicy::Fixed { chunk_bytes } if chunk_bytes <= room => Some(chunk_bytes),
                    GrowthPolicy::Fixed { .. } => break,
                    _ => None,
                };
                let place = self.placement_at(end);
                let Some((chunk, size)) = pool.take(place, exact, need, fit.min(room)) else {
                    break;
                };
                chunks.push((chunk, size, place));
                end += size;
            }
        }
        let reused = chunks.len();
        let mut mapped = 0usize;
        let attempt = (|| {
            for size in self
                .policy
                .plan(self.granularity, end, bytes, self.reserved)?
            {
                let place = self.placement_at(end);
                chunks.push((backend.create(size, place)?, size, place));
                end += size;
            }
            for (chunk, size, _) in &chunks {
                backend.map(g.res(), at + mapped, chunk)?;
                mapped += size;
            }
            // One access call per run of chunks with the same placement.
            let mut run_at = at;
            for run in chunks.chunk_by(|a, b| a.2 == b.2) {
                let run_bytes: usize = run.iter().map(|c| c.1).sum();
                backend.set_access(g.res(), run_at, run_bytes, &self.access_for(run[0].2))?;
                run_at += run_bytes;
            }
            Ok(())
        })();
        if let Err(e) = attempt {
            // Undo in reverse. Nothing can have used the new chunks: they never
            // got access, so unmapping them needs no wait.
            if mapped > 0 {
                if let Err(u) = backend.unmap(g.res(), at, mapped) {
                    tracing::error!(error = %u, "vmmbuf: undoing a failed grow: unmap failed");
                }
            }
            for (chunk, size, place) in chunks {
                let _ = self.dispose(chunk, size, place); // logged inside
            }
            tracing::debug!(error = %e, "vmmbuf: grow failed and was undone");
            return Err(e);
        }
        let n = chunks.len();
        let mut offset = at;
        for (chunk, bytes, placement) in chunks {
            g.chunks.push(Entry {
                chunk,
                offset,
                bytes,
                placement,
                access: self.access_for(placement),
            });
            offset += bytes;
        }
        g.capacity = end;
        g.stats.grows += 1;
        g.stats.chunks_mapped_total += n as u64;
        g.stats.peak_mapped_bytes = g.stats.peak_mapped_bytes.max(g.capacity);
        tracing::debug!(
            parent: &span,
            chunks = n,
            from_pool = reused,
            bytes = end - at,
            elapsed_us = start.elapsed().as_micros() as u64,
            "vmmbuf: grew"
        );
        Ok(())
    }

    /// The pool this buffer takes chunks from and gives them to, if any.
    pub(crate) fn pool(&self) -> Option<&Arc<ChunkPool<B>>> {
        self.pool.as_ref()
    }

    /// Where a new chunk starting at `offset` goes.
    pub(crate) fn placement_at(&self, offset: usize) -> Location {
        self.range_placements
            .iter()
            .rev()
            .find(|(r, _)| r.contains(&offset))
            .map_or(self.placement, |&(_, l)| l)
    }

    /// The access list of a chunk placed at `placement`.
    pub(crate) fn access_for(&self, placement: Location) -> Arc<[AccessDesc]> {
        self.grants
            .iter()
            .filter(|d| d.location != Location::Host || placement == Location::Host)
            .copied()
            .collect()
    }

    /// Gives an unmapped chunk to the pool, or back to the driver.
    pub(crate) fn dispose(&self, chunk: B::Chunk, bytes: usize, placement: Location) -> Result<()> {
        match &self.pool {
            Some(pool) => {
                pool.put(placement, bytes, chunk);
                Ok(())
            }
            None => self.backend.release(chunk).inspect_err(|e| {
                tracing::error!(error = %e, "vmmbuf: releasing a chunk failed");
            }),
        }
    }

    /// Unmaps chunks `keep..` and gives them to the pool or the driver; with
    /// `wait`, synchronises the device first.
    fn release_tail(&self, g: &mut Inner<B>, keep: usize, wait: bool) -> Result<()> {
        if keep == g.chunks.len() {
            return Ok(());
        }
        let start = Instant::now();
        let from = g.chunks[keep].offset;
        let bytes = g.capacity - from;
        let _span = tracing::debug_span!("vmmbuf.trim", len = g.len, from, bytes, wait).entered();
        if wait {
            self.backend.synchronize()?;
        }
        self.backend.unmap(g.res(), from, bytes)?;
        let gone: Vec<_> = g.chunks.drain(keep..).collect();
        let released = gone.len();
        g.capacity = from;
        g.stats.trims += 1;
        g.stats.chunks_released_total += released as u64;
        let mut first_err = None;
        for e in gone {
            if let Err(err) = self.dispose(e.chunk, e.bytes, e.placement) {
                first_err.get_or_insert(err);
            }
        }
        tracing::debug!(
            chunks = released,
            bytes,
            elapsed_us = start.elapsed().as_micros() as u64,
            "vmmbuf: trimmed"
        );
        first_err.map_or(Ok(()), Err)
    }

    /// Releases chunks past the length whose fences have passed.
    fn reclaim_locked(&self, g: &mut Inner<B>) -> Result<()> {
        if g.pending.is_empty() {
            return Ok(());
        }
        let mut boundary: Option<usize> = None;
        let mut err = None;
        g.pending
            .retain(|p| match self.backend.fence_done(&p.fence) {
                Ok(true) => {
                    boundary = Some(boundary.map_or(p.high_water, |b| b.min(p.high_water)));
                    false
                }
                Ok(false) => true,
                Err(e) => {
                    err.get_or_insert(e);
                    true
                }
            });
        if let Some(b) = boundary {
            let keep = g.chunks.partition_point(|e| e.offset < b);
            self.release_tail(g, keep, false)?;
        }
        err.map_or(Ok(()), Err)
    }

    /// Reduces the length to `bytes`, keeping the chunks mapped for regrowth.
    /// [`Error::InvalidArgument`] if `bytes` is above the length.
    pub fn truncate(&mut self, bytes: usize) -> Result<()> {
        let g = self.inner.get_mut();
        if bytes > g.len {
            return Err(Error::invalid(format!(
                "cannot shrink {} bytes to {bytes}",
                g.len
            )));
        }
        if bytes < g.len {
            g.len = bytes;
            g.stats.shrinks += 1;
        }
        Ok(())
    }

    /// Sets the length to `bytes`: grows as [`grow_to`](Self::grow_to) or
    /// shrinks as [`truncate`](Self::truncate).
    pub fn resize(&mut self, bytes: usize) -> Result<()> {
        if bytes > self.inner.get_mut().len {
            self.grow_to(bytes)
        } else {
            self.truncate(bytes)
        }
    }

    /// Reduces the length to `bytes` and gives back every chunk that lies
    /// wholly past it: [`truncate`](Self::truncate), then [`trim`](Self::trim).
    pub fn shrink_to(&mut self, bytes: usize) -> Result<()> {
        self.truncate(bytes)?;
        self.trim()
    }

    /// Unmaps and releases every chunk that lies wholly past the length,
    /// after waiting for the GPU (the whole device: see
    /// [`shrink_to_after`](Self::shrink_to_after) for the version that waits
    /// on a stream instead). A chunk that holds any byte in use stays. Chunks
    /// go to the pool if the buffer has one.
    ///
    /// If the wait or the unmap fails, nothing has changed. If releasing a
    /// chunk fails, the buffer is trimmed all the same and the error is
    /// returned (the chunk's token retries and logs when it drops).
    pub fn trim(&mut self) -> Result<()> {
        let mut g = self.inner.lock();
        let keep = g.chunks.partition_point(|e| e.offset < g.len);
        self.release_tail(&mut g, keep, true)?;
        g.pending.clear();
        Ok(())
    }

    /// Reduces the length to `bytes` now and releases the chunks wholly past
    /// it once `fence` has passed, without blocking the host: stream-ordered
    /// release. The release happens in a later call that finds the fence done
    /// ([`grow_to`](Self::grow_to), [`reclaim`](Self::reclaim), this one), or
    /// at once in [`trim`](Self::trim) and drop, which wait.
    ///
    /// `fence` must come after all GPU work that uses bytes past `bytes` (for
    /// CUDA: record it with [`CudaBackend::fence`](crate::CudaBackend::fence)
    /// on the stream of that work, after joining any other streams into it).
    /// Growing again before the fence passes simply reuses the chunks still
    /// mapped; nothing that was in use since the fence is ever released.
    pub fn shrink_to_after(&mut self, bytes: usize, fence: B::Fence) -> Result<()> {
        self.truncate(bytes)?;
        let mut g = self.inner.lock();
        if g.chunks.last().is_some_and(|e| e.offset >= bytes) {
            g.pending.push(Pending {
                fence,
                high_water: bytes,
            });
        }
        self.reclaim_locked(&mut g)
    }

    /// Releases what earlier [`shrink_to_after`](Self::shrink_to_after) calls
    /// deferred, where their fences have passed. Never blocks on the GPU.
    pub fn reclaim(&self) -> Result<()> {
        self.reclaim_locked(&mut self.inner.lock())
    }

    fn check_span(&self, len: usize, offset: usize, n: usize) -> Result<()> {
        match offset.checked_add(n) {
            Some(end) if end <= len => Ok(()),
            _ => Err(Error::invalid(format!(
                "bytes {offset}+{n} are outside the {len} bytes in use"
            ))),
        }
    }

    /// Copies bytes in use, from `offset`, into `dst`.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        let mut g = self.inner.lock();
        self.check_span(g.len, offset, dst.len())?;
        self.backend.read(g.res(), offset, dst)
    }

    /// Copies `src` into the bytes in use, from `offset`.
    pub fn write(&mut self, offset: usize, src: &[u8]) -> Result<()> {
        let backend = self.backend.clone();
        let len = self.inner.get_mut().len;
        self.check_span(len, offset, src.len())?;
        backend.write(self.inner.get_mut().res(), offset, src)
    }

    /// The base and length, if every chunk in use grants the host `need`.
    pub(crate) fn host_view(&self, need: Access) -> Result<(u64, usize)> {
        let len = self.len();
        self.check_access(Location::Host, need, 0, len)?;
        Ok((self.base, len))
    }

    /// Checks that `[offset, offset + bytes)` is in use and that every chunk
    /// it touches grants `who` at least `need`.
    pub(crate) fn check_access(
        &self,
        who: Location,
        need: Access,
        offset: usize,
        bytes: usize,
    ) -> Result<()> {
        let g = self.inner.lock();
        self.check_span(g.len, offset, bytes)?;
        let end = offset + bytes;
        for e in g
            .chunks
            .iter()
            .filter(|e| e.offset < end && e.offset + e.bytes > offset)
        {
            let has = e
                .access
                .iter()
                .find(|d| d.location == who)
                .map_or(Access::None, |d| d.access);
            if has < need {
                return Err(Error::invalid(format!(
                    "the chunk at {:#x} grants {who} {has:?} access, {need:?} is needed",
                    e.offset
                )));
            }
        }
        Ok(())
    }
}

impl<B: Backend> Drop for GrowableBuffer<B> {
    fn drop(&mut self) {
        let backend = self.backend.clone();
        let g = self.inner.get_mut();
        let Some(mut res) = g.res.take() else { return };
        if !g.chunks.is_empty() {
            // Kernels may still use the memory: wait before unmapping.
            if let Err(e) = backend.synchronize() {
                tracing::error!(error = %e, "vmmbuf: synchronize before drop failed");
            }
            if let Err(e) = backend.unmap(&mut res, 0, g.capacity) {
                tracing::error!(error = %e, "vmmbuf: unmap in drop failed");
            }
            for e in std::mem::take(&mut g.chunks) {
                // Logged inside.
                let _ = self.dispose(e.chunk, e.bytes, e.placement);
            }
        }
        if let Err(e) = backend.free(res) {
            tracing::error!(error = %e, "vmmbuf: freeing the reservation in drop failed");
        }
    }
}
