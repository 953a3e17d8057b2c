//! Reproducers of defects a review found at d749d2b (RT-1 to RT-7;
//! RT-8 is a unit test, `order::tests`, and the stream-order oracle's). Each
//! test asserts what the docs promise: on d749d2b each one fails, now each
//! passes. RT-1 asserts the rule chosen for it (no host slices of shareable
//! buffers); RT-4 frees B on a thread of its own, since with ordered fences
//! B's free waits for A's to be numbered.

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};

use parking_lot::Mutex;
use vmmbuf::{
    ipc::Exporter, ipc::SharedBuffer, Access, Arena, ArenaDesc, ArenaStream, BufferDesc, ChunkPool,
    GrowableBuffer, GrowthPolicy, HostBackend, PoolDesc,
};

use crate::failing_backend::{FaultBackend, TestFence};
use crate::share::{head, record, send_raw};

crate::register! {
    host: [
        rt1_host_slice_changes_under_a_shared_write,
        rt2_sync_error_after_effect,
        rt3_coalesce_keeps_the_older_fence,
        rt4_concurrent_drops_keep_the_older_fence,
        rt5_shrink_to_fit_forgets_the_pending_fence,
        rt6_drop_pools_chunks_before_the_pending_fence,
        rt7_pool_reserve_huge_total_aborts,
    ],
    child: [rt7_child],
}

type Fb = FaultBackend<HostBackend>;

/// A stream whose fences the test opens by hand. `pause` makes the next
/// `fence()` call block between two barriers (after making its fence).
#[derive(Clone)]
struct Ctl {
    key: u64,
    log: Arc<Mutex<Vec<TestFence>>>,
    pause: Arc<AtomicBool>,
    gate: Arc<(Barrier, Barrier)>,
}

impl Ctl {
    fn new(key: u64, log: &Arc<Mutex<Vec<TestFence>>>) -> Self {
        Self {
            key,
            log: log.clone(),
            pause: Arc::new(AtomicBool::new(false)),
            gate: Arc::new((Barrier::new(2), Barrier::new(2))),
        }
    }
    fn last(&self) -> TestFence {
        self.log.lock().last().unwrap().clone()
    }
}

impl ArenaStream<Fb> for Ctl {
    fn key(&self) -> (u64, u64) {
        (0, self.key)
    }
    fn fence(&self, _: &Fb) -> vmmbuf::Result<TestFence> {
        let f = TestFence::default();
        self.log.lock().push(f.clone());
        if self.pause.swap(false, Ordering::SeqCst) {
            self.gate.0.wait();
            self.gate.1.wait();
        }
        Ok(f)
    }
}

const G: usize = 64 << 10;

fn fb() -> Arc<Fb> {
    FaultBackend::new(HostBackend::with_granularity(G).unwrap())
}

fn overlaps(a: (u64, usize), b: (u64, usize)) -> bool {
    a.0 < b.0 + b.1 as u64 && b.0 < a.0 + a.1 as u64
}

/// RT-1: `host_slice` promised "no safe API writes it while &self is
/// borrowed", but an importer in the same process (SharedBuffer::write,
/// safe) wrote the very pages an outstanding `&[u8]` pointed at. The rule
/// now: a shareable buffer gives no host slices (`&` or `&mut`); reads and
/// writes copy, and see the importer's bytes.
fn rt1_host_slice_changes_under_a_shared_write() {
    let backend = crate::common::host();
    let buf =
        GrowableBuffer::new(backend.clone(), BufferDesc::new(16 * G).shareable(true)).unwrap();
    buf.grow_to(G).unwrap();
    let mut buf = buf;
    buf.write(0, &[0x11; 64]).unwrap();
    let (a, b) = UnixStream::pair().unwrap();
    let mut ex = Exporter::new(a);
    buf.publish(&mut ex).unwrap();
    let mut rw = SharedBuffer::import(backend.clone(), b, Access::ReadWrite).unwrap();
    let slice = buf.host_slice(..64).map(|s| s.to_vec());
    eprintln!(
        "  host_slice of a shareable buffer -> {:?}",
        slice.as_ref().map(|s| &s[..4])
    );
    assert!(
        matches!(slice, Err(vmmbuf::Error::Unsupported { .. })),
        "a shareable buffer gave a &[u8] that an importer's safe write changes"
    );
    assert!(matches!(
        buf.host_slice_mut(..64),
        Err(vmmbuf::Error::Unsupported { .. })
    ));
    rw.write(0, &[0xAA; 64]).unwrap();
    let mut seen = [0u8; 64];
    buf.read(0, &mut seen).unwrap();
    assert_eq!(
        seen, [0xAA; 64],
        "the exporter reads what the importer wrote"
    );
    // A buffer that is not shareable still gives slices.
    let plain = GrowableBuffer::new(backend.clone(), BufferDesc::new(16 * G)).unwrap();
    plain.grow_to(G).unwrap();
    assert_eq!(plain.host_slice(..8).unwrap().len(), 8);
}

fn sealed_memfd(bytes: u64) -> OwnedFd {
    use rustix::fs::{MemfdFlags, SealFlags};
    let m =
        rustix::fs::memfd_create("rt", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).unwrap();
    rustix::fs::ftruncate(&m, bytes).unwrap();
    rustix::fs::fcntl_add_seals(&m, SealFlags::SHRINK | SealFlags::GROW).unwrap();
    m
}

/// RT-2: a generation whose chunks leave a hole below its length passes
/// every check in `apply`, maps, and only then fails at `set_len`: an error
/// returned after the effect ("the buffer is as before" is promised), the
/// length left at 0, and the importer desynchronised from the exporter.
fn rt2_sync_error_after_effect() {
    let backend = crate::common::host();
    let g = G as u64;
    let reserved = 16 * g;
    let buf = GrowableBuffer::new(
        backend.clone(),
        BufferDesc::new(reserved as usize)
            .growth(GrowthPolicy::Exact)
            .shareable(true),
    )
    .unwrap();
    buf.grow_to(G).unwrap();
    let (a, b) = UnixStream::pair().unwrap();
    let raw = a.try_clone().unwrap();
    let mut ex = Exporter::new(a);
    buf.publish(&mut ex).unwrap();
    let mut shared = SharedBuffer::import(backend.clone(), b, Access::Read).unwrap();
    let before = (
        shared.len(),
        shared.generation(),
        shared.chunk_count(),
        shared.capacity(),
    );
    // Generation 2: one fresh chunk at 2g (a hole below it), length g.
    let mut m = head(1, 2, reserved, g, g, 1, 1);
    m.extend(record(2 * g, g, u64::MAX, 777, 1));
    send_raw(&raw, &m, &[]);
    let mut batch = head(2, 2, 0, 0, 0, 1, 0);
    batch.extend(0u64.to_le_bytes());
    send_raw(&raw, &batch, &[sealed_memfd(g)]);
    let r = shared.sync();
    let after = (
        shared.len(),
        shared.generation(),
        shared.chunk_count(),
        shared.capacity(),
    );
    eprintln!("  sync -> {r:?}");
    eprintln!("  (len, generation, chunks, capacity) before {before:?} after {after:?}");
    // The real exporter's next generation is now refused too.
    buf.publish(&mut ex).unwrap();
    let next = shared.sync();
    eprintln!("  the real exporter's next publish -> {next:?}");
    assert!(r.is_err());
    assert_eq!(after, before, "a failed sync changed the importer");
    assert!(next.is_ok(), "the importer no longer follows the exporter");
}

/// RT-3: pending(S1, older) | settled | pending(S1, newer). An S1 miss
/// coalesces the three; the joined block keeps the *older* S1 fence, so it
/// settles (and S2 gets the bytes S1's newer free still uses) once the older
/// one passes.
fn rt3_coalesce_keeps_the_older_fence() {
    let fb = fb();
    let arena: Arena<Fb, Ctl> = Arena::new(
        fb.clone(),
        ArenaDesc::new(64 << 20).max_reserved_bytes(3 * G),
    )
    .unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    let (s1, s2, s3) = (Ctl::new(1, &log), Ctl::new(2, &log), Ctl::new(3, &log));
    let a = arena.alloc(G, &s1).unwrap();
    let b = arena.alloc(G, &s3).unwrap();
    let c = arena.alloc(G, &s1).unwrap();
    let c_range = (c.address(), G);
    assert_eq!(
        (b.address() - a.address(), c.address() - a.address()),
        (G as u64, 2 * G as u64)
    );
    drop(a);
    let f_a = s1.last();
    drop(b);
    s3.last().pass();
    drop(c);
    let f_c = s1.last();
    // S1 asks for more than fits: coalesce runs, then the budget refuses.
    let miss = arena.alloc(4 * G, &s1);
    eprintln!("  S1's miss: {:?}", miss.as_ref().map(|_| ()));
    // S1's older fence passes; its newer one (C's free) has not.
    f_a.pass();
    assert!(!f_c.0.load(Ordering::SeqCst));
    let r = arena.alloc(3 * G, &s2);
    match &r {
        Ok(x) => eprintln!(
            "  S2 got {:#x}+{:#x}; C's bytes {:#x}+{:#x} still pending on S1",
            x.address(),
            3 * G,
            c_range.0,
            c_range.1
        ),
        Err(e) => eprintln!("  S2: {e}"),
    }
    if let Ok(x) = &r {
        assert!(
            !overlaps((x.address(), x.capacity()), c_range),
            "S2 was given bytes whose S1 fence has not passed"
        );
    }
    drop(r);
    f_c.pass();
}

/// RT-4: two frees on one stream from two threads. The fence is recorded
/// before the arena's lock is taken; the later-recorded free is inserted
/// first, and the merge keeps the earlier fence as "newer".
fn rt4_concurrent_drops_keep_the_older_fence() {
    let fb = fb();
    let arena: Arena<Fb, Ctl> = Arena::new(
        fb.clone(),
        ArenaDesc::new(64 << 20).max_reserved_bytes(2 * G),
    )
    .unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    let (s1, s2) = (Ctl::new(1, &log), Ctl::new(2, &log));
    let a = arena.alloc(G, &s1).unwrap();
    let b = arena.alloc(G, &s1).unwrap();
    let b_range = (b.address(), G);
    assert_eq!(b.address() - a.address(), G as u64);
    s1.pause.store(true, Ordering::SeqCst);
    let gate = s1.gate.clone();
    let t = std::thread::spawn(move || drop(a)); // records f_a, then waits
    gate.0.wait();
    let f_a = log.lock().last().unwrap().clone();
    // B's free records f_b (later on S1). Without ordering it is inserted
    // first, while A's free waits; with it, it waits for A's fence to be
    // numbered (so it runs on a thread of its own), then goes.
    let t2 = std::thread::spawn(move || drop(b));
    std::thread::sleep(std::time::Duration::from_millis(50));
    gate.1.wait();
    t.join().unwrap();
    t2.join().unwrap();
    let f_b = log.lock().last().unwrap().clone();
    assert!(!Arc::ptr_eq(&f_a.0, &f_b.0), "two fences were recorded");
    f_a.pass(); // the earlier fence passes; f_b (B's last use) has not
    let r = arena.alloc(2 * G, &s2);
    match &r {
        Ok(x) => eprintln!(
            "  S2 got {:#x}+{:#x}; B's bytes {:#x}+{:#x} pending on S1 (f_b not passed)",
            x.address(),
            2 * G,
            b_range.0,
            b_range.1
        ),
        Err(e) => eprintln!("  S2: {e}"),
    }
    if let Ok(x) = &r {
        assert!(
            !overlaps((x.address(), x.capacity()), b_range),
            "S2 was given B's bytes before B's fence passed"
        );
    }
    drop(r);
    f_b.pass();
}

/// RT-5: shrink_to_fit_after(fence) then shrink_to_fit(): the pending fence
/// is dropped unwaited (`g.pending.clear()`), the tail unmapped at once.
fn rt5_shrink_to_fit_forgets_the_pending_fence() {
    let fb = fb();
    let mut buf = GrowableBuffer::new(
        fb.clone(),
        BufferDesc::new(16 * G)
            .growth(GrowthPolicy::Exact)
            .pooled(false),
    )
    .unwrap();
    for k in 1..=4 {
        buf.grow_to(k * G).unwrap();
    }
    assert_eq!(buf.chunk_count(), 4);
    buf.truncate(G);
    let fence = TestFence::default(); // work on the tail, not finished
    buf.shrink_to_fit_after(fence.clone()).unwrap();
    assert_eq!(buf.capacity(), 4 * G, "deferred");
    let r = buf.shrink_to_fit();
    eprintln!(
        "  shrink_to_fit -> {r:?}; capacity {} with the fence passed: {}",
        buf.capacity(),
        fence.0.load(Ordering::SeqCst)
    );
    assert!(
        buf.capacity() == 4 * G || r.is_err(),
        "the tail was unmapped before the fence given for it passed"
    );
}

/// RT-6: drop with a pending deferred release: the tail's chunks go to the
/// pool (another buffer maps them) while the fence has not passed.
fn rt6_drop_pools_chunks_before_the_pending_fence() {
    let fb = fb();
    let pool = ChunkPool::new(fb.clone(), PoolDesc::default()).unwrap();
    let mut buf =
        GrowableBuffer::with_pool(&pool, BufferDesc::new(16 * G).growth(GrowthPolicy::Exact))
            .unwrap();
    for k in 1..=4 {
        buf.grow_to(k * G).unwrap();
    }
    assert_eq!(buf.chunk_count(), 4);
    buf.truncate(G);
    let fence = TestFence::default();
    buf.shrink_to_fit_after(fence.clone()).unwrap();
    drop(buf);
    let other =
        GrowableBuffer::with_pool(&pool, BufferDesc::new(16 * G).growth(GrowthPolicy::Exact))
            .unwrap();
    other.grow_to(4 * G).unwrap();
    let hits = pool.stats().hits;
    eprintln!(
        "  fence passed: {}; pool hits by the next buffer: {hits}",
        fence.0.load(Ordering::SeqCst)
    );
    assert_eq!(hits, 0, "chunks under an unpassed fence were reused");
}

/// RT-7: ChunkPool::reserve sizes a Vec by the request before creating
/// anything: a huge total aborts the process (allocation failure), which no
/// caller can catch. Run in a child process.
fn rt7_pool_reserve_huge_total_aborts() {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "reviewed_defects::rt7_child",
            "--ignored",
            "--test-threads=1",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    let line = err
        .lines()
        .find(|l| l.contains("memory allocation") || l.contains("panicked"));
    eprintln!("  child: {:?}; {:?}", out.status, line);
    assert!(
        out.status.success(),
        "reserve(Host, 64 KiB, usize::MAX) killed the process"
    );
}

fn rt7_child() {
    let backend = crate::common::host();
    let pool = ChunkPool::new(backend.clone(), PoolDesc::default()).unwrap();
    let r = pool.reserve(vmmbuf::Location::Host, G, usize::MAX);
    eprintln!("  reserve -> {:?}", r.map(|_| ()));
}
