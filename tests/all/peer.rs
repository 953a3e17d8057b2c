//! Peer access between two GPUs (run on the 2-GPU machine with
//! `VMMBUF_REQUIRE_PEERS=1`; elsewhere it is ignored).

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::PushKernelArg;
use vmmbuf::{
    cuda::CudaArena, Access, Arena, ArenaDesc, Backend, BufferDesc, CudaBackend, GrowableBuffer,
    GrowthPolicy, Location,
};

use crate::cuda_only::Kernels;

crate::register! {
    two_gpus: [a_peer_reads_and_writes_once_granted_and_is_refused_before, an_arena_with_peer_access_is_mapped_for_its_peers, an_arena_grants_its_peers_access_later, a_lazy_guard_puts_the_callers_context_back_after_another_gpus_work],
    child: [child_peer_read_without_access],
}

/// GPUs 0 and 1. The peer test runs where two GPUs are usable (or under
/// `VMMBUF_REQUIRE_PEERS=1`, where their absence fails it).
fn two_gpus() -> (Arc<CudaBackend>, Arc<CudaBackend>) {
    match CudaBackend::new(0).and_then(|a| Ok((a, CudaBackend::new(1)?))) {
        Ok((a, b)) => (
            crate::common::keep_nothing(a),
            crate::common::keep_nothing(b),
        ),
        Err(e) => panic!("the peer test needs two GPUs: {e}"),
    }
}

const WORDS: u64 = (4 << 20) / 4; // two 2 MiB chunks

fn a_peer_reads_and_writes_once_granted_and_is_refused_before() {
    let (b0, b1) = two_gpus();

    // Without access, GPU 1's read must fail (not hang, not succeed). The
    // fault poisons GPU 1's context, so it happens in a child process.
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "peer::child_peer_read_without_access",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("VMMBUF_PEER_CHILD", "1")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            panic!("a peer read without access hung");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("REFUSED"),
        "child said: {text}"
    );
    eprintln!(
        "{}",
        text.lines().find(|l| l.contains("REFUSED")).unwrap_or("")
    );

    let (k0, k1) = (Kernels::load(&b0), Kernels::load(&b1));
    let mut buf = GrowableBuffer::new(
        b0.clone(),
        BufferDesc::new(1 << 30).growth(GrowthPolicy::Exact),
    )
    .unwrap();
    buf.grow_to(WORDS as usize * 4).unwrap();
    let base = buf.base();
    k0.fill(base, 0, WORDS, 3);
    buf.record_stream(&k0.stream).unwrap(); // raw-address work: recorded
    k0.stream.synchronize().unwrap();
    buf.add_peer(1).unwrap();
    assert!(buf
        .report()
        .chunks
        .iter()
        .all(|c| c.access.contains(&(Location::Device(1), Access::ReadWrite))));
    assert_eq!(
        k1.mismatches(base, 0, WORDS, 3),
        0,
        "GPU 1 reads GPU 0's chunks through the buffer's address"
    );
    k1.fill(base, 0, WORDS, 4);
    buf.record_stream(&k1.stream).unwrap(); // raw-address work: recorded
    k1.stream.synchronize().unwrap();
    assert_eq!(
        k0.mismatches(base, 0, WORDS, 4),
        0,
        "GPU 0 sees what GPU 1 wrote"
    );
    // New chunks inherit the peer.
    buf.grow_to(WORDS as usize * 8).unwrap();
    assert!(buf.report().chunks[2]
        .access
        .contains(&(Location::Device(1), Access::ReadWrite)));
    k1.fill(base + WORDS * 4, WORDS, WORDS, 5);
    buf.record_stream(&k1.stream).unwrap(); // raw-address work: recorded
    k1.stream.synchronize().unwrap();
    assert_eq!(k0.mismatches(base + WORDS * 4, WORDS, WORDS, 5), 0);
    // Revoking is per chunk and per device.
    buf.set_access(0..WORDS as usize * 4, Location::Device(1), Access::None)
        .unwrap();
    assert!(buf.report().chunks[0]
        .access
        .contains(&(Location::Device(1), Access::None)));
    assert_eq!(
        k0.mismatches(base, 0, WORDS, 4),
        0,
        "GPU 0 keeps its access"
    );
}

fn child_peer_read_without_access() {
    assert_eq!(
        std::env::var("VMMBUF_PEER_CHILD").as_deref(),
        Ok("1"),
        "run only as the peer test's child"
    );
    let (b0, b1) = two_gpus();
    let (k0, k1) = (Kernels::load(&b0), Kernels::load(&b1));
    let buf = GrowableBuffer::new(b0.clone(), BufferDesc::new(1 << 30)).unwrap();
    buf.grow_to(WORDS as usize * 4).unwrap();
    k0.fill(buf.base(), 0, WORDS, 3);
    buf.record_stream(&k0.stream).unwrap(); // raw-address work: recorded
    k0.stream.synchronize().unwrap();
    let mut bad = k1.stream.alloc_zeros::<u32>(1).unwrap();
    let base = buf.base();
    let mut l = k1.stream.launch_builder(&k1.spin_check);
    l.arg(&base)
        .arg(&0u64)
        .arg(&WORDS)
        .arg(&3u32)
        .arg(&mut bad)
        .arg(&0u64);
    // SAFETY: test code; the point is an access GPU 1 was not granted.
    let launched = unsafe { l.launch(Kernels::cfg(WORDS)) };
    let result = launched.and_then(|_| k1.stream.synchronize());
    match result {
        Err(e) => println!("REFUSED: GPU 1 reading GPU 0's chunk without access failed with {e:?}"),
        Ok(()) => panic!("GPU 1 read GPU 0's chunk without being granted access"),
    }
    std::mem::forget(bad); // its context is poisoned; do not free through it
    std::mem::forget(buf);
}

/// An arena made with `peer_access` maps every chunk for the GPUs that can
/// reach its own: a kernel on GPU 1 reads what GPU 0 wrote, and GPU 0 sees
/// what GPU 1 wrote, at the arena's addresses, in a large block and a
/// small one (the arena's two zones), and in a chunk mapped after the first
/// ones. CuPy's copies between devices failed on arena memory mapped for
/// its own GPU only (`cudaErrorInvalidValue`, issue 38).
fn an_arena_with_peer_access_is_mapped_for_its_peers() {
    let (b0, b1) = two_gpus();
    assert!(
        b0.peers().unwrap().contains(&1),
        "GPU 1 can reach GPU 0 on this machine: {:?}",
        b0.peers()
    );
    let (k0, k1) = (Kernels::load(&b0), Kernels::load(&b1));
    let arena: CudaArena =
        Arena::new(b0.clone(), ArenaDesc::new(1 << 30).peer_access(true)).unwrap();
    let large = arena.alloc(WORDS as usize * 4, &k0.stream).unwrap();
    let small = arena.alloc(4096, &k0.stream).unwrap();
    for (i, (a, n)) in [(large.address(), WORDS), (small.address(), 1024)]
        .into_iter()
        .enumerate()
    {
        let seed = 7 + i as u32;
        k0.fill(a, 0, n, seed);
        k0.stream.synchronize().unwrap();
        both_gpus_reach(&k0, &k1, a, n, seed, i);
    }
    // A chunk mapped later is mapped for the peer as well.
    later_block_reaches_gpu_1(&arena, &k0, &k1, 11);
}

/// GPU 1 reads the `n` words at `a` that GPU 0 wrote from `seed` (its work
/// finished), writes its own, and GPU 0 sees them (block `i`).
fn both_gpus_reach(k0: &Kernels, k1: &Kernels, a: u64, n: u64, seed: u32, i: usize) {
    assert_eq!(
        k1.mismatches(a, 0, n, seed),
        0,
        "GPU 1 reads GPU 0's block {i}"
    );
    k1.fill(a, 0, n, seed + 100);
    k1.stream.synchronize().unwrap();
    assert_eq!(
        k0.mismatches(a, 0, n, seed + 100),
        0,
        "GPU 0 sees GPU 1's writes {i}"
    );
}

/// A block allocated now, which maps a chunk past the arena's first ones:
/// GPU 1 reads what GPU 0 writes there from `seed`. Returned, still live.
fn later_block_reaches_gpu_1(
    arena: &CudaArena,
    k0: &Kernels,
    k1: &Kernels,
    seed: u32,
) -> vmmbuf::cuda::CudaAllocation {
    let later = arena.alloc(WORDS as usize * 8, &k0.stream).unwrap();
    k0.fill(later.address(), 0, WORDS * 2, seed);
    k0.stream.synchronize().unwrap();
    assert_eq!(k1.mismatches(later.address(), 0, WORDS * 2, seed), 0);
    k1.stream.synchronize().unwrap();
    later
}

/// An arena made for its own GPU only grants its peers access later
/// (`Arena::grant_peer_access`, what the PyTorch plug-in does once a
/// process allocates on a second GPU): every chunk mapped before the grant,
/// in both zones, becomes readable and writable from GPU 1 with the bytes
/// GPU 0 wrote before it, a chunk mapped after it is mapped for GPU 1 too,
/// and a second grant finds nothing left to grant.
fn an_arena_grants_its_peers_access_later() {
    let (b0, b1) = two_gpus();
    let (k0, k1) = (Kernels::load(&b0), Kernels::load(&b1));
    let arena: CudaArena = Arena::new(b0.clone(), ArenaDesc::new(1 << 30)).unwrap();
    assert!(!arena.grants_peer_access());
    let large = arena.alloc(WORDS as usize * 4, &k0.stream).unwrap();
    let small = arena.alloc(4096, &k0.stream).unwrap();
    let blocks = [(large.address(), WORDS), (small.address(), 1024)];
    for (i, &(a, n)) in blocks.iter().enumerate() {
        k0.fill(a, 0, n, 21 + i as u32);
    }
    // Queued work on the chunks is not waited for: access only widens.
    let granted = arena.grant_peer_access().unwrap();
    let mapped = |s: vmmbuf::stats::ArenaStats| (s.num_device_alloc - s.num_device_free) as usize;
    let chunks = mapped(arena.stats());
    assert!(
        granted >= 2 && granted == chunks,
        "granted {granted} of {chunks} chunks"
    );
    assert!(arena.grants_peer_access());
    k0.stream.synchronize().unwrap();
    for (i, &(a, n)) in blocks.iter().enumerate() {
        both_gpus_reach(&k0, &k1, a, n, 21 + i as u32, i);
    }
    let _later = later_block_reaches_gpu_1(&arena, &k0, &k1, 31);
    assert!(
        mapped(arena.stats()) > chunks,
        "the later block mapped a chunk"
    );
    assert_eq!(
        arena.grant_peer_access().unwrap(),
        0,
        "nothing left to grant"
    );
}

/// The PyTorch plug-in's context guard (`KeepCurrentContext::lazy`, which
/// reads the caller's context only when vmmbuf is about to switch it)
/// around work on GPU 1's arena while GPU 0's context is current, and on a
/// thread with none: mapping, fences recorded by frees, and giving memory
/// back bind GPU 1's context, and the caller's is current again after each
/// guard. Unguarded, the same mapping leaves GPU 1's current, so the check
/// can fail if a place that switches forgets the hook.
fn a_lazy_guard_puts_the_callers_context_back_after_another_gpus_work() {
    use vmmbuf::cuda::{current_device, KeepCurrentContext};
    let (b0, b1) = two_gpus();
    let s1 = b1.context().new_stream().unwrap();
    let arena: CudaArena = Arena::new(b1.clone(), ArenaDesc::new(1 << 30)).unwrap();
    let dev = || current_device().unwrap();
    b0.context().bind_to_thread().unwrap();
    let probe = arena.alloc(6 << 20, &s1).unwrap();
    assert_eq!(
        dev(),
        Some(1),
        "unguarded, the arena's mapping binds GPU 1's context"
    );
    drop(probe);
    arena.release_all_cached().unwrap();
    // Sizes from 512 B to 16 MiB, some served from cache, some mapped.
    let mut seed = 0x9e37_79b9_u64;
    let mut live = Vec::new();
    for i in 0..64 {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let bytes = 512usize << (seed >> 60);
        b0.context().bind_to_thread().unwrap();
        {
            let _keep = KeepCurrentContext::lazy();
            live.push(arena.alloc(bytes, &s1).unwrap());
            if i % 3 == 2 {
                // A free on GPU 1's stream records a fence there.
                live.swap_remove((seed >> 8) as usize % live.len());
            }
            if i % 16 == 15 {
                arena.release_all_cached().unwrap();
            }
        }
        assert_eq!(
            dev(),
            Some(0),
            "step {i} ({bytes} B): GPU 0's context is current again"
        );
    }
    let arena = Arc::new(arena);
    let a = arena.clone();
    let s = s1.clone();
    std::thread::spawn(move || {
        assert_eq!(dev(), None, "a new thread has no context");
        for bytes in [4096, 3 << 20, 10 << 20] {
            let _keep = KeepCurrentContext::lazy();
            drop(a.alloc(bytes, &s).unwrap());
            a.release_all_cached().unwrap();
        }
        assert_eq!(dev(), None, "the guard leaves the thread without a context");
    })
    .join()
    .unwrap();
    b0.context().bind_to_thread().unwrap();
    {
        let _keep = KeepCurrentContext::lazy();
        drop(live);
        arena.empty_cache().unwrap();
    }
    assert_eq!(dev(), Some(0), "after the last frees and empty_cache");
    s1.synchronize().unwrap();
}
