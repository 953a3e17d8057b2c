//! The chunk pool and stream-ordered release, on both backends.

use std::sync::Arc;

use crate::common::{assert_consistent, contents, random_bytes};
use crate::fault::{FaultBackend, TestFence};
use vmmbuf::{Backend, BufferDesc, ChunkPool, GrowableBuffer, GrowthPolicy, PoolDesc};

crate::register! {
    generic: [pooled_chunks_are_reused_across_buffers, regrowth_after_shrink_takes_pooled_chunks, the_pool_sheds_past_its_high_watermark, out_of_memory_drains_the_pool_and_retries_once, deferred_release_waits_for_its_fence, deferred_release_never_frees_what_was_regrown, a_reserved_pool_serves_growth_without_creating, a_failed_reserve_keeps_nothing],
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
    mut base: vmmbuf::LiveCounts,
    pool: &ChunkPool<B>,
) -> vmmbuf::LiveCounts {
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

fn deferred_release_waits_for_its_fence<B: Backend>(real: Arc<B>) {
    let g = real.granularity(real.home()).unwrap();
    let fb = FaultBackend::new(real.clone());
    let baseline = fb.live();
    let mut buf = GrowableBuffer::new(
        fb.clone(),
        BufferDesc::new(64 * g).growth(GrowthPolicy::Exact),
    )
    .unwrap();
    buf.grow_to(8 * g).unwrap();
    let data = random_bytes(9, 8 * g);
    buf.write(0, &data).unwrap();
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
    let g = real.granularity(real.home()).unwrap();
    let fb = FaultBackend::new(real.clone());
    let baseline = fb.live();
    let mut buf = GrowableBuffer::new(
        fb.clone(),
        BufferDesc::new(64 * g).growth(GrowthPolicy::Exact),
    )
    .unwrap();
    buf.grow_to(8 * g).unwrap();
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
    // trim() forces what is still pending.
    buf.truncate(0);
    buf.shrink_to_fit_after(TestFence::default()).unwrap();
    assert_eq!(buf.capacity(), g);
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
