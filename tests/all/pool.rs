//! The chunk pool and stream-ordered release, on both backends.

use std::sync::Arc;

use crate::common::{assert_consistent, contents, random_bytes};
use crate::failing_backend::{FaultBackend, TestFence};
use vmmbuf::{Backend, BufferDesc, ChunkPool, GrowableBuffer, GrowthPolicy, PoolDesc};

crate::register! {
    generic: [pooled_chunks_are_reused_across_buffers, regrowth_after_shrink_takes_pooled_chunks, the_pool_sheds_past_its_high_watermark, out_of_memory_drains_the_pool_and_retries_once, deferred_release_waits_for_its_fence, deferred_release_never_frees_what_was_regrown, a_reserved_pool_serves_growth_without_creating, a_failed_reserve_keeps_nothing, default_pool_serves_regrowth_without_asking, default_pool_bounds_and_trim_give_memory_back],
    host: [default_pool_chunks_go_back_to_the_kernel_when_the_backend_drops],
}

/// `GrowableBuffer::new` takes the backend's default pool: chunks a shrink
/// gives up stay pooled and the next growth (of this buffer or another)
/// maps them again, creating nothing; every handle on the default pool sees
/// the same chunks; an unpooled buffer's chunks go straight back.
fn default_pool_serves_regrowth_without_asking<B: Backend>(backend: Arc<B>) {
    let g = backend.granularity(backend.home()).unwrap();
    let pool = vmmbuf::ChunkPool::default_for(&backend).expect("both backends have a default pool");
    pool.set_desc(PoolDesc::default()).unwrap(); // the helpers set 0
    let baseline = backend.live();
    let mut buf = GrowableBuffer::new(backend.clone(), BufferDesc::new(256 * g)).unwrap();
    assert!(buf.pool().is_some(), "new() gives the default pool");
    let steps: Vec<usize> = (1..=24).map(|i| i * 3 * g + 7 * i).collect();
    for &s in &steps {
        buf.grow_to(s).unwrap();
    }
    let data = random_bytes(41, buf.len());
    buf.write(0, &data).unwrap();
    let (chunks, created) = (buf.chunk_count(), backend.live().chunks - baseline.chunks);
    assert_eq!(chunks, created);

    // Shrink to a prefix: the chunks past it stay pooled, none released.
    let keep = steps[5];
    buf.truncate(keep);
    buf.shrink_to_fit().unwrap();
    let pooled = chunks - buf.chunk_count();
    assert!(pooled > 0);
    let other = vmmbuf::ChunkPool::default_for(&backend).unwrap();
    assert_eq!(
        other.stats().pooled_chunks,
        pooled,
        "one pool behind every handle"
    );
    assert_eq!(
        backend.live().chunks,
        baseline.chunks + chunks,
        "pooled, not released"
    );
    assert!(contents(&buf) == data[..keep], "the kept prefix is intact");

    // Regrow along the same steps: the chunks come from the pool (the plan
    // may take fewer, larger ones), none is created.
    let hits = pool.stats().hits;
    for &s in &steps {
        buf.grow_to(s).unwrap();
    }
    let st = pool.stats();
    assert!(st.hits > hits, "{st}");
    assert_eq!((st.hits - hits) as usize + st.pooled_chunks, pooled, "{st}");
    assert_eq!(
        backend.live().chunks,
        baseline.chunks + chunks,
        "nothing created"
    );
    let fresh = random_bytes(42, buf.len() - keep);
    buf.write(keep, &fresh).unwrap();
    let all = contents(&buf);
    assert!(all[..keep] == data[..keep] && all[keep..] == fresh[..]);

    // Another buffer grows into what this one gives up at drop.
    drop(buf);
    assert_eq!(pool.stats().pooled_chunks, chunks);
    let b2 = GrowableBuffer::new(backend.clone(), BufferDesc::new(256 * g)).unwrap();
    for &s in &steps {
        b2.grow_to(s).unwrap();
    }
    assert_eq!(
        backend.live().chunks,
        baseline.chunks + chunks,
        "all reused"
    );
    drop(b2);

    // An unpooled buffer gives its chunks straight back.
    let mut own =
        GrowableBuffer::new(backend.clone(), BufferDesc::new(64 * g).pooled(false)).unwrap();
    assert!(own.pool().is_none());
    own.grow_to(40 * g).unwrap(); // more than the pool holds in one size
    let before = backend.live().chunks;
    own.truncate(0);
    own.shrink_to_fit().unwrap();
    assert!(backend.live().chunks < before, "released, not pooled");
    assert_eq!(
        pool.stats().pooled_chunks,
        chunks,
        "the pool did not take them"
    );
    drop(own);

    pool.trim().unwrap();
    assert_eq!(backend.live(), baseline, "trim gave every chunk back");
}

/// A release threshold bounds the default pool at once and from then on;
/// bad bounds are refused and change nothing; trim empties it.
fn default_pool_bounds_and_trim_give_memory_back<B: Backend>(backend: Arc<B>) {
    let g = backend.granularity(backend.home()).unwrap();
    let pool = vmmbuf::ChunkPool::default_for(&backend).unwrap();
    pool.set_desc(PoolDesc::default()).unwrap();
    let baseline = backend.live();
    let desc = BufferDesc::new(64 * g).growth(GrowthPolicy::Exact);
    let buf = GrowableBuffer::new(backend.clone(), desc.clone()).unwrap();
    buf.grow_to(10 * g).unwrap();
    drop(buf);
    assert_eq!(pool.stats().pooled_bytes, 10 * g);
    assert!(pool.set_desc(PoolDesc::watermarks(3 * g, g)).is_err());
    assert_eq!(
        pool.desc(),
        PoolDesc::default(),
        "a refused bound changes nothing"
    );
    assert_eq!(pool.stats().pooled_bytes, 10 * g);

    pool.set_release_threshold(4 * g).unwrap();
    assert_eq!(pool.desc(), PoolDesc::release_threshold(4 * g));
    let s = pool.stats();
    assert_eq!((s.pooled_bytes, s.released), (4 * g, 6), "{s}");
    assert_eq!(backend.live().chunks, baseline.chunks + 4);

    // Growth takes the 4, creates 2; giving 6 back keeps 4 again.
    let mut buf = GrowableBuffer::new(backend.clone(), desc).unwrap();
    buf.grow_to(6 * g).unwrap();
    assert_eq!(pool.stats().pooled_chunks, 0);
    let data = random_bytes(43, 6 * g);
    buf.write(0, &data).unwrap();
    assert!(contents(&buf) == data);
    buf.truncate(0);
    buf.shrink_to_fit().unwrap();
    assert_eq!(pool.stats().pooled_bytes, 4 * g, "{}", pool.stats());
    assert_eq!(backend.live().chunks, baseline.chunks + 4);

    pool.trim().unwrap();
    assert_eq!(pool.stats().pooled_chunks, 0);
    assert_eq!(backend.live().chunks, baseline.chunks);
    drop(buf);
    assert_eq!(backend.live(), baseline);
}

/// The default pool lives as long as its backend: when the backend (and
/// every buffer, which holds it) is gone, the kernel has its memfds back.
fn default_pool_chunks_go_back_to_the_kernel_when_the_backend_drops() {
    let count = || {
        std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
            .filter(|t| t.to_string_lossy().contains("memfd:vmmbuf"))
            .count()
    };
    let fds = count();
    let backend = vmmbuf::HostBackend::with_granularity(64 << 10).unwrap();
    let buf = GrowableBuffer::new(
        backend.clone(),
        BufferDesc::new(1 << 24).growth(GrowthPolicy::Exact),
    )
    .unwrap();
    buf.grow_to(7 << 16).unwrap();
    drop(buf);
    let pool =
        vmmbuf::ChunkPool::default_for(&backend).expect("the host backend has a default pool");
    assert_eq!(pool.stats().pooled_chunks, 7);
    assert_eq!(count(), fds + 7, "pooled chunks keep their memfds");
    drop(pool);
    assert_eq!(count(), fds + 7, "the backend still holds its pool");
    drop(backend);
    assert_eq!(count(), fds, "the backend's drop gave them back");
}

fn pooled_chunks_are_reused_across_buffers<B: Backend>(backend: Arc<B>) {
    let g = backend.granularity(backend.home()).unwrap();
    let baseline = backend.live();
    let pool = ChunkPool::new(backend.clone(), PoolDesc::default()).unwrap();
    let desc = BufferDesc::new(64 * g).growth(GrowthPolicy::Exact);
    let a = GrowableBuffer::with_pool(&pool, desc.clone()).unwrap();
    a.grow_to(8 * g).unwrap();
    drop(a);
    assert_eq!(pool.stats().pooled_chunks, 8, "{}", pool.stats());
    assert_eq!(
        backend.live().chunks,
        baseline.chunks + 8,
        "pooled chunks stay allocated"
    );
    assert_eq!(
        backend.live().mapped_bytes,
        baseline.mapped_bytes,
        "but unmapped"
    );

    let mut b = GrowableBuffer::with_pool(&pool, desc).unwrap();
    b.grow_to(10 * g).unwrap();
    assert_eq!(pool.stats().hits, 8);
    assert_eq!(
        backend.live().chunks,
        baseline.chunks + 10,
        "8 reused, 2 created"
    );
    let data = random_bytes(1, 10 * g);
    b.write(0, &data).unwrap();
    assert!(contents(&b) == data);
    b.truncate(0);
    b.shrink_to_fit().unwrap();
    assert_eq!(pool.stats().pooled_chunks, 10);
    pool.trim().unwrap();
    assert_eq!(pool.stats().pooled_bytes, 0);
    assert_eq!(
        backend.live().chunks,
        baseline.chunks,
        "trim gave the chunks back"
    );
    drop(b);
    drop(pool);
    assert_eq!(backend.live(), baseline);
}

fn regrowth_after_shrink_takes_pooled_chunks<B: Backend>(backend: Arc<B>) {
    let g = backend.granularity(backend.home()).unwrap();
    let baseline = backend.live();
    let pool = ChunkPool::new(backend.clone(), PoolDesc::default()).unwrap();
    let mut buf = GrowableBuffer::with_pool(&pool, BufferDesc::new(1024 * g)).unwrap();
    let steps: Vec<usize> = (1..=40).map(|i| i * 5 * g + 123).collect();
    for &s in &steps {
        buf.grow_to(s).unwrap();
    }
    let chunks = buf.chunk_count();
    let created = backend.live().chunks - baseline.chunks;
    buf.truncate(0);
    buf.shrink_to_fit().unwrap();
    assert_eq!(pool.stats().pooled_chunks, chunks);
    for &s in &steps {
        let grows = buf.stats().grows;
        buf.grow_to(s).unwrap();
        if buf.stats().grows > grows {
            let bound = crate::common::overcommit_bound(buf.growth_policy(), g, s);
            assert!(
                buf.capacity() - s < bound,
                "pooled chunks kept over-commit in bound\n{}",
                buf.report()
            );
        }
    }
    assert_eq!(
        backend.live().chunks - baseline.chunks,
        created,
        "regrowth created nothing new"
    );
    assert_eq!(pool.stats().hits as usize, chunks);
    assert_consistent(&buf, baseline_with_pool(baseline, &pool));
}

/// The live counts a buffer is measured against when a pool holds chunks too.
fn baseline_with_pool<B: Backend>(
    mut base: vmmbuf::stats::LiveCounts,
    pool: &ChunkPool<B>,
) -> vmmbuf::stats::LiveCounts {
    base.chunks += pool.stats().pooled_chunks;
    base
}

fn the_pool_sheds_past_its_high_watermark<B: Backend>(backend: Arc<B>) {
    let g = backend.granularity(backend.home()).unwrap();
    let baseline = backend.live();
    assert!(ChunkPool::new(backend.clone(), PoolDesc::watermarks(2, 1)).is_err());
    let pool = ChunkPool::new(backend.clone(), PoolDesc::watermarks(2 * g, 4 * g)).unwrap();
    let mut buf =
        GrowableBuffer::with_pool(&pool, BufferDesc::new(64 * g).growth(GrowthPolicy::Exact))
            .unwrap();
    buf.grow_to(6 * g).unwrap();
    buf.truncate(0);
    buf.shrink_to_fit().unwrap();
    // The 5th chunk back takes the pool to 5g > 4g: it sheds to 2g (3
    // released); the 6th takes it to 3g, under the high mark.
    let s = pool.stats();
    assert_eq!(
        (s.pooled_chunks, s.pooled_bytes, s.released),
        (3, 3 * g, 3),
        "{s}"
    );
    assert_eq!(backend.live().chunks, baseline.chunks + 3);
}

fn out_of_memory_drains_the_pool_and_retries_once<B: Backend>(real: Arc<B>) {
    let g = real.granularity(real.home()).unwrap();
    let fb = FaultBackend::new(real.clone());
    let baseline = fb.live();
    let pool = ChunkPool::new(fb.clone(), PoolDesc::default()).unwrap();
    let desc = BufferDesc::new(64 * g).growth(GrowthPolicy::Exact);
    let other = GrowableBuffer::with_pool(&pool, desc.clone()).unwrap();
    other.grow_to(2 * g).unwrap();
    drop(other); // two chunks now idle in the pool
    let buf = GrowableBuffer::with_pool(&pool, desc).unwrap();
    // The first attempt takes the 2 pooled chunks and must create 1: fail
    // that create as out of memory. The pool is drained, the retry creates 3.
    fb.fail_nth(1);
    buf.grow_to(3 * g).unwrap();
    assert_eq!(fb.injected(), 1);
    let s = pool.stats();
    assert_eq!(
        (s.oom_drains, s.pooled_chunks, s.released),
        (1, 0, 2),
        "{s}"
    );
    assert_eq!(buf.chunk_count(), 3);
    assert_consistent(&buf, baseline);
    // Out of memory with an empty pool is returned as it is.
    fb.fail_nth(1);
    let e = buf.grow_to(4 * g).unwrap_err();
    assert!(e.is_transient(), "{e}");
    assert_eq!(buf.chunk_count(), 3);
    assert_consistent(&buf, baseline);
}

/// A buffer of 8 granules in `Exact` chunks over a fault backend, filled
/// with seeded data: what the deferred-release tests start from.
pub(crate) struct Fenced<B: Backend> {
    pub(crate) g: usize,
    pub(crate) fb: Arc<FaultBackend<B>>,
    pub(crate) baseline: vmmbuf::stats::LiveCounts,
    pub(crate) buf: GrowableBuffer<FaultBackend<B>>,
    pub(crate) data: Vec<u8>,
}

pub(crate) fn eight_granules<B: Backend>(real: Arc<B>, seed: u64) -> Fenced<B> {
    let g = real.granularity(real.home()).unwrap();
    let fb = FaultBackend::new(real.clone());
    let baseline = fb.live();
    let mut buf = GrowableBuffer::new(
        fb.clone(),
        BufferDesc::new(64 * g).growth(GrowthPolicy::Exact),
    )
    .unwrap();
    buf.grow_to(8 * g).unwrap();
    let data = random_bytes(seed, 8 * g);
    buf.write(0, &data).unwrap();
    Fenced {
        g,
        fb,
        baseline,
        buf,
        data,
    }
}

fn deferred_release_waits_for_its_fence<B: Backend>(real: Arc<B>) {
    let Fenced {
        g,
        fb,
        baseline,
        mut buf,
        data,
    } = eight_granules(real, 9);
    let fence = TestFence::default();
    let calls = fb.injected();
    buf.truncate(3 * g);
    buf.shrink_to_fit_after(fence.clone()).unwrap();
    assert_eq!(buf.len(), 3 * g);
    assert_eq!(
        buf.capacity(),
        8 * g,
        "nothing is unmapped before the fence passes"
    );
    assert_eq!(fb.live().mapped_bytes, baseline.mapped_bytes + 8 * g);
    buf.reclaim().unwrap();
    buf.grow_to(3 * g).unwrap(); // a no-op growth polls too
    assert_eq!(buf.capacity(), 8 * g);
    fence.pass();
    buf.reclaim().unwrap();
    assert_eq!(buf.capacity(), 3 * g, "released once the fence passed");
    assert_eq!(fb.injected(), calls, "no fault was involved");
    assert!(contents(&buf) == data[..3 * g]);
    assert_consistent(&buf, baseline);
    // A fence that has already passed releases at once.
    let done = TestFence::default();
    done.pass();
    buf.truncate(g);
    buf.shrink_to_fit_after(done).unwrap();
    assert_eq!(buf.capacity(), g);
    assert_consistent(&buf, baseline);
}

fn deferred_release_never_frees_what_was_regrown<B: Backend>(real: Arc<B>) {
    let Fenced {
        g,
        fb,
        baseline,
        mut buf,
        ..
    } = eight_granules(real, 10);
    let f1 = TestFence::default();
    buf.truncate(2 * g);
    buf.shrink_to_fit_after(f1.clone()).unwrap();
    // Regrow into the still-mapped tail before the fence passes: work after
    // the fence may now use bytes up to 6g.
    buf.grow_to(6 * g).unwrap();
    assert_eq!(buf.capacity(), 8 * g, "regrowth reused the mapped tail");
    let f2 = TestFence::default();
    buf.truncate(g);
    buf.shrink_to_fit_after(f2.clone()).unwrap();
    f1.pass();
    buf.reclaim().unwrap();
    assert_eq!(
        buf.capacity(),
        6 * g,
        "f1 only frees past the 6g used since it"
    );
    f2.pass();
    buf.reclaim().unwrap();
    assert_eq!(buf.capacity(), g);
    assert_consistent(&buf, baseline);
    // shrink_to_fit waits for what is still pending (RT-5): a fence that
    // has not passed is waited on, never dropped; here it never passes, so
    // the wait fails and nothing changes.
    buf.truncate(0);
    let f3 = TestFence::default();
    buf.shrink_to_fit_after(f3.clone()).unwrap();
    assert_eq!(buf.capacity(), g);
    assert!(
        buf.shrink_to_fit().is_err(),
        "waited on f3, which never passes"
    );
    assert_eq!(buf.capacity(), g, "nothing unmapped under f3");
    f3.pass();
    buf.shrink_to_fit().unwrap();
    assert_eq!(buf.capacity(), 0);
    drop(buf);
    assert_eq!(fb.live(), baseline);
}

/// `ChunkPool::reserve` creates ahead of time; growth then only maps.
fn a_reserved_pool_serves_growth_without_creating<B: Backend>(backend: Arc<B>) {
    let g = backend.granularity(backend.home()).unwrap();
    let baseline = backend.live();
    let pool = ChunkPool::new(backend.clone(), PoolDesc::watermarks(0, 0)).unwrap();
    assert_eq!(pool.reserve(backend.home(), g, 5 * g + 1).unwrap(), 6 * g);
    let s = pool.stats();
    assert_eq!(
        (s.pooled_chunks, s.pooled_bytes),
        (6, 6 * g),
        "kept past the watermarks"
    );
    assert_eq!(backend.live().chunks, baseline.chunks + 6);
    let desc = BufferDesc::new(64 * g).growth(GrowthPolicy::Fixed { chunk_bytes: g });
    let mut b = GrowableBuffer::with_pool(&pool, desc).unwrap();
    b.grow_to(6 * g).unwrap();
    assert_eq!(pool.stats().hits, 6);
    assert_eq!(
        backend.live().chunks,
        baseline.chunks + 6,
        "nothing created"
    );
    let data = random_bytes(4, 6 * g);
    b.write(0, &data).unwrap();
    assert!(contents(&b) == data);
    drop(b);
    drop(pool);
    assert_eq!(backend.live(), baseline);
}

/// A reserve that runs out of memory part way keeps nothing.
fn a_failed_reserve_keeps_nothing<B: Backend>(real: Arc<B>) {
    let fb = FaultBackend::new(real);
    let g = fb.granularity(fb.home()).unwrap();
    let baseline = fb.live();
    let pool = ChunkPool::new(fb.clone(), PoolDesc::default()).unwrap();
    fb.fail_every_from(3, "create");
    let r = pool.reserve(fb.home(), g, 8 * g);
    fb.fail_every(None);
    assert!(r.is_err());
    assert_eq!(pool.stats().pooled_chunks, 0);
    assert_eq!(fb.live(), baseline, "the two chunks made were released");
}
