//! Map hooks (issue 24): what an arena or a buffer tells a hook as it grows,
//! gives memory back, sleeps, wakes, migrates and drops, checked against the
//! driver calls it makes (a recording backend: `FaultBackend`'s log, into
//! which the hook writes its own calls). Without a GPU, on a backend that
//! emulates GPU 0 with host placement beside it. The stream-order side (no
//! range is told unmapping under work in flight) is the oracle's
//! (`oracle_arena_map_hook`, `oracle_buffers_map_hook`).

use std::sync::Arc;

use vmmbuf::hook::{HookCall, MapHook, MappedRange, RecordingHook};
use vmmbuf::{
    Arena, ArenaDesc, Backend, BufferDesc, GrowableBuffer, GrowthPolicy, HostBackend, Location,
    SleepDesc, WakeDesc,
};

use crate::common::{host, random_bytes};
use crate::failing_backend::FaultBackend;

crate::register! {
    host: [
        a_map_hook_follows_an_arena_through_growth_release_sleep_and_drop,
        a_map_hook_follows_a_buffer_through_growth_migration_and_shrink,
        a_hook_set_on_a_live_arena_hears_of_its_memory_and_removing_it_tells_all_is_going,
        a_panicking_hook_is_caught_and_the_arena_goes_on,
        every_block_of_a_hooked_arena_lies_in_one_reported_range,
    ],
}

type Fb = FaultBackend<HostBackend>;

// A stream of the emulated GPU; its work has always finished.
use crate::failing_backend::DoneStream as Q;

/// A hook that writes its calls into the backend's log (so they interleave
/// with the driver's maps and unmaps) and records them.
struct LogHook {
    fb: Arc<Fb>,
    rec: RecordingHook,
}

impl MapHook for LogHook {
    fn mapped(&self, r: MappedRange) {
        self.fb.log.lock().push(("hook mapped", r.addr, r.bytes));
        self.rec.mapped(r);
    }
    fn unmapping(&self, r: MappedRange) {
        self.fb.log.lock().push(("hook unmapping", r.addr, r.bytes));
        self.rec.unmapping(r);
    }
}

fn log_hook(fb: &Arc<Fb>) -> Arc<LogHook> {
    Arc::new(LogHook {
        fb: fb.clone(),
        rec: RecordingHook::default(),
    })
}

/// Replays the backend's log: no map lands inside a range the hook holds,
/// no unmap touches one, a range is reported mapped only where a chunk was
/// mapped at its start, and unmapping names a live range exactly. Then the
/// hook's own rules.
fn check_order(fb: &Fb, hook: &LogHook) {
    let mut live: Vec<(u64, u64)> = Vec::new();
    // Chunk start -> bytes, as mapped.
    let mut chunk_starts = std::collections::BTreeMap::new();
    for (i, &(what, at, bytes)) in fb.log.lock().iter().enumerate() {
        let end = at + bytes as u64;
        let hit = |a: u64, e: u64| live.iter().find(|&&(s, t)| s < e && a < t).copied();
        match what {
            "map" => {
                assert_eq!(
                    hit(at, at + 1),
                    None,
                    "event {i}: a map at {at:#x} inside a live range"
                );
                chunk_starts.insert(at, bytes);
            }
            "unmap" => {
                assert_eq!(
                    hit(at, end),
                    None,
                    "event {i}: unmap {at:#x}+{bytes:#x} under a live range"
                );
                let gone: Vec<u64> = chunk_starts.range(at..end).map(|(&s, _)| s).collect();
                gone.iter().for_each(|s| {
                    chunk_starts.remove(s);
                });
            }
            "hook mapped" => {
                assert_eq!(
                    chunk_starts.get(&at),
                    Some(&bytes),
                    "event {i}: reported {at:#x}+{bytes:#x}, not one whole chunk"
                );
                assert_eq!(hit(at, end), None, "event {i}: reported mapped twice");
                live.push((at, end));
            }
            "hook unmapping" => {
                let k = live
                    .iter()
                    .position(|&r| r == (at, end))
                    .unwrap_or_else(|| {
                        panic!("event {i}: unmapping {at:#x}+{bytes:#x}, not a live range")
                    });
                live.swap_remove(k);
            }
            // Access to mapped chunks: the rules above are about maps.
            "access" => {}
            _ => unreachable!(),
        }
    }
    hook.rec.check().unwrap();
}

/// Every chunk and reservation made since `baseline` went back to the
/// driver.
fn assert_given_back(fb: &Fb, baseline: vmmbuf::stats::LiveCounts) {
    let now = fb.live();
    assert_eq!(
        (now.chunks, now.reservations),
        (baseline.chunks, baseline.reservations),
        "memory went back to the driver"
    );
}

/// An emulated GPU, what it holds before the test, and an arena of
/// 256 KiB chunks on it.
fn arena_on_emulated_gpu() -> (Arc<Fb>, vmmbuf::stats::LiveCounts, Arena<Fb, Q>) {
    let fb = FaultBackend::emulating_gpu(host());
    let baseline = fb.live();
    let arena = Arena::new(
        fb.clone(),
        ArenaDesc::new(1 << 30).max_chunk_bytes(256 << 10),
    )
    .unwrap();
    (fb, baseline, arena)
}

fn live_bytes(hook: &LogHook) -> usize {
    hook.rec.live().iter().map(|r| r.bytes).sum()
}

fn a_map_hook_follows_an_arena_through_growth_release_sleep_and_drop() {
    let (fb, baseline, arena) = arena_on_emulated_gpu();
    let hook = log_hook(&fb);
    arena.set_map_hook(Some(hook.clone())).unwrap();
    assert!(hook.rec.calls().is_empty(), "nothing mapped yet");

    // Allocations of varied sizes and data; a large one that maps fresh
    // memory lies in one reported range, whole.
    let sizes = [100, 3 << 20, 70_000, (5 << 20) + 11, 4096, 1 << 20, 9 << 20];
    let mut live = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        let before = arena.stats().reserved_bytes.current;
        let mut a = arena.alloc(n, &Q(i as u64 % 2)).unwrap();
        let data = random_bytes(100 + i as u64, n);
        a.write(0, &data).unwrap();
        let grew = arena.stats().reserved_bytes.current - before;
        if grew > 0 {
            let r = hook.rec.live();
            assert!(
                r.iter()
                    .any(|r| r.addr <= a.address() && a.address() + n as u64 <= r.end()),
                "a {n}-byte allocation that needed new memory lies in one range: {r:?}"
            );
        }
        live.push((a, data));
    }
    assert_eq!(live_bytes(&hook), arena.stats().reserved_bytes.current);
    assert!(hook
        .rec
        .live()
        .iter()
        .all(|r| r.placement == Location::Device(0)));
    check_order(&fb, &hook);

    // Frees, then a release: only whole ranges go, and what stays is still
    // reported exactly.
    let freed: Vec<_> = [1usize, 3].iter().rev().map(|&i| live.remove(i)).collect();
    drop(freed);
    let released = arena.release_cached().unwrap();
    assert!(released > 0, "the freed 3 MiB and 5 MiB ranges went back");
    assert_eq!(live_bytes(&hook), arena.stats().reserved_bytes.current);
    check_order(&fb, &hook);

    let intact = |live: &Vec<(vmmbuf::Allocation<Fb, Q>, Vec<u8>)>, when: &str| {
        for (a, data) in live {
            let mut got = vec![0u8; data.len()];
            a.read(0, &mut got).unwrap();
            assert!(got == *data, "{when}: bytes lost");
        }
    };
    intact(&live, "after the release");

    // A kept sleep: every range is told it is going, and the host chunks
    // at the same addresses are reported with their placement (an NCCL
    // hook skips them); the wake reports device ranges again.
    arena.sleep(&[Q(0), Q(1)], &SleepDesc::keep()).unwrap();
    let asleep = hook.rec.live();
    assert!(!asleep.is_empty() && asleep.iter().all(|r| r.placement == Location::Host));
    assert_eq!(live_bytes(&hook), arena.stats().reserved_bytes.current);
    arena.wake(&[Q(0), Q(1)], &WakeDesc::default()).unwrap();
    assert!(hook
        .rec
        .live()
        .iter()
        .all(|r| r.placement == Location::Device(0)));
    assert_eq!(live_bytes(&hook), arena.stats().reserved_bytes.current);
    intact(&live, "after a kept sleep");
    check_order(&fb, &hook);

    // A discarding sleep: nothing is mapped, nothing is live in the hook.
    arena.sleep(&[Q(0), Q(1)], &SleepDesc::discard()).unwrap();
    assert!(hook.rec.live().is_empty(), "{:?}", hook.rec.live());
    arena.wake(&[Q(0), Q(1)], &WakeDesc::default()).unwrap();
    assert_eq!(live_bytes(&hook), arena.stats().reserved_bytes.current);
    assert!(live_bytes(&hook) > 0);
    check_order(&fb, &hook);

    // A stashing sleep tells each range once that it is going and reports
    // nothing anew while it unmaps (a range cut chunk by chunk would be
    // reported again and again); its wake reports each run once.
    // (The discarding sleep lost the data: new data first.)
    for (i, (a, data)) in live.iter_mut().enumerate() {
        *data = random_bytes(200 + i as u64, data.len());
        a.write(0, data).unwrap();
    }
    let ranges = hook.rec.live().len();
    let since = |n: usize| hook.rec.calls()[n..].to_vec();
    let n = hook.rec.calls().len();
    arena.sleep(&[Q(0), Q(1)], &SleepDesc::stash()).unwrap();
    let told = since(n);
    assert!(hook.rec.live().is_empty(), "{:?}", hook.rec.live());
    assert!(
        told.iter().all(|c| matches!(c, HookCall::Unmapping(_))) && told.len() == ranges,
        "{ranges} ranges: {told:?}"
    );
    let n = hook.rec.calls().len();
    arena.wake(&[Q(0), Q(1)], &WakeDesc::default()).unwrap();
    let told = since(n);
    assert!(
        told.iter().all(|c| matches!(c, HookCall::Mapped(_))) && told.len() <= ranges,
        "{ranges} ranges before the sleep: {told:?}"
    );
    assert_eq!(live_bytes(&hook), arena.stats().reserved_bytes.current);
    intact(&live, "after a stashing sleep");
    check_order(&fb, &hook);

    // Grows after the wake are reported too; then everything goes.
    let more = arena.alloc(6 << 20, &Q(0)).unwrap();
    assert_eq!(live_bytes(&hook), arena.stats().reserved_bytes.current);
    drop(more);
    live.clear();
    drop(arena);
    assert!(
        hook.rec.live().is_empty(),
        "the drop told the hook of every range"
    );
    check_order(&fb, &hook);
    assert_given_back(&fb, baseline);
}

fn a_map_hook_follows_a_buffer_through_growth_migration_and_shrink() {
    let fb = FaultBackend::emulating_gpu(host());
    let baseline = fb.live();
    let g = fb.granularity(Location::Device(0)).unwrap();
    let mut buf = GrowableBuffer::new(
        fb.clone(),
        BufferDesc::new(256 * g).growth(GrowthPolicy::Exact),
    )
    .unwrap();
    let hook = log_hook(&fb);
    buf.set_map_hook(Some(hook.clone())).unwrap();
    let base = buf.base();

    // Each growth reports its new chunks, one range each, in order.
    let d = |o: usize, n: usize| MappedRange::new(base + o as u64, n, Location::Device(0));
    let steps = [3 * g, 5 * g, 4 * g, 6 * g];
    let mut cap = 0;
    for &n in &steps {
        let before = hook.rec.calls().len();
        buf.grow_to(cap + n).unwrap();
        let got: Vec<HookCall> = hook.rec.calls()[before..].to_vec();
        let want: Vec<HookCall> = (0..n / g)
            .map(|i| HookCall::Mapped(d(cap + i * g, g)))
            .collect();
        assert_eq!(got, want);
        cap += n;
    }
    let data = random_bytes(7, cap - 100);
    buf.write(0, &data).unwrap();

    // Moving bytes 5g..10g to the host: the chunks there are told first,
    // then come back with their new placement, one range each.
    let before = hook.rec.calls().len();
    buf.migrate(5 * g..10 * g, Location::Host).unwrap();
    let calls = hook.rec.calls();
    let unmapped: Vec<MappedRange> = calls[before..]
        .iter()
        .filter_map(|c| match c {
            HookCall::Unmapping(r) => Some(*r),
            _ => None,
        })
        .collect();
    assert_eq!(unmapped, (5..10).map(|i| d(i * g, g)).collect::<Vec<_>>());
    let mut live = hook.rec.live();
    live.sort_by_key(|r| r.addr);
    let h = |o: usize, n: usize| MappedRange::new(base + o as u64, n, Location::Host);
    let want: Vec<MappedRange> = (0..cap / g)
        .map(|i| {
            if (5..10).contains(&i) {
                h(i * g, g)
            } else {
                d(i * g, g)
            }
        })
        .collect();
    assert_eq!(live, want);
    let mut got = vec![0u8; data.len()];
    buf.read(0, &mut got).unwrap();
    assert!(got == data, "the migration kept every byte");
    check_order(&fb, &hook);

    // A shrink gives back whole ranges (chunks) only: a length inside a
    // chunk keeps it; at its start, it goes.
    buf.truncate(14 * g - 100);
    buf.shrink_to_fit().unwrap();
    assert_eq!(buf.capacity(), 14 * g, "the range holding the length stays");
    buf.truncate(12 * g);
    buf.shrink_to_fit().unwrap();
    assert_eq!(buf.capacity(), 12 * g);
    assert_eq!(live_bytes(&hook), 12 * g);
    let mut got = vec![0u8; 12 * g];
    buf.read(0, &mut got).unwrap();
    assert!(
        got == data[..12 * g],
        "the shrink kept every byte below the length"
    );
    check_order(&fb, &hook);

    drop(buf);
    assert!(hook.rec.live().is_empty());
    check_order(&fb, &hook);
    assert_given_back(&fb, baseline);
}

fn a_hook_set_on_a_live_arena_hears_of_its_memory_and_removing_it_tells_all_is_going() {
    let (fb, _, arena) = arena_on_emulated_gpu();
    let keep: Vec<_> = [4000usize, 2 << 20, 300_000]
        .iter()
        .map(|&n| arena.alloc(n, &Q(0)).unwrap())
        .collect();
    let mapped = arena.stats().reserved_bytes.current;
    let first = log_hook(&fb);
    arena.set_map_hook(Some(first.clone())).unwrap();
    assert_eq!(
        live_bytes(&first),
        mapped,
        "told of every mapped byte at once"
    );
    let second = log_hook(&fb);
    arena.set_map_hook(Some(second.clone())).unwrap();
    assert!(
        first.rec.live().is_empty(),
        "the replaced hook was told all is going"
    );
    assert_eq!(second.rec.live(), {
        let mut v: Vec<MappedRange> = first
            .rec
            .calls()
            .iter()
            .filter_map(|c| match c {
                HookCall::Mapped(r) => Some(*r),
                _ => None,
            })
            .collect();
        v.sort_by_key(|r| r.addr);
        v
    });
    arena.set_map_hook(None).unwrap();
    assert!(second.rec.live().is_empty());
    first.rec.check().unwrap();
    second.rec.check().unwrap();
    // Without a hook, growth tells nobody.
    let calls = (first.rec.calls().len(), second.rec.calls().len());
    let more = arena.alloc(3 << 20, &Q(1)).unwrap();
    assert_eq!((first.rec.calls().len(), second.rec.calls().len()), calls);
    drop((keep, more));
}

/// A hook that panics on every call. It unwinds with `resume_unwind`,
/// which skips the panic hook: the same unwinding through the arena, with
/// no "panicked at" message in a passing run.
struct Panicky(std::sync::atomic::AtomicUsize);

impl MapHook for Panicky {
    fn mapped(&self, _: MappedRange) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        std::panic::resume_unwind(Box::new("a hook's own bug (mapped)"));
    }
    fn unmapping(&self, _: MappedRange) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        std::panic::resume_unwind(Box::new("a hook's own bug (unmapping)"));
    }
}

fn a_panicking_hook_is_caught_and_the_arena_goes_on() {
    let (fb, baseline, arena) = arena_on_emulated_gpu();
    let hook = Arc::new(Panicky(std::sync::atomic::AtomicUsize::new(0)));
    arena.set_map_hook(Some(hook.clone())).unwrap();
    let mut keep = Vec::new();
    for (i, n) in [5000usize, 3 << 20, 700_000].into_iter().enumerate() {
        let mut a = arena.alloc(n, &Q(0)).unwrap();
        let data = random_bytes(40 + i as u64, n);
        a.write(0, &data).unwrap();
        keep.push((a, data));
    }
    keep.remove(1);
    assert!(arena.release_cached().unwrap() > 0);
    arena.sleep(&[Q(0)], &SleepDesc::keep()).unwrap();
    arena.wake(&[Q(0)], &WakeDesc::default()).unwrap();
    for (a, data) in &keep {
        let mut got = vec![0u8; data.len()];
        a.read(0, &mut got).unwrap();
        assert!(got == *data, "bytes kept through a panicking hook");
    }
    assert!(
        hook.0.load(std::sync::atomic::Ordering::SeqCst) >= 4,
        "the hook was called"
    );
    keep.clear();
    drop(arena);
    assert_given_back(&fb, baseline);
}

/// With a hook, every block handed out lies in one reported range (one
/// chunk: one NCCL registration), whatever its size, on two streams, with
/// free blocks that would have joined across chunks, and with the hook set
/// while blocks that straddle chunks are live and free: those are split at
/// the chunks' starts as they come back. Drawn sizes from 256 bytes to 3x
/// a chunk; every byte written is read back before its free.
fn every_block_of_a_hooked_arena_lies_in_one_reported_range() {
    let mut seed = 0x2545_F491_4F6C_DD1Du64;
    let mut draw = move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    for case in 0..6 {
        let (fb, baseline, arena) = arena_on_emulated_gpu();
        let hook = log_hook(&fb);
        let mut live: Vec<(vmmbuf::Allocation<Fb, Q>, Vec<u8>)> = Vec::new();
        let mut hooked = false;
        let mut checked = 0;
        for step in 0..300 {
            // The hook comes on after a while, over live and free blocks.
            if step == 60 + case * 10 && !hooked {
                arena.set_map_hook(Some(hook.clone())).unwrap();
                hooked = true;
            }
            if draw(5) < 3 || live.is_empty() {
                let n = match draw(4) {
                    0 => 256 * (1 + draw(64) as usize),
                    1 => (1 + draw(256) as usize) << 10,
                    _ => (1 + draw(768) as usize) << 10,
                };
                let mut a = arena.alloc(n, &Q(draw(2))).unwrap();
                if hooked {
                    let (at, end) = (a.address(), a.address() + n as u64);
                    let ranges = hook.rec.live();
                    assert!(
                        ranges.iter().any(|r| r.addr <= at && end <= r.end()),
                        "case {case} step {step}: {at:#x}+{n:#x} lies in no one reported range"
                    );
                    checked += 1;
                }
                let data = random_bytes(draw(u64::MAX), n.min(4096));
                a.write(0, &data).unwrap();
                live.push((a, data));
            } else {
                let (a, data) = live.swap_remove(draw(live.len() as u64) as usize);
                let mut back = vec![0u8; data.len()];
                a.read(0, &mut back).unwrap();
                assert_eq!(back, data, "case {case} step {step}: bytes kept");
            }
        }
        assert!(checked > 50, "case {case}: {checked} allocations checked");
        live.clear();
        arena.release_cached().unwrap();
        assert_eq!(live_bytes(&hook), arena.stats().reserved_bytes.current);
        drop(arena);
        check_order(&fb, &hook);
        assert_given_back(&fb, baseline);
    }
}
