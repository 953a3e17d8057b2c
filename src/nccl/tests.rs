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

/// One case of the test below: the hook, what is mapped, the
/// communicators added.
struct Case {
    rec: Arc<Recorder>,
    hook: NcclHook,
    mapped: BTreeMap<u64, MappedRange>,
    comms: Vec<(u64, usize)>,
    next_comm: usize,
}

impl Case {
    fn new() -> Self {
        let rec = Arc::new(Recorder::default());
        let hook = NcclHook::with(rec.clone());
        Self {
            rec,
            hook,
            mapped: BTreeMap::new(),
            comms: Vec::new(),
            next_comm: 0x10,
        }
    }

    /// Maps a range at a drawn address: a device range, or (one in five) a
    /// host range, apart at and above `HOST_AT`, where no registration may
    /// ever name an address.
    fn map(&mut self, draw: &mut impl FnMut(u64) -> u64) {
        let addr = (draw(64) + 1) << 21;
        if self.mapped.contains_key(&addr) || self.mapped.contains_key(&(HOST_AT + addr)) {
            return;
        }
        let r = if draw(5) == 0 {
            MappedRange::new(HOST_AT + addr, 2 << 20, Location::Host)
        } else {
            dev(addr, (draw(3) as usize + 1) << 21)
        };
        self.hook.mapped(r);
        self.mapped.insert(addr, r);
    }

    /// Unmaps a drawn range, if any.
    fn unmap(&mut self, draw: &mut impl FnMut(u64) -> u64) {
        let nth = draw(self.mapped.len() as u64 + 1) as usize;
        if let Some(&a) = self.mapped.keys().nth(nth) {
            let r = self.mapped.remove(&a).unwrap();
            self.hook.unmapping(r);
        }
    }

    fn add_comm(&mut self) {
        self.next_comm += 1;
        let id = add(&self.hook, self.next_comm).unwrap();
        self.comms.push((id, self.next_comm));
    }

    /// Removes a drawn communicator, once only.
    fn remove_comm(&mut self, draw: &mut impl FnMut(u64) -> u64, case: usize) {
        if !self.comms.is_empty() {
            let (id, _) = self.comms.remove(draw(self.comms.len() as u64) as usize);
            self.hook.remove(id).unwrap();
            assert!(self.hook.remove(id).is_err(), "case {case}: removed twice");
        }
    }

    /// NCCL refuses one device range's registrations.
    fn refuse_one(&mut self) {
        if let Some(r) = self.mapped.values().find(|r| r.placement != Location::Host) {
            self.rec.refuse.lock().push(r.addr);
        }
    }
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
        let mut c = Case::new();
        for _ in 0..60 {
            match draw(6) {
                0 | 1 => c.map(&mut draw),
                2 => c.unmap(&mut draw),
                3 => c.add_comm(),
                4 => c.remove_comm(&mut draw, case),
                _ => c.refuse_one(),
            }
            hook_agrees(&c.hook, &c.rec, &c.mapped, &c.comms, case);
        }
        let calls = c.rec.calls.lock();
        assert!(
            calls.iter().all(|x| x.2 < HOST_AT),
            "case {case}: a host range was registered"
        );
        let n = c.hook.counts();
        seen.0 += n.deregistrations;
        seen.1 += n.failures;
        seen.2 += calls.iter().filter(|x| x.0 == 'r').count() as u64;
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

    /// One rank: an arena on the host backend whose map hook tells an NCCL
    /// hook (registered with one communicator) of its ranges as device
    /// ranges, the registrar's calls recorded.
    struct Rank {
        rec: Arc<Recorder>,
        hook: Arc<NcclHook>,
        arena: crate::host::HostArena,
        stream: crate::host::HostStream,
        live: Vec<crate::host::HostAllocation>,
        /// Growths and sleeps seen.
        seen: (u32, u32),
    }

    impl Rank {
        fn new() -> Self {
            use crate::{ArenaDesc, HostBackend};
            let rec = Arc::new(Recorder::default());
            let hook = Arc::new(NcclHook::with(rec.clone()));
            add(&hook, 0x10).unwrap();
            let desc = ArenaDesc::new(256 << 20).max_chunk_bytes(4 << 20);
            let arena: crate::host::HostArena =
                crate::Arena::new(HostBackend::new(), desc).unwrap();
            arena
                .set_map_hook(Some(Arc::new(AsDevice(hook.clone()))))
                .unwrap();
            let stream = crate::host::HostStream(1);
            Self {
                rec,
                hook,
                arena,
                stream,
                live: Vec::new(),
                seen: (0, 0),
            }
        }

        /// Step `step` of kind `what` (0-3 allocate, 4 free, 5 release, 6
        /// sleep and wake, 7 empty the cache), its sizes and choices from
        /// `draw`.
        fn step(&mut self, step: usize, what: u64, draw: &mut impl FnMut(u64) -> u64) {
            match what {
                0..=3 => match self
                    .arena
                    .alloc(((draw(512) as usize) + 1) << 12, &self.stream)
                {
                    Ok(a) => self.live.push(a),
                    Err(e) => panic!("step {step}: {e}"),
                },
                4 if !self.live.is_empty() => {
                    drop(self.live.swap_remove(draw(self.live.len() as u64) as usize))
                }
                5 => {
                    self.arena.release_cached().unwrap();
                }
                6 => self.sleep_and_wake(step, draw(2) == 0),
                _ => self.arena.empty_cache().unwrap(),
            }
        }

        /// A sleep that gives device memory back (`stash`, else discard: a
        /// kept sleep moves it to the host, which this stand-in cannot tell
        /// from a GPU's) leaves nothing registered; the wake registers the
        /// live allocations' memory again.
        fn sleep_and_wake(&mut self, step: usize, stash: bool) {
            use crate::{SleepDesc, WakeDesc};
            let (desc, mode) = match stash {
                true => (SleepDesc::stash(), "stash"),
                false => (SleepDesc::discard(), "discard"),
            };
            let s = std::slice::from_ref(&self.stream);
            self.arena.sleep(s, &desc).unwrap();
            let n = self.hook.counts();
            assert_eq!(
                (n.registered_bytes, self.rec.open.lock().len()),
                (0, 0),
                "step {step}: registered while asleep ({mode})"
            );
            self.seen.1 += 1;
            self.arena.wake(s, &WakeDesc::default()).unwrap();
            assert!(
                self.live.is_empty() || self.hook.counts().registered_bytes > 0,
                "step {step}: the live allocations' memory is mapped and registered again"
            );
        }

        /// What is registered is exactly the device ranges mapped now, one
        /// registration each.
        fn check_registered_is_mapped(&self, step: usize) {
            let n = self.hook.counts();
            let open: Vec<u64> = self.rec.open.lock().values().map(|&(_, a)| a).collect();
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
        }

        /// A growth from `mapped_before` ranges only registered (the new
        /// ranges), in the calls from `before` on.
        fn check_growth(&mut self, step: usize, before: usize, mapped_before: usize) {
            let n = self.hook.counts();
            if n.mapped_ranges <= mapped_before {
                return;
            }
            self.seen.0 += 1;
            let calls = self.rec.calls.lock();
            let new = &calls[before..];
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

    /// Replayed call by call, a registration names a range not registered,
    /// a deregistration one that is; none is left.
    fn check_never_twice(calls: &[(char, usize, u64, usize)]) {
        let mut open = std::collections::BTreeSet::new();
        for c in calls {
            match c.0 {
                'r' => assert!(open.insert(c.2), "registered twice: {c:?}"),
                _ => assert!(open.remove(&c.2), "deregistered unregistered: {c:?}"),
            }
        }
        assert!(open.is_empty());
    }

    /// One rank's run: an arena registered with a communicator grows, frees,
    /// gives memory back, sleeps (in every mode) and wakes, the calls drawn
    /// from `seed`. After every step: what is registered is exactly what is
    /// mapped, each range once; no range is registered while it is, nor
    /// deregistered while it is not; a growth only registers (the new ranges)
    /// and a sleep leaves nothing registered. Returns the registrar's calls,
    /// addresses relative to the arena's base, and (growths, sleeps) seen.
    fn rank_run(seed: u64) -> (Vec<Call>, (u32, u32)) {
        let mut rank = Rank::new();
        let base = rank.arena.base();
        let mut x = seed;
        let mut draw = |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        for step in 0..120 {
            let before = rank.rec.calls.lock().len();
            let mapped_before = rank.hook.counts().mapped_ranges;
            let what = draw(8);
            rank.step(step, what, &mut draw);
            rank.check_registered_is_mapped(step);
            if what <= 3 {
                rank.check_growth(step, before, mapped_before);
            }
        }
        let Rank {
            rec,
            hook,
            arena,
            live,
            seen,
            ..
        } = rank;
        drop(live);
        drop(arena);
        assert_eq!(
            hook.counts().registered_bytes,
            0,
            "the arena's end deregisters all"
        );
        let calls = rec.calls.lock().clone();
        check_never_twice(&calls);
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
