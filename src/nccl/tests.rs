//! The NCCL hook against a recording registrar: every mapped device range
//! registered with every communicator, and ranks that grow, sleep and wake
//! alike registering alike.
use super::*;
use std::sync::Arc;

/// Records every call; refuses a registration at an address in `refuse`.
#[derive(Default)]
struct Recorder {
    calls: Mutex<Vec<(char, usize, u64, usize)>>,
    refuse: Mutex<Vec<u64>>,
    next: std::sync::atomic::AtomicUsize,
    /// handle -> (comm, addr) of registrations not yet undone.
    open: Mutex<HashMap<usize, (usize, u64)>>,
}

impl Registrar for Arc<Recorder> {
    fn register(&self, comm: usize, addr: u64, bytes: usize) -> std::result::Result<usize, String> {
        self.calls.lock().push(('r', comm, addr, bytes));
        if self.refuse.lock().contains(&addr) {
            return Err("refused".into());
        }
        let h = 1000 + self.next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.open.lock().insert(h, (comm, addr));
        Ok(h)
    }
    fn deregister(&self, comm: usize, handle: usize) -> std::result::Result<(), String> {
        let Some((c, addr)) = self.open.lock().remove(&handle) else {
            return Err(format!("handle {handle} is not open"));
        };
        assert_eq!(c, comm, "a handle undone with another communicator");
        self.calls.lock().push(('d', comm, addr, 0));
        Ok(())
    }
}

const HOST_AT: u64 = 1 << 40;

/// `add` with a recorder: the communicator is a number it never
/// dereferences.
#[allow(unsafe_code)]
fn add(hook: &NcclHook, comm: usize) -> Result<u64> {
    // SAFETY: the recorder only records the number.
    unsafe { hook.add(comm as *mut _) }
}

fn dev(addr: u64, bytes: usize) -> MappedRange {
    MappedRange::new(addr, bytes, Location::Device(0))
}

/// Ranges mapped before and after each communicator is added are
/// registered with it; an unmapping deregisters the range with every
/// communicator; a removed communicator's registrations are all undone,
/// and none is undone twice or with another communicator. Host ranges
/// are never registered. Drawn over many orders of the same calls.
#[test]
fn every_mapped_device_range_is_registered_with_every_communicator() {
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut draw = |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    let mut seen = (0u64, 0u64, 0u64);
    for case in 0..200 {
        let rec = Arc::new(Recorder::default());
        let hook = NcclHook::with(rec.clone());
        let mut mapped: BTreeMap<u64, MappedRange> = BTreeMap::new();
        let mut comms: Vec<(u64, usize)> = Vec::new();
        let mut next_comm = 0x10usize;
        for _ in 0..60 {
            match draw(6) {
                0 | 1 => {
                    let addr = (draw(64) + 1) << 21;
                    if mapped.contains_key(&addr) || mapped.contains_key(&(HOST_AT + addr)) {
                        continue;
                    }
                    // Host ranges lie apart, at and above HOST_AT:
                    // no registration may ever name an address there.
                    let r = if draw(5) == 0 {
                        MappedRange::new(HOST_AT + addr, 2 << 20, Location::Host)
                    } else {
                        dev(addr, (draw(3) as usize + 1) << 21)
                    };
                    hook.mapped(r);
                    mapped.insert(addr, r);
                }
                2 => {
                    if let Some(&a) = mapped.keys().nth(draw(mapped.len() as u64 + 1) as usize) {
                        let r = mapped.remove(&a).unwrap();
                        hook.unmapping(r);
                    }
                }
                3 => {
                    next_comm += 1;
                    comms.push((add(&hook, next_comm).unwrap(), next_comm));
                }
                4 => {
                    if !comms.is_empty() {
                        let (id, _) = comms.remove(draw(comms.len() as u64) as usize);
                        hook.remove(id).unwrap();
                        assert!(hook.remove(id).is_err(), "case {case}: removed twice");
                    }
                }
                _ => {
                    // NCCL refuses one device range's registrations.
                    if let Some(r) = mapped.values().find(|r| r.placement != Location::Host) {
                        rec.refuse.lock().push(r.addr);
                    }
                }
            }
            hook_agrees(&hook, &rec, &mapped, &comms, case);
        }
        assert!(
            rec.calls.lock().iter().all(|c| c.2 < HOST_AT),
            "case {case}: a host range was registered"
        );
        let n = hook.counts();
        seen.0 += n.deregistrations;
        seen.1 += n.failures;
        seen.2 += rec.calls.lock().iter().filter(|c| c.0 == 'r').count() as u64;
    }
    // The draws took every path: registrations, refusals, undoing.
    assert!(seen.0 > 0 && seen.1 > 0 && seen.2 > 0, "{seen:?}");
}

/// After each call of the test above: what is open is exactly each
/// communicator's device ranges that NCCL did not refuse, the counts
/// and bytes agree with it, and a range is covered exactly where every
/// communicator holds it.
fn hook_agrees(
    hook: &NcclHook,
    rec: &Recorder,
    mapped: &BTreeMap<u64, MappedRange>,
    comms: &[(u64, usize)],
    case: usize,
) {
    // What is open is exactly each communicator's device ranges
    // that NCCL did not refuse.
    let refused = rec.refuse.lock().clone();
    let mut want: Vec<(usize, u64)> = comms
        .iter()
        .flat_map(|&(_, c)| {
            mapped
                .values()
                .filter(|r| r.placement != Location::Host)
                .map(move |r| (c, r.addr))
        })
        .collect();
    let mut open: Vec<(usize, u64)> = rec.open.lock().values().copied().collect();
    // A range refused after its registration stays registered.
    want.retain(|w| open.contains(w) || !refused.contains(&w.1));
    want.sort_unstable();
    open.sort_unstable();
    assert_eq!(open, want, "case {case}");
    let n = hook.counts();
    let dev_bytes: u64 = mapped
        .values()
        .filter(|r| r.placement != Location::Host)
        .map(|r| r.bytes as u64)
        .sum();
    assert_eq!(n.mapped_bytes, dev_bytes, "case {case}");
    let reg_bytes: u64 = open.iter().map(|(_, a)| mapped[a].bytes as u64).sum();
    assert_eq!(n.registered_bytes, reg_bytes, "case {case}");
    assert_eq!(n.comms, comms.len());
    // A range is covered where every communicator holds it; a
    // byte past it never is (ranges are not merged).
    for r in mapped.values() {
        let want = r.placement != Location::Host
            && !comms.is_empty()
            && comms.iter().all(|&(_, c)| open.contains(&(c, r.addr)));
        assert_eq!(hook.covers(r.addr, r.bytes), want, "case {case}: {r:?}");
        assert!(!hook.covers(r.addr, r.bytes + 1), "case {case}: {r:?}");
    }
    assert_eq!(
        n.registrations - n.deregistrations,
        open.len() as u64,
        "case {case}: {n:?}"
    );
}

#[test]
fn a_null_or_repeated_communicator_is_refused() {
    let hook = NcclHook::with(Arc::new(Recorder::default()));
    assert!(matches!(add(&hook, 0), Err(Error::InvalidArgument(_))));
    let id = add(&hook, 7).unwrap();
    let e = add(&hook, 7).unwrap_err().to_string();
    assert!(e.contains("registered already"), "{e}");
    hook.remove(id).unwrap();
    assert!(hook.is_empty());
    assert!(add(&hook, 7).is_ok(), "added again once removed");
}

/// Ranks on the host backend (Linux only).
#[cfg(target_os = "linux")]
mod ranks {
    use super::*;

    /// Tells the NCCL hook of a host-backed arena's ranges as device ranges:
    /// the arena's growth, release, sleep and wake run as on a GPU, and the
    /// hook registers what it is told.
    struct AsDevice(Arc<NcclHook>);

    impl MapHook for AsDevice {
        fn mapped(&self, r: MappedRange) {
            self.0.mapped(dev(r.addr, r.bytes));
        }
        fn unmapping(&self, r: MappedRange) {
            self.0.unmapping(dev(r.addr, r.bytes));
        }
    }

    /// A registrar call: 'r' (register) or 'd', the address relative to the
    /// arena's base, the bytes ('d': 0).
    type Call = (char, u64, usize);

    /// One rank's run: an arena registered with a communicator grows, frees,
    /// gives memory back, sleeps (in every mode) and wakes, the calls drawn
    /// from `seed`. After every step: what is registered is exactly what is
    /// mapped, each range once; no range is registered while it is, nor
    /// deregistered while it is not; a growth only registers (the new ranges)
    /// and a sleep leaves nothing registered. Returns the registrar's calls,
    /// addresses relative to the arena's base, and (growths, sleeps) seen.
    fn rank_run(seed: u64) -> (Vec<Call>, (u32, u32)) {
        use crate::host::HostStream;
        use crate::{ArenaDesc, HostBackend, SleepDesc, WakeDesc};

        let rec = Arc::new(Recorder::default());
        let hook = Arc::new(NcclHook::with(rec.clone()));
        add(&hook, 0x10).unwrap();
        let desc = ArenaDesc::new(256 << 20).max_chunk_bytes(4 << 20);
        let arena: crate::host::HostArena = crate::Arena::new(HostBackend::new(), desc).unwrap();
        arena
            .set_map_hook(Some(Arc::new(AsDevice(hook.clone()))))
            .unwrap();
        let s = HostStream(1);
        let base = arena.base();
        let mut x = seed;
        let mut draw = |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        let mut live = Vec::new();
        let mut seen = (0u32, 0u32);
        for step in 0..120 {
            let before = rec.calls.lock().len();
            let mapped_before = hook.counts().mapped_ranges;
            let what = draw(8);
            match what {
                0..=3 => match arena.alloc(((draw(512) as usize) + 1) << 12, &s) {
                    Ok(a) => live.push(a),
                    Err(e) => panic!("step {step}: {e}"),
                },
                4 if !live.is_empty() => drop(live.swap_remove(draw(live.len() as u64) as usize)),
                5 => {
                    arena.release_cached().unwrap();
                }
                6 => {
                    // The sleeps that give device memory back (a kept sleep
                    // moves it to the host, which this stand-in cannot tell
                    // from a GPU's).
                    let (desc, mode) = match draw(2) {
                        0 => (SleepDesc::stash(), "stash"),
                        _ => (SleepDesc::discard(), "discard"),
                    };
                    arena.sleep(std::slice::from_ref(&s), &desc).unwrap();
                    let n = hook.counts();
                    assert_eq!(
                        (n.registered_bytes, rec.open.lock().len()),
                        (0, 0),
                        "step {step}: registered while asleep ({mode})"
                    );
                    seen.1 += 1;
                    arena
                        .wake(std::slice::from_ref(&s), &WakeDesc::default())
                        .unwrap();
                    let n = hook.counts();
                    assert!(
                        live.is_empty() || n.registered_bytes > 0,
                        "step {step}: the live allocations' memory is mapped and registered again"
                    );
                }
                _ => arena.empty_cache().unwrap(),
            }
            let calls = rec.calls.lock().clone();
            let new = &calls[before..];
            // What is registered is exactly the device ranges mapped now, one
            // registration each.
            let n = hook.counts();
            let open: Vec<u64> = rec.open.lock().values().map(|&(_, a)| a).collect();
            let mut unique = open.clone();
            unique.sort_unstable();
            unique.dedup();
            assert_eq!(
                unique.len(),
                open.len(),
                "step {step}: a range registered twice"
            );
            assert_eq!(open.len(), n.mapped_ranges, "step {step}: {n:?}");
            assert_eq!(n.registered_bytes, n.mapped_bytes, "step {step}: {n:?}");
            if what <= 3 && n.mapped_ranges > mapped_before {
                seen.0 += 1;
                assert!(
                    new.iter().all(|c| c.0 == 'r'),
                    "step {step}: a growth deregistered: {new:?}"
                );
                assert_eq!(
                    new.len(),
                    n.mapped_ranges - mapped_before,
                    "step {step}: only the new ranges"
                );
            }
        }
        drop(live);
        drop(arena);
        assert_eq!(
            hook.counts().registered_bytes,
            0,
            "the arena's end deregisters all"
        );
        // Never twice: replayed call by call, a registration names a range not
        // registered, a deregistration one that is.
        let calls = rec.calls.lock().clone();
        let mut open = std::collections::BTreeSet::new();
        for c in &calls {
            match c.0 {
                'r' => assert!(open.insert(c.2), "registered twice: {c:?}"),
                _ => assert!(open.remove(&c.2), "deregistered unregistered: {c:?}"),
            }
        }
        assert!(open.is_empty());
        let rel = calls.iter().map(|c| (c.0, c.2 - base, c.3)).collect();
        (rel, seen)
    }

    /// Ranks making the same calls register the same ranges in the same order
    /// (registration is symmetric by construction: each rank follows its own
    /// mappings, and equal calls map equal ranges), through growth, release,
    /// sleep and wake; over several draws.
    #[test]
    fn ranks_that_grow_sleep_and_wake_alike_register_alike_once_each() {
        let mut total = (0, 0);
        for seed in [
            0x9E37_79B9_7F4A_7C15u64,
            0x1234_5678_9ABC_DEF1,
            0x0F0F_F0F0_3C3C_C3C3,
        ] {
            let (a, seen) = rank_run(seed);
            let (b, _) = rank_run(seed);
            assert!(!a.is_empty());
            assert_eq!(a, b, "seed {seed:#x}: the ranks' registrations differ");
            total.0 += seen.0;
            total.1 += seen.1;
        }
        assert!(
            total.0 > 5 && total.1 > 5,
            "growths and sleeps drawn: {total:?}"
        );
    }
}
