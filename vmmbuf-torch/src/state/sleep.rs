//! Sleep and wake by tag, and the host pieces kept between sleeps.

use super::*;

/// What a sleep or a wake of tags did, summed over devices and tags.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Moved {
    /// Bytes put to sleep or woken.
    pub(crate) bytes: u64,
    /// Device bytes given back (sleep) or mapped (wake).
    pub(crate) device_bytes: u64,
}

impl Moved {
    fn add(&mut self, r: &vmmbuf::stats::SleepReport) {
        self.bytes += r.bytes as u64;
        self.device_bytes += r.device_bytes as u64;
    }
}

/// The tags of `d` that `tag` names (`None`: all), sorted.
fn tags_of<'a>(d: &'a Device, tag: Option<&str>) -> Vec<&'a String> {
    let mut tags: Vec<&String> = d
        .arenas
        .keys()
        .filter(|t| tag.is_none_or(|want| want == t.as_str()))
        .collect();
    tags.sort_unstable();
    tags
}

/// Puts `tag`'s arena (`None`: every tag's) on every device to sleep in
/// `mode`: keeping the data in pinned host memory at its addresses,
/// stashing it there away from them, or discarding it; the memory goes back
/// to the driver, the addresses stay. A preparation under way
/// (`prepare_sleep`) is waited for first. On an error the arena that failed
/// stays as it was and the ones before it stay asleep.
pub(crate) fn sleep_tags(tag: Option<&str>, mode: SleepMode) -> Result<Moved> {
    let desc = SleepDesc::from(mode);
    let mut moved = Moved::default();
    for (_, d) in all_devices() {
        let mut d = d.lock();
        d.finish_preparing();
        for t in tags_of(&d, tag) {
            let arena = &d.arenas[t];
            let r = arena.sleep(&d.live_streams(arena), &desc)?;
            moved.add(&r);
        }
    }
    Ok(moved)
}

/// Wakes `tag`'s arena (`None`: every tag's) on every device: kept data
/// comes back, discarded ranges get fresh memory (zeroed if `zero`), at the
/// same addresses; a stashing or pageable sleep's host copy stays readable
/// if `keep_backup` (`WakeDesc::keep_backup`); with `restore_free` the free
/// memory the sleep gave back is mapped again (`WakeDesc::restore_free`).
/// On an error the arena that
/// failed stays asleep.
pub(crate) fn wake_tags(
    tag: Option<&str>,
    zero: bool,
    keep_backup: bool,
    restore_free: bool,
) -> Result<Moved> {
    let mut desc = WakeDesc::default();
    desc.zero = zero;
    desc.keep_backup = keep_backup;
    desc.restore_free = restore_free;
    let mut moved = Moved::default();
    for (_, d) in all_devices() {
        let d = d.lock();
        for t in tags_of(&d, tag) {
            let arena = &d.arenas[t];
            if arena.sleep_mode().is_none() {
                continue;
            }
            let r = arena.wake(&d.live_streams(arena), &desc)?;
            moved.add(&r);
        }
    }
    Ok(moved)
}

/// Creates the host pieces a kept sleep of `tag` (`None`: every tag) would
/// take, on a thread of its own per device (the GPU keeps working); the
/// next sleep waits for it. With `wait`, returns once they exist, with the
/// bytes created.
pub(crate) fn prepare_sleep(tag: Option<&str>, mode: SleepMode, wait: bool) -> Result<u64> {
    let desc = SleepDesc::from(mode);
    let mut made = 0u64;
    for (_, d) in all_devices() {
        let mut d = d.lock();
        let arenas: Vec<TorchArena> = tags_of(&d, tag)
            .into_iter()
            .map(|t| d.arenas[t].clone())
            .filter(|a| a.sleep_mode().is_none())
            .collect();
        d.finish_preparing();
        let work = move || -> Result<usize> {
            let mut n = 0;
            for a in arenas {
                n += a.prepare_sleep(&desc)?;
            }
            Ok(n)
        };
        if wait {
            drop(d);
            made += work()? as u64;
        } else {
            let h = std::thread::Builder::new()
                .name("vmmbuf-prepare".into())
                .spawn(work)
                .map_err(|e| Error::Os {
                    call: "spawning the preparing thread",
                    source: e,
                })?;
            d.preparing = Some(h);
        }
    }
    Ok(made)
}

/// Gives the host pieces kept between sleeps back to the driver, on every
/// device (after any preparation under way); the bytes they held.
pub(crate) fn release_host_cache() -> Result<u64> {
    let mut gone = 0u64;
    for (_, d) in all_devices() {
        let mut d = d.lock();
        // A preparation under way finishes first (its pieces go too).
        d.finish_preparing();
        for a in d.arenas.values() {
            // An arena asleep stashed keeps its stash (its data).
            if a.sleep_mode() != Some(SleepMode::Stash) {
                a.release_stash()?;
            }
        }
        gone += d.pool.stats().pooled_host_bytes as u64;
        d.pool.trim_at(Location::Host)?;
    }
    Ok(gone)
}

/// Bounds the host pieces each device keeps between sleeps (shedding the
/// largest at once if it holds more).
pub(crate) fn set_host_cache_limit(bytes: usize) -> Result<()> {
    for (_, d) in all_devices() {
        let d = d.lock();
        let desc = d.pool.desc().max_host_bytes(bytes);
        d.pool.set_desc(desc)?;
    }
    HOST_LIMIT.store(bytes, std::sync::atomic::Ordering::Relaxed);
    Ok(())
}

/// The host bound for devices used later (`usize::MAX`: none).
pub(super) static HOST_LIMIT: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(usize::MAX);

/// The bytes a stashing or pageable sleep kept for `[ptr, ptr + bytes)`,
/// while the tag whose arena holds them is asleep so, or after a wake that
/// kept them (torch_memory_saver's `get_cpu_backup`); `None` when no arena
/// holds such a backup.
///
/// The buffer is made only for a backup that holds the range, and made
/// fallibly: a size the host cannot give is
/// [`Error::OutOfMemory`](vmmbuf::Error::OutOfMemory), never an abort.
#[cfg_attr(not(feature = "python"), allow(dead_code))]
pub(crate) fn read_backup(ptr: u64, bytes: usize) -> Result<Option<Vec<u8>>> {
    for (_, d) in all_devices() {
        let d = d.lock();
        for a in d.arenas.values() {
            if !a.holds_backup(ptr, bytes) {
                continue;
            }
            let mut buf = Vec::new();
            buf.try_reserve_exact(bytes)
                .map_err(|_| Error::OutOfMemory {
                    call: "a host buffer for a backup's bytes",
                    requested_bytes: bytes,
                })?;
            buf.resize(bytes, 0);
            if a.read_backup(ptr, &mut buf)? {
                return Ok(Some(buf));
            }
        }
    }
    Ok(None)
}

/// The host address of the backup of `[ptr, ptr + bytes)` (see
/// `Arena::backup_address`): torch_memory_saver's
/// `get_cpu_backup(zero_copy=True)`; `None` when no arena holds it whole.
#[cfg_attr(not(feature = "python"), allow(dead_code))]
pub(crate) fn backup_address(ptr: u64, bytes: usize) -> Result<Option<u64>> {
    for (_, d) in all_devices() {
        let d = d.lock();
        for a in d.arenas.values() {
            if let Some(h) = a.backup_address(ptr, bytes)? {
                return Ok(Some(h));
            }
        }
    }
    Ok(None)
}

/// torch_memory_saver's region memory as the Python package tags it: the
/// region's tag followed by the suffix of its kind (`cpu_backup_backend`
/// "pinned", "mmap", a disk backup, or no backup), and the sleep its pause
/// takes. The
/// suffixes start with a control character no user's tag has. One table
/// for Python (`_native.tms_kinds`) and the C `tms_pause`.
pub(crate) const TMS_KINDS: [(&str, &str, SleepMode); 4] = [
    ("pinned", "", SleepMode::Stash),
    ("mmap", "\u{1f}mmap", SleepMode::Pageable),
    ("disk", "\u{1f}disk", SleepMode::Disk),
    ("discard", "\u{1f}discard", SleepMode::Discard),
];

/// Whether the C `tms_resume` maps back the free memory its pause gave
/// back (`WakeDesc::restore_free`): set from Python where vmmbuf is the
/// process's allocator, so that its free blocks are the cache PyTorch's
/// allocator would keep (torch_memory_saver's resume maps that back).
static TMS_RESTORE_FREE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Sets what the C `tms_resume` does with free memory ([`TMS_RESTORE_FREE`]):
/// from Python only.
#[cfg_attr(not(feature = "python"), allow(dead_code))]
pub(crate) fn set_tms_restore_free(on: bool) {
    TMS_RESTORE_FREE.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// torch_memory_saver's C `tms_pause` (`pause`) and `tms_resume`: every
/// arena of the region tag `tag` (`None`: of every region; untagged memory
/// is no region's) sleeps as its kind's pause does, or wakes. On an error
/// the arena that failed stays as it was and the ones before it moved.
pub(crate) fn tms_move(tag: Option<&str>, pause: bool) -> Result<Moved> {
    let mut moved = Moved::default();
    for (_, d) in all_devices() {
        let mut d = d.lock();
        d.finish_preparing();
        let mut todo: Vec<(String, SleepMode)> = Vec::new();
        for t in tags_of(&d, None) {
            let Some((base, mode)) = TMS_KINDS.iter().find_map(|&(_, suffix, mode)| {
                let base = t.strip_suffix(suffix)?;
                (!base.is_empty() && !base.contains('\u{1f}')).then_some((base, mode))
            }) else {
                continue;
            };
            if tag.is_none_or(|want| want == base) {
                todo.push((t.clone(), mode));
            }
        }
        for (t, mode) in todo {
            let arena = &d.arenas[&t];
            let streams = d.live_streams(arena);
            let r = if pause {
                if arena.sleep_mode().is_some() {
                    continue;
                }
                arena.sleep(&streams, &SleepDesc::from(mode))?
            } else {
                if arena.sleep_mode().is_none() {
                    continue;
                }
                let mut desc = WakeDesc::default();
                desc.restore_free = TMS_RESTORE_FREE.load(std::sync::atomic::Ordering::Relaxed);
                arena.wake(&streams, &desc)?
            };
            moved.add(&r);
        }
    }
    Ok(moved)
}
