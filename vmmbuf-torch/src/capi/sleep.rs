//! The C entry points of sleep and wake: by tag (`vmmbuf_sleep`,
//! `vmmbuf_wake`), ahead of a sleep (`vmmbuf_prepare_sleep`), the host
//! memory kept between sleeps, and torch_memory_saver's C `tms_pause` and
//! `tms_resume`.

use super::*;

/// Puts `tag`'s allocations (null: every tag's) on every device to sleep
/// and gives their device memory back; the addresses stay. `mode` is the
/// sleep's mode number ([`vmmbuf::SleepMode::code`], the one mode type of
/// Rust and Python too): `VMMBUF_KEEP` 0 moves the contents to pinned host
/// memory at the same addresses (kernels still reach them),
/// `VMMBUF_DISCARD` 1 drops them, `VMMBUF_STASH` 2 copies them to pinned
/// host memory kept away from the addresses (unmapped until the wake; one
/// copy each way, the fastest way to keep them), `VMMBUF_PAGEABLE` 3
/// copies them to pageable host memory away from the addresses, given
/// back to the system at the wake (no pinned memory), `VMMBUF_DISK` 4 to
/// files of the spill directory (`vmmbuf.set_spill_dir`), removed at the
/// wake; another number is an error. Waits for the work queued so far on
/// the streams of the tag's live allocations, for the fences of its frees
/// and for the uses recorded on its allocations; never for the whole device
/// (but once where frees, whose fences are deferred by default, were made
/// on a stream no live allocation of the tag uses any more). Until
/// `vmmbuf_wake`, new allocations under a tag kept asleep are made in host
/// memory (discarded: in fresh device memory elsewhere). Returns the bytes
/// put to sleep, or -1 on an error (logged; the arena that failed stays as
/// it was).
///
/// # Safety
/// `tag` is null or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn vmmbuf_sleep(tag: *const c_char, mode: c_int) -> i64 {
    guard("vmmbuf_sleep", -1, || move_tag(tag, true, mode))
}

/// Wakes `tag`'s allocations (null: every tag's) at the same addresses:
/// kept contents come back; discarded ranges get fresh memory, zeroed if
/// `flags` bit 0 (`VMMBUF_ZERO`) is set; a stashing or pageable sleep's
/// host copy stays readable after the wake if bit 1
/// (`VMMBUF_KEEP_BACKUP`) is set; the free memory the sleep gave back is
/// mapped again, free for the next allocations, if bit 2
/// (`VMMBUF_RESTORE_FREE`) is set (best effort: see
/// `vmmbuf::WakeDesc::restore_free`). Returns the bytes woken, or -1 on an
/// error (logged).
///
/// # Safety
/// `tag` is null or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn vmmbuf_wake(tag: *const c_char, flags: c_int) -> i64 {
    guard("vmmbuf_wake", -1, || move_tag(tag, false, flags))
}

/// The error for a mode number no [`vmmbuf::SleepMode`] has, naming the
/// numbers there are.
fn unknown_mode(n: c_int) -> String {
    let known: Vec<String> = vmmbuf::SleepMode::ALL
        .iter()
        .map(|m| format!("{} ({m})", m.code()))
        .collect();
    format!("sleep mode number {n}: one of {}", known.join(", "))
}

fn move_tag(tag: *const c_char, sleep: bool, flags: c_int) -> i64 {
    let what = if sleep { "vmmbuf_sleep" } else { "vmmbuf_wake" };
    let every = tag.is_null();
    let Some(tag) = tag_of(tag) else {
        fail(what, &"a tag that is not UTF-8");
        return -1;
    };
    let t = (!every).then_some(tag.as_str());
    let r = if sleep {
        // `flags` is the sleep's mode number here.
        let Some(mode) = vmmbuf::SleepMode::from_code(flags) else {
            fail(what, &unknown_mode(flags));
            return -1;
        };
        state::sleep_tags(t, mode)
    } else {
        state::wake_tags(t, flags & 1 != 0, flags & 2 != 0, flags & 4 != 0)
    };
    match r {
        Ok(m) => m.bytes as i64,
        Err(e) => {
            fail(&format!("{what}({tag:?})"), &e);
            -1
        }
    }
}

/// Pins, ahead of a sleep of `tag` (null: every tag) in `mode` (the
/// sleep's mode number, [`vmmbuf::SleepMode::code`]: `VMMBUF_KEEP` 0 or
/// `VMMBUF_STASH` 2; `VMMBUF_DISCARD` 1, `VMMBUF_PAGEABLE` 3 and
/// `VMMBUF_DISK` 4 pin nothing), the host memory it
/// will take: on a thread of its own if `wait` is 0 (the next sleep waits
/// for it), else now. Returns the bytes pinned (0 when not waiting), or -1
/// on an error (logged; an unknown mode number too).
///
/// # Safety
/// `tag` is null or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn vmmbuf_prepare_sleep(tag: *const c_char, mode: c_int, wait: c_int) -> i64 {
    guard("vmmbuf_prepare_sleep", -1, || {
        let every = tag.is_null();
        let Some(tag) = tag_of(tag) else {
            fail("vmmbuf_prepare_sleep", &"a tag that is not UTF-8");
            return -1;
        };
        let Some(mode) = vmmbuf::SleepMode::from_code(mode) else {
            fail("vmmbuf_prepare_sleep", &unknown_mode(mode));
            return -1;
        };
        match state::prepare_sleep((!every).then_some(tag.as_str()), mode, wait != 0) {
            Ok(n) => n as i64,
            Err(e) => {
                fail("vmmbuf_prepare_sleep", &e);
                -1
            }
        }
    })
}

/// Gives the pinned host memory kept between sleeps back to the driver, on
/// every device. Returns the bytes, or -1 on an error (logged).
#[no_mangle]
pub extern "C" fn vmmbuf_release_host_cache() -> i64 {
    guard(
        "vmmbuf_release_host_cache",
        -1,
        || match state::release_host_cache() {
            Ok(n) => n as i64,
            Err(e) => {
                fail("vmmbuf_release_host_cache", &e);
                -1
            }
        },
    )
}

/// Bounds the pinned host memory each device keeps between sleeps (what is
/// above it goes back at once). Returns 0, or -1 on an error (logged).
#[no_mangle]
pub extern "C" fn vmmbuf_set_host_cache_limit(bytes: usize) -> c_int {
    guard(
        "vmmbuf_set_host_cache_limit",
        -1,
        || match state::set_host_cache_limit(bytes) {
            Ok(()) => 0,
            Err(e) => {
                fail("vmmbuf_set_host_cache_limit", &e);
                -1
            }
        },
    )
}

/// torch_memory_saver's C `tms_pause` (vmmbuf's preload library exports
/// that name and calls this): the memory of the region tag `tag` (null:
/// every region's) sleeps as `torch_memory_saver.pause` puts it to sleep
/// (a pinned backup stashed, an mmap backup in pageable memory, the rest
/// discarded). Returns 0, or -1 on an error (logged, [`vmmbuf_last_error`]).
///
/// # Safety
/// `tag` is null or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn vmmbuf_tms_pause(tag: *const c_char) -> c_int {
    guard("tms_pause", -1, || tms_move(tag, true))
}

/// torch_memory_saver's C `tms_resume`: the memory of the region tag `tag`
/// (null: every region's) wakes at its addresses. Returns 0, or -1 on an
/// error (logged).
///
/// # Safety
/// `tag` is null or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn vmmbuf_tms_resume(tag: *const c_char) -> c_int {
    guard("tms_resume", -1, || tms_move(tag, false))
}

fn tms_move(tag: *const c_char, pause: bool) -> c_int {
    let what = if pause { "tms_pause" } else { "tms_resume" };
    let every = tag.is_null();
    let Some(tag) = tag_of(tag) else {
        fail(what, &"a tag that is not UTF-8");
        return -1;
    };
    match state::tms_move((!every).then_some(tag.as_str()), pause) {
        Ok(_) => 0,
        Err(e) => {
            fail(what, &e);
            -1
        }
    }
}
