//! Issue 10's defects, one test each: transactions that must lose nothing and
//! alias nothing on any failure, and bad input that must be an error rather
//! than a panic or an abort. Placement and migration run on the fault backend
//! emulating a GPU over host memory, so all of it runs without a GPU.

use std::sync::Arc;

use crate::common::{contents, host, random_bytes};
use crate::failing_backend::{FaultBackend, TestFence};
use vmmbuf::migration::MigrationPolicy;
use vmmbuf::{
    Access, Backend, BufferDesc, ChunkPool, Error, GrowableBuffer, GrowthPolicy, HostBackend,
    Location, PoolDesc,
};

crate::register! {
    host: [
        read_mostly_survives_offload_and_restore,
        a_failed_apply_migration_policy_leaves_new_chunks_at_home,
        a_grow_whose_undo_fails_poisons_and_never_pools_a_mapped_chunk,
        a_migration_whose_undo_fails_poisons_and_never_pools_a_mapped_chunk,
        a_failed_deferred_release_changes_nothing,
        a_16_tib_exact_growth_fails_cleanly,
        huge_fixed_chunks_in_a_pooled_grow_are_no_panic,
        the_host_backend_maps_a_chunk_once,
        too_many_open_files_is_not_out_of_memory,
        placement_ranges_stay_bounded_however_often_they_are_set,
        a_deferred_release_waits_for_recorded_uses_not_only_its_fence,
        giving_memory_back_waits_for_recorded_uses,
    ],
}

const G: usize = 64 << 10;

/// A buffer of `n` chunks of `G` on the emulated GPU, filled with data.
fn emulated(
    fb: &Arc<FaultBackend<HostBackend>>,
    pool: Option<&Arc<ChunkPool<FaultBackend<HostBackend>>>>,
    n: usize,
) -> (GrowableBuffer<FaultBackend<HostBackend>>, Vec<u8>) {
    let desc = BufferDesc::new(64 * G).growth(GrowthPolicy::Exact);
    let mut buf = match pool {
        Some(p) => GrowableBuffer::with_pool(p, desc),
        None => GrowableBuffer::new(fb.clone(), desc),
    }
    .unwrap();
    buf.grow_to(n * G).unwrap();
    let data = random_bytes(n as u64 + 40, n * G);
    buf.write(0, &data).unwrap();
    (buf, data)
}

fn gpu_access(buf: &GrowableBuffer<FaultBackend<HostBackend>>) -> Vec<Access> {
    buf.report()
        .chunks
        .iter()
        .map(|c| {
            c.access
                .iter()
                .find(|(l, _)| *l == Location::Device(0))
                .map_or(Access::None, |(_, a)| *a)
        })
        .collect()
}

/// Item 4: migration kept the buffer's grants instead of each chunk's own
/// access, so sealed chunks came back writable.
fn read_mostly_survives_offload_and_restore() {
    let fb = FaultBackend::emulating_gpu(host());
    let (mut buf, data) = emulated(&fb, None, 4);
    buf.apply_migration_policy(0..2 * G, MigrationPolicy::ReadMostly)
        .unwrap();
    buf.set_access(3 * G..4 * G, Location::Device(0), Access::Read)
        .unwrap();
    let sealed = vec![Access::Read, Access::Read, Access::ReadWrite, Access::Read];
    assert_eq!(gpu_access(&buf), sealed);
    buf.offload().unwrap();
    assert_eq!(buf.stats().host_bytes, 4 * G);
    assert_eq!(
        gpu_access(&buf),
        sealed,
        "offload keeps each chunk's access"
    );
    buf.restore().unwrap();
    assert_eq!(buf.stats().device_bytes, 4 * G);
    assert_eq!(
        gpu_access(&buf),
        sealed,
        "restore keeps each chunk's access"
    );
    assert!(buf.write(0, &[1]).is_err(), "a sealed chunk stays sealed");
    assert!(buf.write(3 * G, &[1]).is_err());
    buf.write(2 * G, &[1]).unwrap();
    let mut want = data;
    want[2 * G] = 1;
    assert!(contents(&buf) == want);
}

/// Item 5: the range's placement was recorded before migrating and kept
/// when the migration failed, so later growth landed on the host.
fn a_failed_apply_migration_policy_leaves_new_chunks_at_home() {
    let fb = FaultBackend::emulating_gpu(host());
    let (mut buf, data) = emulated(&fb, None, 2);
    fb.fail_nth(1); // the migration's first call
    let r = buf.apply_migration_policy(0..8 * G, MigrationPolicy::PreferHost);
    fb.fail_nth(0);
    assert!(r.is_err());
    buf.grow_to(6 * G).unwrap();
    let places: Vec<Location> = buf.report().chunks.iter().map(|c| c.placement).collect();
    assert_eq!(
        places,
        vec![Location::Device(0); 6],
        "nothing moved, and new chunks go home"
    );
    assert!(contents(&buf)[..2 * G] == data[..]);
    // The same call without a fault moves the range and places growth there.
    buf.apply_migration_policy(0..8 * G, MigrationPolicy::PreferHost)
        .unwrap();
    buf.grow_to(8 * G).unwrap();
    assert!(buf
        .report()
        .chunks
        .iter()
        .all(|c| c.placement == Location::Host));
}

/// A fault backend over the host and a buffer of four `G` chunks on it.
fn four_chunks() -> (
    Arc<FaultBackend<HostBackend>>,
    GrowableBuffer<FaultBackend<HostBackend>>,
) {
    let fb = FaultBackend::new(host());
    let desc = BufferDesc::new(64 * G).growth(GrowthPolicy::Exact);
    let buf = GrowableBuffer::new(fb.clone(), desc).unwrap();
    buf.grow_to(4 * G).unwrap();
    (fb, buf)
}

/// No chunk the pool holds may be mapped anywhere: pooled bytes plus the
/// buffer's mapped bytes must equal what the backend has mapped or held.
fn assert_pool_holds_nothing_mapped(
    fb: &FaultBackend<HostBackend>,
    pool: &ChunkPool<FaultBackend<HostBackend>>,
    mapped_by_buffers: usize,
) {
    let live = fb.live();
    assert_eq!(
        live.mapped_bytes, mapped_by_buffers,
        "the backend maps exactly what the buffers account for"
    );
    assert_eq!(
        live.chunk_bytes,
        mapped_by_buffers + pool.stats().pooled_bytes,
        "every live chunk is either mapped by a buffer or idle in the pool, never both"
    );
}

/// Item 6 (grow): when the undo of a failed grow cannot unmap, the chunks it
/// mapped must not be released or pooled; the buffer answers "poisoned".
fn a_grow_whose_undo_fails_poisons_and_never_pools_a_mapped_chunk() {
    let fb = FaultBackend::new(host());
    let baseline = fb.live();
    let pool = ChunkPool::new(fb.clone(), PoolDesc::default()).unwrap();
    let desc = BufferDesc::new(64 * G).growth(GrowthPolicy::Exact);
    let a = GrowableBuffer::with_pool(&pool, desc.clone()).unwrap();
    a.grow_to(G).unwrap();
    // Grow by three chunks: 3 creates, 3 maps, then the access call fails,
    // and so does every unmap of the undo.
    fb.fail_nth(7);
    fb.fail_every(Some("unmap"));
    let r = a.grow_to(4 * G);
    fb.fail_nth(0);
    fb.fail_every(None);
    assert!(r.is_err());
    assert_pool_holds_nothing_mapped(&fb, &pool, fb.live().mapped_bytes);
    assert_eq!(
        pool.stats().pooled_chunks,
        0,
        "no mapped chunk went to the pool"
    );
    let poisoned = |r: vmmbuf::Result<()>| matches!(r, Err(Error::Poisoned { .. }));
    assert!(poisoned(a.grow_to(2 * G)), "{:?}", a.grow_to(2 * G));
    assert!(poisoned(a.read(0, &mut [0u8; 4])));
    // A second buffer on the same pool gets fresh chunks, not A's.
    let b = GrowableBuffer::with_pool(&pool, desc).unwrap();
    b.grow_to(3 * G).unwrap();
    drop(b);
    drop(a); // unmaps (no fault now) and gives everything back
    drop(pool);
    assert_eq!(fb.live(), baseline);
}

/// Item 6 (migration): a swap whose access call fails and whose undo cannot
/// unmap leaves the new chunk mapped: it must not be pooled, and the old one
/// (holding the data) must not be either.
fn a_migration_whose_undo_fails_poisons_and_never_pools_a_mapped_chunk() {
    let fb = FaultBackend::emulating_gpu(host());
    let baseline = fb.live();
    let pool = ChunkPool::new(fb.clone(), PoolDesc::default()).unwrap();
    let (mut buf, _) = emulated(&fb, Some(&pool), 2);
    // Staging: reserve, create, map, set_access, copy, sync, unmap, free = 8
    // calls; the swap: unmap, map, set_access (the 11th) fails, and every
    // unmap from then on (the undo's) fails too.
    fb.fail_nth(11);
    fb.fail_every_from(12, "unmap");
    let r = buf.migrate(0..G, Location::Host);
    fb.fail_nth(0);
    fb.fail_every(None);
    assert!(r.is_err());
    assert_eq!(pool.stats().pooled_chunks, 0, "no chunk went to the pool");
    assert!(matches!(
        buf.migrate(0..G, Location::Host),
        Err(Error::Poisoned { .. })
    ));
    assert!(matches!(buf.shrink_to_fit(), Err(Error::Poisoned { .. })));
    drop(buf);
    drop(pool);
    assert_eq!(fb.live(), baseline);
}

/// Item 7: a deferred release that fails must change nothing, not leave a
/// release pending behind an error.
fn a_failed_deferred_release_changes_nothing() {
    let (fb, mut buf) = four_chunks();
    buf.truncate(G);
    // The fence has passed, so the release happens now: its unmap fails.
    fb.fail_every(Some("unmap"));
    assert!(buf.shrink_to_fit_after(TestFence::passed()).is_err());
    fb.fail_every(None);
    assert_eq!(buf.capacity(), 4 * G, "a failed release keeps the chunks");
    buf.reclaim().unwrap();
    assert_eq!(
        buf.capacity(),
        4 * G,
        "and leaves nothing pending behind the error"
    );
    // A fence that cannot be queried: an error, nothing recorded.
    let broken = TestFence::default();
    broken.break_it();
    assert!(buf.shrink_to_fit_after(broken).is_err());
    buf.reclaim().unwrap();
    assert_eq!(buf.capacity(), 4 * G);
    buf.shrink_to_fit_after(TestFence::passed()).unwrap();
    assert_eq!(buf.capacity(), G);
}

/// Item 8: `Exact` growth planned one entry per granule before the first
/// call: 16 TiB aborted the process on a 32 GiB allocation.
fn a_16_tib_exact_growth_fails_cleanly() {
    let b = HostBackend::with_granularity(2 << 20).unwrap();
    let buf = GrowableBuffer::new(
        b.clone(),
        BufferDesc::new(16 << 40).growth(GrowthPolicy::Exact),
    )
    .unwrap();
    let t = std::time::Instant::now();
    let r = buf.grow_to(16 << 40);
    assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
    assert!(t.elapsed().as_secs() < 5, "refused before any work");
    assert_eq!((buf.len(), buf.capacity()), (0, 0));
    assert_eq!(b.live().chunks, 0);
}

/// Item 9: a pooled grow with a huge `Fixed` chunk overflowed in the fit
/// arithmetic (a panic in debug builds).
fn huge_fixed_chunks_in_a_pooled_grow_are_no_panic() {
    let b = host();
    let pool = ChunkPool::new(b.clone(), PoolDesc::default()).unwrap();
    for chunk_bytes in [
        usize::MAX - G,
        usize::MAX - (8 << 20),
        usize::MAX / 2,
        1 << 62,
    ] {
        let desc = BufferDesc::new(16 * G).growth(GrowthPolicy::Fixed { chunk_bytes });
        let buf = GrowableBuffer::with_pool(&pool, desc).unwrap();
        buf.grow_to(3 * G + 1).unwrap();
        assert_eq!(buf.capacity(), 16 * G, "one chunk, cut to the reservation");
        drop(buf);
        let buf = GrowableBuffer::with_pool(
            &pool,
            BufferDesc::new(16 * G).growth(GrowthPolicy::Fixed { chunk_bytes }),
        )
        .unwrap();
        buf.grow_to(2 * G).unwrap(); // takes the pooled chunk
        assert_eq!(buf.capacity(), 16 * G);
    }
    for bad in [
        GrowthPolicy::Proportional { divisor: 0 },
        GrowthPolicy::Fixed { chunk_bytes: 0 },
        GrowthPolicy::Fixed {
            chunk_bytes: usize::MAX,
        },
    ] {
        let r = GrowableBuffer::new(b.clone(), BufferDesc::new(16 * G).growth(bad));
        assert!(matches!(r, Err(Error::InvalidArgument(_))), "{bad:?}");
        let mut buf = GrowableBuffer::new(b.clone(), BufferDesc::new(16 * G)).unwrap();
        assert!(matches!(
            buf.set_growth_policy(bad),
            Err(Error::InvalidArgument(_))
        ));
    }
}

/// Item 10: the host backend mapped one chunk at two offsets (two views of
/// the same memory, one of them unaccounted for).
fn the_host_backend_maps_a_chunk_once() {
    let b = host();
    let mut res = b.reserve(8 * G, G).unwrap();
    let c = b.create(G, Location::Host).unwrap();
    b.map(&mut res, 0, &c).unwrap();
    assert!(matches!(
        b.map(&mut res, 2 * G, &c),
        Err(Error::InvalidArgument(_))
    ));
    let mut other = b.reserve(8 * G, G).unwrap();
    assert!(
        b.map(&mut other, 0, &c).is_err(),
        "nor in another reservation"
    );
    b.unmap(&mut res, 0, G).unwrap();
    b.map(&mut other, G, &c).unwrap(); // once unmapped, it maps again
    b.unmap(&mut other, G, G).unwrap();
    b.release(c).unwrap();
    b.free(res).unwrap();
    b.free(other).unwrap();
}

/// Item 10: `memfd_create` failing for lack of descriptors was reported as
/// out of memory.
fn too_many_open_files_is_not_out_of_memory() {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let b = host();
    let old = getrlimit(Resource::Nofile);
    let open = std::fs::read_dir("/proc/self/fd").unwrap().count() as u64;
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(open + 4),
            maximum: old.maximum,
        },
    )
    .unwrap();
    let mut chunks = Vec::new();
    let err = loop {
        match b.create(G, Location::Host) {
            Ok(c) => chunks.push(c),
            Err(e) => break e,
        }
        assert!(chunks.len() < 64, "the descriptor limit never bit");
    };
    setrlimit(Resource::Nofile, old).unwrap();
    assert!(
        matches!(
            err,
            Error::Os {
                call: "memfd_create",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(
        !err.is_transient(),
        "not an out-of-memory the caller can wait out"
    );
}

/// Item 11: every `apply_migration_policy` appended to a list scanned for
/// each new chunk: after 200k calls a growth slowed 16x. Ranges now replace
/// what they cover, so the list holds distinct intervals only.
fn placement_ranges_stay_bounded_however_often_they_are_set() {
    let fb = FaultBackend::emulating_gpu(host());
    let (mut buf, _) = emulated(&fb, None, 2);
    for i in 0..200_000usize {
        let p = if i % 2 == 0 {
            MigrationPolicy::PreferHost
        } else {
            MigrationPolicy::Default
        };
        // Past the capacity: no chunk moves, only the range is recorded.
        buf.apply_migration_policy(8 * G..40 * G, p).unwrap();
    }
    buf.apply_migration_policy(16 * G..24 * G, MigrationPolicy::PreferHost)
        .unwrap();
    assert_eq!(
        buf.placement_ranges(),
        vec![
            (8 * G..16 * G, Location::Device(0)),
            (16 * G..24 * G, Location::Host),
            (24 * G..40 * G, Location::Device(0)),
        ]
    );
    buf.grow_to(40 * G).unwrap();
    let host: Vec<usize> = buf
        .report()
        .chunks
        .iter()
        .filter(|c| c.placement == Location::Host)
        .map(|c| c.offset / G)
        .collect();
    assert_eq!(host, (16..24).collect::<Vec<_>>());
}

/// Item 3: `shrink_to_fit_after` trusted the caller's fence; work recorded
/// on another queue must pass too before the chunks go.
fn a_deferred_release_waits_for_recorded_uses_not_only_its_fence() {
    let (fb, mut buf) = four_chunks();
    let busy = TestFence::default(); // work on "stream B", still running
    buf.record_use(busy.clone());
    buf.truncate(G);
    buf.shrink_to_fit_after(TestFence::passed()).unwrap(); // "stream A", idle
    buf.reclaim().unwrap();
    assert_eq!(buf.capacity(), 4 * G, "B's work still uses the tail");
    busy.pass();
    buf.reclaim().unwrap();
    assert_eq!(buf.capacity(), G, "released once B passed");
    assert_eq!(fb.live().device_syncs, 0, "no device-wide wait on the way");
}

/// Shrinking, migrating, access changes and drop wait for the recorded uses
/// (here: a wait that fails leaves everything as it was).
fn giving_memory_back_waits_for_recorded_uses() {
    let fb = FaultBackend::emulating_gpu(host());
    let (mut buf, data) = emulated(&fb, None, 4);
    let busy = TestFence::default();
    buf.record_use(busy.clone());
    buf.truncate(G);
    // The test backend refuses to wait on a fence that never passes.
    assert!(buf.shrink_to_fit().is_err());
    assert!(buf.migrate(0..G, Location::Host).is_err());
    assert!(buf
        .set_access(0..G, Location::Device(0), Access::Read)
        .is_err());
    assert_eq!(
        (buf.capacity(), buf.stats().host_bytes),
        (4 * G, 0),
        "nothing changed"
    );
    busy.pass();
    buf.shrink_to_fit().unwrap();
    buf.migrate(0..G, Location::Host).unwrap();
    assert_eq!((buf.capacity(), buf.stats().host_bytes), (G, G));
    assert!(contents(&buf) == data[..G]);
    // A newer fence on the same queue replaces the older one.
    buf.grow_to(3 * G).unwrap();
    buf.truncate(G);
    let (a, b) = (TestFence::default(), TestFence::default());
    let shared = TestFence(a.0.clone(), a.1.clone());
    buf.record_use(a);
    buf.record_use(b.clone()); // another queue
    shared.pass();
    assert!(buf.shrink_to_fit().is_err(), "b has not passed");
    b.pass();
    buf.shrink_to_fit().unwrap();
    assert_eq!(buf.capacity(), G);
    assert_eq!(fb.live().device_syncs, 0);
}
