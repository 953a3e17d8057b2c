//! Sharing a growing buffer with another process (issue 14): the exporter
//! publishes generations over a Unix socket, the importer follows them.
//! The two-process tests re-execute this binary as the importer; the error
//! cases run both ends in one process over a socket pair.

use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Arc;
use std::time::Duration;

use crate::common::keep_nothing;
use vmmbuf::{
    ipc::Exporter, ipc::SharedBuffer, Access, Backend, BufferDesc, CudaBackend, Error,
    GrowableBuffer, GrowthPolicy, HostBackend,
};

crate::register! {
    generic: [an_importer_never_reads_a_released_chunk_in_place_of_a_new_one, a_shareable_buffer_never_takes_unexportable_pooled_chunks, errors_change_nothing_and_leak_no_descriptor, more_chunks_than_one_message_holds, a_read_write_importer_writes_what_the_exporter_reads],
    host: [host_importer_in_another_process_follows_twenty_growths_and_a_shrink, a_buffer_shared_by_fabric_handles_keeps_every_byte],
    gpu: [gpu_importer_in_another_process_follows_twenty_growths_and_a_shrink, fabric_handles_where_the_driver_permits_them],
    two_gpus: [an_importer_on_the_second_gpu_follows_the_first],
    child: [share_child_importer],
}

/// The byte every test writes at `offset` in round `round` (never all zeros).
fn pattern(offset: usize, round: u64) -> u8 {
    let x = (offset as u64)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(round.wrapping_mul(0xD1B5_4A32_D192_ED03));
    (x >> 56) as u8 ^ (x >> 17) as u8
}

/// Descriptors open in this process.
fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// The lengths of the twenty growths, the shrink after the tenth, and the
/// round each byte was written in: bytes below `SHRINK` keep round 0; those
/// written after the shrink carry round 1.
const STEPS: usize = 20;
fn length_at(g: usize, step: usize) -> usize {
    step * 7 * g / 4 + 13 * step
}
const SHRINK_AFTER: usize = 10;

/// Expected byte at `offset` once the exporter has made `step` growths.
fn expected(g: usize, offset: usize, step: usize) -> u8 {
    let cut = length_at(g, SHRINK_AFTER) / 2;
    if step > SHRINK_AFTER && offset >= cut {
        pattern(offset, 1)
    } else {
        pattern(offset, 0)
    }
}

/// The exporter's side: grows `STEPS` times, writing the new bytes; halves
/// the buffer after `SHRINK_AFTER` growths (the chunks past the cut are
/// released, not pooled, and the importer still reads them until it syncs);
/// publishes after each step and waits for the importer's word.
fn export_twenty<B: Backend>(backend: Arc<B>, mut peer: UnixStream) {
    let g = backend.granularity(backend.home()).unwrap();
    let pool = vmmbuf::ChunkPool::default_for(&backend);
    let mut buf = GrowableBuffer::new(
        backend.clone(),
        BufferDesc::new(64 * g)
            .growth(GrowthPolicy::Exact)
            .shareable(true),
    )
    .unwrap();
    let mut ex = Exporter::new(peer.try_clone().unwrap());
    for step in 1..=STEPS {
        let (old, new) = (buf.len(), length_at(g, step));
        buf.grow_to(new).unwrap();
        let from = if step == SHRINK_AFTER + 1 {
            length_at(g, SHRINK_AFTER) / 2
        } else {
            old
        };
        let data: Vec<u8> = (from..new).map(|o| expected(g, o, step)).collect();
        buf.write(from, &data).unwrap();
        assert_eq!(
            buf.publish(&mut ex).unwrap(),
            step as u64 + (step > SHRINK_AFTER) as u64
        );
        expect_word(&mut peer, "ok");
        if step == SHRINK_AFTER {
            let before = backend.live().chunks;
            let pooled = pool.as_ref().map_or(0, |p| p.stats().pooled_chunks);
            buf.truncate(length_at(g, SHRINK_AFTER) / 2);
            buf.shrink_to_fit().unwrap();
            assert!(backend.live().chunks < before, "released at once");
            assert_eq!(
                pool.as_ref().map_or(0, |p| p.stats().pooled_chunks),
                pooled,
                "a published buffer's chunks are never pooled"
            );
            // The importer reads the old bytes past the cut before it syncs.
            buf.publish(&mut ex).unwrap();
            expect_word(&mut peer, "ok");
        }
    }
    drop(ex);
    drop(buf);
    peer.write_all(b"done\n").unwrap();
    expect_word(&mut peer, "bye");
    drop(peer);
}

fn expect_word(peer: &mut UnixStream, word: &str) {
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    while b[0] != b'\n' {
        assert_eq!(peer.read(&mut b).unwrap(), 1, "the importer hung up");
        line.push(b[0]);
    }
    let line = String::from_utf8_lossy(&line);
    assert_eq!(line.trim(), word, "the importer said: {line}");
}

/// Runs the importer in a child process (this binary, re-executed) on
/// `backend_spec` ("host" or "cuda:N") and the exporter here.
fn two_processes<B: Backend>(backend: Arc<B>, backend_spec: &str) {
    let fds = open_fds();
    let free_before = backend.device_memory().map(|m| m.0);
    let dir = std::env::temp_dir().join(format!("vmmbuf-share-{}", std::process::id()));
    let _ = std::fs::remove_file(&dir);
    let listener = UnixListener::bind(&dir).unwrap();
    let child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "share::share_child_importer",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("VMMBUF_SHARE_SOCKET", &dir)
        .env("VMMBUF_SHARE_BACKEND", backend_spec)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let (peer, _) = listener.accept().unwrap();
    let _ = std::fs::remove_file(&dir);
    peer.set_read_timeout(Some(Duration::from_secs(120)))
        .unwrap();
    export_twenty(backend.clone(), peer);
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("IMPORTER OK"),
        "the importer said: {text}"
    );
    eprintln!(
        "{}",
        text.lines()
            .find(|l| l.contains("IMPORTER OK"))
            .unwrap_or("")
    );
    drop(listener);
    assert_eq!(
        open_fds(),
        fds,
        "the exporter's descriptors are back to the start"
    );
    // Both processes are done with the buffer: the device has its memory back.
    if let (Some(before), Some(after)) = (free_before, backend.device_memory().map(|m| m.0)) {
        eprintln!("device free before {before} B, after both exited {after} B");
        assert!(
            after + (2 << 20) >= before,
            "device memory not back: {before} -> {after}"
        );
    }
}

fn host_importer_in_another_process_follows_twenty_growths_and_a_shrink() {
    two_processes(crate::common::host(), "host");
}

fn gpu_importer_in_another_process_follows_twenty_growths_and_a_shrink() {
    two_processes(crate::common::gpu(), "cuda:0");
}

/// The exporter on GPU 0, the importer on GPU 1 (peer access).
fn an_importer_on_the_second_gpu_follows_the_first() {
    let b0 = keep_nothing(CudaBackend::new(0).unwrap());
    assert!(
        b0.can_access_peer(1, 0).unwrap(),
        "GPU 1 cannot reach GPU 0"
    );
    two_processes(b0, "cuda:1");
}

/// The importer's side, in the child: imports, then syncs after every
/// publish and checks every byte in use; before syncing past the shrink it
/// reads the bytes the exporter gave up (still there). Its descriptors are
/// back to their start at the end.
fn share_child_importer() {
    let path = std::env::var("VMMBUF_SHARE_SOCKET").expect("run by the share tests");
    let spec = std::env::var("VMMBUF_SHARE_BACKEND").unwrap();
    let checked = match spec.as_str() {
        "host" => import_twenty(HostBackend::with_granularity(64 << 10).unwrap(), &path),
        s => {
            let d: u32 = s.trim_start_matches("cuda:").parse().unwrap();
            import_twenty(CudaBackend::new(d).unwrap(), &path)
        }
    };
    println!("IMPORTER OK: {checked} bytes checked over {STEPS} growths and a shrink, on {spec}");
}

fn import_twenty<B: Backend>(backend: Arc<B>, path: &str) -> usize {
    let fds = open_fds(); // after the backend opened what it keeps
    let mut peer = UnixStream::connect(path).unwrap();
    peer.set_read_timeout(Some(Duration::from_secs(120)))
        .unwrap();
    let mut shared =
        SharedBuffer::import(backend.clone(), peer.try_clone().unwrap(), Access::Read).unwrap();
    let g = shared.reserved() / 64;
    let mut checked = 0;
    let mut check = |shared: &mut SharedBuffer<B>, step: usize, upto: usize| {
        let mut got = vec![0u8; upto];
        shared.read(0, &mut got).unwrap();
        for (o, b) in got.iter().enumerate() {
            assert_eq!(*b, expected(g, o, step), "byte {o} at step {step}");
        }
        checked += upto;
    };
    for step in 1..=STEPS {
        if step > 1 {
            shared.sync().unwrap();
        }
        assert_eq!(shared.len(), length_at(g, step), "step {step}");
        let n = shared.len();
        check(&mut shared, step, n);
        peer.write_all(b"ok\n").unwrap();
        if step == SHRINK_AFTER {
            // The exporter has shrunk and released those chunks: this
            // process still maps them, and they hold what they held.
            let before = shared.len();
            std::thread::sleep(Duration::from_millis(50));
            check(&mut shared, step, before);
            let gen = shared.sync().unwrap();
            let half = length_at(g, SHRINK_AFTER) / 2;
            assert_eq!(shared.len(), half);
            assert_eq!(
                shared.capacity(),
                half.div_ceil(g) * g,
                "gen {gen} unmapped the rest"
            );
            let n = shared.len();
            check(&mut shared, step, n);
            peer.write_all(b"ok\n").unwrap();
        }
    }
    // The exporter is done: the next sync finds it gone.
    let mut line = String::new();
    let mut b = [0u8; 1];
    while b[0] != b'\n' {
        assert_eq!(peer.read(&mut b).unwrap(), 1);
        line.push(b[0] as char);
    }
    assert_eq!(line.trim(), "done");
    peer.write_all(b"bye\n").unwrap();
    let before = (shared.len(), shared.generation(), shared.chunk_count());
    match shared.sync() {
        Err(Error::PeerGone { .. }) => {}
        other => panic!("a sync after the exporter left: {other:?}"),
    }
    assert_eq!(
        (shared.len(), shared.generation(), shared.chunk_count()),
        before
    );
    let n = shared.len();
    check(&mut shared, STEPS, n);
    drop(shared);
    drop(peer);
    assert_eq!(
        open_fds(),
        fds,
        "the importer's descriptors are back to the start"
    );
    checked
}

/// A shareable buffer takes only exportable chunks from the pool, and a plain
/// one only plain chunks.
fn a_shareable_buffer_never_takes_unexportable_pooled_chunks<B: Backend>(backend: Arc<B>) {
    let g = backend.granularity(backend.home()).unwrap();
    let pool = vmmbuf::ChunkPool::default_for(&backend).unwrap();
    pool.set_release_threshold(usize::MAX).unwrap();
    let desc = BufferDesc::new(64 * g).growth(GrowthPolicy::Exact);
    let plain = GrowableBuffer::new(backend.clone(), desc.clone()).unwrap();
    plain.grow_to(6 * g).unwrap();
    drop(plain);
    let hits = pool.stats().hits;
    let shared = GrowableBuffer::new(backend.clone(), desc.clone().shareable(true)).unwrap();
    shared.grow_to(6 * g).unwrap();
    assert_eq!(
        pool.stats().hits,
        hits,
        "no plain chunk went to the shareable buffer"
    );
    let (a, b) = UnixStream::pair().unwrap();
    let mut ex = Exporter::new(a);
    shared.publish(&mut ex).unwrap(); // every chunk exports
    let imported = SharedBuffer::import(backend.clone(), b, Access::Read).unwrap();
    assert_eq!(imported.capacity(), 6 * g);
    drop(imported);
    drop(ex);
    // A shareable buffer never published gives its chunks to the pool...
    let unpublished = GrowableBuffer::new(backend.clone(), desc.clone().shareable(true)).unwrap();
    unpublished.grow_to(4 * g).unwrap();
    drop(unpublished);
    // ...where a plain buffer does not take them, and a shareable one does.
    let hits = pool.stats().hits;
    let plain = GrowableBuffer::new(backend.clone(), desc.clone()).unwrap();
    plain.grow_to(4 * g).unwrap();
    assert_eq!(pool.stats().hits, hits + 4, "the 6 plain chunks serve it");
    let again = GrowableBuffer::new(backend.clone(), desc.shareable(true)).unwrap();
    again.grow_to(4 * g).unwrap();
    assert_eq!(
        pool.stats().hits,
        hits + 8,
        "the 4 shareable chunks serve it"
    );
    // A plain buffer cannot publish.
    let (a, _b) = UnixStream::pair().unwrap();
    assert!(matches!(
        plain.publish(&mut Exporter::new(a)),
        Err(Error::Unsupported { .. })
    ));
    drop((plain, again, shared));
    pool.trim().unwrap();
}

/// Hand-made messages in the documented wire format (see `vmmbuf::ipc::Exporter`):
/// a 64-byte head of eight little-endian u64s, then the records.
pub(crate) fn head(
    kind: u64,
    generation: u64,
    reserved: u64,
    granularity: u64,
    len: u64,
    count: u64,
    fds: u64,
) -> Vec<u8> {
    [
        u64::from_le_bytes(*b"vmmbufv1"),
        kind,
        generation,
        reserved,
        granularity,
        len,
        count,
        fds,
    ]
    .iter()
    .flat_map(|v| v.to_le_bytes())
    .collect()
}

pub(crate) fn record(offset: u64, bytes: u64, placement: u64, id: u64, fresh: u64) -> Vec<u8> {
    [offset, bytes, placement, id, fresh]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect()
}

pub(crate) fn send_raw(socket: &UnixStream, bytes: &[u8], fds: &[OwnedFd]) {
    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
    use std::os::fd::AsFd;
    let borrowed: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
    let mut space = vec![std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !borrowed.is_empty() {
        assert!(control.push(SendAncillaryMessage::ScmRights(&borrowed)));
    }
    let n = rustix::net::sendmsg(
        socket,
        &[std::io::IoSlice::new(bytes)],
        &mut control,
        SendFlags::NOSIGNAL,
    )
    .unwrap();
    assert_eq!(n, bytes.len());
}

/// Every error case: a dead peer on either side, garbage, a descriptor that
/// is no chunk, a memfd not sealed, a wrong size, a stale generation, a chunk
/// placed where this backend cannot map it, bad layouts. After each, the
/// importer holds what it held (length, generation, chunks, bytes) and the
/// process's descriptors are as before.
fn errors_change_nothing_and_leak_no_descriptor<B: Backend>(backend: Arc<B>) {
    let g = backend.granularity(backend.home()).unwrap() as u64;
    let desc = BufferDesc::new(16 * g as usize)
        .growth(GrowthPolicy::Exact)
        .shareable(true);
    let mut buf = GrowableBuffer::new(backend.clone(), desc.clone()).unwrap();
    buf.grow_to(3 * g as usize).unwrap();
    let data: Vec<u8> = (0..3 * g as usize).map(|o| pattern(o, 7)).collect();
    buf.write(0, &data).unwrap();
    let (a, b) = UnixStream::pair().unwrap();
    let raw = a.try_clone().unwrap();
    let mut ex = Exporter::new(a);
    assert_eq!(buf.publish(&mut ex).unwrap(), 1);
    let mut shared = SharedBuffer::import(backend.clone(), b, Access::Read).unwrap();
    // What later cases need, made before the descriptors are counted: a
    // second exporter on the same stream, and another buffer's chunk.
    let mut second = Exporter::new(raw.try_clone().unwrap());
    let other = GrowableBuffer::new(backend.clone(), desc).unwrap();
    other.grow_to(g as usize).unwrap();
    let (x, y) = UnixStream::pair().unwrap();
    let mut xex = Exporter::new(x);
    other.publish(&mut xex).unwrap();
    let mut fwd = Some(recv_one_fd(&y));
    let (x2, y2) = UnixStream::pair().unwrap();
    let mut xex2 = Exporter::new(x2);
    other.publish(&mut xex2).unwrap();
    let mut fwd2 = Some(recv_one_fd(&y2));
    drop((xex2, y2));
    // The two forwarded descriptors are open until their cases send them.
    let fds = open_fds() - 2;
    let mut held_fds = 2;
    let held = |s: &mut SharedBuffer<B>| {
        let mut got = vec![0u8; s.len()];
        s.read(0, &mut got).unwrap();
        assert!(got == data, "the bytes held are intact");
        (s.len(), s.generation(), s.chunk_count(), s.capacity())
    };
    let start = held(&mut shared);
    let reserved = 16 * g;
    let placement = match backend.home() {
        vmmbuf::Location::Host => u64::MAX,
        vmmbuf::Location::Device(d) => d as u64,
    };
    let check =
        |shared: &mut SharedBuffer<B>, what: &str, ok: fn(&Error) -> bool, held_fds: usize| {
            match shared.sync() {
                Err(e) if ok(&e) => eprintln!("  {what}: {e}"),
                other => panic!("{what}: {other:?}"),
            }
            assert_eq!(held(shared), start, "{what} changed the importer");
            assert_eq!(open_fds(), fds + held_fds, "{what} leaked a descriptor");
        };
    let protocol = |e: &Error| matches!(e, Error::Protocol { .. });
    let mut batch = head(2, 2, 0, 0, 0, 1, 0);
    batch.extend(0u64.to_le_bytes());

    // A real chunk (another buffer's) described with the wrong size.
    let fwd = fwd.take().unwrap(); // sent, then closed
    held_fds -= 1;
    let mut wrong = head(1, 2, reserved, g, 2 * g, 1, 1);
    wrong.extend(record(0, 2 * g, placement, 5, 1));
    send_raw(&raw, &wrong, &[]);
    send_raw(&raw, &batch, &[fwd]);
    check(
        &mut shared,
        "a chunk of the wrong size",
        |e| matches!(e, Error::Protocol { .. } | Error::Driver { .. }),
        held_fds,
    );
    // A real chunk described as placed elsewhere: on the host for CUDA (the
    // driver's properties say GPU), on a GPU for the host backend.
    let fwd2 = fwd2.take().unwrap(); // sent, then closed
    held_fds -= 1;
    let elsewhere = if placement == u64::MAX { 0 } else { u64::MAX };
    let mut moved = head(1, 2, reserved, g, g, 1, 1);
    moved.extend(record(0, g, elsewhere, 6, 1));
    send_raw(&raw, &moved, &[]);
    send_raw(&raw, &batch, &[fwd2]);
    check(
        &mut shared,
        "a chunk described as placed elsewhere",
        |e| matches!(e, Error::Protocol { .. } | Error::Unsupported { .. }),
        held_fds,
    );
    // Garbage.
    (&raw).write_all(&[0xAB; 64]).unwrap();
    check(&mut shared, "garbage", protocol, held_fds);
    // A stale generation: a second exporter on the same stream starts at 1.
    buf.publish(&mut second).unwrap();
    check(
        &mut shared,
        "stale generation",
        |e| matches!(e, Error::StaleGeneration { got: 1, have: 1 }),
        held_fds,
    );
    // A descriptor that is no chunk: a socket's end.
    let (p, q) = UnixStream::pair().unwrap();
    drop(q);
    let p = OwnedFd::from(p); // sent, then closed
    let mut msg = head(1, 2, reserved, g, 4 * g, 1, 1);
    msg.extend(record(0, 4 * g, placement, 99, 1));
    send_raw(&raw, &msg, &[]);
    send_raw(&raw, &batch, &[p]);
    check(&mut shared, "a socket for a chunk", protocol, held_fds);
    // A memfd not sealed (host), or any memfd (CUDA): not a chunk to map.
    let m = rustix::fs::memfd_create("not-a-chunk", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    rustix::fs::ftruncate(&m, 4 * g).unwrap();
    send_raw(&raw, &msg, &[]);
    send_raw(&raw, &batch, &[m]);
    check(&mut shared, "an unsealed memfd", protocol, held_fds);
    // A chunk placed on a GPU this process has no such device for.
    let mut far = head(1, 2, reserved, g, g, 1, 0);
    far.extend(record(0, g, 4242, 5, 0));
    send_raw(&raw, &far, &[]);
    check(
        &mut shared,
        "a chunk on a device out of reach",
        protocol,
        held_fds,
    );
    // Layouts: past the reservation, overlapping, a length past the chunks,
    // a record claiming to be held that is not, a different reservation.
    for (what, m) in [
        ("past the reservation", {
            let mut m = head(1, 2, reserved, g, g, 1, 0);
            m.extend(record(reserved, g, placement, 1, 0));
            m
        }),
        ("overlapping chunks", {
            let mut m = head(1, 2, reserved, g, g, 2, 0);
            m.extend(record(0, 2 * g, placement, 1, 0));
            m.extend(record(g, g, placement, 2, 0));
            m
        }),
        ("a length past the chunks", {
            head(1, 2, reserved, g, 9 * g, 0, 0)
        }),
        ("a chunk not held", {
            let mut m = head(1, 2, reserved, g, g, 1, 0);
            m.extend(record(0, g, placement, 0xDEAD, 0));
            m
        }),
        ("another reservation", head(1, 2, reserved * 2, g, 0, 0, 0)),
        ("descriptors announced, none sent", {
            let mut m = head(1, 2, reserved, g, g, 1, 1);
            m.extend(record(0, g, placement, 0xDEAD, 0));
            m
        }),
    ] {
        send_raw(&raw, &m, &[]);
        check(&mut shared, what, protocol, held_fds);
    }

    // The exporter's publish still works after all that: a real growth.
    buf.grow_to(5 * g as usize).unwrap();
    let mut fresh = data.clone();
    fresh.extend((3 * g as usize..5 * g as usize).map(|o| pattern(o, 8)));
    buf.write(3 * g as usize, &fresh[3 * g as usize..]).unwrap();
    // `ex` is at generation 1 and the importer too.
    assert_eq!(buf.publish(&mut ex).unwrap(), 2);
    assert_eq!(shared.sync().unwrap(), 2);
    let mut got = vec![0u8; shared.len()];
    shared.read(0, &mut got).unwrap();
    assert!(got == fresh);

    // A dead exporter: the importer's sync says so and changes nothing.
    drop((ex, second, raw, xex, y, other));
    let before = (shared.len(), shared.generation(), shared.chunk_count());
    assert!(matches!(shared.sync(), Err(Error::PeerGone { .. })));
    assert_eq!(
        (shared.len(), shared.generation(), shared.chunk_count()),
        before
    );
    // A dead importer: publish says so, the buffer is unchanged.
    let (a, b) = UnixStream::pair().unwrap();
    drop(b);
    let len = buf.len();
    assert!(matches!(
        buf.publish(&mut Exporter::new(a)),
        Err(Error::PeerGone { .. })
    ));
    assert_eq!(buf.len(), len);
    drop(shared);
    drop(buf);
}

/// Receives one publish on `y` and returns the first descriptor in it.
fn recv_one_fd(y: &UnixStream) -> OwnedFd {
    use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
    let mut found = None;
    for _ in 0..2 {
        let mut space = vec![std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(8))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let mut buf = [0u8; 4096];
        rustix::net::recvmsg(
            y,
            &mut [std::io::IoSliceMut::new(&mut buf)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        )
        .unwrap();
        for m in control.drain() {
            if let RecvAncillaryMessage::ScmRights(fds) = m {
                for fd in fds {
                    found.get_or_insert(fd);
                }
            }
        }
        if found.is_some() {
            break;
        }
    }
    found.expect("the publish carried a descriptor")
}

/// A layout of more chunks than one message may carry descriptors for: the
/// descriptors go in batches, and every byte arrives.
fn more_chunks_than_one_message_holds<B: Backend>(backend: Arc<B>) {
    let g = backend.granularity(backend.home()).unwrap();
    let n = 2 * vmmbuf::ipc::FDS_PER_MESSAGE + 17;
    let mut buf = GrowableBuffer::new(
        backend.clone(),
        BufferDesc::new((n + 8) * g)
            .growth(GrowthPolicy::Exact)
            .shareable(true),
    )
    .unwrap();
    buf.grow_to(n * g - 5).unwrap();
    let data: Vec<u8> = (0..buf.len()).map(|o| pattern(o, 9)).collect();
    buf.write(0, &data).unwrap();
    let fds = open_fds();
    let (a, b) = UnixStream::pair().unwrap();
    let mut ex = Exporter::new(a);
    // The importer runs beside: the socket's buffer holds less than the
    // publish writes.
    let importer = std::thread::spawn({
        let backend = backend.clone();
        move || {
            let mut shared = SharedBuffer::import(backend, b, Access::Read).unwrap();
            let mut got = vec![0u8; shared.len()];
            shared.read(0, &mut got).unwrap();
            (shared.chunk_count(), got)
        }
    });
    buf.publish(&mut ex).unwrap();
    let (chunks, got) = importer.join().unwrap();
    assert_eq!(chunks, n);
    assert!(got == data, "every byte of {n} chunks arrived");
    drop(ex);
    assert_eq!(open_fds(), fds, "no descriptor left open");
}

/// An importer granted read-write access writes the exporter's memory; one
/// granted read access is refused, and nothing changes.
fn a_read_write_importer_writes_what_the_exporter_reads<B: Backend>(backend: Arc<B>) {
    let g = backend.granularity(backend.home()).unwrap();
    let desc = BufferDesc::new(16 * g).shareable(true);
    let buf = GrowableBuffer::new(backend.clone(), desc).unwrap();
    buf.grow_to(3 * g + 100).unwrap();
    let mut buf = buf;
    let data: Vec<u8> = (0..buf.len()).map(|o| pattern(o, 11)).collect();
    buf.write(0, &data).unwrap();
    let (a, b) = UnixStream::pair().unwrap();
    let (c, d) = UnixStream::pair().unwrap();
    let (mut ex_rw, mut ex_r) = (Exporter::new(a), Exporter::new(c));
    buf.publish(&mut ex_rw).unwrap();
    buf.publish(&mut ex_r).unwrap();
    let mut rw = SharedBuffer::import(backend.clone(), b, Access::ReadWrite).unwrap();
    let mut ro = SharedBuffer::import(backend.clone(), d, Access::Read).unwrap();
    let patch: Vec<u8> = (0..g + 50).map(|o| pattern(o, 12)).collect();
    let at = 2 * g - 20; // across a chunk boundary
    rw.write(at, &patch).unwrap();
    let mut expect = data.clone();
    expect[at..at + patch.len()].copy_from_slice(&patch);
    let mut seen = vec![0u8; buf.len()];
    buf.read(0, &mut seen).unwrap();
    assert!(seen == expect, "the exporter reads what the importer wrote");
    ro.read(0, &mut seen).unwrap();
    assert!(seen == expect, "and so does the other importer");
    assert!(matches!(
        ro.write(0, &[1, 2, 3]),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        rw.write(buf.len() - 1, &[1, 2]),
        Err(Error::InvalidArgument(_))
    ));
    buf.read(0, &mut seen).unwrap();
    assert!(seen == expect, "refused writes changed nothing");
}

/// Issue 19: the exporter sends each chunk once, known by its id. Ids were
/// the driver's handle (CUDA) or the memfd's inode (host), both reused after
/// a release: a new chunk with an old id was taken for one the importer
/// held, and the importer kept mapping the old one. Each round releases the
/// tail chunk (shrink_to_fit; a published buffer's chunks go to the driver),
/// grows again with new data, publishes, syncs and reads every byte back.
fn an_importer_never_reads_a_released_chunk_in_place_of_a_new_one<B: Backend>(backend: Arc<B>) {
    let g = backend.granularity(backend.home()).unwrap();
    let mut buf = GrowableBuffer::new(
        backend.clone(),
        BufferDesc::new(64 * g)
            .growth(GrowthPolicy::Exact)
            .shareable(true),
    )
    .unwrap();
    let (a, b) = UnixStream::pair().unwrap();
    let mut ex = Exporter::new(a);
    buf.grow_to(2 * g).unwrap();
    let first: Vec<u8> = (0..2 * g).map(|i| pattern(i, 0)).collect();
    buf.write(0, &first).unwrap();
    buf.publish(&mut ex).unwrap();
    let mut imp = SharedBuffer::import(backend.clone(), b, Access::Read).unwrap();
    let mut got = vec![0u8; g];
    let rounds = if backend.name() == "cuda" { 1000 } else { 300 };
    for round in 1..=rounds {
        buf.truncate(g);
        buf.shrink_to_fit().unwrap();
        assert_eq!(buf.capacity(), g, "round {round}: the tail chunk went");
        buf.grow_to(2 * g).unwrap();
        let data: Vec<u8> = (0..g).map(|i| pattern(g + i, round)).collect();
        buf.write(g, &data).unwrap();
        buf.publish(&mut ex).unwrap();
        imp.sync().unwrap();
        imp.read(g, &mut got).unwrap();
        assert!(
            got == data,
            "round {round}: the importer read old data at offset {g:#x}"
        );
    }
    imp.read(0, &mut got).unwrap();
    assert!(got[..] == first[..g], "the first chunk kept its bytes");
}

/// Issue 40: chunks sent as fabric handles (64 bytes in the description,
/// no descriptor) instead of POSIX descriptors, over a stand-in fabric
/// between two backends of this process. The importer follows growth,
/// mixed generations (a second exporter sends descriptors), a shrink and a
/// regrowth with every byte checked; an exporter whose backend has no
/// fabric refuses the publish before sending anything, and the buffer
/// publishes by descriptor afterwards as if nothing happened.
fn a_buffer_shared_by_fabric_handles_keeps_every_byte() {
    use std::sync::atomic::Ordering;
    use vmmbuf::ipc::HandleKind;
    let fds = open_fds();
    let ex_backend = crate::failing_backend::FaultBackend::new(crate::common::host());
    let im_backend = crate::failing_backend::FaultBackend::new(crate::common::host());
    let g = ex_backend.granularity(ex_backend.home()).unwrap();
    let mut buf = GrowableBuffer::new(
        ex_backend.clone(),
        BufferDesc::new(64 * g)
            .growth(GrowthPolicy::Exact)
            .shareable(true),
    )
    .unwrap();
    buf.grow_to(3 * g + 17).unwrap();
    let mut data: Vec<u8> = (0..buf.len()).map(|o| pattern(o, 21)).collect();
    buf.write(0, &data).unwrap();

    // No fabric on the exporter's side yet: refused, nothing sent.
    let (a, b) = UnixStream::pair().unwrap();
    let mut ex = Exporter::with_handles(a, HandleKind::Fabric);
    assert_eq!(ex.handle_kind(), HandleKind::Fabric);
    let e = buf.publish(&mut ex).unwrap_err();
    assert!(matches!(e, Error::Unsupported { .. }), "{e}");
    assert!(e.to_string().contains("fabric"), "{e}");
    b.set_nonblocking(true).unwrap();
    let mut probe = [0u8; 1];
    assert!(
        (&b).read(&mut probe).is_err(),
        "a refused publish sent nothing"
    );
    b.set_nonblocking(false).unwrap();
    assert_eq!(ex.generation(), 0);

    ex_backend.fabric.store(true, Ordering::SeqCst);
    im_backend.fabric.store(true, Ordering::SeqCst);
    let made = crate::failing_backend::fabric_handles_made();
    assert_eq!(buf.publish(&mut ex).unwrap(), 1);
    assert_eq!(
        crate::failing_backend::fabric_handles_made() - made,
        4,
        "each of the 4 chunks went as a fabric handle"
    );
    let mut imp = SharedBuffer::import(im_backend.clone(), b, Access::ReadWrite).unwrap();
    let mut seen = vec![0u8; buf.len()];
    imp.read(0, &mut seen).unwrap();
    assert!(seen == data, "the first generation's bytes");

    // A second importer by descriptor beside it, of the same buffer.
    let (c, d) = UnixStream::pair().unwrap();
    let mut ex_fd = Exporter::new(c);
    buf.publish(&mut ex_fd).unwrap();
    let mut imp_fd = SharedBuffer::import(im_backend.clone(), d, Access::Read).unwrap();

    for round in 0..6u64 {
        let len = buf.len();
        if round == 3 {
            buf.truncate(2 * g);
            buf.shrink_to_fit().unwrap();
            data.truncate(2 * g);
        } else {
            let more: Vec<u8> = (len..len + g + 333)
                .map(|o| pattern(o, 30 + round))
                .collect();
            buf.grow_to(len + more.len()).unwrap();
            buf.write(len, &more).unwrap();
            data.extend_from_slice(&more);
        }
        buf.publish(&mut ex).unwrap();
        buf.publish(&mut ex_fd).unwrap();
        imp.sync().unwrap();
        imp_fd.sync().unwrap();
        for (who, i) in [("fabric", &mut imp), ("descriptor", &mut imp_fd)] {
            assert_eq!(i.len(), data.len(), "round {round}: {who} length");
            let mut seen = vec![0u8; data.len()];
            i.read(0, &mut seen).unwrap();
            assert!(
                seen == data,
                "round {round}: every byte through the {who} importer"
            );
        }
    }
    // The fabric importer writes; the exporter reads it.
    let patch: Vec<u8> = (0..g).map(|o| pattern(o, 99)).collect();
    imp.write(g / 2, &patch).unwrap();
    data[g / 2..g / 2 + g].copy_from_slice(&patch);
    let mut seen = vec![0u8; data.len()];
    buf.read(0, &mut seen).unwrap();
    assert!(
        seen == data,
        "the exporter reads what the fabric importer wrote"
    );
    drop((imp, imp_fd, ex, ex_fd, buf));
    // The stand-in fabric keeps its descriptors for the process (a fabric
    // handle may be imported again): only this test's sockets and imports
    // must be gone.
    assert!(
        open_fds() <= fds + 64,
        "descriptors: {} before, {} after",
        fds,
        open_fds()
    );
}

/// On the GPU: a chunk made NCCL-ready exports a fabric handle where the
/// device and driver permit it, and the handle imports to the same memory
/// (checked by bytes through two mappings); otherwise the test says the
/// driver's reason and that export is refused with a typed error.
fn fabric_handles_where_the_driver_permits_them() {
    use vmmbuf::cuda::CudaBackendDesc;
    use vmmbuf::ipc::HandleKind;
    let backend = CudaBackend::with_desc(0, &CudaBackendDesc::nccl_ready()).unwrap();
    let g = backend.granularity(backend.home()).unwrap();
    let mut buf = GrowableBuffer::new(
        backend.clone(),
        BufferDesc::new(16 * g)
            .growth(GrowthPolicy::Exact)
            .shareable(true),
    )
    .unwrap();
    buf.grow_to(2 * g).unwrap();
    let data: Vec<u8> = (0..2 * g).map(|o| pattern(o, 5)).collect();
    buf.write(0, &data).unwrap();
    let kind = backend.chunk_kind().unwrap();
    let (a, b) = UnixStream::pair().unwrap();
    let mut ex = Exporter::with_handles(a, HandleKind::Fabric);
    match buf.publish(&mut ex) {
        Ok(_) => {
            assert!(
                kind.fabric,
                "published by fabric handle while chunk_kind says none"
            );
            let mut imp = SharedBuffer::import(backend.clone(), b, Access::Read).unwrap();
            let mut seen = vec![0u8; data.len()];
            imp.read(0, &mut seen).unwrap();
            assert!(seen == data, "the fabric import maps the same bytes");
            println!("fabric handles: exported and imported {} bytes", data.len());
        }
        Err(Error::Unsupported { what }) => {
            assert!(!kind.fabric, "refused while chunk_kind says fabric: {what}");
            println!(
                "skipped: fabric handles are not available here: {}",
                kind.no_fabric.as_deref().unwrap_or("(no reason given)")
            );
        }
        Err(e) => panic!("neither published nor refused as unsupported: {e}"),
    }
}
