//! A growable buffer's basic behaviours, on the host backend and on CUDA:
//! growth keeps data and base, truncation and trimming, the growth
//! policies' chunk sizes, concurrent growth, the reservation as a hard
//! limit, statistics, drop, and claims.

use std::sync::Arc;

use crate::common::{assert_consistent, contents, random_bytes};
use vmmbuf::{stats::LiveCounts, Backend, BufferDesc, Error, GrowableBuffer, GrowthPolicy};

crate::register! {
    generic: [grow_keeps_data_and_base, truncate_keeps_trim_releases, policies_size_chunks_as_documented, concurrent_growth_through_shared_ref, reservation_is_a_hard_limit, stats_and_report_follow_operations, drop_gives_everything_back, claims_are_aligned_and_disjoint],
}

fn policies() -> [GrowthPolicy; 3] {
    [
        GrowthPolicy::default(),
        GrowthPolicy::Exact,
        GrowthPolicy::Fixed {
            chunk_bytes: 3 << 20,
        },
    ]
}

fn grow_keeps_data_and_base<B: Backend>(backend: Arc<B>) {
    for (p, policy) in policies().into_iter().enumerate() {
        let baseline = backend.live();
        let mut buf =
            GrowableBuffer::new(backend.clone(), BufferDesc::new(256 << 20).growth(policy))
                .unwrap();
        let base = buf.base();
        let mut model = Vec::new();
        // Irregular step sizes, none a multiple of the granularity.
        for (step, add) in [1usize, 4095, 70_001, 1 << 20, 3_333_333, 17, 9 << 20]
            .into_iter()
            .enumerate()
        {
            let at = buf.grow_by(add).unwrap();
            assert_eq!(at, model.len());
            let data = random_bytes((p * 100 + step) as u64, add);
            buf.write(at, &data).unwrap();
            model.extend_from_slice(&data);
            assert_eq!(buf.base(), base, "the base moved");
            assert_eq!(buf.len(), model.len());
            assert!(
                contents(&buf) == model,
                "{policy:?} step {step}: contents differ"
            );
            assert_consistent(&buf, baseline);
        }
        drop(buf);
        assert_eq!(backend.live(), baseline);
    }
}

fn truncate_keeps_trim_releases<B: Backend>(backend: Arc<B>) {
    let baseline = backend.live();
    let g = backend.granularity(backend.home()).unwrap();
    let mut buf = GrowableBuffer::new(
        backend.clone(),
        BufferDesc::new(64 * g).growth(GrowthPolicy::Exact),
    )
    .unwrap();
    buf.grow_to(10 * g + 5).unwrap();
    let data = random_bytes(7, 10 * g + 5);
    buf.write(0, &data).unwrap();
    assert_eq!(buf.chunk_count(), 11);

    buf.truncate(3 * g + 1);
    assert_eq!(buf.capacity(), 11 * g, "truncate keeps the chunks");
    assert_eq!(backend.live().chunks, baseline.chunks + 11);
    buf.shrink_to_fit().unwrap();
    assert_eq!(
        buf.capacity(),
        4 * g,
        "trim keeps the chunk holding byte 3g"
    );
    assert_eq!(backend.live().chunks, baseline.chunks + 4);
    assert_eq!(backend.live().mapped_bytes, baseline.mapped_bytes + 4 * g);
    assert!(
        contents(&buf) == data[..3 * g + 1],
        "data below the cut survives"
    );
    assert_consistent(&buf, baseline);

    // Regrow over trimmed space: the kept bytes stay, the base stays.
    let base = buf.base();
    buf.grow_to(6 * g).unwrap();
    assert_eq!(buf.base(), base);
    let mut head = vec![0u8; 3 * g + 1];
    buf.read(0, &mut head).unwrap();
    assert!(head == data[..3 * g + 1]);

    buf.truncate(0);

    buf.shrink_to_fit().unwrap();
    assert_eq!((buf.len(), buf.capacity(), buf.chunk_count()), (0, 0, 0));
    assert_eq!(backend.live().chunks, baseline.chunks);
    assert_eq!(backend.live().mapped_bytes, baseline.mapped_bytes);
    buf.shrink_to_fit().unwrap(); // nothing left to do
    drop(buf);
    assert_eq!(backend.live(), baseline);
}

fn policies_size_chunks_as_documented<B: Backend>(backend: Arc<B>) {
    let g = backend.granularity(backend.home()).unwrap();
    // Proportional: a KV cache growing one granule at a time to 256 granules.
    let buf = GrowableBuffer::new(backend.clone(), BufferDesc::new(512 * g)).unwrap();
    for step in 1..=256 {
        let grows = buf.stats().grows;
        buf.grow_to(step * g).unwrap();
        if buf.stats().grows > grows {
            let bound = crate::common::overcommit_bound(buf.growth_policy(), g, buf.len());
            assert!(
                buf.capacity() - buf.len() < bound,
                "step {step}: {}",
                buf.report()
            );
        }
    }
    let n = buf.chunk_count();
    assert!(
        n <= 40,
        "{n} mappings for 256 granules: not logarithmic\n{}",
        buf.report()
    );
    assert!(
        buf.capacity() - buf.len() <= buf.len() / 8,
        "{}",
        buf.report()
    );
    drop(buf);
    // Exact: one granule per chunk.
    let buf = GrowableBuffer::new(
        backend.clone(),
        BufferDesc::new(64 * g).growth(GrowthPolicy::Exact),
    )
    .unwrap();
    buf.grow_to(5 * g - 1).unwrap();
    assert!(buf.report().chunks.iter().all(|c| c.bytes == g));
    assert_eq!(buf.chunk_count(), 5);
    drop(buf);
    // Fixed: rounded up to the granularity.
    let desc = BufferDesc::new(64 * g).growth(GrowthPolicy::Fixed {
        chunk_bytes: 2 * g + 1,
    });
    let buf = GrowableBuffer::new(backend.clone(), desc).unwrap();
    assert_eq!(
        buf.growth_policy(),
        GrowthPolicy::Fixed { chunk_bytes: 3 * g }
    );
    buf.grow_to(7 * g).unwrap();
    assert!(buf.report().chunks.iter().all(|c| c.bytes == 3 * g));
    assert_eq!(buf.capacity(), 9 * g);
}

fn concurrent_growth_through_shared_ref<B: Backend>(backend: Arc<B>) {
    let baseline = backend.live();
    let g = backend.granularity(backend.home()).unwrap();
    let mut buf = GrowableBuffer::new(backend.clone(), BufferDesc::new(4096 * g)).unwrap();
    let base = buf.base();
    const THREADS: usize = 12; // growers; 4 more threads only read
    const EACH: usize = 50;
    let done = std::sync::atomic::AtomicBool::new(false);
    let claims: Vec<Vec<(usize, usize)>> = std::thread::scope(|s| {
        let readers: Vec<_> = (0..4)
            .map(|_| {
                let (buf, done) = (&buf, &done);
                s.spawn(move || {
                    let mut last = 0;
                    while !done.load(std::sync::atomic::Ordering::Relaxed) {
                        assert_eq!(buf.base(), base, "the base moved under a reader");
                        let (len, cap) = (buf.len(), buf.capacity());
                        assert!(len >= last, "len went backwards: {last} -> {len}");
                        // Capacity cannot shrink under &self, so a later read covers an earlier len.
                        assert!(
                            cap >= len,
                            "capacity {cap} below a length {len} seen before it"
                        );
                        last = len;
                    }
                })
            })
            .collect();
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let buf = &buf;
                s.spawn(move || {
                    (0..EACH)
                        .map(|i| {
                            let n = 1 + (t * 7919 + i * 104_729) % (g / 2);
                            assert_eq!(buf.base(), base);
                            (buf.grow_by(n).unwrap(), n)
                        })
                        .collect()
                })
            })
            .collect();
        let out = handles.into_iter().map(|h| h.join().unwrap()).collect();
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        for r in readers {
            r.join().unwrap();
        }
        out
    });
    let mut all: Vec<(usize, usize)> = claims.into_iter().flatten().collect();
    all.sort();
    let mut at = 0;
    for &(off, n) in &all {
        assert_eq!(off, at, "claims are disjoint and leave no gap");
        at += n;
    }
    assert_eq!(buf.len(), at, "no growth lost");
    assert_eq!(all.len(), THREADS * EACH);
    // Each claim gets its own data; all of it reads back.
    for (i, &(off, n)) in all.iter().enumerate() {
        buf.write(off, &random_bytes(i as u64, n)).unwrap();
    }
    let got = contents(&buf);
    for (i, &(off, n)) in all.iter().enumerate() {
        assert!(
            got[off..off + n] == random_bytes(i as u64, n)[..],
            "claim {i}"
        );
    }
    assert_consistent(&buf, baseline);
}

fn reservation_is_a_hard_limit<B: Backend>(backend: Arc<B>) {
    let g = backend.granularity(backend.home()).unwrap();
    let mut buf = GrowableBuffer::new(backend.clone(), BufferDesc::new(4 * g - 100)).unwrap();
    assert_eq!(
        buf.reserved(),
        4 * g,
        "the reservation rounds up to the granularity"
    );
    buf.grow_to(g).unwrap();
    let data = random_bytes(3, g);
    buf.write(0, &data).unwrap();
    let before = (buf.len(), buf.capacity(), buf.chunk_count(), backend.live());
    for bad in [4 * g + 1, usize::MAX] {
        match buf.grow_to(bad) {
            Err(Error::ReservationExhausted {
                requested_bytes,
                reserved_bytes,
            }) => {
                assert_eq!((requested_bytes, reserved_bytes), (bad, 4 * g));
            }
            other => panic!("grow_to({bad}) gave {other:?}"),
        }
    }
    assert!(matches!(
        buf.grow_by(3 * g + 1),
        Err(Error::ReservationExhausted { .. })
    ));
    assert_eq!(
        before,
        (buf.len(), buf.capacity(), buf.chunk_count(), backend.live())
    );
    assert!(contents(&buf) == data);
    buf.grow_to(4 * g).unwrap();
    assert_eq!(
        buf.capacity(),
        4 * g,
        "the last chunk is cut to the reservation"
    );
    buf.resize(g).unwrap();
    assert_eq!(buf.len(), g);
    assert!(contents(&buf) == data);
}

fn stats_and_report_follow_operations<B: Backend>(backend: Arc<B>) {
    let g = backend.granularity(backend.home()).unwrap();
    let mut buf = GrowableBuffer::new(
        backend.clone(),
        BufferDesc::new(64 * g).growth(GrowthPolicy::Exact),
    )
    .unwrap();
    buf.grow_to(3 * g).unwrap();
    buf.grow_to(2 * g).unwrap(); // no-op
    buf.grow_to(5 * g).unwrap();
    buf.truncate(g);
    buf.shrink_to_fit().unwrap();
    let s = buf.stats();
    assert_eq!(s.reserved_bytes, 64 * g);
    assert_eq!((s.in_use_bytes, s.mapped_bytes, s.chunks), (g, g, 1));
    assert_eq!((s.grows, s.shrinks, s.trims), (2, 1, 1));
    assert_eq!((s.chunks_mapped_total, s.chunks_released_total), (5, 4));
    assert_eq!(s.peak_mapped_bytes, 5 * g);
    let r = buf.report();
    assert_eq!(r.base, buf.base());
    assert_eq!(r.chunks.len(), 1);
    assert_eq!(r.chunks[0].placement, backend.home());
    let text = r.to_string();
    assert!(text.contains("2 grows, 1 shrinks, 1 trims"), "{text}");
    assert!(format!("{buf:?}").contains("GrowableBuffer"));
}

fn drop_gives_everything_back<B: Backend>(backend: Arc<B>) {
    let baseline: LiveCounts = backend.live();
    let bufs: Vec<_> = (0..5)
        .map(|i| {
            let b = GrowableBuffer::new(backend.clone(), BufferDesc::new(1 << 30)).unwrap();
            b.grow_to(((i + 1) * 3) << 20).unwrap();
            b
        })
        .collect();
    assert_eq!(backend.live().reservations, baseline.reservations + 5);
    drop(bufs);
    assert_eq!(backend.live(), baseline);
}

fn claims_are_aligned_and_disjoint<B: Backend>(backend: Arc<B>) {
    let g = backend.granularity(backend.home()).unwrap();
    for align in [256usize, 4096] {
        let buf = GrowableBuffer::new(backend.clone(), BufferDesc::new(1024 * g).alignment(align))
            .unwrap();
        buf.grow_to(3).unwrap(); // an odd length before the first claim
        let claims: Vec<(usize, usize)> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..4)
                .map(|t| {
                    let buf = &buf;
                    s.spawn(move || {
                        (0..40)
                            .map(|i| {
                                let n = 1 + (t * 31 + i * 977) % 5000;
                                (buf.claim(n).unwrap(), n)
                            })
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            hs.into_iter().flat_map(|h| h.join().unwrap()).collect()
        });
        let mut sorted = claims.clone();
        sorted.sort();
        assert!(
            sorted[0].0 >= 3,
            "the first claim starts past the existing length"
        );
        for w in sorted.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "claims overlap: {w:?}");
        }
        for &(at, _) in &claims {
            assert_eq!(at % align, 0);
            assert_eq!(
                (buf.base() + at as u64) % align as u64,
                0,
                "addresses are aligned too"
            );
        }
        let last = sorted.last().unwrap();
        assert_eq!(buf.len(), last.0 + last.1);
    }
    for bad in [0usize, 3, 2 * g] {
        let r = GrowableBuffer::new(backend.clone(), BufferDesc::new(g).alignment(bad));
        assert!(
            matches!(r, Err(Error::InvalidArgument(_))),
            "alignment {bad}"
        );
    }
}
