//! The heap alone, against a model of who holds each unit of memory:
//! no backend, no mapping, the calls the arena makes.

use proptest::prelude::*;

use super::blocks::NoWalls;
use super::*;
use crate::order::FenceSet;

/// The unit of the model: every size and offset is a multiple of it.
const UNIT: usize = 64 << 10;
/// 32 MiB: the small zone is its first eighth (4 MiB), as in an arena.
const UNITS: usize = 512;

#[derive(Clone, Debug)]
enum Op {
    /// Fresh memory of `units` in zone `zone` (the lowest unmapped
    /// range there that fits), as growth maps it.
    Map { zone: usize, units: usize },
    /// A request of `units` (less `short` bytes asked for) on stream
    /// `s`, for graph `g` (0: none).
    Alloc {
        units: usize,
        short: usize,
        s: u64,
        g: u64,
    },
    /// Free the `i`th live allocation (modulo the count); `pending`:
    /// the block stays its stream's until settled.
    Free { i: usize, pending: bool },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0usize..2, 1usize..48).prop_map(|(zone, units)| Op::Map { zone, units }),
        (1usize..40, 0usize..1000, 0u64..3, 0u64..3).prop_map(|(units, short, s, g)| Op::Alloc {
            units,
            short,
            s,
            g
        }),
        (any::<usize>(), any::<bool>()).prop_map(|(i, pending)| Op::Free { i, pending }),
    ]
}

/// Who holds a unit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Unit {
    Unmapped,
    Free,
    Live,
}

struct Model {
    units: Vec<Unit>,
    /// Live allocations: offset, size, requested, stream, graph.
    live: Vec<(usize, usize, usize, u64, u64)>,
}

impl Model {
    fn mark(&mut self, o: usize, n: usize, from: Unit, to: Unit) -> Result<(), String> {
        for u in &mut self.units[o / UNIT..(o + n) / UNIT] {
            if *u != from {
                return Err(format!(
                    "unit at {o:#x}+{n:#x} was {u:?}, expected {from:?}"
                ));
            }
            *u = to;
        }
        Ok(())
    }

    /// The lowest run of `units` unmapped units in `zone`.
    fn hole(&self, zone: usize, units: usize, small_end: usize) -> Option<usize> {
        let (lo, hi) = if zone == 0 {
            (0, small_end / UNIT)
        } else {
            (small_end / UNIT, UNITS)
        };
        (lo..hi.saturating_sub(units) + 1)
            .find(|&k| {
                self.units[k..k + units]
                    .iter()
                    .all(|&u| u == Unit::Unmapped)
            })
            .map(|k| k * UNIT)
    }
}

fn check(heap: &Heap<u32>, model: &Model) -> Result<(), String> {
    let live: usize = model.live.iter().map(|l| l.1).sum();
    let requested: usize = model.live.iter().map(|l| l.2).sum();
    if (heap.allocated, heap.requested) != (live, requested) {
        return Err(format!(
            "allocated {} / requested {}, the model {live} / {requested}",
            heap.allocated, heap.requested
        ));
    }
    if heap.live.len() != model.live.len()
        || model
            .live
            .iter()
            .any(|l| heap.live.get(&l.0).map(|x| x.size) != Some(l.1))
    {
        return Err("the live allocations differ from the model's".into());
    }
    for g in 1..3u64 {
        let want = model.live.iter().filter(|l| l.4 == g).count();
        let got = heap.graphs.live_of(GraphPoolId(g));
        if got != want {
            return Err(format!("graph {g}: {got} live, the model {want}"));
        }
    }
    // Every free block lies in its zone, over units the model has free,
    // and together they are all of them: nothing lost, nothing twice.
    let mut seen = vec![false; UNITS];
    for (z, zone) in heap.zones.iter().enumerate() {
        for (o, f) in zone.iter() {
            let in_zone = if z == 0 {
                o + f.size <= heap.small_end
            } else {
                o >= heap.small_end
            };
            if !in_zone || o % UNIT != 0 || f.size % UNIT != 0 {
                return Err(format!("zone {z}: block {o:#x}+{:#x}", f.size));
            }
            let units = o / UNIT..(o + f.size) / UNIT;
            for (k, s) in units.clone().zip(&mut seen[units]) {
                if model.units[k] != Unit::Free || *s {
                    return Err(format!("block {o:#x}+{:#x} over unit {k}", f.size));
                }
                *s = true;
            }
        }
    }
    match (0..UNITS).find(|&k| (model.units[k] == Unit::Free) != seen[k]) {
        Some(k) => Err(format!("unit {k} is free in the model, in no block")),
        None if heap.spare_uses.len() > SPARE_USES => Err("too many spare use lists".into()),
        None => Ok(()),
    }
}

fn run(ops: Vec<Op>) -> Result<(), String> {
    let small_end = UNITS * UNIT / 8;
    let mut heap: Heap<u32> = Heap::new(small_end, true);
    let mut model = Model {
        units: vec![Unit::Unmapped; UNITS],
        live: Vec::new(),
    };
    for op in ops {
        match op {
            Op::Map { zone, units } => {
                if let Some(at) = model.hole(zone, units, small_end) {
                    model.mark(at, units * UNIT, Unit::Unmapped, Unit::Free)?;
                    heap.insert_fresh(at, units * UNIT, &NoWalls);
                }
            }
            Op::Alloc { units, short, s, g } => {
                let size = units * UNIT;
                let key = (0, s);
                let z = Heap::<u32>::zone_of_size(size);
                if let Some(o) = heap.zones[z].take(size, key) {
                    let graph = (g > 0).then_some(GraphPoolId(g));
                    model.mark(o, size, Unit::Free, Unit::Live)?;
                    let requested = size - short.min(size - 1);
                    heap.note_live(o, size, requested, key, graph);
                    model.live.push((o, size, requested, s, g));
                }
            }
            Op::Free { i, pending } => {
                if model.live.is_empty() {
                    continue;
                }
                let (o, size, requested, s, g) = model.live.swap_remove(i % model.live.len());
                let l = heap
                    .live
                    .remove(&o)
                    .ok_or("freed an allocation the heap lost")?;
                let graph = (g > 0).then_some(GraphPoolId(g));
                heap.note_freed(size, requested, graph, &l.uses);
                drop(l);
                let free = Free {
                    size,
                    stream: pending.then_some((0, s)),
                    fences: FenceSet::default(),
                };
                heap.insert_free(o, free, &NoWalls);
                model.mark(o, size, Unit::Live, Unit::Free)?;
            }
        }
        check(&heap, &model)?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(if cfg!(miri) { crate::miri_cases() } else { 256 }))]

    /// Hand-outs, frees and fresh memory keep the heap's free blocks,
    /// live allocations, graph counts and byte counts what the model
    /// says, in both zones.
    #[test]
    fn the_heap_matches_a_model_of_who_holds_each_unit(
        ops in proptest::collection::vec(op(), 1..if cfg!(miri) { 24 } else { 120 })
    ) {
        run(ops).map_err(TestCaseError::fail)?;
    }
}
