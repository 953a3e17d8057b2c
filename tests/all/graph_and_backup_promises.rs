//! Frees into a second graph's capture, kept backups, disk backup files and
//! captures that run out of memory: each test checks what the arena's
//! documentation promises, and fails where the arena does otherwise.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use vmmbuf::host::{HostCaptureState, HostStream};
use vmmbuf::{
    Arena, ArenaDesc, ArenaStream, Backend, Error, GraphPoolId, HostBackend, SleepDesc, SleepMode,
    WakeDesc,
};

use crate::common::random_bytes;
use crate::failing_backend::{Ctl, DoneStream as Q, FaultBackend, TestFence};

crate::register! {
    host: [
        a_block_made_in_one_capture_and_freed_in_another_stays_while_either_graph_lives,
        prepare_sleep_keeps_a_kept_stash_backup,
        a_kept_backup_is_the_last_sleeps_copy,
        disk_backup_files_go_with_a_killed_process,
        files_made_first_in_the_spill_directory_do_not_stop_a_disk_sleep,
        out_of_memory_in_a_capture_never_synchronises,
        a_stash_sleep_cut_short_loses_no_chunk,
        the_host_backend_refuses_what_cuda_refuses_during_a_capture,
        nothing_in_the_arena_synchronises_during_a_capture,
        a_disk_sleep_that_cannot_write_leaves_the_arena_awake_and_says_where,
    ],
    child: [spill_child_killed_asleep, spill_child_with_names_taken],
}

type Fb = FaultBackend<HostBackend>;
const G: usize = 64 << 10;

/// An arena with room for `chunks` granules on a counting host backend.
fn small_arena(chunks: usize, desc: ArenaDesc) -> (Arc<Fb>, Arena<Fb, Ctl>) {
    let fb = FaultBackend::new(HostBackend::with_granularity(G).unwrap());
    let a = Arena::new(fb.clone(), desc.max_reserved_bytes(chunks * G)).unwrap();
    (fb, a)
}

/// The emulated GPU of the sleep tests: 256 KiB chunks of host memory.
fn emulated() -> (Arc<Fb>, Arena<Fb, Q>) {
    let fb = FaultBackend::emulating_gpu(crate::common::host());
    let arena = Arena::new(
        fb.clone(),
        ArenaDesc::new(1 << 30).max_chunk_bytes(256 << 10),
    )
    .unwrap();
    (fb, arena)
}

/// `free_into_graph(h)` of an allocation made in graph g's capture (g
/// still alive): the block is referenced by g and h. When g is released,
/// the block stays held for h, whose capture used and freed it and which
/// replays at those addresses: neither s1's next allocation nor s2's takes
/// it. The control (an allocation made outside any capture, freed into h)
/// is held for h alone. Once h goes too, everything goes back.
fn a_block_made_in_one_capture_and_freed_in_another_stays_while_either_graph_lives() {
    for from_graph in [false, true] {
        let (fb, arena) = small_arena(2, ArenaDesc::new(64 << 20));
        let (s1, s2) = (Ctl::new(1), Ctl::new(2));
        let (g, h) = (GraphPoolId(41), GraphPoolId(42));
        // A: graph g's (say, g's output), or an ordinary allocation.
        let a = if from_graph {
            arena.alloc_in_graph(G, &s1, g).unwrap()
        } else {
            arena.alloc(G, &s1).unwrap()
        };
        let at = a.address();
        // s1 is captured into h: h's work reads A, then A is freed.
        a.free_into_graph(h);
        let after_free = arena.graph_pools();
        // g is destroyed (never replayed again); h lives on.
        let released = arena.release_graph(g).unwrap();
        let after_release = arena.graph_pools();
        // s1's next call outside any capture, then its work finishes.
        let c = arena.alloc(G, &s1).unwrap();
        let c_at = c.address();
        drop(c);
        s1.finish();
        let b = arena.alloc(G, &s2);
        let b_at = b.as_ref().map(|b| b.address()).ok();
        eprintln!(
            "  A from graph g: {from_graph}; A at {at:#x}; pools after free_into_graph(h) \
             {after_free:?}; release_graph(g) freed {released}, pools now {after_release:?}; \
             s1 then got {c_at:#x}; s2 got {:?}",
            b_at.map(|x| format!("{x:#x}"))
        );
        assert!(
            c_at != at && b_at != Some(at),
            "A from graph g: {from_graph}: A's bytes were handed out again (s1: {}, s2: {}) \
             while graph h, whose capture used and freed them, is still alive",
            c_at == at,
            b_at == Some(at)
        );
        drop(b);
        s2.finish();
        // h goes too: the block goes back, and everything to the driver.
        arena.release_graph(h).unwrap();
        assert!(arena.graph_pools().is_empty());
        arena.release_all_cached().unwrap();
        arena.empty_cache().unwrap();
        let st = arena.stats();
        assert_eq!(
            (st.allocated_bytes.current, st.reserved_bytes.current),
            (0, 0)
        );
        drop(arena);
        assert_eq!(fb.live().mapped_bytes, 0, "every byte back");
    }
}

/// `WakeDesc::keep_backup` keeps a stash's copy readable (`read_backup`,
/// `backup_address`) "until the next sleep ... or `release_stash`":
/// `prepare_sleep` (which torch_memory_saver's shim runs as every region
/// with a pinned backup ends) leaves it as it is, also after the arena
/// grew, at the same host address.
fn prepare_sleep_keeps_a_kept_stash_backup() {
    let (_fb, arena) = emulated();
    let n = 300 << 10;
    let mut a = arena.alloc(n, &Q(0)).unwrap();
    let data = random_bytes(5, n);
    a.write(0, &data).unwrap();
    arena.sleep(&[Q(0)], &SleepDesc::stash()).unwrap();
    arena.wake(&[Q(0)], &WakeDesc::keeping_backup()).unwrap();
    let read = |arena: &Arena<Fb, Q>| {
        let mut got = vec![0u8; n];
        let ok = arena.read_backup(a.address(), &mut got).unwrap();
        (ok, got == data, got[..8].to_vec())
    };
    let before = read(&arena);
    let host_before = arena.backup_address(a.address(), n).unwrap();
    assert!(before.0 && before.1, "the kept backup holds A: {before:?}");
    // With nothing changed, preparing the next sleep keeps it.
    arena.prepare_sleep(&SleepDesc::stash()).unwrap();
    let unchanged = read(&arena);
    // A new region allocates: the arena's run grows past A.
    let b = arena.alloc(n, &Q(0)).unwrap();
    arena.prepare_sleep(&SleepDesc::stash()).unwrap();
    let after = read(&arena);
    let host_after = arena.backup_address(a.address(), n).unwrap();
    eprintln!(
        "  read_backup (held, equal to A, first bytes): kept {before:?}; after a prepare \
         with nothing new {unchanged:?}; after an allocation and a prepare {after:?}; \
         backup_address {host_before:#x?} -> {host_after:#x?}"
    );
    assert!(
        unchanged.0 && unchanged.1,
        "an idle prepare_sleep changed the backup"
    );
    assert!(
        !after.0 || after.1,
        "prepare_sleep replaced the kept backup's memory: read_backup still answers true \
         but returns other bytes ({:02x?} instead of {:02x?})",
        after.2,
        &data[..8]
    );
    assert!(after.0, "the kept backup is still there");
    assert_eq!(host_after, host_before, "at the same host address");
    drop((a, b));
}

/// A backup a wake keeps is the last sleep's copy: after a pageable sleep
/// whose wake kept its copy, then new data, a stashing sleep and a wake
/// that keeps the stash, `read_backup` and `backup_address` answer with the
/// stash (the new data), never the older pageable copy.
fn a_kept_backup_is_the_last_sleeps_copy() {
    let (_fb, arena) = emulated();
    let n = 300 << 10;
    let mut a = arena.alloc(n, &Q(0)).unwrap();
    let (old, new) = (random_bytes(11, n), random_bytes(12, n));
    a.write(0, &old).unwrap();
    arena
        .sleep(&[Q(0)], &SleepDesc::from(SleepMode::Pageable))
        .unwrap();
    arena.wake(&[Q(0)], &WakeDesc::keeping_backup()).unwrap();
    a.write(0, &new).unwrap();
    arena.sleep(&[Q(0)], &SleepDesc::stash()).unwrap();
    arena.wake(&[Q(0)], &WakeDesc::keeping_backup()).unwrap();
    let mut got = vec![0u8; n];
    assert!(
        arena.read_backup(a.address(), &mut got).unwrap(),
        "a backup is kept"
    );
    assert!(
        got == new,
        "the kept backup is the stash's copy (the new data), not the older pageable one"
    );
    let at = arena
        .backup_address(a.address(), n)
        .unwrap()
        .expect("an address");
    let mut back = vec![0u8; n];
    a.read(0, &mut back).unwrap();
    assert!(back == new, "the allocation holds the new data");
    eprintln!("  kept backup at {at:#x}: the stash's copy");
    arena.release_stash().unwrap();
    assert!(
        !arena.read_backup(a.address(), &mut got).unwrap(),
        "released: no backup"
    );
}

/// The directory a child process of these tests spills into.
fn spill_dir(what: &str) -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!("vmmbuf-spill-test-{what}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    std::fs::create_dir_all(&p).unwrap();
    p
}

fn run_child(name: &str, dir: &std::path::Path) -> std::process::Output {
    std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--ignored", "--test-threads=1"])
        .env("VMMBUF_SPILL_TEST_DIR", dir)
        .output()
        .unwrap()
}

fn files_in(dir: &std::path::Path) -> Vec<(String, u64)> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                e.metadata().unwrap().len(),
            )
        })
        .collect()
}

/// A process killed while asleep on disk (the OOM killer, a SIGKILL from a
/// job scheduler) leaves no file in the spill directory
/// (torch_memory_saver's default: /tmp): the files have no name there, so
/// they go with the process. (Named files, removed only by path, were all
/// left behind, as large as the memory that slept.)
fn disk_backup_files_go_with_a_killed_process() {
    let dir = spill_dir("killed");
    let out = run_child("graph_and_backup_promises::spill_child_killed_asleep", &dir);
    let left = files_in(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    let err = String::from_utf8_lossy(&out.stderr);
    let said = err
        .lines()
        .find(|l| l.contains("killed child"))
        .unwrap_or("");
    eprintln!(
        "  child: {:?} ({said}); files left in the spill directory: {} ({} bytes): {:?}",
        out.status,
        left.len(),
        left.iter().map(|f| f.1).sum::<u64>(),
        left.iter().take(4).collect::<Vec<_>>()
    );
    assert!(
        said.contains("asleep"),
        "the child did not reach its disk sleep: {err}"
    );
    assert!(
        left.is_empty(),
        "{} backup files of a killed process were left behind",
        left.len()
    );
}

fn spill_child_killed_asleep() {
    let dir = std::path::PathBuf::from(std::env::var_os("VMMBUF_SPILL_TEST_DIR").unwrap());
    let (_fb, arena) = emulated();
    arena.set_spill_dir(Some(dir));
    let mut a = arena.alloc(3 << 20, &Q(0)).unwrap();
    a.write(0, &random_bytes(3, 3 << 20)).unwrap();
    let r = arena
        .sleep(&[Q(0)], &SleepDesc::from(SleepMode::Disk))
        .unwrap();
    eprintln!("killed child: asleep on disk, {} bytes", r.bytes);
    // Killed while asleep: no destructor runs.
    rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL)
        .unwrap();
}

/// Files another local user creates first in a shared spill directory (the
/// default, /tmp), under the names a disk sleep once used
/// (`vmmbuf-<pid>-<n>.bak`), do not stop it: its files have no name, or a
/// random one passed over if taken.
fn files_made_first_in_the_spill_directory_do_not_stop_a_disk_sleep() {
    let dir = spill_dir("foreseen");
    let out = run_child(
        "graph_and_backup_promises::spill_child_with_names_taken",
        &dir,
    );
    let _ = std::fs::remove_dir_all(&dir);
    let err = String::from_utf8_lossy(&out.stderr);
    let said = err
        .lines()
        .find(|l| l.contains("names-taken child"))
        .unwrap_or("");
    eprintln!("  child: {:?}; {said}", out.status);
    assert!(
        said.contains("sleep ->"),
        "the child did not try the sleep: {err}"
    );
    assert!(
        said.contains("sleep -> Ok"),
        "the disk sleep failed on names created in advance by someone else"
    );
}

fn spill_child_with_names_taken() {
    let dir = std::path::PathBuf::from(std::env::var_os("VMMBUF_SPILL_TEST_DIR").unwrap());
    // What another user of the directory does, knowing this process's id.
    for n in 0..64 {
        let p = dir.join(format!("vmmbuf-{}-{n}.bak", std::process::id()));
        std::fs::write(p, b"").unwrap();
    }
    let (_fb, arena) = emulated();
    arena.set_spill_dir(Some(dir));
    let a = arena.alloc(1 << 20, &Q(0)).unwrap();
    let r = arena.sleep(&[Q(0)], &SleepDesc::from(SleepMode::Disk));
    eprintln!(
        "names-taken child: sleep -> {:?}; mode now {:?}",
        r.as_ref().map(|r| r.bytes).map_err(|e| e.to_string()),
        arena.sleep_mode()
    );
    if r.is_ok() {
        arena.wake(&[Q(0)], &WakeDesc::default()).unwrap();
    }
    drop(a);
}

/// `alloc_in_graph` runs while its stream is captured: out of memory, it
/// never synchronises the device (illegal while any stream is captured: it
/// fails and invalidates the capture), even with a free still owed that
/// only a synchronisation would show finished; the error says so.
fn out_of_memory_in_a_capture_never_synchronises() {
    let (fb, arena) = small_arena(1, ArenaDesc::new(64 << 20).defer_free_fences(true));
    let (s1, s2) = (Ctl::new(1), Ctl::new(2));
    // A free on s1 whose fence is deferred (owed), as the plug-in makes them.
    drop(arena.alloc(G, &s1).unwrap());
    let before = fb.live().device_syncs;
    // s2 is captured into graph 5 and asks for memory the budget lacks.
    let r = arena.alloc_in_graph(G, &s2, GraphPoolId(5));
    let syncs = fb.live().device_syncs - before;
    eprintln!(
        "  alloc_in_graph -> {:?}; device synchronisations during it: {syncs}",
        r.as_ref().map(|a| a.address()).map_err(|e| e.to_string())
    );
    assert_eq!(
        syncs, 0,
        "an allocation inside a capture synchronised the device"
    );
    assert!(
        matches!(
            r,
            Err(Error::ArenaOutOfMemory {
                during_capture: true,
                ..
            })
        ),
        "a typed out of memory that says a capture was under way: {r:?}"
    );
    drop(r);
    s1.finish();
    s2.finish();
    arena.release_graph(GraphPoolId(5)).unwrap();
    arena.release_all_cached().unwrap();
    arena.empty_cache().unwrap();
    drop(arena);
    assert_eq!(fb.live().mapped_bytes, 0, "every byte back");
}

/// A stashing sleep unmaps chunk by chunk as the copies finish; one cut
/// short leaves the chunks done so far asleep and the rest awake. An
/// allocation over both, freed while asleep, frees both parts: after the
/// wake and `empty_cache` nothing stays mapped. (Its awake part was once
/// lost for good.)
fn a_stash_sleep_cut_short_loses_no_chunk() {
    let (fb, arena) = emulated();
    // 300 KiB: a 256 KiB chunk and a 64 KiB one.
    let a = arena.alloc(300 << 10, &Q(0)).unwrap();
    // The second copy's fence fails (the first chunk is unmapped by then).
    let waits = Arc::new(AtomicUsize::new(0));
    let w = waits.clone();
    *fb.on_wait.lock() = Some(Box::new(move |f: &TestFence| {
        if w.fetch_add(1, Ordering::SeqCst) == 1 {
            f.break_it();
        }
    }));
    let desc = SleepDesc::stash().max_piece_bytes(256 << 10);
    let r = arena.sleep(&[], &desc);
    *fb.on_wait.lock() = None;
    let asleep = arena.stats().discarded_bytes;
    drop(a);
    arena.wake(&[Q(0)], &WakeDesc::default()).unwrap();
    arena.empty_cache().unwrap();
    let s = arena.stats();
    eprintln!(
        "  sleep -> {:?}; asleep {asleep} bytes; after the free, the wake and empty_cache: \
         allocated {}, reserved {}",
        r.as_ref().map(|r| r.bytes).map_err(|e| e.to_string()),
        s.allocated_bytes.current,
        s.reserved_bytes.current
    );
    assert!(r.is_err() && asleep > 0, "the sleep was not cut short");
    assert_eq!(
        s.reserved_bytes.current, 0,
        "nothing is allocated, yet {} bytes stay mapped for good",
        s.reserved_bytes.current
    );
}

/// The host backend refuses, during a capture, what CUDA refuses (a device
/// synchronisation; a fence on, or a wait for, the captured stream; a
/// synchronous copy) and invalidates the capture as CUDA does, so that its
/// end fails; another stream's fence is allowed.
fn the_host_backend_refuses_what_cuda_refuses_during_a_capture() {
    let b = HostBackend::with_granularity(G).unwrap();
    let (s1, s2) = (HostStream(1), HostStream(2));
    let before = s1.fence(&b).unwrap();
    b.begin_capture(s1.key()).unwrap();
    assert_eq!(b.capture_state(s1.key()), HostCaptureState::Active);
    assert!(b.capture_underway());
    assert!(s2.fence(&b).is_ok(), "another stream's fence is allowed");
    let sync = b.synchronize();
    eprintln!("  a synchronisation during a capture: {sync:?}");
    assert!(matches!(sync, Err(Error::CaptureUnderway { .. })));
    assert_eq!(b.capture_state(s1.key()), HostCaptureState::Invalidated);
    assert!(
        b.end_capture(s1.key()).is_err(),
        "an invalidated capture's end fails"
    );
    assert!(!b.capture_underway());
    b.synchronize().expect("allowed again after the capture");
    // A fence on the captured stream, a synchronous copy; a wait for a
    // fence recorded before the capture is allowed.
    b.begin_capture(s1.key()).unwrap();
    b.wait(&before).unwrap();
    b.end_capture(s1.key())
        .expect("a wait for an earlier fence is allowed");
    let mut res = b.reserve(G, G).unwrap();
    let c = b.create(G, vmmbuf::Location::Host).unwrap();
    b.map(&mut res, 0, &c).unwrap();
    b.set_access(
        &mut res,
        0,
        G,
        &[vmmbuf::AccessDesc::new(
            vmmbuf::Location::Host,
            vmmbuf::Access::ReadWrite,
        )],
    )
    .unwrap();
    type Call<'a> = Box<dyn Fn() -> vmmbuf::Result<()> + 'a>;
    let calls: Vec<(&str, Call)> = vec![
        ("a fence", Box::new(|| s1.fence(&b).map(drop))),
        ("a copy", Box::new(|| b.read(&res, 0, &mut [0u8; 16]))),
    ];
    for (what, call) in calls {
        b.begin_capture(s1.key()).unwrap();
        assert!(call().is_err(), "{what} during a capture was allowed");
        assert!(
            b.end_capture(s1.key()).is_err(),
            "{what} left the capture valid"
        );
        call().unwrap_or_else(|e| panic!("{what} after the capture: {e}"));
    }
    b.unmap(&mut res, 0, G).unwrap();
    b.release(c).unwrap();
    b.free(res).unwrap();
}

/// While a stream is captured (the host backend's simulated capture): a
/// graph's allocation that only a synchronisation could serve fails with
/// a typed out-of-memory error that says so, an ordinary one too, and
/// `empty_cache` gives back what has passed; sleep, wake and
/// `release_all_cached` are refused with `CaptureUnderway`, nothing
/// changed. The capture stays valid throughout; after it, the same calls
/// succeed, and everything goes back.
fn nothing_in_the_arena_synchronises_during_a_capture() {
    let b = HostBackend::with_granularity(G).unwrap();
    let arena = Arena::new(
        b.clone(),
        ArenaDesc::new(64 << 20)
            .max_reserved_bytes(2 * G)
            .defer_free_fences(true),
    )
    .unwrap();
    let (s1, s2) = (HostStream(1), HostStream(2));
    let keep = arena.alloc(G, &s1).unwrap();
    // A free on s1 whose fence is deferred: only a cover or a device
    // synchronisation shows it passed.
    drop(arena.alloc(G, &s1).unwrap());
    b.begin_capture(s2.key()).unwrap();
    let in_graph = arena.alloc_in_graph(G, &s2, GraphPoolId(9));
    let plain = arena.alloc(G, &HostStream(3));
    arena.empty_cache().unwrap();
    let sleep = arena.sleep(&[s1], &SleepDesc::discard());
    let all = arena.release_all_cached();
    eprintln!(
        "  during the capture: alloc_in_graph {:?}; sleep {:?}; release_all_cached {:?}",
        in_graph
            .as_ref()
            .map(|a| a.address())
            .map_err(|e| e.to_string()),
        sleep.as_ref().map(|r| r.bytes).map_err(|e| e.to_string()),
        all.as_ref().map_err(|e| e.to_string())
    );
    assert!(
        matches!(
            in_graph,
            Err(Error::ArenaOutOfMemory {
                during_capture: true,
                never_fits: false,
                ..
            })
        ),
        "{in_graph:?}"
    );
    assert!(matches!(
        plain,
        Err(Error::ArenaOutOfMemory {
            during_capture: true,
            ..
        })
    ));
    assert!(matches!(sleep, Err(Error::CaptureUnderway { .. })));
    assert!(matches!(all, Err(Error::CaptureUnderway { .. })));
    assert_eq!(
        arena.sleep_mode(),
        None,
        "the refused sleep changed nothing"
    );
    assert_eq!(
        b.capture_state(s2.key()),
        HostCaptureState::Active,
        "still valid"
    );
    b.end_capture(s2.key()).expect("the capture ends well");
    arena.release_graph(GraphPoolId(9)).unwrap();
    // After the capture the same allocation is served.
    let again = arena.alloc(G, &s2).expect("served once the capture ended");
    drop((again, keep));
    arena.empty_cache().unwrap();
    let s = arena.stats();
    assert_eq!(
        (s.allocated_bytes.current, s.reserved_bytes.current),
        (0, 0)
    );
    drop(arena);
    assert_eq!(b.live().mapped_bytes, 0, "everything went back");
}

/// A disk sleep into a directory that cannot take its files (here: one
/// that does not exist; a full disk fails the same call) is a typed error
/// naming the directory and the bytes, and leaves the arena awake with
/// every byte in place; the same sleep into a good directory then works.
fn a_disk_sleep_that_cannot_write_leaves_the_arena_awake_and_says_where() {
    let (fb, arena) = emulated();
    let n = 700 << 10;
    let mut a = arena.alloc(n, &Q(0)).unwrap();
    let data = random_bytes(11, n);
    a.write(0, &data).unwrap();
    let missing = std::env::temp_dir().join(format!("vmmbuf-no-such-dir-{}", std::process::id()));
    arena.set_spill_dir(Some(missing.clone()));
    let mapped = fb.live().mapped_bytes;
    let r = arena.sleep(&[Q(0)], &SleepDesc::from(SleepMode::Disk));
    eprintln!(
        "  a disk sleep into {}: {:?}",
        missing.display(),
        r.as_ref().map(|r| r.bytes).map_err(|e| e.to_string())
    );
    match r {
        Err(Error::Spill { dir, bytes, .. }) => {
            assert_eq!(dir, missing);
            assert!(bytes >= n, "the bytes the sleep needs: {bytes}");
        }
        other => panic!("expected Error::Spill, got {other:?}"),
    }
    assert_eq!(arena.sleep_mode(), None, "awake");
    assert_eq!(fb.live().mapped_bytes, mapped, "nothing unmapped");
    let mut got = vec![0u8; n];
    a.read(0, &mut got).unwrap();
    assert!(got == data, "every byte in place");
    let dir = spill_dir("good");
    arena.set_spill_dir(Some(dir.clone()));
    arena
        .sleep(&[Q(0)], &SleepDesc::from(SleepMode::Disk))
        .unwrap();
    arena.wake(&[Q(0)], &WakeDesc::default()).unwrap();
    a.read(0, &mut got).unwrap();
    assert!(got == data, "every byte back after the good sleep");
    let _ = std::fs::remove_dir_all(&dir);
    drop(a);
}
