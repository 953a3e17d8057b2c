//! Fault injection: fail the k-th driver call of grow, trim, shrink and drop,
//! for every k; each time the buffer is unchanged (or, for trim, consistently
//! trimmed), its data intact, and nothing leaks.

use std::sync::Arc;

use crate::common::{assert_consistent, contents, random_bytes};
use crate::failing_backend::{fail_each_call, FaultBackend, TestFence};
use vmmbuf::{Backend, BufferDesc, ChunkPool, GrowableBuffer, GrowthPolicy, PoolDesc};

crate::register! {
    generic: [every_failed_grow_call_is_undone, every_failed_trim_call_keeps_the_buffer_consistent, every_failed_drop_call_still_gives_everything_back, every_failed_call_of_a_pooled_buffer_is_undone],
}

/// The driver's free memory where the backend can tell (CUDA), for checks
/// that memory really went back, not only the backend's counters.
fn device_free<B: Backend>(b: &B) -> Option<usize> {
    let any: &dyn std::any::Any = b;
    any.downcast_ref::<vmmbuf::CudaBackend>()
        .map(|c| c.mem_info().expect("cuMemGetInfo").0)
}

fn every_failed_grow_call_is_undone<B: Backend>(real: Arc<B>) {
    let g = real.granularity(real.home()).unwrap();
    for policy in [GrowthPolicy::Exact, GrowthPolicy::default()] {
        let fb = FaultBackend::new(real.clone());
        let baseline = fb.live();
        let mut buf =
            GrowableBuffer::new(fb.clone(), BufferDesc::new(256 * g).growth(policy)).unwrap();
        buf.grow_to(2 * g + 3).unwrap();
        let data = random_bytes(11, 2 * g + 3);
        buf.write(0, &data).unwrap();
        let free_before = device_free(&*real);
        let before = (
            buf.len(),
            buf.capacity(),
            buf.chunk_count(),
            fb.live(),
            buf.base(),
        );
        let calls = fail_each_call(
            &fb,
            &mut buf,
            |buf| buf.grow_to(9 * g + 1), // Exact: 3 granules mapped, 10 needed
            |buf, k, r| {
                let e = r.unwrap_err();
                assert!(crate::failing_backend::injected(&e), "{e}");
                assert_eq!(
                    before,
                    (
                        buf.len(),
                        buf.capacity(),
                        buf.chunk_count(),
                        fb.live(),
                        buf.base()
                    ),
                    "k={k}"
                );
                assert_eq!(
                    device_free(&*real),
                    free_before,
                    "k={k}: device memory leaked"
                );
                assert!(contents(buf) == data, "k={k}: data changed");
                assert_consistent(buf, baseline);
            },
        );
        // Exact: 7 creates + 7 maps + 1 set_access; proportional: one chunk.
        let expected_calls = if policy == GrowthPolicy::Exact {
            7 + 7 + 1
        } else {
            3
        };
        assert_eq!(
            calls, expected_calls,
            "{policy:?}: every call of the grow was failed once"
        );
        assert_eq!(buf.len(), 9 * g + 1);
        assert!(contents(&buf)[..data.len()] == data[..]);
        assert_consistent(&buf, baseline);
        drop(buf);
        assert_eq!(fb.live(), baseline);
    }
}

fn every_failed_trim_call_keeps_the_buffer_consistent<B: Backend>(real: Arc<B>) {
    let g = real.granularity(real.home()).unwrap();
    let mut k = 1;
    loop {
        let fb = FaultBackend::new(real.clone());
        let baseline = fb.live();
        let free_start = device_free(&*real);
        let mut buf = GrowableBuffer::new(
            fb.clone(),
            BufferDesc::new(64 * g).growth(GrowthPolicy::Exact),
        )
        .unwrap();
        buf.grow_to(6 * g).unwrap();
        let data = random_bytes(k as u64, 6 * g);
        buf.write(0, &data).unwrap();
        buf.record_use(TestFence::passed()); // work that used it, done
        fb.fail_nth(k);
        buf.truncate(2 * g - 1);
        let r = buf.shrink_to_fit(); // wait for the use, unmap, 4 releases
        fb.fail_nth(0);
        assert_eq!(
            buf.len(),
            2 * g - 1,
            "truncate happens before any driver call"
        );
        assert!(
            contents(&buf)[..] == data[..2 * g - 1],
            "k={k}: kept data changed"
        );
        assert_consistent(&buf, baseline);
        match k {
            1 | 2 => {
                assert!(r.is_err(), "k={k}");
                assert_eq!(
                    buf.capacity(),
                    6 * g,
                    "k={k}: a failed wait or unmap changes nothing"
                );
                buf.shrink_to_fit().unwrap();
            }
            _ if r.is_err() => {}
            _ => {
                assert_eq!(k, 7, "wait + unmap + 4 releases");
                assert_eq!(fb.injected(), 0);
            }
        }
        // A release that failed gave the chunk back through its token.
        assert_eq!(buf.capacity(), 2 * g, "k={k}");
        assert_consistent(&buf, baseline);
        drop(buf);
        assert_eq!(fb.live(), baseline, "k={k}");
        assert_eq!(
            device_free(&*real),
            free_start,
            "k={k}: device memory leaked"
        );
        if r.is_ok() {
            break;
        }
        k += 1;
    }
}

fn every_failed_drop_call_still_gives_everything_back<B: Backend>(real: Arc<B>) {
    let g = real.granularity(real.home()).unwrap();
    for k in 1..=6 {
        // wait for the recorded use, unmap, 3 releases, free
        let fb = FaultBackend::new(real.clone());
        let baseline = fb.live();
        let free_start = device_free(&*real);
        let buf = GrowableBuffer::new(
            fb.clone(),
            BufferDesc::new(64 * g).growth(GrowthPolicy::Exact),
        )
        .unwrap();
        buf.grow_to(3 * g).unwrap();
        buf.record_use(TestFence::passed());
        fb.fail_nth(k);
        drop(buf);
        assert_eq!(fb.injected(), 1, "k={k}: the drop made at least k calls");
        // Where the unmap could not run, the reservation token unmaps what it
        // holds as it drops, after a device-wide wait: the failure path only.
        let mut live = fb.live();
        assert!(live.device_syncs - baseline.device_syncs <= 1, "k={k}");
        live.device_syncs = baseline.device_syncs;
        assert_eq!(live, baseline, "k={k}");
        assert_eq!(
            device_free(&*real),
            free_start,
            "k={k}: device memory leaked"
        );
    }
}

fn every_failed_call_of_a_pooled_buffer_is_undone<B: Backend>(real: Arc<B>) {
    let g = real.granularity(real.home()).unwrap();
    let fb = FaultBackend::new(real.clone());
    let baseline = fb.live();
    let pool = ChunkPool::new(fb.clone(), PoolDesc::watermarks(g, 3 * g)).unwrap();
    let desc = BufferDesc::new(64 * g).growth(GrowthPolicy::Exact);
    let mut buf = GrowableBuffer::with_pool(&pool, desc).unwrap();
    buf.grow_to(g).unwrap();
    let data = random_bytes(3, g);
    buf.write(0, &data).unwrap();
    let with_pool = |pool: &ChunkPool<FaultBackend<B>>| {
        let mut b = baseline;
        b.chunks += pool.stats().pooled_chunks;
        b
    };
    let refill = |pool: &Arc<ChunkPool<FaultBackend<B>>>| {
        // Two chunks idle in the pool.
        while pool.stats().pooled_chunks < 2 {
            let other =
                GrowableBuffer::with_pool(pool, BufferDesc::new(8 * g).growth(GrowthPolicy::Exact))
                    .unwrap();
            other.grow_to(2 * g).unwrap();
        }
    };
    // A growth needing four chunks, two of them from the pool.
    refill(&pool);
    let drains = std::cell::Cell::new(pool.stats().oom_drains);
    let returns = std::cell::Cell::new(pool.stats().returns);
    let calls = fail_each_call(
        &fb,
        &mut buf,
        |buf| buf.grow_to(5 * g),
        |buf, k, r| {
            match r {
                Err(_) => {
                    assert_eq!((buf.len(), buf.capacity()), (g, g), "k={k}");
                    // Every chunk the attempt held (2 taken, up to 2 created) went
                    // back to the pool, which may then shed past its watermark.
                    assert!(
                        pool.stats().returns >= returns.get() + 2,
                        "k={k}: held chunks went back to the pool"
                    );
                }
                Ok(()) => {
                    // An out-of-memory create: the pool was drained and the grow retried.
                    assert_eq!(
                        pool.stats().oom_drains,
                        drains.get() + 1,
                        "k={k}: succeeded without a retry"
                    );
                    assert_eq!(buf.len(), 5 * g);
                    buf.truncate(g);
                    buf.shrink_to_fit().unwrap();
                }
            }
            assert!(contents(buf)[..g] == data[..], "k={k}");
            assert_consistent(buf, with_pool(&pool));
            refill(&pool);
            drains.set(pool.stats().oom_drains);
            returns.set(pool.stats().returns);
        },
    );
    assert!(calls > 3, "the grow made several calls ({calls})");
    // Trim into the pool (which sheds past its high watermark), every call failed once.
    buf.grow_to(5 * g).unwrap();
    let calls = fail_each_call(
        &fb,
        &mut buf,
        |buf| {
            buf.truncate(g);
            buf.shrink_to_fit()
        },
        |buf, k, _| {
            assert!(contents(buf)[..] == data[..], "trim k={k}");
            assert_consistent(buf, with_pool(&pool));
            buf.grow_to(5 * g).unwrap();
        },
    );
    assert!(calls > 1, "the trim made several calls ({calls})");
    drop(buf);
    pool.trim().unwrap();
    assert_eq!(fb.live(), baseline);
}
