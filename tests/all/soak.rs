//! Soak: a long random sequence of grow / claim / truncate / shrink / trim /
//! migrate / access / write / verify against a `Vec<u8>` model, with
//! checksums, ending with every byte of memory back where it started.
//! `VMMBUF_SOAK_OPS` sets the length (the GPU run uses 100000; default 3000).

use std::sync::Arc;

use rand::{Rng, SeedableRng};

use crate::common::{assert_consistent, contents};
use vmmbuf::{
    Access, Backend, BufferDesc, ChunkPool, GrowableBuffer, GrowthPolicy, Location, PoolDesc,
};

crate::register! {
    generic: [random_operations_keep_every_byte_and_give_all_memory_back],
}

fn ops() -> usize {
    std::env::var("VMMBUF_SOAK_OPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3000)
}

fn checksum(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| {
        (h ^ x as u64).wrapping_mul(0x100_0000_01b3)
    })
}

fn random_operations_keep_every_byte_and_give_all_memory_back<B: Backend>(backend: Arc<B>) {
    let n = ops();
    let g = backend.granularity(backend.home()).unwrap();
    let any: &dyn std::any::Any = &*backend;
    let cuda = any.downcast_ref::<vmmbuf::CudaBackend>();
    let free_start = cuda.map(|c| c.mem_info().unwrap().0);
    let baseline = backend.live();
    let places: Vec<Location> = match cuda {
        Some(_) => vec![backend.home(), Location::Host],
        None => vec![Location::Host],
    };
    let started = std::time::Instant::now();
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x50a6);
    let mut counts = [0usize; 9];
    {
        let pool = ChunkPool::new(backend.clone(), PoolDesc::watermarks(8 * g, 32 * g)).unwrap();
        let policy = [GrowthPolicy::default(), GrowthPolicy::Exact][rng.gen_range(0..2)];
        let mut buf =
            GrowableBuffer::with_pool(&pool, BufferDesc::new(64 * g).growth(policy)).unwrap();
        let base = buf.base();
        let mut model: Vec<u8> = Vec::new();
        for i in 0..n {
            let op = rng.gen_range(0..100);
            let len = model.len();
            match op {
                0..=24 => {
                    let add = rng.gen_range(1..=g * 2);
                    if len + add <= buf.reserved() {
                        buf.grow_to(len + add).unwrap();
                        let mut data = vec![0u8; add];
                        rng.fill(&mut data[..]);
                        buf.write(len, &data).unwrap();
                        model.extend_from_slice(&data);
                    }
                    counts[0] += 1;
                }
                25..=29 => {
                    let add = rng.gen_range(1..=4096);
                    if let Ok(at) = buf.claim(add) {
                        model.resize(at, 0);
                        let mut data = vec![0u8; add];
                        rng.fill(&mut data[..]);
                        // Padding bytes before `at` are not ours to predict: fix them.
                        let pad = vec![0xa5; at - len];
                        buf.write(len, &pad).unwrap();
                        model[len..at].copy_from_slice(&pad);
                        buf.write(at, &data).unwrap();
                        model.extend_from_slice(&data);
                    }
                    counts[1] += 1;
                }
                30..=37 => {
                    let to = rng.gen_range(0..=len);
                    buf.truncate(to);
                    model.truncate(to);
                    counts[2] += 1;
                }
                38..=45 => {
                    let to = rng.gen_range(0..=len);
                    buf.truncate(to);
                    buf.shrink_to_fit().unwrap();
                    model.truncate(to);
                    counts[3] += 1;
                }
                46..=49 => {
                    buf.shrink_to_fit().unwrap();
                    counts[4] += 1;
                }
                50..=57 if buf.capacity() > 0 => {
                    let at = rng.gen_range(0..buf.capacity());
                    let to = places[rng.gen_range(0..places.len())];
                    buf.migrate(at..at + 1, to).unwrap();
                    counts[5] += 1;
                }
                58..=61 if buf.capacity() > 0 => {
                    // Seal a chunk read-only, check a write fails, unseal.
                    let at = rng.gen_range(0..buf.capacity());
                    let home = backend.home();
                    buf.set_access(at..at + 1, home, Access::Read).unwrap();
                    if at < len {
                        assert!(
                            buf.write(at, &[0]).is_err(),
                            "op {i}: wrote into a read-only chunk"
                        );
                    }
                    buf.make_writable(at..at + 1).unwrap();
                    counts[6] += 1;
                }
                62..=84 if len > 0 => {
                    let at = rng.gen_range(0..len);
                    let k = rng.gen_range(1..=(len - at).min(8192));
                    let mut data = vec![0u8; k];
                    rng.fill(&mut data[..]);
                    buf.write(at, &data).unwrap();
                    model[at..at + k].copy_from_slice(&data);
                    counts[7] += 1;
                }
                _ if len > 0 => {
                    let at = rng.gen_range(0..len);
                    let k = rng.gen_range(1..=(len - at).min(65536));
                    let mut got = vec![0u8; k];
                    buf.read(at, &mut got).unwrap();
                    assert_eq!(
                        checksum(&got),
                        checksum(&model[at..at + k]),
                        "op {i}: checksum of {at}+{k}"
                    );
                    counts[8] += 1;
                }
                _ => {}
            }
            assert_eq!(buf.base(), base);
            assert_eq!(buf.len(), model.len());
            if i % 1000 == 999 {
                assert!(contents(&buf) == model, "op {i}: full comparison");
                let mut with_pool = baseline;
                with_pool.chunks += pool.stats().pooled_chunks;
                assert_consistent(&buf, with_pool);
            }
        }
        assert!(contents(&buf) == model);
        drop(buf);
        pool.trim().unwrap();
    }
    let syncs = backend.live().device_syncs - baseline.device_syncs;
    assert_eq!(syncs, 0, "no device-wide synchronisation in the whole soak");
    assert_eq!(backend.live(), baseline, "everything went back");
    if let (Some(c), Some(start)) = (cuda, free_start) {
        assert_eq!(
            c.mem_info().unwrap().0,
            start,
            "device memory is back to the baseline"
        );
    }
    eprintln!(
        "soak ({}): {n} operations in {:.1} s: grow {}, claim {}, truncate {}, shrink {}, trim {}, migrate {}, \
         access {}, write {}, verify {}; {syncs} device-wide syncs",
        backend.name(),
        started.elapsed().as_secs_f64(),
        counts[0], counts[1], counts[2], counts[3], counts[4], counts[5], counts[6], counts[7], counts[8]
    );
}
