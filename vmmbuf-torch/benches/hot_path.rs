//! Diagnostic, not a claim: what one `malloc` and `free` through the plug-in
//! cost the CPU, where that time goes, and the same against the driver's own
//! stream-ordered allocator (`cuMemAllocAsync`/`cuMemFreeAsync` on the
//! device's default pool, kept: PyTorch's `backend:cudaMallocAsync`), in the
//! same process.
//!
//! The pattern is a training step's: sizes drawn from 48 tensor shapes
//! (512 B to 24 MiB), 40 live at once, each step one allocation and one free
//! of the oldest, all on one stream. Two regimes: the GPU idle, and the
//! stream behind a kernel that runs through the whole loop (fences then wait
//! on real work). Each figure is the mean over 40,000 pairs after 4,000 warm
//! ones, and the median of per-pair times. Components are timed on their own
//! in plain loops.
//!
//! Issue 24: under FSDP on 2x H200 the plug-in took 9.7 us a malloc and
//! 4.8 us a free, and the step 1.14x native's.

use std::collections::VecDeque;
use std::ffi::c_void;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{sys, CudaContext, CudaStream, LaunchConfig, PushKernelArg};
use vmmbuf::{Arena, ArenaDesc, ChunkPool, CudaBackend, PoolDesc};

/// A kernel that spins on the global timer for `ns` nanoseconds.
const PTX: &str = r#"
.version 7.0
.target sm_70
.address_size 64
.visible .entry spin(.param .u64 p_ns)
{
    .reg .pred %p;
    .reg .b64 %rd<5>;
    ld.param.u64 %rd1, [p_ns];
    mov.u64 %rd2, %globaltimer;
LOOP:
    mov.u64 %rd3, %globaltimer;
    sub.u64 %rd4, %rd3, %rd2;
    setp.lt.u64 %p, %rd4, %rd1;
    @%p bra LOOP;
    ret;
}
"#;

const WARM: usize = 4_000;
const PAIRS: usize = 40_000;
const LIVE: usize = 40;

#[track_caller]
fn ok(call: &str, r: sys::CUresult) {
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "{call} failed");
}

/// The step's sizes: 48 shapes, log-spread from 512 B to 24 MiB, drawn by a
/// fixed generator (the same sequence for every allocator).
fn sizes(n: usize) -> Vec<usize> {
    let shapes: Vec<usize> = (0..48)
        .map(|i| {
            let lo = (512f64).ln();
            let hi = ((24usize << 20) as f64).ln();
            (lo + (hi - lo) * i as f64 / 47.0).exp() as usize
        })
        .collect();
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Small tensors are the common case in a step.
            let i = (x % 48) as usize;
            let j = ((x >> 8) % 48) as usize;
            shapes[i.min(j)]
        })
        .collect()
}

/// Evicts the CPU's caches, as a training step's Python and kernel
/// launches do between two allocator calls: writes `COLD_BYTES` of memory.
struct Cold(Vec<u64>);

const COLD_BYTES: usize = 4 << 20;

impl Cold {
    fn new() -> Self {
        Self(vec![1; COLD_BYTES / 8])
    }
    fn evict(&mut self) {
        for (i, x) in self.0.iter_mut().enumerate().step_by(8) {
            *x = x.wrapping_add(i as u64);
        }
        std::hint::black_box(&self.0);
    }
}

/// Mean and median nanoseconds per pair of `alloc` then `free` of the
/// oldest live allocation, over the step pattern; with `cold`, the caches
/// evicted before each pair (not timed).
fn pairs<T>(
    mut alloc: impl FnMut(usize) -> T,
    mut free: impl FnMut(T),
    sizes: &[usize],
    mut cold: Option<&mut Cold>,
) -> (f64, f64) {
    let mut live = VecDeque::with_capacity(LIVE + 1);
    let mut each = Vec::with_capacity(PAIRS);
    let mut total = 0f64;
    for (i, &n) in sizes.iter().enumerate() {
        if let Some(c) = cold.as_deref_mut() {
            c.evict();
        }
        let t = Instant::now();
        live.push_back(alloc(n));
        if live.len() > LIVE {
            free(live.pop_front().unwrap());
        }
        let dt = t.elapsed().as_nanos() as f64;
        if i >= WARM {
            each.push(dt);
            total += dt;
        }
    }
    for a in live {
        free(a);
    }
    each.sort_by(|a, b| a.partial_cmp(b).unwrap());
    (total / each.len() as f64, each[each.len() / 2])
}

/// Mean nanoseconds of `f` over `n` calls; with `cold`, the caches evicted
/// before each call (not timed).
fn each(n: usize, mut cold: Option<&mut Cold>, mut f: impl FnMut()) -> f64 {
    for _ in 0..n / 10 {
        f();
    }
    let mut total = 0u128;
    for _ in 0..n {
        if let Some(c) = cold.as_deref_mut() {
            c.evict();
        }
        let t = Instant::now();
        f();
        total += t.elapsed().as_nanos();
    }
    total as f64 / n as f64
}

fn main() {
    let backend = match CudaBackend::new(0) {
        Ok(b) => b,
        Err(e) if std::env::var("VMMBUF_REQUIRE_GPU").as_deref() == Ok("1") => {
            panic!("hot_path: VMMBUF_REQUIRE_GPU=1 but no usable GPU: {e}")
        }
        Err(e) => {
            println!("hot_path: skipped, no usable GPU: {e}");
            return;
        }
    };
    let ctx: Arc<CudaContext> = backend.context().clone();
    ctx.bind_to_thread().unwrap();
    let stream: Arc<CudaStream> = ctx.new_stream().unwrap();
    let spin = ctx
        .load_module(cudarc::nvrtc::Ptx::from_src(PTX))
        .unwrap()
        .load_function("spin")
        .unwrap();
    let draw = sizes(WARM + PAIRS);
    let cu = stream.cu_stream();

    // The driver's stream-ordered pool, kept (release threshold: all).
    let mut pool = std::ptr::null_mut();
    // SAFETY: a valid out-pointer; device 0 exists (the backend opened it).
    ok("cuDeviceGetDefaultMemPool", unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, 0)
    });
    let mut keep = u64::MAX;
    // SAFETY: the attribute takes a u64; it outlives the call.
    ok("cuMemPoolSetAttribute", unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut keep as *mut u64).cast(),
        )
    });

    println!("hot_path: ns per malloc+free pair (mean / median), {PAIRS} pairs, {LIVE} live");
    let mut cold = Cold::new();
    for (busy, evict) in [(false, false), (true, false), (true, true)] {
        let regime = match (busy, evict) {
            (false, _) => "idle GPU",
            (true, false) => "busy GPU",
            (true, true) => "busy,cold",
        };
        let mut c = evict.then_some(&mut cold);
        let draw = if evict {
            &draw[..WARM + PAIRS / 4]
        } else {
            &draw[..]
        };
        let n = if evict { 10_000 } else { 100_000 };
        if busy && !evict {
            // Long enough to cover every loop of the regime.
            let mut l = stream.launch_builder(&spin);
            let ns: u64 = 15_000_000_000;
            l.arg(&ns);
            // SAFETY: the argument matches the PTX's one u64 parameter.
            unsafe {
                l.launch(LaunchConfig {
                    grid_dim: (1, 1, 1),
                    block_dim: (1, 1, 1),
                    shared_mem_bytes: 0,
                })
            }
            .unwrap();
        }
        // The plug-in's C entry points, as PyTorch calls them.
        let plugin_pairs = |c: Option<&mut Cold>| {
            pairs(
                |n| {
                    let p = vmmbuf_torch::vmmbuf_malloc(n as isize, 0, cu as *mut c_void);
                    assert!(!p.is_null(), "vmmbuf_malloc({n}) failed");
                    (p, n)
                },
                |(p, n)| vmmbuf_torch::vmmbuf_free(p, n as isize, 0, cu as *mut c_void),
                draw,
                c,
            )
        };
        let plugin = plugin_pairs(c.as_deref_mut());
        // The same with captures announced (as the Python package does):
        // no capture query while none is under way.
        vmmbuf_torch::vmmbuf_announce_captures(1);
        let announced = plugin_pairs(c.as_deref_mut());
        vmmbuf_torch::vmmbuf_announce_captures(0);
        // The arena as the plug-in makes it (a chunk pool, 20 MiB chunks,
        // free chunks kept mapped): the plug-in's figure less this one is
        // what its own layer (lookups, locks, timers) costs.
        let pool = ChunkPool::new(backend.clone(), PoolDesc::default()).unwrap();
        let mut desc = ArenaDesc::new(1 << 40).max_chunk_bytes(20 << 20);
        desc.release_before_map = false;
        let same = Arena::with_pool(pool, desc).unwrap();
        let as_plugin = pairs(
            |n| same.alloc(n, &stream).unwrap(),
            drop,
            draw,
            c.as_deref_mut(),
        );
        drop(same);
        let arena = Arena::new(backend.clone(), ArenaDesc::new(1 << 40)).unwrap();
        let core = pairs(
            |n| arena.alloc(n, &stream).unwrap(),
            drop,
            draw,
            c.as_deref_mut(),
        );
        let driver = pairs(
            |n| {
                let mut p = 0;
                // SAFETY: a valid out-pointer and a live stream of the bound
                // context.
                ok("cuMemAllocAsync", unsafe {
                    sys::cuMemAllocAsync(&mut p, n, cu)
                });
                p
            },
            |p| {
                // SAFETY: `p` came from cuMemAllocAsync and is freed once.
                ok("cuMemFreeAsync", unsafe { sys::cuMemFreeAsync(p, cu) })
            },
            draw,
            c.as_deref_mut(),
        );
        for (name, (mean, median)) in [
            ("plug-in vmmbuf_malloc/vmmbuf_free", plugin),
            ("plug-in, captures announced", announced),
            ("Arena::alloc + drop", core),
            ("Arena::alloc + drop, the plug-in's arena", as_plugin),
            ("cuMemAllocAsync/cuMemFreeAsync", driver),
        ] {
            println!("  {regime:9} {name:44} {mean:8.0} / {median:8.0}");
        }
        println!(
            "  {regime:9} plug-in / driver pool: {:.2}x (mean)",
            plugin.0 / driver.0
        );

        // The plug-in's per-call pieces, each on its own.
        let relaxed = each(n, c.as_deref_mut(), || {
            drop(vmmbuf::cuda::RelaxedCapture::new().unwrap())
        });
        let captured = each(n, c.as_deref_mut(), || {
            assert!(vmmbuf::cuda::capture_of(&stream).unwrap().is_none())
        });
        let bind = each(n, c.as_deref_mut(), || ctx.bind_to_thread().unwrap());
        let fence = each(n, c.as_deref_mut(), || {
            drop(backend.fence(&stream).unwrap())
        });
        let mut ev = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; the context is bound.
        let created = unsafe {
            sys::cuEventCreate(&mut ev, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
        };
        ok("cuEventCreate", created);
        let record = each(n, c.as_deref_mut(), || {
            // SAFETY: a live event and stream of the bound context.
            ok("cuEventRecord", unsafe { sys::cuEventRecord(ev, cu) })
        });
        let query = each(n, c, || {
            // SAFETY: a live event of the bound context.
            let _ = unsafe { sys::cuEventQuery(ev) };
        });
        // SAFETY: the event is not used after.
        ok("cuEventDestroy", unsafe { sys::cuEventDestroy_v2(ev) });
        for (name, ns) in [
            ("RelaxedCapture (2 mode exchanges)", relaxed),
            ("capture_of (bind + cuStreamIsCapturing)", captured),
            ("bind_to_thread (cuCtxGetCurrent)", bind),
            ("backend.fence + drop (spare event)", fence),
            ("cuEventRecord", record),
            ("cuEventQuery", query),
        ] {
            println!("  {regime:9} {name:42} {ns:8.0} ns");
        }
    }
    // SAFETY: the context is bound; ends the spinning kernel's wait.
    ok("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() });
}
