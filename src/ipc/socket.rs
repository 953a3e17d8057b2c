//! The sockets of a shared buffer: frames (a head, a payload, descriptors
//! by SCM_RIGHTS) sent and received with rustix, the [`Exporter`], and the
//! receipt of one generation (its description, then its descriptor
//! batches).

use std::collections::BTreeMap;
use std::io::IoSlice;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

use super::wire::{
    Head, Record, FDS_PER_MESSAGE, FRESH_FABRIC, FRESH_FD, KIND_DESC, KIND_FDS, MAGIC, MAX_RECORDS,
};
use super::{FabricHandle, HandleKind};
use crate::error::{Error, Result};

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
    recv_exact(socket, &mut payload)?;
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
/// id, and how the chunk's handle follows: 0 not at all (the peer has it),
/// 1 its descriptor in a batch, 2 its fabric handle (64 bytes, after the
/// records, in record order). A batch carries `count` record indices, one
/// per descriptor attached to it (SCM_RIGHTS, at most [`FDS_PER_MESSAGE`]).
/// A publish is one description and the batches of its new chunks'
/// descriptors.
#[derive(Debug)]
pub struct Exporter {
    pub(crate) socket: UnixStream,
    /// How new chunks are sent.
    pub(crate) kind: HandleKind,
    /// offset -> (bytes, chunk id) of every chunk this peer was sent and
    /// still maps.
    pub(crate) sent: BTreeMap<u64, (u64, u64)>,
    pub(crate) generation: u64,
    /// A send failed part-way: the peer's stream is out of step for good.
    pub(crate) broken: bool,
}

impl Exporter {
    /// `records` of generation `generation` reached the peer: what it maps
    /// now.
    pub(crate) fn sent_now(&mut self, records: &[Record], generation: u64) {
        self.sent = records
            .iter()
            .map(|r| (r.offset, (r.bytes, r.id)))
            .collect();
        self.generation = generation;
    }

    /// An exporter over a connected Unix stream socket, sending each new
    /// chunk as a POSIX file descriptor.
    pub fn new(socket: UnixStream) -> Self {
        Self::with_handles(socket, HandleKind::PosixFd)
    }

    /// An exporter sending each new chunk as a handle of `kind`: with
    /// [`HandleKind::Fabric`], 64 bytes in the description instead of a
    /// descriptor (for an importer on another host of an NVLink fabric,
    /// with the socket carried by other means, or on this one). A publish
    /// with a chunk the backend cannot export as `kind` fails before
    /// anything is sent ([`Error::Unsupported`]).
    pub fn with_handles(socket: UnixStream, kind: HandleKind) -> Self {
        Self {
            kind,
            socket,
            sent: BTreeMap::new(),
            generation: 0,
            broken: false,
        }
    }

    /// How new chunks are sent.
    pub fn handle_kind(&self) -> HandleKind {
        self.kind
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
/// record the descriptor or the fabric handle that came with it.
pub(crate) struct Generation {
    pub(crate) head: Head,
    pub(crate) records: Vec<Record>,
    pub(crate) fds: BTreeMap<usize, OwnedFd>,
    pub(crate) fabric: BTreeMap<usize, FabricHandle>,
}

pub(crate) fn recv_generation(socket: &UnixStream) -> Result<Generation> {
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
    let fabric = recv_fabric(socket, &records)?;
    let fresh = fresh_of(&records, FRESH_FD);
    if fresh.len() as u64 != head.fds {
        return Err(Error::protocol(format!(
            "{} fresh chunks but {} descriptors announced",
            fresh.len(),
            head.fds
        )));
    }
    let fds = recv_fds(socket, &head, &records, fresh.len())?;
    Ok(Generation {
        head,
        records,
        fds,
        fabric,
    })
}

/// The indices of the records whose chunk is fresh of kind `code`.
fn fresh_of(records: &[Record], code: u64) -> Vec<usize> {
    let at = records.iter().enumerate();
    at.filter(|(_, r)| r.fresh == code)
        .map(|(i, _)| i)
        .collect()
}

/// The fabric handles that follow the records, 64 bytes each in record
/// order, by record index.
fn recv_fabric(socket: &UnixStream, records: &[Record]) -> Result<BTreeMap<usize, FabricHandle>> {
    let inline = fresh_of(records, FRESH_FABRIC);
    let mut fabric = BTreeMap::new();
    if inline.is_empty() {
        return Ok(fabric);
    }
    let mut bytes = vec![0u8; inline.len() * 64];
    recv_exact(socket, &mut bytes)?;
    for (&i, h) in inline.iter().zip(bytes.chunks_exact(64)) {
        let mut one = [0u8; 64];
        one.copy_from_slice(h);
        fabric.insert(i, FabricHandle(one));
    }
    Ok(fabric)
}

/// The `n` descriptors of the fresh chunks of generation `head`, in
/// batches of (record index, descriptor), by record index; a batch of
/// another generation, a count that does not match, or a descriptor for a
/// record that is not a fresh one (or twice) is refused.
fn recv_fds(
    socket: &UnixStream,
    head: &Head,
    records: &[Record],
    n: usize,
) -> Result<BTreeMap<usize, OwnedFd>> {
    let mut fds = BTreeMap::new();
    while fds.len() < n {
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
            if records.get(i).is_none_or(|r| r.fresh != FRESH_FD) || fds.insert(i, fd).is_some() {
                return Err(Error::protocol(format!("a descriptor for record {i}")));
            }
        }
    }
    Ok(fds)
}

/// Reads exactly `buf.len()` bytes (no descriptors may come with them).
fn recv_exact(socket: &UnixStream, buf: &mut [u8]) -> Result<()> {
    let mut at = 0;
    while at < buf.len() {
        let r =
            rustix::net::recv(socket, &mut buf[at..], RecvFlags::empty()).map_err(recv_error)?;
        if r.0 == 0 {
            return Err(Error::PeerGone {
                reason: "the socket closed inside a message".into(),
            });
        }
        at += r.0;
    }
    Ok(())
}
