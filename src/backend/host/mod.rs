//! The host backend: the operating system's own virtual memory (Linux).
//!
//! Real mappings, not a simulation: a reservation is `mmap(PROT_NONE)` of
//! private anonymous memory with `MAP_NORESERVE`; a chunk is a `memfd`; mapping
//! is `mmap(MAP_FIXED | MAP_SHARED)` of the memfd over the reservation; access
//! flags are `mprotect`; unmapping puts a `PROT_NONE` placeholder back so the
//! range stays reserved. Each token tracks what is mapped in it, so every call
//! is checked against the token's own bookkeeping before it touches memory.
#![allow(unsafe_code)]

use std::os::fd::OwnedFd;
use std::ptr::NonNull;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use rustix::mm::{MapFlags, MprotectFlags, ProtFlags};

use super::host_capture::HostCaptureState;
use super::host_lag::Clock;
pub use super::host_lag::HostFence;
use super::{Backend, Counters, LiveCounts};
use crate::error::{Error, Result};
use crate::location::{Access, AccessDesc, Location};
use crate::table::{ChunkTable, Entry};

mod memory;
use memory::{host_range, os, prot, reserve_error, MappedFlag};
pub use memory::{raise_fd_limit, HostChunk, HostReservation};

/// The host's virtual memory as a [`Backend`]. Places memory on [`Location::Host`]
/// only; access lists name [`Location::Host`] only.
#[derive(Debug)]
pub struct HostBackend {
    granularity: usize,
    counters: Arc<Counters>,
    /// Where its default pool lives (see [`Backend::pool_slot`]).
    pool_slot: super::PoolSlot,
    /// When its fences pass (at once unless made with
    /// [`with_fence_lag`](Self::with_fence_lag)).
    clock: Clock,
    /// Whether a chunk may be mapped at several addresses at once
    /// ([`mapping_chunks_twice`](Self::mapping_chunks_twice)).
    double_maps: bool,
    /// Simulated CUDA graph captures ([`begin_capture`](Self::begin_capture)).
    captures: super::host_capture::Captures,
}

impl HostBackend {
    /// A backend with the system page size as granularity.
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            granularity: rustix::param::page_size(),
            counters: Arc::default(),
            pool_slot: Default::default(),
            clock: Clock::default(),
            double_maps: false,
            captures: Default::default(),
        })
    }

    /// A backend with a coarser granularity, e.g. 2 MiB to behave like CUDA.
    /// It must be a power of two and a multiple of the page size.
    pub fn with_granularity(granularity: usize) -> Result<Arc<Self>> {
        Self::build(granularity, Clock::default(), false)
    }

    /// A backend of `granularity`, checked, with fences on `clock`, mapping
    /// a chunk at several addresses where `double_maps`.
    fn build(granularity: usize, clock: Clock, double_maps: bool) -> Result<Arc<Self>> {
        let page = rustix::param::page_size();
        if !granularity.is_power_of_two() || !granularity.is_multiple_of(page) {
            return Err(Error::invalid(format!(
                "host granularity {granularity} is not a power-of-two multiple of the page size {page}"
            )));
        }
        Ok(Arc::new(Self {
            granularity,
            counters: Arc::default(),
            pool_slot: Default::default(),
            clock,
            double_maps,
            captures: Default::default(),
        }))
    }

    /// A backend of `granularity` with fences passing `lag` ticks late (as
    /// [`with_fence_lag`](Self::with_fence_lag); 0: at once) that maps a
    /// chunk at several addresses at once, as CUDA does
    /// ([`Backend::maps_a_chunk_twice`]): every mapping shows the chunk's
    /// pages, and [`LiveCounts::mapped_bytes`] counts each. For an arena
    /// that moves free chunks ([`ArenaDesc::move_free_chunks`](crate::ArenaDesc::move_free_chunks))
    /// on the host, in tests and trace replays. Other host backends map a
    /// chunk once and refuse a second mapping.
    pub fn mapping_chunks_twice(granularity: usize, lag: u64) -> Result<Arc<Self>> {
        Self::build(granularity, Clock::new(lag), true)
    }

    /// A backend of `granularity` (as [`with_granularity`](Self::with_granularity))
    /// whose fences pass `lag` ticks of [`tick`](Self::tick) after they are
    /// made, as a GPU's work finishes some time after the CPU queued it: a
    /// replay that ticks once per event then sees frees whose fences have
    /// not passed, and waits and synchronisations, where a device would.
    /// A wait on a fence moves the clock on to it; a synchronisation, to
    /// the latest fence made. Fence queries are counted
    /// ([`LiveCounts::fence_queries`]).
    pub fn with_fence_lag(granularity: usize, lag: u64) -> Result<Arc<Self>> {
        Self::build(granularity, Clock::new(lag), false)
    }

    /// Advances the fences' clock by one tick (see
    /// [`with_fence_lag`](Self::with_fence_lag); without a lag, fences have
    /// passed already and this changes nothing they answer).
    pub fn tick(&self) {
        self.clock.tick();
    }

    /// A fence made now on the stream of `key`: refused while that stream
    /// is captured (which invalidates its capture, as recording an event
    /// on a captured stream makes a graph node no query sees pass).
    pub(crate) fn fence_on(&self, key: crate::StreamKey) -> Result<HostFence> {
        self.captures
            .refuse_on(key, "a fence on a captured stream")?;
        Ok(self.clock.fence(key))
    }

    /// Stream `key` starts being captured into a (simulated) CUDA graph:
    /// until [`end_capture`](Self::end_capture), what CUDA refuses during
    /// a capture fails here too and invalidates it (see the rules in
    /// [`HostCaptureState`]'s module): a device synchronisation, a fence
    /// on that stream, a synchronous copy. Refused if `key`
    /// is captured already.
    pub fn begin_capture(&self, key: crate::StreamKey) -> Result<()> {
        self.captures.begin(key)
    }

    /// Stream `key`'s capture ends; an error if a refused call invalidated
    /// it (CUDA's `cuStreamEndCapture` fails then) or none was under way.
    pub fn end_capture(&self, key: crate::StreamKey) -> Result<()> {
        self.captures.end(key)
    }

    /// Where stream `key` stands with capture.
    pub fn capture_state(&self, key: crate::StreamKey) -> HostCaptureState {
        self.captures.state(key)
    }

    fn check_host(&self, placement: Location) -> Result<()> {
        match placement {
            Location::Host => Ok(()),
            Location::Device(d) => Err(Error::Unsupported {
                what: format!("placement on gpu{d} with the host backend"),
            }),
        }
    }
}

impl Backend for HostBackend {
    type Reservation = HostReservation;
    type Chunk = HostChunk;
    type Fence = HostFence;

    fn name(&self) -> &'static str {
        "host"
    }

    fn home(&self) -> Location {
        Location::Host
    }

    fn granularity(&self, placement: Location) -> Result<usize> {
        self.check_host(placement)?;
        Ok(self.granularity)
    }

    fn reserve(&self, bytes: usize, align: usize) -> Result<HostReservation> {
        super::check_reserve(bytes, align, self.granularity)?;
        let table = ChunkTable::new(bytes, self.granularity)?;
        let page = rustix::param::page_size();
        let slack = if align > page { align } else { 0 };
        let total = bytes
            .checked_add(slack)
            .ok_or_else(|| Error::invalid(format!("reserving {bytes} bytes overflows")))?;
        // SAFETY: a fresh private PROT_NONE mapping at an address the kernel
        // picks cannot overlap anything the program uses.
        let raw = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                total,
                ProtFlags::empty(),
                MapFlags::PRIVATE | MapFlags::NORESERVE,
            )
        }
        .map_err(|e| reserve_error(e, total))?;
        let start = raw as usize;
        let aligned = start.next_multiple_of(align.max(page));
        let (head, tail) = (aligned - start, total - bytes - (aligned - start));
        // SAFETY: head and tail lie inside the mapping just made and outside the
        // part kept; nothing refers to them.
        unsafe {
            if head > 0 {
                let _ = rustix::mm::munmap(raw, head);
            }
            if tail > 0 {
                let _ = rustix::mm::munmap((aligned + bytes) as *mut _, tail);
            }
        }
        self.counters.update(|c| {
            c.reservations += 1;
            c.reserved_bytes += bytes;
        });
        Ok(HostReservation {
            base: NonNull::new(aligned as *mut u8).expect("mmap returned null"),
            table,
            counters: self.counters.clone(),
        })
    }

    fn base(&self, res: &HostReservation) -> u64 {
        res.base.as_ptr() as u64
    }

    fn free(&self, res: HostReservation) -> Result<()> {
        super::check_free(&res.table)?;
        drop(res);
        Ok(())
    }

    fn create(&self, bytes: usize, placement: Location) -> Result<HostChunk> {
        self.memfd_chunk(bytes, placement, false)
    }

    fn create_shareable(&self, bytes: usize, placement: Location) -> Result<HostChunk> {
        self.memfd_chunk(bytes, placement, true)
    }

    fn is_shareable(&self, chunk: &HostChunk) -> bool {
        chunk.sealed
    }

    fn export(&self, chunk: &HostChunk) -> Result<OwnedFd> {
        if !chunk.sealed {
            return Err(Error::invalid("exporting a chunk not created shareable"));
        }
        chunk.fd.try_clone().map_err(|e| Error::Os {
            call: "dup",
            source: e,
        })
    }

    fn import(&self, fd: OwnedFd, bytes: usize, placement: Location) -> Result<HostChunk> {
        if placement != Location::Host {
            return Err(Error::protocol(format!(
                "a chunk placed at {placement} sent to the host backend"
            )));
        }
        super::check_chunk(bytes, self.granularity).map_err(|e| Error::protocol(e.to_string()))?;
        let st = rustix::fs::fstat(&fd)
            .map_err(|e| Error::protocol(format!("fstat of a received descriptor: {e}")))?;
        if st.st_size as u64 != bytes as u64 {
            return Err(Error::protocol(format!(
                "a received descriptor holds {} bytes, not the {bytes} described",
                st.st_size
            )));
        }
        // Only a memfd sealed against shrinking is safe to map: the peer
        // could otherwise truncate it and fault every access here.
        let seals = rustix::fs::fcntl_get_seals(&fd)
            .map_err(|e| Error::protocol(format!("a received descriptor is not a memfd: {e}")))?;
        if !seals.contains(rustix::fs::SealFlags::SHRINK) {
            return Err(Error::protocol(
                "a received memfd is not sealed against shrinking",
            ));
        }
        self.counters.update(|c| {
            c.chunks += 1;
            c.chunk_bytes += bytes;
        });
        Ok(HostChunk {
            id: super::next_chunk_id(),
            fd,
            bytes,
            mapped: MappedFlag::default(),
            counters: self.counters.clone(),
            sealed: true,
        })
    }

    fn chunk_id(&self, chunk: &HostChunk) -> u64 {
        chunk.id
    }

    fn release(&self, chunk: HostChunk) -> Result<()> {
        drop(chunk);
        Ok(())
    }

    fn map(&self, res: &mut HostReservation, offset: usize, chunk: &HostChunk) -> Result<()> {
        res.table.check_insert(offset, chunk.bytes)?;
        if chunk.mapped.fetch_add(1, Ordering::SeqCst) > 0 && !self.double_maps {
            chunk.mapped.fetch_sub(1, Ordering::SeqCst);
            return Err(Error::invalid("the chunk is already mapped"));
        }
        // SAFETY: the range lies inside this token's reservation (checked
        // above) and holds no mapping (checked above), so MAP_FIXED replaces
        // only our own PROT_NONE placeholder. PROT_NONE: nobody can touch it
        // until set_access, as with cuMemMap. Another mapping of the same
        // chunk shares its pages (MAP_SHARED), as a second cuMemMap of one
        // handle does; the bytes are only ever touched through raw copies.
        unsafe {
            rustix::mm::mmap(
                res.addr(offset),
                chunk.bytes,
                ProtFlags::empty(),
                MapFlags::SHARED | MapFlags::FIXED,
                &chunk.fd,
                0,
            )
        }
        .map_err(|e| {
            chunk.mapped.fetch_sub(1, Ordering::SeqCst);
            os("mmap", e, chunk.bytes)
        })?;
        res.table.insert(
            offset,
            Entry::new(chunk.mapped.clone(), chunk.bytes, Location::Host),
        )?;
        self.counters.update(|c| c.mapped_bytes += chunk.bytes);
        Ok(())
    }

    fn unmap(&self, res: &mut HostReservation, offset: usize, bytes: usize) -> Result<()> {
        let keys = res.table.covering(offset, bytes, true)?;
        // SAFETY: the range is inside this token's reservation and made of
        // whole mappings of ours (checked above); a fixed PROT_NONE private
        // mapping puts the reservation's placeholder back over it. Callers
        // that handed out references into it hold `&mut` to the token.
        unsafe {
            rustix::mm::mmap_anonymous(
                res.addr(offset),
                bytes,
                ProtFlags::empty(),
                MapFlags::PRIVATE | MapFlags::FIXED | MapFlags::NORESERVE,
            )
        }
        .map_err(|e| os("mmap", e, bytes))?;
        for k in keys {
            if let Some(e) = res.table.remove(k) {
                e.chunk.fetch_sub(1, Ordering::SeqCst);
            }
        }
        self.counters.update(|c| c.mapped_bytes -= bytes);
        Ok(())
    }

    fn set_access(
        &self,
        res: &mut HostReservation,
        offset: usize,
        bytes: usize,
        access: &[AccessDesc],
    ) -> Result<()> {
        let mut host = Access::None;
        for (i, d) in access.iter().enumerate() {
            self.check_host(d.location)?;
            if i > 0 {
                return Err(Error::invalid("the host is listed twice in an access list"));
            }
            host = d.access;
        }
        let keys = res.table.covering(offset, bytes, true)?;
        let flags = MprotectFlags::from_bits_retain(prot(host).bits());
        // SAFETY: the range is made of whole mappings inside this token's
        // reservation (checked above); `&mut` to the token means no reference
        // into it is alive that a narrower protection could invalidate.
        unsafe { rustix::mm::mprotect(res.addr(offset), bytes, flags) }
            .map_err(|e| os("mprotect", e, bytes))?;
        res.table.set_access(&keys, access);
        Ok(())
    }

    fn capture_underway(&self) -> bool {
        self.captures.any()
    }

    fn synchronize(&self) -> Result<()> {
        self.captures.refuse_any("a device synchronisation")?;
        self.clock.synchronize();
        Ok(())
    }

    fn wait(&self, fence: &HostFence) -> Result<()> {
        // A fence is recorded outside any capture (one on a captured
        // stream is refused): waiting for it is allowed, as vmmbuf's CUDA
        // backend waits in relaxed capture mode.
        self.clock.wait(fence);
        Ok(())
    }

    fn fence_key(&self, fence: &HostFence) -> crate::StreamKey {
        Clock::key(fence)
    }

    fn wait_copies(&self) -> Result<()> {
        Ok(()) // host copies are done when `copy` returns
    }

    fn copies_fence(&self) -> Result<HostFence> {
        Ok(HostFence::default()) // done already
    }

    fn maps_a_chunk_twice(&self) -> bool {
        self.double_maps // mappings of one memfd share its pages
    }

    fn copy(
        &self,
        dst: &mut HostReservation,
        dst_offset: usize,
        src: &HostReservation,
        src_offset: usize,
        bytes: usize,
    ) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        host_range(&src.table, src_offset, bytes, Access::Read)?;
        host_range(&dst.table, dst_offset, bytes, Access::ReadWrite)?;
        // SAFETY: both ranges are mapped with the access needed (checked
        // above) in two distinct tokens (`&mut` and `&` cannot alias), so they
        // do not overlap; `&mut dst` excludes every other reference into it.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.addr(src_offset) as *const u8,
                dst.addr(dst_offset) as *mut u8,
                bytes,
            )
        };
        Ok(())
    }

    fn can_access_peer(&self, device: u32, peer: u32) -> Result<bool> {
        Err(Error::Unsupported {
            what: format!("peer access gpu{device} -> gpu{peer} with the host backend"),
        })
    }

    fn fence_done(&self, fence: &HostFence) -> Result<bool> {
        self.counters.update(|c| c.fence_queries += 1);
        Ok(self.clock.done(fence))
    }

    fn read(&self, res: &HostReservation, offset: usize, dst: &mut [u8]) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        self.captures.refuse_any("a synchronous copy to the host")?;
        host_range(&res.table, offset, dst.len(), Access::Read)?;
        // SAFETY: the source range is mapped and readable (checked above), lies
        // in memory this token owns, and `&HostReservation` excludes writers.
        unsafe {
            std::ptr::copy_nonoverlapping(
                res.addr(offset) as *const u8,
                dst.as_mut_ptr(),
                dst.len(),
            )
        };
        Ok(())
    }

    fn write(&self, res: &mut HostReservation, offset: usize, src: &[u8]) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        self.captures
            .refuse_any("a synchronous copy from the host")?;
        host_range(&res.table, offset, src.len(), Access::ReadWrite)?;
        // SAFETY: the destination is mapped read-write (checked above), lies in
        // memory this token owns, and `&mut` excludes every other reference.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), res.addr(offset) as *mut u8, src.len())
        };
        Ok(())
    }

    fn pool_slot(&self) -> Option<&super::PoolSlot> {
        Some(&self.pool_slot)
    }

    fn live(&self) -> LiveCounts {
        self.counters.get()
    }
}
