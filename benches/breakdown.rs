//! Diagnostic, not a claim: where a growth step's time goes. Times each driver
//! call on its own (median of repeated plain loops) for chunks of 64 MiB,
//! 1 GiB and 8 GiB, in two regimes: "recycled" (create right after releasing
//! a chunk of the same size, as a benchmark loop does) and "fresh" (several
//! creates in a row, each taking memory the process has not used), and the
//! same for cuMemAlloc.

mod common;

use std::time::Instant;

use common::{gpu_or_skip, ok, Raw, GIB, MIB};
use cudarc::driver::sys;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn us(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e6
}

fn main() {
    let Some(backend) = gpu_or_skip("breakdown") else {
        return;
    };
    let raw = Raw::new(backend.clone());
    println!("breakdown: per-call medians in us (lower is better)");
    for (size, reps, fresh_n) in [(64 * MIB, 30, 8), (GIB, 12, 6), (8 * GIB, 6, 4)] {
        let va = raw.reserve(fresh_n * size);
        let (mut create, mut map, mut access, mut unmap, mut release) =
            (vec![], vec![], vec![], vec![], vec![]);
        for _ in 0..reps {
            let t = Instant::now();
            let h = raw.create_map_access(va, size); // timed whole, then split below
            let whole = us(t);
            raw.unmap_release(va, size, h);
            create.push(whole);
        }
        let recycled_total = median(std::mem::take(&mut create));
        // The same sequence call by call.
        for _ in 0..reps {
            let (h, c, m, a) = split_create_map_access(&raw, va, size);
            create.push(c);
            map.push(m);
            access.push(a);
            raw.sync();
            let t = Instant::now();
            // SAFETY: one mapping of ours, nothing uses it (synchronised).
            ok("cuMemUnmap", unsafe { sys::cuMemUnmap(va, size) });
            unmap.push(us(t));
            let t = Instant::now();
            // SAFETY: released once.
            ok("cuMemRelease", unsafe { sys::cuMemRelease(h) });
            release.push(us(t));
        }
        // Fresh: fresh_n creates in a row, then release them all.
        let mut fresh = vec![];
        let mut hs = vec![];
        for i in 0..fresh_n {
            let (h, c, _, _) = split_create_map_access(&raw, va + (i * size) as u64, size);
            fresh.push(c);
            hs.push(h);
        }
        for (i, h) in hs.into_iter().enumerate() {
            raw.unmap_release(va + (i * size) as u64, size, h);
        }
        raw.address_free(va, fresh_n * size);
        // cuMemAlloc recycled and fresh.
        let mut alloc_recycled = vec![];
        for _ in 0..reps {
            let t = Instant::now();
            let p = raw.alloc(size);
            alloc_recycled.push(us(t));
            raw.free(p);
        }
        let mut alloc_fresh = vec![];
        let ps: Vec<u64> = (0..fresh_n)
            .map(|_| {
                let t = Instant::now();
                let p = raw.alloc(size);
                alloc_fresh.push(us(t));
                p
            })
            .collect();
        let p = ps[0];
        let t = Instant::now();
        raw.copy(ps[1], p, size);
        raw.sync();
        let copy = us(t);
        for p in ps {
            raw.free(p);
        }
        println!(
            "breakdown/{:>5}: create+map+access {:>8.1} | create {:>8.1} (fresh {:>8.1}) map {:>5.1} access {:>6.1} \
             unmap {:>6.1} release {:>7.1} | cuMemAlloc {:>8.1} (fresh {:>8.1}) | copy {:>7.1} ({:.2} TB/s r+w)",
            if size >= GIB { format!("{}GiB", size / GIB) } else { format!("{}MiB", size / MIB) },
            recycled_total,
            median(create),
            median(fresh),
            median(map),
            median(access),
            median(unmap),
            median(release),
            median(alloc_recycled),
            median(alloc_fresh),
            copy,
            2.0 * size as f64 / copy / 1e6
        );
    }
}

/// cuMemCreate, cuMemMap, cuMemSetAccess timed one by one.
fn split_create_map_access(
    raw: &Raw,
    va: u64,
    size: usize,
) -> (sys::CUmemGenericAllocationHandle, f64, f64, f64) {
    // SAFETY: plain C data, then filled in (device 0 = location id 0).
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    let mut h = 0;
    let t = Instant::now();
    // SAFETY: valid out-pointer and properties.
    ok("cuMemCreate", unsafe {
        sys::cuMemCreate(&mut h, size, &prop, 0)
    });
    let c = us(t);
    let t = Instant::now();
    // SAFETY: va..va+size is reserved by us and unmapped.
    ok("cuMemMap", unsafe { sys::cuMemMap(va, size, 0, h, 0) });
    let m = us(t);
    // SAFETY: plain C data, then filled in.
    let mut desc: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
    desc.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    desc.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    let t = Instant::now();
    // SAFETY: exactly the mapping just made; one descriptor.
    ok("cuMemSetAccess", unsafe {
        sys::cuMemSetAccess(va, size, &desc, 1)
    });
    let a = us(t);
    let _ = raw;
    (h, c, m, a)
}
