//! The growth plan's tests.

use super::*;
const G: usize = 2 << 20;
const GPU: Location = Location::Device(0);

/// The sizes a plan maps, with no pool and one placement.
fn sizes(p: GrowthPolicy, at: usize, target: usize, limit: usize) -> Result<Vec<usize>> {
    let req = GrowthRequest {
        policy: p.resolve(G)?,
        granularity: G,
        at,
        target,
        limit,
        placement_at: &|_| GPU,
        pool: None,
    };
    let plan = plan_growth(&req)?;
    let mut end = at;
    for c in &plan {
        assert_eq!(c.offset, end, "chunks follow each other");
        assert!(!c.pooled);
        end += c.bytes;
    }
    Ok(plan.iter().map(|c| c.bytes).collect())
}

#[test]
fn proportional_keeps_mappings_logarithmic_and_overcommit_bounded() {
    let p = GrowthPolicy::default();
    let (mut cap, mut chunks) = (0usize, 0usize);
    let mut worst = 0.0f64;
    // A KV cache filling up: 2 MiB at a time to 2 GiB.
    for step in 1..=1024usize {
        let target = step * G;
        let plan = sizes(p, cap, target, usize::MAX / 2 / G * G).unwrap();
        assert!(plan.len() <= 1);
        if let Some(&c) = plan.first() {
            assert_eq!(c % G, 0);
            cap += c;
            chunks += 1;
            assert!(cap - target < p.overcommit_bound(G, target));
        }
        assert!(cap >= target);
        worst = worst.max((cap - target) as f64 / target as f64);
    }
    assert!(chunks < 64, "{chunks} mappings for 1024 steps");
    assert!(
        worst <= 0.125 || cap - 1024 * G < G,
        "worst over-commit {worst}"
    );
}

#[test]
fn a_pool_of_small_chunks_keeps_proportional_mappings_logarithmic() {
    // The pool holds what an exact-policy cache gave back: 1024 granules.
    let p = GrowthPolicy::default();
    let mut offer: PoolOffer = BTreeMap::from([((GPU, G), 1024)]);
    let (mut cap, mut mappings, mut from_pool) = (0usize, 0usize, 0usize);
    for step in 1..=1024usize {
        let target = step * G;
        let plan = plan_growth(&GrowthRequest {
            policy: p,
            granularity: G,
            at: cap,
            target,
            limit: 1 << 40,
            placement_at: &|_| GPU,
            pool: Some(&offer),
        })
        .unwrap();
        for c in &plan {
            if c.pooled {
                from_pool += 1;
                let n = offer.get_mut(&(GPU, c.bytes)).unwrap();
                *n -= 1;
                // Only while a granule is at least half the policy's chunk.
                assert!(2 * c.bytes >= target / 8 / G * G, "step {step}: {c:?}");
            }
            cap += c.bytes;
            mappings += 1;
        }
        assert!(cap >= target && cap - target < p.overcommit_bound(G, target));
    }
    assert!(from_pool > 0, "small growths still take pooled granules");
    assert!(mappings < 80, "{mappings} mappings for 1024 steps");
}

#[test]
fn a_pool_of_mixed_sizes_serves_the_sizes_the_policy_would_create() {
    // Fill a cache once with no pool: the policy's own chunk sizes.
    let p = GrowthPolicy::default();
    let fill = |offer: Option<&PoolOffer>| {
        let (mut cap, mut sizes) = (0usize, Vec::new());
        for step in 1..=1024usize {
            let plan = plan_growth(&GrowthRequest {
                policy: p,
                granularity: G,
                at: cap,
                target: step * G,
                limit: 1 << 40,
                placement_at: &|_| GPU,
                pool: offer,
            })
            .unwrap();
            for c in plan {
                cap += c.bytes;
                sizes.push((c.bytes, c.pooled));
            }
        }
        sizes
    };
    let own = fill(None);
    // A pool holding those sizes and, besides, every size a finer policy
    // (len/16) would have made and a thousand granules.
    let mut offer: PoolOffer = BTreeMap::new();
    for &(b, _) in &own {
        *offer.entry((GPU, b)).or_default() += 1;
    }
    let mut cap = 0;
    for step in 1..=1024usize {
        let c = (step * G / 16 / G * G).max(G);
        if cap < step * G {
            *offer.entry((GPU, c)).or_default() += 1;
            cap += c;
        }
    }
    *offer.entry((GPU, G)).or_default() += 1000;
    let pooled = fill(Some(&offer));
    // The same chunks as without a pool, all of them from the pool.
    assert_eq!(
        pooled.iter().map(|s| s.0).collect::<Vec<_>>(),
        own.iter().map(|s| s.0).collect::<Vec<_>>()
    );
    assert!(pooled.iter().all(|s| s.1));
}

#[test]
fn exact_maps_granules_and_fixed_maps_fixed() {
    let e = GrowthPolicy::Exact;
    assert_eq!(sizes(e, 0, 3 * G + 1, 8 * G).unwrap(), vec![G; 4]);
    assert_eq!(sizes(e, 4 * G, 3 * G, 8 * G).unwrap(), Vec::<usize>::new());
    let f = GrowthPolicy::Fixed {
        chunk_bytes: 3 * G - 5,
    };
    assert_eq!(
        f.resolve(G).unwrap(),
        GrowthPolicy::Fixed { chunk_bytes: 3 * G }
    );
    assert_eq!(sizes(f, 2 * G, 7 * G, 16 * G).unwrap(), vec![3 * G; 2]);
}

#[test]
fn bad_parameters_are_errors() {
    for bad in [
        GrowthPolicy::Proportional { divisor: 0 },
        GrowthPolicy::Fixed { chunk_bytes: 0 },
        GrowthPolicy::Fixed {
            chunk_bytes: usize::MAX,
        },
    ] {
        assert!(matches!(bad.resolve(G), Err(Error::InvalidArgument(_))));
    }
    assert!(GrowthPolicy::Exact.resolve(3).is_err());
    assert!(matches!(
        sizes(GrowthPolicy::Exact, 0, 9 * G, 8 * G),
        Err(Error::ReservationExhausted { requested_bytes, reserved_bytes })
            if requested_bytes == 9 * G && reserved_bytes == 8 * G
    ));
    assert!(
        sizes(GrowthPolicy::Exact, G / 2, 2 * G, 8 * G).is_err(),
        "not granular"
    );
}

#[test]
fn huge_growths_fail_cleanly_without_building_the_plan() {
    let limit = usize::MAX / G * G;
    // 16 TiB in 2 MiB granules: 8M mappings, past what a process can hold.
    let r = sizes(GrowthPolicy::Exact, 0, 16 << 40, limit);
    assert!(
        matches!(r, Err(Error::InvalidArgument(ref m)) if m.contains("mappings")),
        "{r:?}"
    );
    let r = sizes(GrowthPolicy::Fixed { chunk_bytes: G }, 0, limit, limit);
    assert!(r.is_err());
    // A huge fixed chunk and a huge proportional one are one mapping each.
    let huge = GrowthPolicy::Fixed {
        chunk_bytes: 1 << 62,
    };
    assert_eq!(sizes(huge, 0, 1, 64 * G).unwrap(), vec![64 * G]);
    assert_eq!(
        sizes(GrowthPolicy::default(), 0, limit, limit).unwrap(),
        vec![limit]
    );
}

#[test]
fn plans_are_cut_to_the_reservation() {
    let p = GrowthPolicy::default();
    // 64 GiB wants an 8 GiB chunk; only 1 GiB of room is left.
    let cap = 64 << 30;
    assert_eq!(
        sizes(p, cap, cap + 1, cap + (1 << 30)).unwrap(),
        vec![1 << 30]
    );
    let f = GrowthPolicy::Fixed { chunk_bytes: 4 * G };
    assert_eq!(sizes(f, 0, 5 * G, 6 * G).unwrap(), vec![4 * G, 2 * G]);
}

/// A request to grow from 0 to `6 * G`, placed by `placement_at`, from `pool`.
fn grow_to_6<'a>(
    policy: GrowthPolicy,
    placement_at: &'a dyn Fn(usize) -> Location,
    pool: &'a PoolOffer,
) -> GrowthRequest<'a> {
    GrowthRequest {
        policy,
        granularity: G,
        at: 0,
        target: 6 * G,
        limit: 1024 * G,
        placement_at,
        pool: Some(pool),
    }
}

#[test]
fn pooled_chunks_come_first_within_the_bound_and_placement() {
    let mut offer = PoolOffer::new();
    offer.insert((GPU, 4 * G), 1);
    offer.insert((GPU, 64 * G), 1); // too big for the bound at this size
    offer.insert((Location::Host, 2 * G), 3); // other placement
    let plan = plan_growth(&grow_to_6(GrowthPolicy::default(), &|_| GPU, &offer)).unwrap();
    let chunk = |offset, bytes, pooled| Planned {
        offset,
        bytes,
        placement: GPU,
        pooled,
    };
    assert_eq!(
        plan,
        vec![chunk(0, 4 * G, true), chunk(4 * G, 2 * G, false)]
    );
}

#[test]
fn placement_follows_the_offset_and_exact_takes_granules_only() {
    let mut offer = PoolOffer::new();
    offer.insert((GPU, 4 * G), 1);
    offer.insert((Location::Host, 2 * G), 3);
    // The host range takes host chunks.
    let split = |o: usize| if o >= 4 * G { Location::Host } else { GPU };
    let plan = plan_growth(&grow_to_6(GrowthPolicy::Exact, &split, &offer)).unwrap();
    let got: Vec<(usize, Location, bool)> = plan
        .iter()
        .map(|c| (c.bytes, c.placement, c.pooled))
        .collect();
    let mut want = vec![(G, GPU, false); 4];
    want.extend([(G, Location::Host, false); 2]);
    assert_eq!(
        got, want,
        "Exact takes only granule-sized pooled chunks, and the pool has none on the GPU"
    );
    let mut granules = PoolOffer::new();
    granules.insert((Location::Host, G), 5);
    let plan = plan_growth(&grow_to_6(GrowthPolicy::Exact, &split, &granules)).unwrap();
    assert_eq!(
        plan.iter().filter(|c| c.pooled).count(),
        2,
        "two host granules from the pool, no more than the range needs"
    );
}
