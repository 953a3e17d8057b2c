//! NCCL bandwidth over vmmbuf (issue 24), two GPUs, one process per GPU:
//! all-reduce and all-gather from 1 to 256 MiB on
//! - `vmmbuf reg`: an arena of NCCL-ready chunks kept registered by a map
//!   hook (`ncclCommRegister` on every range it maps);
//! - `vmmbuf unreg`: the same kind of arena, no hook (NCCL copies through
//!   its own buffers);
//! - `ncclMemAlloc`: NCCL's own allocation, registered.
//!
//! The variants run interleaved, round after round, in the same processes;
//! medians of the rounds. NVLink multicast stays off (`NCCL_NVLS_ENABLE=0`).
//! Needs `libnccl.so` on `LD_LIBRARY_PATH` (PyTorch's wheel ships one).
//!
//! Run: `benches/nccl` (the packed binary), or `cargo bench --bench nccl`.

#[path = "../tests/all/support/nccl_support.rs"]
mod nccl_support;

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::CudaStream;
use cudarc::nccl::sys;
use nccl_support::{
    all_gather_f32, all_reduce_f32, check, join, registered_hook, unique_id_hex, Comm,
};
use vmmbuf::cuda::{CudaAllocation, CudaArena, CudaBackendDesc};
use vmmbuf::{Arena, ArenaDesc, CudaBackend};

const RANKS: usize = 2;
const ROUNDS: usize = 7;

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // nothing for a test harness to list
    }
    match std::env::var("VMMBUF_NCCL_BENCH_RANK") {
        Ok(r) => child(r.parse().expect("a rank")),
        Err(_) => parent(),
    }
}

fn parent() {
    let uid = match unique_id_hex() {
        Ok(u) => u,
        Err(e) => {
            eprintln!("nccl bench: skipped: {e}");
            if std::env::var("VMMBUF_REQUIRE_PEERS").as_deref() == Ok("1") {
                std::process::exit(1);
            }
            return;
        }
    };
    let count = cudarc::driver::result::init()
        .and_then(|()| cudarc::driver::result::device::get_count())
        .unwrap_or(0);
    if count < 2 {
        eprintln!("nccl bench: skipped: it needs two GPUs, this machine has {count}");
        if std::env::var("VMMBUF_REQUIRE_PEERS").as_deref() == Ok("1") {
            std::process::exit(1);
        }
        return;
    }
    let kids: Vec<_> = (0..RANKS)
        .map(|r| {
            std::process::Command::new(std::env::current_exe().unwrap())
                .env("VMMBUF_NCCL_BENCH_RANK", r.to_string())
                .env("VMMBUF_NCCL_UID", &uid)
                .env("NCCL_NVLS_ENABLE", "0")
                .stdout(if r == 0 {
                    std::process::Stdio::inherit()
                } else {
                    std::process::Stdio::null()
                })
                .spawn()
                .unwrap()
        })
        .collect();
    let mut ok = true;
    for mut k in kids {
        ok &= k.wait().map(|s| s.success()).unwrap_or(false);
    }
    if !ok {
        eprintln!("nccl bench: a rank failed");
        std::process::exit(1);
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Op {
    AllReduce,
    AllGather,
}

/// `iters` launches of `op` over `send`/`recv` (`bytes` of the result), then
/// a stream synchronisation: seconds per launch.
#[allow(clippy::too_many_arguments)]
fn time_op(
    comm: &Comm,
    stream: &CudaStream,
    op: Op,
    send: u64,
    recv: u64,
    bytes: usize,
    iters: usize,
) -> f64 {
    let s = stream.cu_stream() as sys::cudaStream_t;
    let t = Instant::now();
    for _ in 0..iters {
        // SAFETY: send and recv are live device memory of the sizes the op
        // reads and writes (the caller's), until the synchronisation below.
        let r = unsafe {
            match op {
                Op::AllReduce => all_reduce_f32(comm, send, recv, bytes / 4, s),
                Op::AllGather => all_gather_f32(comm, send, recv, bytes / 4 / RANKS, s),
            }
        };
        r.unwrap();
    }
    stream.synchronize().unwrap();
    t.elapsed().as_secs_f64() / iters as f64
}

/// Buffers of one variant for one size: (send, recv) addresses.
enum Bufs {
    Arena(CudaAllocation, CudaAllocation),
    Nccl(u64, u64, Vec<usize>),
}

impl Bufs {
    fn addrs(&self) -> (u64, u64) {
        match self {
            Bufs::Arena(a, b) => (a.address(), b.address()),
            Bufs::Nccl(a, b, _) => (*a, *b),
        }
    }
}

fn nccl_alloc(comm: &Comm, bytes: usize, register: bool) -> (u64, usize) {
    let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    check("ncclMemAlloc", unsafe { sys::ncclMemAlloc(&mut p, bytes) }).unwrap();
    if !register {
        return (p as u64, 0);
    }
    let mut h: *mut std::ffi::c_void = std::ptr::null_mut();
    // SAFETY: p is bytes of live device memory from ncclMemAlloc.
    check("ncclCommRegister", unsafe {
        sys::ncclCommRegister(comm.0, p, bytes, &mut h)
    })
    .unwrap();
    (p as u64, h as usize)
}

fn nccl_free(comm: &Comm, p: u64, h: usize) {
    // SAFETY: the handle (0: not registered) and pointer came from
    // nccl_alloc, freed once, after the stream's work on them finished.
    unsafe {
        if h != 0 {
            check(
                "ncclCommDeregister",
                sys::ncclCommDeregister(comm.0, h as *mut _),
            )
            .unwrap();
        }
        check("ncclMemFree", sys::ncclMemFree(p as *mut _)).unwrap();
    }
}

fn child(rank: usize) {
    let uid = std::env::var("VMMBUF_NCCL_UID").unwrap();
    let b = CudaBackend::with_desc(rank as u32, &CudaBackendDesc::nccl_ready()).unwrap();
    b.context().bind_to_thread().unwrap();
    let comm = join(&uid, RANKS as i32, rank as i32).unwrap();
    let stream: Arc<CudaStream> = b.context().new_stream().unwrap();
    let reg_arena: CudaArena = Arena::new(b.clone(), ArenaDesc::new(8 << 30)).unwrap();
    let (reg, _) = registered_hook(&comm);
    reg_arena.set_map_hook(Some(reg.clone())).unwrap();
    let unreg_arena: CudaArena = Arena::new(b.clone(), ArenaDesc::new(8 << 30)).unwrap();
    // Registered too, with chunks of up to 1 GiB (a tensor is one chunk, as
    // an ncclMemAlloc buffer is) instead of the default 2 MiB.
    let big_arena: CudaArena =
        Arena::new(b.clone(), ArenaDesc::new(8 << 30).max_chunk_bytes(1 << 30)).unwrap();
    let (big_reg, _) = registered_hook(&comm);
    big_arena.set_map_hook(Some(big_reg.clone())).unwrap();
    let kind = b.chunk_kind().unwrap();
    let mut v = 0;
    // SAFETY: a valid out-pointer.
    unsafe { sys::ncclGetVersion(&mut v) };
    if rank == 0 {
        println!("# NCCL {v}, {RANKS} ranks (one process per GPU), NCCL_NVLS_ENABLE=0");
        println!("# chunk kind: {kind:?}");
        println!(
            "# busbw GB/s, median of {ROUNDS} interleaved rounds; all-reduce out of place; \
             size = the result's bytes"
        );
        println!(
            "# vmmbuf: arenas of NCCL-ready chunks, registered by the map hook (reg) or not \
             (unreg), 2 MiB chunks (the default) or up to 1 GiB (big); ncclMemAlloc: \
             registered or not (un)"
        );
        println!(
            "{:>5} {:>10} {:>10} {:>8} {:>8} {:>9} {:>11} {:>9} {:>12} {:>8}",
            "MiB",
            "op",
            "vmmbuf reg",
            "unreg",
            "big reg",
            "memalloc",
            "memalloc un",
            "reg/unreg",
            "reg/memalloc",
            "big/mem"
        );
    }
    let variants = ["reg", "unreg", "big", "memalloc", "memalloc-unreg"];
    for op in [Op::AllReduce, Op::AllGather] {
        for shift in 0..=8 {
            let bytes = (1usize << 20) << shift;
            let send_bytes = match op {
                Op::AllReduce => bytes,
                Op::AllGather => bytes / RANKS,
            };
            // Every variant's buffers, made once per size.
            let mut bufs: Vec<Bufs> = Vec::new();
            for (k, &name) in variants.iter().enumerate() {
                bufs.push(match name {
                    "memalloc" | "memalloc-unreg" => {
                        let register = name == "memalloc";
                        let (a, ha) = nccl_alloc(&comm, send_bytes, register);
                        let (c, hc) = nccl_alloc(&comm, bytes, register);
                        Bufs::Nccl(a, c, vec![ha, hc])
                    }
                    _ => {
                        let arena = [&reg_arena, &unreg_arena, &big_arena][k];
                        let mut a = arena.alloc(send_bytes, &stream).unwrap();
                        let c = arena.alloc(bytes, &stream).unwrap();
                        a.write(0, &vec![1u8; send_bytes]).unwrap();
                        Bufs::Arena(a, c)
                    }
                });
            }
            let (s0, r0) = bufs[0].addrs();
            let (s2, r2) = bufs[2].addrs();
            assert!(
                reg.covers(s0, send_bytes)
                    && reg.covers(r0, bytes)
                    && big_reg.covers(s2, send_bytes)
                    && big_reg.covers(r2, bytes),
                "each registered tensor lies in one registration"
            );
            let iters = ((4usize << 30) / bytes).clamp(10, 400);
            let mut times: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
            // Warm-up: each variant once (NCCL sets up its registrations).
            for b in &bufs {
                let (s, r) = b.addrs();
                time_op(&comm, &stream, op, s, r, bytes, 3);
            }
            for round in 0..ROUNDS {
                for k in 0..variants.len() {
                    // Rotate the order each round.
                    let k = (k + round) % variants.len();
                    let (s, r) = bufs[k].addrs();
                    times[k].push(time_op(&comm, &stream, op, s, r, bytes, iters));
                }
            }
            let med = |v: &mut Vec<f64>| {
                v.sort_by(|a, b| a.partial_cmp(b).unwrap());
                v[v.len() / 2]
            };
            let factor = match op {
                Op::AllReduce => 2.0 * (RANKS as f64 - 1.0) / RANKS as f64,
                Op::AllGather => (RANKS as f64 - 1.0) / RANKS as f64,
            };
            let bw: Vec<f64> = times
                .iter_mut()
                .map(|t| bytes as f64 / med(t) / 1e9 * factor)
                .collect();
            if rank == 0 {
                println!(
                    "{:>5} {:>10} {:>10.1} {:>8.1} {:>8.1} {:>9.1} {:>11.1} {:>8.2}x {:>11.2}x {:>7.2}x",
                    bytes >> 20,
                    if op == Op::AllReduce {
                        "all-reduce"
                    } else {
                        "all-gather"
                    },
                    bw[0],
                    bw[1],
                    bw[2],
                    bw[3],
                    bw[4],
                    bw[0] / bw[1],
                    bw[0] / bw[3],
                    bw[2] / bw[3],
                );
            }
            stream.synchronize().unwrap();
            for b in bufs {
                if let Bufs::Nccl(a, c, h) = b {
                    nccl_free(&comm, a, h[0]);
                    nccl_free(&comm, c, h[1]);
                }
            }
            // The arenas' memory goes (and its registrations) as it frees.
            reg_arena.release_cached().unwrap();
            unreg_arena.release_cached().unwrap();
            big_arena.release_cached().unwrap();
        }
    }
    let (n, big) = (reg.counts(), big_reg.counts());
    if rank == 0 {
        println!(
            "# registrations {} deregistrations {} failures {} (big chunks: {} {} {})",
            n.registrations,
            n.deregistrations,
            n.failures,
            big.registrations,
            big.deregistrations,
            big.failures
        );
    }
    assert_eq!(n.failures + big.failures, 0, "NCCL refused calls");
}
