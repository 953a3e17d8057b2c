//! `GrowableBuffer::reserve`: capacity ahead of the length, mapped by another
//! thread while one grows (the map-ahead pattern of `benches/kv_growth.rs`).

use std::sync::Arc;

use crate::common::{assert_consistent, contents, random_bytes};
use crate::failing_backend::TestFence;
use vmmbuf::{Backend, BufferDesc, Error, GrowableBuffer, GrowthPolicy};

crate::register! {
    generic: [reserve_maps_ahead_and_growth_within_it_maps_nothing, a_thread_mapping_ahead_keeps_a_growing_thread_off_the_driver, a_deferred_release_spares_what_reserve_mapped],
}

fn reserve_maps_ahead_and_growth_within_it_maps_nothing<B: Backend>(backend: Arc<B>) {
    let g = backend.granularity(backend.home()).unwrap();
    let baseline = backend.live();
    let mut buf = GrowableBuffer::new(
        backend.clone(),
        BufferDesc::new(64 * g).growth(GrowthPolicy::Exact),
    )
    .unwrap();
    buf.grow_to(3 * g + 5).unwrap();
    let data = random_bytes(51, buf.len());
    buf.write(0, &data).unwrap();
    buf.reserve(5 * g).unwrap();
    assert_eq!(buf.len(), 3 * g + 5, "reserve leaves the length");
    assert_eq!(buf.capacity(), 9 * g, "len + 5g, in whole chunks");
    assert_consistent(&buf, baseline);
    let grows = buf.stats().grows;
    buf.grow_to(9 * g).unwrap();
    assert_eq!(
        buf.stats().grows,
        grows,
        "growth within the capacity maps nothing"
    );
    buf.reserve(0).unwrap();
    assert_eq!(buf.capacity(), 9 * g);

    // Past the reservation, or overflowing: typed errors, nothing changed.
    let before = (buf.len(), buf.capacity(), backend.live());
    assert!(matches!(
        buf.reserve(56 * g).unwrap_err(),
        Error::ReservationExhausted { .. }
    ));
    assert!(matches!(
        buf.reserve(usize::MAX).unwrap_err(),
        Error::InvalidArgument(_)
    ));
    assert_eq!((buf.len(), buf.capacity(), backend.live()), before);
    assert!(contents(&buf)[..data.len()] == data[..]);
    buf.truncate(0);
    buf.shrink_to_fit().unwrap();
    drop(buf);
    assert_eq!(backend.live(), baseline);
}

/// One thread grows a cache in small steps; another keeps one chunk mapped
/// ahead of it. The over-commit stays within twice the policy's bound, the
/// data written at the end reads back, and everything goes back at drop.
fn a_thread_mapping_ahead_keeps_a_growing_thread_off_the_driver<B: Backend>(backend: Arc<B>) {
    let g = backend.granularity(backend.home()).unwrap();
    let baseline = backend.live();
    let policy = GrowthPolicy::Proportional { divisor: 16 };
    let buf =
        GrowableBuffer::new(backend.clone(), BufferDesc::new(512 * g).growth(policy)).unwrap();
    let step = g / 4 + 3;
    let steps = 300;
    let (tx, rx) = std::sync::mpsc::channel::<usize>();
    std::thread::scope(|s| {
        let ahead = s.spawn(|| {
            let mut n = 0;
            for want in rx {
                buf.reserve(want).unwrap();
                n += 1;
            }
            n
        });
        for i in 1..=steps {
            let len = i * step;
            buf.grow_to(len).unwrap();
            let chunk = g.max(len / 16);
            if buf.capacity() - len < chunk {
                tx.send(chunk).unwrap();
            }
        }
        drop(tx);
        assert!(ahead.join().unwrap() > 0);
    });
    // Allow for the small lengths, where one granule is most of the length.
    let len = buf.len();
    assert!(
        buf.capacity() - len <= 2 * g.max(len / 16) + g,
        "{}",
        buf.report()
    );
    let mut buf = buf;
    let data = random_bytes(52, len);
    buf.write(0, &data).unwrap();
    assert!(contents(&buf) == data);
    assert_consistent(&buf, baseline);
    drop(buf);
    assert_eq!(backend.live(), baseline);
}

fn a_deferred_release_spares_what_reserve_mapped<B: Backend>(real: Arc<B>) {
    let crate::pool::Fenced {
        g,
        baseline,
        mut buf,
        data,
        ..
    } = crate::pool::eight_granules(real, 53);
    let fence = TestFence::default();
    buf.truncate(2 * g);
    buf.shrink_to_fit_after(fence.clone()).unwrap();
    buf.reserve(4 * g).unwrap(); // wants 6g mapped: the release must keep them
    fence.pass();
    buf.reclaim().unwrap();
    assert_eq!(buf.capacity(), 6 * g, "{}", buf.report());
    assert!(contents(&buf) == data[..2 * g]);
    assert_consistent(&buf, baseline);
}
