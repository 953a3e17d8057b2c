//! NCCL over vmmbuf (issue 24): chunks made as `ncclMemAlloc` makes them
//! (`CudaBackendDesc::nccl_ready`), and an arena that stays registered with
//! NCCL through the library's map hook (`vmmbuf::nccl::NcclHook`) while it grows
//! and gives memory back. All-reduce and all-gather over it, every element
//! checked: on one GPU with one rank, and on two GPUs with one process per
//! GPU (the 2-GPU machine, `VMMBUF_REQUIRE_PEERS=1`). NVLink multicast stays
//! off (`NCCL_NVLS_ENABLE=0`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::CudaStream;
use cudarc::nccl::sys;
use rand::{Rng, SeedableRng};
use vmmbuf::cuda::{CudaAllocation, CudaArena, CudaBackendDesc};
use vmmbuf::{Arena, ArenaDesc, Backend, CudaBackend};

use crate::nccl_support::{
    all_gather_f32, all_reduce_f32, join, registered_hook, unique_id_hex, version,
};

crate::register! {
    gpu: [nccl_ready_chunks_stay_registered_through_growth_and_release_on_one_gpu],
    two_gpus: [nccl_all_reduce_and_all_gather_over_a_registered_arena_on_two_gpus],
    child: [nccl_rank],
}

fn nccl_or_fail() -> i32 {
    match version() {
        Ok(v) => v,
        Err(e) => panic!("the NCCL tests need libnccl: {e}"),
    }
}

/// The value rank `r` contributes at element `i` of round `round`: small
/// integers, so that sums in f32 are exact.
fn value(r: usize, round: usize, i: usize) -> f32 {
    ((i * 7 + round * 13 + r * 101) % 1000) as f32
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

fn read_f32s(a: &CudaAllocation, n: usize) -> Vec<f32> {
    let mut bytes = vec![0u8; n * 4];
    a.read(0, &mut bytes).unwrap();
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_ne_bytes(c.try_into().unwrap()))
        .collect()
}

/// What one rank does: `rounds` rounds of growth (a new input of a random
/// size and an all-gather output, kept), all-gather then all-reduce on the
/// new input, every element checked; half-way, the older tensors are freed
/// and the arena gives their memory back (deregistered first), then grows
/// again. Returns a summary line.
fn rank_work(
    backend: &Arc<CudaBackend>,
    comm: &crate::nccl_support::Comm,
    ranks: usize,
    rank: usize,
) -> String {
    let stream: Arc<CudaStream> = backend.context().new_stream().unwrap();
    let arena: CudaArena = Arena::new(backend.clone(), ArenaDesc::new(16 << 30)).unwrap();
    let (reg, id) = registered_hook(comm);
    arena.set_map_hook(Some(reg.clone())).unwrap();
    // The same sizes on every rank.
    let mut rng = rand::rngs::StdRng::seed_from_u64(24);
    let rounds = 8;
    let mut kept: Vec<(CudaAllocation, CudaAllocation)> = Vec::new();
    let (mut covered, mut released) = (0, 0);
    for round in 0..rounds {
        if round == rounds / 2 {
            // Give memory back: the older half goes; its ranges are
            // deregistered before they are unmapped.
            let before = reg.counts().deregistrations;
            kept.drain(..kept.len() / 2);
            stream.synchronize().unwrap();
            released = arena.release_cached().unwrap();
            let after = reg.counts().deregistrations;
            assert!(
                released > 0 && after > before,
                "the release gave back registered ranges"
            );
        }
        let n = rng.gen_range((64 << 10)..(12 << 20)) + rng.gen_range(0..4099);
        let mut x = arena.alloc(n * 4, &stream).unwrap();
        let y = arena.alloc(ranks * n * 4, &stream).unwrap();
        if reg.covers(x.address(), n * 4) && reg.covers(y.address(), ranks * n * 4) {
            covered += 1;
        }
        let mine: Vec<f32> = (0..n).map(|i| value(rank, round, i)).collect();
        x.write(0, &f32s(&mine)).unwrap();
        let s = stream.cu_stream() as sys::cudaStream_t;
        // SAFETY: x holds n floats and y ranks * n, both mapped and live
        // until the stream's work is done (they are dropped in stream order
        // on this stream); the communicator is this process's.
        unsafe {
            all_gather_f32(comm, x.address(), y.address(), n, s).unwrap();
            all_reduce_f32(comm, x.address(), x.address(), n, s).unwrap();
        }
        stream.synchronize().unwrap();
        let sum = read_f32s(&x, n);
        for (i, &v) in sum.iter().enumerate() {
            let want: f32 = (0..ranks).map(|r| value(r, round, i)).sum();
            assert_eq!(v, want, "round {round}: all-reduce element {i} of {n}");
        }
        let all = read_f32s(&y, ranks * n);
        for (k, &v) in all.iter().enumerate() {
            assert_eq!(
                v,
                value(k / n, round, k % n),
                "round {round}: all-gather element {k}"
            );
        }
        kept.push((x, y));
    }
    let at_end = reg.counts();
    let (registered, live_ranges) = (at_end.registrations, at_end.mapped_ranges);
    let mapped = arena.stats().reserved_bytes.current;
    assert_eq!(
        at_end.registered_bytes, mapped as u64,
        "every mapped byte is registered"
    );
    kept.clear();
    stream.synchronize().unwrap();
    drop(arena);
    let n = reg.counts();
    let deregistered = n.deregistrations;
    assert_eq!(n.failures, 0, "NCCL refused calls: {n:?}");
    assert_eq!(registered, deregistered, "every registration was undone");
    assert_eq!((n.registered_bytes, n.mapped_ranges), (0, 0), "{n:?}");
    reg.remove(id).unwrap();
    format!(
        "RANK {rank} OK rounds={rounds} registrations={registered} deregistrations={deregistered} \
         ranges_at_end={live_ranges} mapped_at_end={mapped} released_mid={released} \
         tensors_in_one_registration={covered}/{rounds}"
    )
}

fn nccl_ready_chunks_stay_registered_through_growth_and_release_on_one_gpu() {
    let v = nccl_or_fail();
    let b = crate::common::keep_nothing(
        CudaBackend::with_desc(0, &CudaBackendDesc::nccl_ready()).unwrap(),
    );
    let plain = crate::common::gpu();
    let kind = b.chunk_kind().unwrap();
    eprintln!("  NCCL {v}; chunk kind: {kind:?}");
    assert!(kind.nccl_ready && kind.posix_fd);
    assert!(
        kind.granularity >= plain.granularity(plain.home()).unwrap(),
        "the recommended granularity is at least the minimum"
    );
    assert!(!plain.chunk_kind().unwrap().nccl_ready);
    // A device chunk exports as a descriptor without being asked shareable;
    // a host chunk is made as usual.
    let home = b.home();
    let c = b.create(kind.granularity, home).unwrap();
    drop(b.export(&c).unwrap());
    b.release(c).unwrap();

    b.context().bind_to_thread().unwrap();
    let uid = unique_id_hex().unwrap();
    let comm = join(&uid, 1, 0).unwrap();
    let line = rank_work(&b, &comm, 1, 0);
    eprintln!("  {line}");
    drop(comm);
    let live = b.live();
    assert_eq!(
        (live.chunks, live.mapped_bytes),
        (0, 0),
        "memory went back to the driver"
    );
}

fn nccl_all_reduce_and_all_gather_over_a_registered_arena_on_two_gpus() {
    let v = nccl_or_fail();
    let uid = unique_id_hex().unwrap();
    let children: Vec<_> = (0..2)
        .map(|rank| {
            let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
            cmd.args([
                "--exact",
                "nccl::nccl_rank",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("VMMBUF_NCCL_RANK", rank.to_string())
            .env("VMMBUF_NCCL_UID", &uid)
            .env("NCCL_NVLS_ENABLE", "0")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
            for (k, d) in [("NCCL_DEBUG", "INFO"), ("NCCL_DEBUG_SUBSYS", "INIT,REG")] {
                if std::env::var_os(k).is_none() {
                    cmd.env(k, d);
                }
            }
            cmd.spawn().unwrap()
        })
        .collect();
    let start = Instant::now();
    let mut outs = Vec::new();
    for mut c in children {
        while c.try_wait().unwrap().is_none() {
            if start.elapsed() > Duration::from_secs(300) {
                let _ = c.kill();
                panic!("an NCCL rank hung");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        outs.push(c.wait_with_output().unwrap());
    }
    eprintln!("  NCCL {v}");
    for (rank, out) in outs.iter().enumerate() {
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        // NCCL's own word on the registrations, a few lines of it.
        for l in text
            .lines()
            .filter(|l| l.contains("NCCL INFO") && l.to_lowercase().contains("regist"))
            .take(6)
        {
            eprintln!("  rank {rank}: {l}");
        }
        // NCCL writes to stdout through its own buffer: our line may land
        // inside one of its lines.
        let tag = format!("RANK {rank} OK");
        let ok = text.lines().find_map(|l| l.find(&tag).map(|k| &l[k..]));
        assert!(
            out.status.success() && ok.is_some(),
            "rank {rank} said:\n{text}"
        );
        eprintln!("  {}", ok.unwrap());
    }
}

/// One rank of the two-GPU test, in a child process.
fn nccl_rank() {
    let rank: usize = std::env::var("VMMBUF_NCCL_RANK").unwrap().parse().unwrap();
    let uid = std::env::var("VMMBUF_NCCL_UID").unwrap();
    let b = crate::common::keep_nothing(
        CudaBackend::with_desc(rank as u32, &CudaBackendDesc::nccl_ready()).unwrap(),
    );
    let kind = b.chunk_kind().unwrap();
    assert!(kind.nccl_ready && kind.posix_fd, "{kind:?}");
    println!("rank {rank} chunk kind: {kind:?}");
    b.context().bind_to_thread().unwrap();
    let comm = join(&uid, 2, rank as i32).unwrap();
    let line = rank_work(&b, &comm, 2, rank);
    drop(comm);
    println!("{line}");
}
