//! Sharing a growing buffer with other processes: the exporter's side
//! ([`Exporter`], [`GrowableBuffer::publish`]) and the importer's
//! ([`SharedBuffer`]).
//!
//! A shareable buffer ([`BufferDesc::shareable`](crate::BufferDesc::shareable))
//! creates every chunk exportable as a file descriptor (CUDA's POSIX-fd
//! handle type; the host backend's sealed memfds). Each `publish` sends one
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
//! id, and 1 if the chunk's descriptor follows. A batch carries `count`
//! record indices, one per descriptor attached to it (SCM_RIGHTS).
//!
//! Safe code over the backend trait and rustix's socket calls.

use std::collections::BTreeMap;
use std::io::IoSlice;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;

use bytemuck::{Pod, Zeroable};
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

use crate::backend::{Backend, Uses};
use crate::error::{Error, Result};
use crate::location::{Access, AccessDesc, Location};
use crate::table::{driver_access, ChunkTable, Entry};

/// The most descriptors one message carries (the kernel's limit is 253).
pub const FDS_PER_MESSAGE: usize = 250;

/// The most chunk records one generation may carry (2^20: 2 TiB in 2 MiB
/// chunks, past the driver's ceiling of about 2^19 mappings a process). An
/// importer refuses a description with more, or with more than the
/// reservation has granules, before reading its records
/// ([`Error::Protocol`]); applying one is linear in its records.
pub const MAX_RECORDS: u64 = 1 << 20;

pub(crate) const MAGIC: u64 = u64::from_le_bytes(*b"vmmbufv1");
pub(crate) const KIND_DESC: u64 = 1;
pub(crate) const KIND_FDS: u64 = 2;
/// Placement code for host memory; a GPU is its ordinal.
const HOST: u64 = u64::MAX;

/// The fixed head of every message.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
pub(crate) struct Head {
    pub(crate) magic: u64,
    pub(crate) kind: u64,
    pub(crate) generation: u64,
    /// Description: the reservation's bytes. Descriptor batch: unused.
    pub(crate) reserved: u64,
    pub(crate) granularity: u64,
    pub(crate) len: u64,
    /// Description: chunk records that follow. Batch: record indices that
    /// follow, one per descriptor attached.
    pub(crate) count: u64,
    /// Description: how many descriptors the batches after it carry.
    pub(crate) fds: u64,
}

/// One chunk of a description.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub(crate) struct Record {
    pub(crate) offset: u64,
    pub(crate) bytes: u64,
    pub(crate) placement: u64,
    /// The exporter's [`Backend::chunk_id`].
    pub(crate) id: u64,
    /// 1 if this chunk's descriptor follows (new to this peer).
    pub(crate) fresh: u64,
}

pub(crate) fn placement_code(l: Location) -> u64 {
    match l {
        Location::Host => HOST,
        Location::Device(d) => d as u64,
    }
}

fn placement_of(code: u64) -> Result<Location> {
    match code {
        HOST => Ok(Location::Host),
        d if d <= u32::MAX as u64 => Ok(Location::Device(d as u32)),
        d => Err(Error::protocol(format!("placement code {d:#x}"))),
    }
}

fn send_error(e: rustix::io::Errno) -> Error {
    use rustix::io::Errno;
    match e {
        Errno::PIPE | Errno::CONNRESET | Errno::NOTCONN => Error::PeerGone {
            reason: format!("sendmsg: {e}"),
        },
        e => Error::Os {
            call: "sendmsg",
            source: e.into(),
        },
    }
}

fn recv_error(e: rustix::io::Errno) -> Error {
    use rustix::io::Errno;
    match e {
        Errno::CONNRESET | Errno::NOTCONN => Error::PeerGone {
            reason: format!("recvmsg: {e}"),
        },
        e => Error::Os {
            call: "recvmsg",
            source: e.into(),
        },
    }
}

/// Sends `head` and `payload` as one message with `fds` attached (all of it,
/// looping over short writes; the descriptors go with the first part).
pub(crate) fn send_frame(
    socket: &UnixStream,
    head: &Head,
    payload: &[u8],
    fds: &[OwnedFd],
) -> Result<()> {
    let borrowed: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
    let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(FDS_PER_MESSAGE))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !borrowed.is_empty() && !control.push(SendAncillaryMessage::ScmRights(&borrowed)) {
        return Err(Error::invalid("too many descriptors for one message"));
    }
    let mut bytes = bytemuck::bytes_of(head).to_vec();
    bytes.extend_from_slice(payload);
    let mut sent = rustix::net::sendmsg(
        socket,
        &[IoSlice::new(&bytes)],
        &mut control,
        SendFlags::NOSIGNAL,
    )
    .map_err(send_error)?;
    while sent < bytes.len() {
        let n =
            rustix::net::send(socket, &bytes[sent..], SendFlags::NOSIGNAL).map_err(send_error)?;
        if n == 0 {
            return Err(Error::PeerGone {
                reason: "send wrote nothing".into(),
            });
        }
        sent += n;
    }
    Ok(())
}

/// Receives one message: its head, `payload_of(head)` more bytes, and the
/// descriptors that came with it. A closed socket before the first byte is
/// [`Error::PeerGone`].
fn recv_frame(
    socket: &UnixStream,
    payload_of: impl Fn(&Head) -> Result<usize>,
) -> Result<(Head, Vec<u8>, Vec<OwnedFd>)> {
    let mut head = Head::default();
    let mut fds = Vec::new();
    let mut got = 0usize;
    let mut space =
        vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(FDS_PER_MESSAGE + 3))];
    while got < std::mem::size_of::<Head>() {
        let buf = &mut bytemuck::bytes_of_mut(&mut head)[got..];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let r = rustix::net::recvmsg(
            socket,
            &mut [std::io::IoSliceMut::new(buf)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        )
        .map_err(recv_error)?;
        for m in control.drain() {
            if let RecvAncillaryMessage::ScmRights(received) = m {
                fds.extend(received);
            }
        }
        if r.flags.contains(rustix::net::ReturnFlags::CTRUNC) {
            return Err(Error::protocol(
                "descriptors were cut off (more than one message holds)",
            ));
        }
        if r.bytes == 0 {
            return Err(Error::PeerGone {
                reason: "the socket closed".into(),
            });
        }
        got += r.bytes;
    }
    if head.magic != MAGIC {
        return Err(Error::protocol(format!("bad magic {:#x}", head.magic)));
    }
    let n = payload_of(&head)?;
    let mut payload = vec![0u8; n];
    let mut at = 0;
    while at < n {
        let r = rustix::net::recv(socket, &mut payload[at..], RecvFlags::empty())
            .map_err(recv_error)?;
        if r.0 == 0 {
            return Err(Error::PeerGone {
                reason: "the socket closed inside a message".into(),
            });
        }
        at += r.0;
    }
    Ok((head, payload, fds))
}

/// One connection to an importer: the socket, what this peer already holds
/// and the generation last sent. See [`GrowableBuffer::publish`](crate::GrowableBuffer::publish).
///
/// # Wire format
/// Every message starts with a head of eight little-endian `u64`s: the magic
/// `b"vmmbufv1"`, the kind (1: a description, 2: a descriptor batch), the
/// generation, the reservation's bytes, the granularity, the length in use,
/// a count, and (descriptions) how many descriptors follow. A description
/// carries `count` records of five `u64`s: offset, bytes, placement
/// (`u64::MAX` for host memory, else the GPU's ordinal), the exporter's chunk
/// id, and 1 if the chunk's descriptor follows. A batch carries `count`
/// record indices, one per descriptor attached to it (SCM_RIGHTS, at most
/// [`FDS_PER_MESSAGE`]). A publish is one description and the batches of
/// its new chunks' descriptors.
#[derive(Debug)]
pub struct Exporter {
    pub(crate) socket: UnixStream,
    /// offset -> (bytes, chunk id) of every chunk this peer was sent and
    /// still maps.
    pub(crate) sent: BTreeMap<u64, (u64, u64)>,
    pub(crate) generation: u64,
    /// A send failed part-way: the peer's stream is out of step for good.
    pub(crate) broken: bool,
}

impl Exporter {
    /// An exporter over a connected Unix stream socket.
    pub fn new(socket: UnixStream) -> Self {
        Self {
            socket,
            sent: BTreeMap::new(),
            generation: 0,
            broken: false,
        }
    }

    /// The generation last published (0 before the first).
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The socket, e.g. to read what the importer writes back.
    pub fn socket(&self) -> &UnixStream {
        &self.socket
    }
}

/// One generation as received: its head, its chunks, and for each fresh
/// record the descriptor that came with it.
struct Generation {
    head: Head,
    records: Vec<Record>,
    fds: BTreeMap<usize, OwnedFd>,
}

fn recv_generation(socket: &UnixStream) -> Result<Generation> {
    let (head, payload, stray) = recv_frame(socket, |h| {
        // Checked before the records are read.
        if h.kind != KIND_DESC || h.count > MAX_RECORDS {
            return Err(Error::protocol(format!(
                "expected a description, got kind {} with {} records",
                h.kind, h.count
            )));
        }
        Ok(h.count as usize * std::mem::size_of::<Record>())
    })?;
    if !stray.is_empty() {
        return Err(Error::protocol("descriptors came with a description"));
    }
    let records: Vec<Record> = bytemuck::pod_collect_to_vec(&payload);
    let fresh: Vec<usize> = records
        .iter()
        .enumerate()
        .filter(|(_, r)| r.fresh != 0)
        .map(|(i, _)| i)
        .collect();
    if fresh.len() as u64 != head.fds {
        return Err(Error::protocol(format!(
            "{} fresh chunks but {} descriptors announced",
            fresh.len(),
            head.fds
        )));
    }
    let mut fds = BTreeMap::new();
    while fds.len() < fresh.len() {
        let (h, payload, got) = recv_frame(socket, |h| {
            if h.kind != KIND_FDS || h.count as usize > FDS_PER_MESSAGE {
                return Err(Error::protocol(format!(
                    "expected a descriptor batch, got kind {} with {}",
                    h.kind, h.count
                )));
            }
            Ok(h.count as usize * 8)
        })?;
        let idx: Vec<u64> = bytemuck::pod_collect_to_vec(&payload);
        if h.generation != head.generation || got.len() != idx.len() {
            return Err(Error::protocol(format!(
                "a batch of {} indices came with {} descriptors",
                idx.len(),
                got.len()
            )));
        }
        for (i, fd) in idx.into_iter().zip(got) {
            let i = i as usize;
            if records.get(i).is_none_or(|r| r.fresh == 0) || fds.insert(i, fd).is_some() {
                return Err(Error::protocol(format!("a descriptor for record {i}")));
            }
        }
    }
    Ok(Generation { head, records, fds })
}

/// A buffer another process shares: the importer's side.
///
/// [`import`](Self::import) receives the exporter's first generation over
/// a Unix socket, reserves an address range of the same size and maps every
/// chunk at its own offset, with access for this backend's device (and the
/// host, for chunks in host memory). [`sync`](Self::sync) follows the
/// exporter's growth. Offsets mean the same bytes in both processes; the base
/// address is this process's own.
///
/// All or nothing: a failed import or sync maps nothing new and unmaps
/// nothing; the descriptors received are closed. Kernels that read the
/// buffer by address must be recorded ([`record_use`](Self::record_use))
/// before a sync or drop unmaps what they read.
pub struct SharedBuffer<B: Backend> {
    backend: Arc<B>,
    socket: UnixStream,
    res: Option<B::Reservation>,
    table: ChunkTable<B::Chunk>,
    /// The exporter's chunk id at each offset.
    ids: BTreeMap<usize, u64>,
    base: u64,
    reserved: usize,
    granularity: usize,
    generation: u64,
    grants: Vec<AccessDesc>,
    uses: Uses<B::Fence>,
    poisoned: Option<String>,
    /// Chunks an undo could not unmap: dropped after the reservation.
    quarantine: Vec<B::Chunk>,
}

impl<B: Backend> std::fmt::Debug for SharedBuffer<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedBuffer")
            .field("base", &format_args!("{:#x}", self.base))
            .field("generation", &self.generation)
            .field("len", &self.table.len())
            .field("chunks", &self.table.chunk_count())
            .finish()
    }
}

impl<B: Backend> SharedBuffer<B> {
    /// Receives the exporter's next generation on `socket` and maps it in a
    /// reservation of its own, granting `access` to this backend's device
    /// (and to the host for host-placed chunks).
    ///
    /// Errors: [`Error::PeerGone`], [`Error::Protocol`] (including a chunk
    /// placed on a GPU this device cannot reach), driver errors; nothing
    /// stays mapped and no descriptor stays open.
    pub fn import(backend: Arc<B>, socket: UnixStream, access: Access) -> Result<Self> {
        let gen = recv_generation(&socket)?;
        let reserved = gen.head.reserved as usize;
        let granularity = gen.head.granularity as usize;
        let home = backend.home();
        let g = backend.granularity(home)?;
        if granularity == 0
            || !granularity.is_power_of_two()
            || !granularity.is_multiple_of(g)
            || reserved == 0
            || !reserved.is_multiple_of(granularity)
        {
            return Err(Error::protocol(format!(
                "reservation {reserved} at granularity {granularity} (this device's is {g})"
            )));
        }
        let table = ChunkTable::new(reserved, g)?;
        let res = backend.reserve(reserved, granularity)?;
        let base = backend.base(&res);
        let mut grants = vec![AccessDesc::new(home, access)];
        if home != Location::Host {
            grants.push(AccessDesc::new(Location::Host, access));
        }
        let mut this = Self {
            backend,
            socket,
            res: Some(res),
            table,
            ids: BTreeMap::new(),
            base,
            reserved,
            granularity,
            generation: 0,
            grants,
            uses: Uses::default(),
            poisoned: None,
            quarantine: Vec::new(),
        };
        this.apply(gen)?;
        Ok(this)
    }

    /// Waits for the exporter's next generation and applies it: maps the
    /// chunks that are new, unmaps those the exporter gave up (after the
    /// recorded uses), and takes the new length. Returns the generation.
    ///
    /// Errors: [`Error::PeerGone`] when the exporter is gone,
    /// [`Error::StaleGeneration`] for a generation not past this one,
    /// [`Error::Protocol`] for anything malformed; the buffer is as before.
    pub fn sync(&mut self) -> Result<u64> {
        self.check_poison()?;
        let gen = recv_generation(&self.socket)?;
        self.apply(gen)?;
        Ok(self.generation)
    }

    fn check_poison(&self) -> Result<()> {
        match &self.poisoned {
            Some(reason) => Err(Error::Poisoned {
                reason: reason.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Checks a generation against what is held, imports its fresh chunks,
    /// then swaps the mappings: all or nothing.
    fn apply(&mut self, mut gen: Generation) -> Result<()> {
        let h = gen.head;
        if h.generation <= self.generation {
            return Err(Error::StaleGeneration {
                got: h.generation,
                have: self.generation,
            });
        }
        if h.reserved as usize != self.reserved || h.granularity as usize != self.granularity {
            return Err(Error::protocol(format!(
                "the reservation changed: {} bytes at {} (held: {} at {})",
                h.reserved, h.granularity, self.reserved, self.granularity
            )));
        }
        // The records: in order, within the reservation, whole granules,
        // placed where this device can reach; the length within them.
        let backend = &*self.backend;
        let mut end = 0u64;
        // Where the run of chunks from offset 0 without a hole ends: the
        // length must lie within it (the table's rule), checked here, before
        // anything is mapped.
        let mut prefix = 0u64;
        for r in &gen.records {
            let place = placement_of(r.placement)?;
            let g = backend
                .granularity(place)
                .map_err(|e| Error::protocol(format!("a chunk placed at {place}: {e}")))?;
            let ok = r.offset >= end
                && r.bytes > 0
                && r.offset % g as u64 == 0
                && r.bytes % g as u64 == 0
                && r.offset
                    .checked_add(r.bytes)
                    .is_some_and(|e| e <= h.reserved);
            if !ok {
                return Err(Error::protocol(format!(
                    "chunk {:#x}+{:#x} in a {:#x}-byte reservation",
                    r.offset, r.bytes, h.reserved
                )));
            }
            if let (Location::Device(d), Location::Device(me)) = (place, backend.home()) {
                if d != me && !backend.can_access_peer(me, d)? {
                    return Err(Error::protocol(format!(
                        "a chunk on gpu{d}, which gpu{me} cannot reach"
                    )));
                }
            }
            end = r.offset + r.bytes;
            if r.offset == prefix {
                prefix = end;
            }
        }
        for r in &gen.records {
            if r.fresh == 0 && self.ids.get(&(r.offset as usize)) != Some(&r.id) {
                return Err(Error::protocol(format!(
                    "chunk {:#x} is not fresh, but this importer does not hold it",
                    r.offset
                )));
            }
        }
        if h.len > prefix {
            return Err(Error::protocol(format!(
                "length {} past {prefix}, where the chunks from offset 0 stop without a hole",
                h.len
            )));
        }
        // Import every fresh chunk: failing here changes nothing.
        let mut fresh: Vec<(usize, B::Chunk, Location, u64)> = Vec::new();
        for (i, r) in gen.records.iter().enumerate() {
            if r.fresh == 0 {
                continue;
            }
            let fd = gen
                .fds
                .remove(&i)
                .expect("one descriptor per fresh record (checked)");
            let place = placement_of(r.placement)?;
            let chunk = backend.import(fd, r.bytes as usize, place)?; // drops the rest on error
            fresh.push((r.offset as usize, chunk, place, r.id));
        }
        // What goes: chunks held whose offset or id no record keeps.
        let keep: BTreeMap<usize, u64> = gen
            .records
            .iter()
            .filter(|r| r.fresh == 0)
            .map(|r| (r.offset as usize, r.id))
            .collect();
        let gone: Vec<usize> = self
            .table
            .iter()
            .map(|(o, _)| o)
            .filter(|o| !keep.contains_key(o))
            .collect();
        if !gone.is_empty() {
            self.wait_uses()?;
        }
        // Sizes by offset, looked up in log time: applying is linear in the
        // records (up to a log factor).
        let sizes: BTreeMap<usize, usize> = gen
            .records
            .iter()
            .map(|r| (r.offset as usize, r.bytes as usize))
            .collect();
        let bytes_at = |o: usize| sizes.get(&o).copied().unwrap_or(0);
        let res = self.res.as_mut().expect("the reservation lives until drop");
        let table = &mut self.table;
        let grants = &self.grants;
        // Unmap what goes; then map and grant what comes. Undo on error.
        let mut removed: Vec<(usize, Entry<B::Chunk>)> = Vec::new();
        let mut mapped: Vec<usize> = Vec::new();
        // The table keeps chunks in use; the new length is set at the end.
        let old_len = table.len();
        table.set_len(0).expect("0 is always a valid length");
        let step = (|| {
            for &o in &gone {
                let bytes = table.get(o).expect("listed").bytes;
                backend.unmap(res, o, bytes)?;
                removed.push((o, table.remove(o).expect("listed")));
            }
            for (o, chunk, place, _) in &fresh {
                backend.map(res, *o, chunk)?;
                mapped.push(*o);
                backend.set_access(res, *o, bytes_at(*o), &driver_access(grants, *place))?;
            }
            Ok::<(), Error>(())
        })();
        if let Err(e) = step {
            // Put it back as it was; a failure here poisons.
            let mut undo = Ok(());
            for o in mapped.into_iter().rev() {
                undo = undo.and(backend.unmap(res, o, bytes_at(o)));
            }
            for (o, entry) in removed.into_iter().rev() {
                let list = entry.driver_access();
                undo = undo
                    .and_then(|()| backend.map(res, o, &entry.chunk))
                    .and_then(|()| backend.set_access(res, o, entry.bytes, &list));
                table.insert(o, entry).expect("it was there");
            }
            table.set_len(old_len).expect("the old chunks are back");
            match undo {
                Ok(()) => {
                    for (_, chunk, _, _) in fresh {
                        let _ = backend.release(chunk);
                    }
                }
                Err(u) => {
                    self.poisoned = Some(format!("undoing a failed sync: {u}"));
                    // They may still be mapped: kept until the reservation
                    // is gone.
                    self.quarantine.extend(fresh.into_iter().map(|f| f.1));
                }
            }
            return Err(e);
        }
        for (_, entry) in removed {
            let _ = backend.release(entry.chunk);
        }
        for (o, chunk, place, id) in fresh {
            let mut entry = Entry::new(chunk, bytes_at(o), place);
            entry.access = driver_access(&self.grants, place).into();
            self.table
                .insert(o, entry)
                .expect("checked: in order and unmapped");
            self.ids.insert(o, id);
        }
        let table = &self.table;
        self.ids.retain(|o, _| table.get(*o).is_some());
        // The importer's length is the exporter's (checked above to lie
        // within the chunks from offset 0, so this cannot fail).
        self.table
            .set_len(h.len as usize)
            .map_err(|e| Error::protocol(format!("length {}: {e}", h.len)))?;
        self.generation = h.generation;
        tracing::debug!(
            generation = h.generation,
            chunks = self.table.chunk_count(),
            "vmmbuf: synced"
        );
        Ok(())
    }

    fn wait_uses(&self) -> Result<()> {
        self.uses.each(|f| self.backend.wait(f))
    }

    /// Records work that reads the buffer by address (a kernel on a stream):
    /// a sync that unmaps, and drop, wait for it first.
    pub fn record_use(&self, fence: B::Fence) {
        self.uses.put(self.backend.fence_key(&fence), fence);
    }

    /// This process's address of offset 0.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// The exporter's length (bytes in use) as of the last generation.
    pub fn len(&self) -> usize {
        self.table.len()
    }

    /// True when the length is 0.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes mapped here.
    pub fn capacity(&self) -> usize {
        self.table.mapped_bytes()
    }

    /// The size of the reservation (the exporter's).
    pub fn reserved(&self) -> usize {
        self.reserved
    }

    /// The generation held.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Chunks mapped here.
    pub fn chunk_count(&self) -> usize {
        self.table.chunk_count()
    }

    /// The backend this buffer is mapped in.
    pub fn backend(&self) -> &Arc<B> {
        &self.backend
    }

    /// The socket, e.g. to answer the exporter.
    pub fn socket(&self) -> &UnixStream {
        &self.socket
    }

    /// Copies `dst.len()` bytes in use from `offset` into `dst` (after the
    /// recorded uses). The exporter may be writing meanwhile: the bytes are
    /// what the memory held when copied.
    pub fn read(&mut self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check_poison()?;
        self.table.check_in_use(offset, dst.len())?;
        self.wait_uses()?;
        let res = self.res.as_ref().expect("the reservation lives until drop");
        self.backend.read(res, offset, dst)
    }

    /// Copies `src` into the bytes in use from `offset`: the exporter's
    /// memory itself, which it reads at the same offset. Needs the buffer
    /// imported with [`Access::ReadWrite`] (else [`Error::InvalidArgument`],
    /// nothing written); waits for the recorded uses first.
    pub fn write(&mut self, offset: usize, src: &[u8]) -> Result<()> {
        self.check_poison()?;
        if self.grants[0].access != Access::ReadWrite {
            return Err(Error::invalid(
                "writing a shared buffer imported without Access::ReadWrite",
            ));
        }
        self.table.check_in_use(offset, src.len())?;
        self.wait_uses()?;
        let res = self.res.as_mut().expect("the reservation lives until drop");
        self.backend.write(res, offset, src)
    }
}

impl<B: Backend> Drop for SharedBuffer<B> {
    fn drop(&mut self) {
        if let Err(e) = self.wait_uses() {
            tracing::error!(error = %e, "vmmbuf: waiting for a shared buffer's uses failed");
        }
        let Some(mut res) = self.res.take() else {
            return;
        };
        let offsets: Vec<(usize, usize)> = self.table.iter().map(|(o, e)| (o, e.bytes)).collect();
        for (o, bytes) in offsets {
            match self.backend.unmap(&mut res, o, bytes) {
                Ok(()) => {
                    if let Some(e) = self.table.remove(o) {
                        let _ = self.backend.release(e.chunk);
                    }
                }
                Err(e) => tracing::error!(error = %e, "vmmbuf: unmapping a shared chunk failed"),
            }
        }
        if let Err(e) = self.backend.free(res) {
            tracing::error!(error = %e, "vmmbuf: freeing a shared buffer's reservation failed");
        }
        // The token unmapped what it still held as it dropped.
        self.quarantine.clear();
    }
}
