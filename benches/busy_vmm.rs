//! Diagnostic, not a claim: what VMM calls cost while the GPU works, and
//! whether they slow the GPU's work (issue 42). Moving free chunks cost
//! 85-211 us a 2 MiB chunk under training on H100s, against ~33 us idle;
//! a move done by a background thread would take that wait off the
//! launching thread, but helps only if the page-table updates do not stall
//! the kernels themselves. Four measurements, 2 MiB chunks:
//!
//! 1. map + access, then unmap, each timed, with the GPU idle;
//! 2. the same on the launching thread while a batch of memory-bound
//!    kernels runs on a stream (the plug-in's case);
//! 3. map, access and unmap apart, per chunk, idle and busy, one chunk a
//!    call against 16 adjacent chunks a call (one `cuMemSetAccess` and one
//!    `cuMemUnmap` over the 16): whether batching a move's calls, or
//!    leaving its unmap for later, would pay;
//! 4. the batch's wall time alone, and with a second thread mapping and
//!    unmapping chunks throughout (a background mover's case): a ratio
//!    above 1 means the updates stall the kernels.
//!
//!     cargo bench --bench busy_vmm

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use common::{gpu_or_skip, ok, Raw, MIB};
use cudarc::driver::{sys, LaunchConfig, PushKernelArg};

/// Each thread rewrites words of the buffer in a grid-stride loop, `reps`
/// times over: memory-bound work whose length is fixed by its arguments.
const PTX: &str = r#"
.version 7.0
.target sm_70
.address_size 64
.visible .entry touch(.param .u64 p_ptr, .param .u64 p_n, .param .u32 p_reps)
{
    .reg .pred %p;
    .reg .b32 %r<12>;
    .reg .b64 %rd<10>;
    ld.param.u64 %rd1, [p_ptr];
    ld.param.u64 %rd2, [p_n];
    ld.param.u32 %r1, [p_reps];
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mov.u32 %r4, %tid.x;
    mul.wide.u32 %rd3, %r2, %r3;
    cvt.u64.u32 %rd4, %r4;
    add.u64 %rd3, %rd3, %rd4;
    mov.u32 %r5, %nctaid.x;
    mul.wide.u32 %rd5, %r5, %r3;
    mov.u32 %r8, 1664525;
    mov.u32 %r9, 1013904223;
    mov.u32 %r6, 0;
REP:
    setp.ge.u32 %p, %r6, %r1;
    @%p bra DONE;
    mov.u64 %rd6, %rd3;
LOOP:
    setp.ge.u64 %p, %rd6, %rd2;
    @%p bra NEXT;
    shl.b64 %rd7, %rd6, 2;
    add.u64 %rd8, %rd1, %rd7;
    ld.global.u32 %r7, [%rd8];
    mad.lo.u32 %r7, %r7, %r8, %r9;
    st.global.u32 [%rd8], %r7;
    add.u64 %rd6, %rd6, %rd5;
    bra LOOP;
NEXT:
    add.u32 %r6, %r6, 1;
    bra REP;
DONE:
    ret;
}
"#;

const CHUNK: usize = 2 * MIB;
/// Chunks mapped and unmapped per measurement.
const N: usize = 256;
/// The kernels' buffer: 1 GiB, past the L2.
const WORDS: u64 = 256 << 20;
/// Launches in a batch, and passes over the buffer per launch.
const LAUNCHES: usize = 40;
const REPS: u32 = 4;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// One chunk mapped and made accessible at `va`, then unmapped: the
/// microseconds of each half.
fn map_then_unmap(raw: &Raw, va: u64, h: sys::CUmemGenericAllocationHandle) -> (f64, f64) {
    let t = Instant::now();
    raw.map_access(va, CHUNK, h);
    let mapped = t.elapsed().as_secs_f64() * 1e6;
    let t = Instant::now();
    // SAFETY: (va, CHUNK) is exactly the mapping just made, and no kernel
    // uses it (the kernels touch another buffer).
    ok("cuMemUnmap", unsafe { sys::cuMemUnmap(va, CHUNK) });
    (mapped, t.elapsed().as_secs_f64() * 1e6)
}

/// `N` chunks through `map_then_unmap`: median microseconds of each half.
fn medians(raw: &Raw, va: u64, handles: &[sys::CUmemGenericAllocationHandle]) -> (f64, f64) {
    let (m, u): (Vec<f64>, Vec<f64>) = handles
        .iter()
        .enumerate()
        .map(|(i, &h)| map_then_unmap(raw, va + (i * CHUNK) as u64, h))
        .unzip();
    (median(m), median(u))
}

/// The handles mapped `group` at a time at adjacent addresses from `va`:
/// each chunk's `cuMemMap`, then one `cuMemSetAccess` and one `cuMemUnmap`
/// over the group. Median microseconds per chunk of the three phases.
fn phases(va: u64, handles: &[sys::CUmemGenericAllocationHandle], group: usize) -> (f64, f64, f64) {
    // SAFETY: plain C data, then filled in.
    let mut desc: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
    desc.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    desc.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    let (mut m, mut a, mut u) = (Vec::new(), Vec::new(), Vec::new());
    let per = |t: Instant| t.elapsed().as_secs_f64() * 1e6 / group as f64;
    for (g, hs) in handles.chunks(group).enumerate() {
        let base = va + (g * group * CHUNK) as u64;
        let bytes = hs.len() * CHUNK;
        let t = Instant::now();
        for (i, &h) in hs.iter().enumerate() {
            // SAFETY: the address lies in our reservation and is unmapped;
            // h is a live handle of CHUNK bytes.
            ok("cuMemMap", unsafe {
                sys::cuMemMap(base + (i * CHUNK) as u64, CHUNK, 0, h, 0)
            });
        }
        m.push(per(t));
        let t = Instant::now();
        // SAFETY: the range is exactly the group's mappings; one descriptor.
        ok("cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(base, bytes, &desc, 1)
        });
        a.push(per(t));
        let t = Instant::now();
        // SAFETY: the range is exactly the group's adjacent whole mappings,
        // which no kernel uses (the kernels touch another buffer).
        ok("cuMemUnmap", unsafe { sys::cuMemUnmap(base, bytes) });
        u.push(per(t));
    }
    (median(m), median(a), median(u))
}

fn main() {
    let Some(backend) = gpu_or_skip("busy_vmm") else {
        return;
    };
    let raw = Raw::new(backend.clone());
    let ctx = backend.context().clone();
    let module = ctx
        .load_module(cudarc::nvrtc::Ptx::from_src(PTX))
        .expect("loading the PTX module");
    let touch = module.load_function("touch").unwrap();
    let stream = ctx.new_stream().unwrap();
    let buf = raw.alloc(WORDS as usize * 4);
    let cfg = LaunchConfig {
        grid_dim: (132 * 8, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let batch = || {
        for _ in 0..LAUNCHES {
            let mut l = stream.launch_builder(&touch);
            l.arg(&buf).arg(&WORDS).arg(&REPS);
            // SAFETY: the kernel reads and writes WORDS u32s from `buf`,
            // which cuMemAlloc made that large; argument types match the PTX.
            unsafe { l.launch(cfg) }.expect("touch launch");
        }
    };
    let va = raw.reserve(N * CHUNK);
    let handles: Vec<_> = (0..N).map(|_| raw.create(CHUNK)).collect();
    // Warm-up: the module, the first launches, the first mappings.
    batch();
    stream.synchronize().unwrap();
    medians(&raw, va, &handles);

    println!("busy_vmm: 2 MiB chunks, {N} each; medians in us (lower is better)");
    let (m, u) = medians(&raw, va, &handles);
    println!("busy_vmm idle                          map+access {m:8.1}  unmap {u:8.1}");
    batch();
    let (m, u) = medians(&raw, va, &handles);
    let left = Instant::now();
    stream.synchronize().unwrap();
    println!(
        "busy_vmm kernels in flight, same thread map+access {m:8.1}  unmap {u:8.1}  (batch still ran {:.1} ms after)",
        left.elapsed().as_secs_f64() * 1e3
    );

    for group in [1, 16] {
        let (m, a, u) = phases(va, &handles, group);
        println!(
            "busy_vmm idle, {group:2} chunk(s) a call     per chunk: map {m:6.1}  access {a:6.1}  unmap {u:6.1}"
        );
        batch();
        let (m, a, u) = phases(va, &handles, group);
        let left = Instant::now();
        stream.synchronize().unwrap();
        println!(
            "busy_vmm busy, {group:2} chunk(s) a call     per chunk: map {m:6.1}  access {a:6.1}  unmap {u:6.1}  (batch still ran {:.1} ms after)",
            left.elapsed().as_secs_f64() * 1e3
        );
    }

    // The batch alone, then beside a thread mapping and unmapping chunks
    // throughout, three times each, alternating.
    let wall = |with_mover: bool| -> (f64, usize) {
        let stop = Arc::new(AtomicBool::new(false));
        let mover = with_mover.then(|| {
            let (stop, ctx, handles) = (stop.clone(), ctx.clone(), handles.clone());
            let backend = backend.clone();
            std::thread::spawn(move || {
                ctx.bind_to_thread().unwrap();
                let raw = Raw::new(backend);
                let mut n = 0;
                while !stop.load(Ordering::Relaxed) {
                    let i = n % N;
                    map_then_unmap(&raw, va + (i * CHUNK) as u64, handles[i]);
                    n += 1;
                }
                n
            })
        });
        let t = Instant::now();
        batch();
        stream.synchronize().unwrap();
        let ms = t.elapsed().as_secs_f64() * 1e3;
        stop.store(true, Ordering::Relaxed);
        let moves = mover.map_or(0, |m| m.join().unwrap());
        (ms, moves)
    };
    let (mut alone, mut beside) = (Vec::new(), Vec::new());
    let mut moves = 0;
    for _ in 0..3 {
        alone.push(wall(false).0);
        let (ms, n) = wall(true);
        beside.push(ms);
        moves += n;
    }
    let (a, b) = (median(alone), median(beside));
    println!(
        "busy_vmm batch of {LAUNCHES} kernels   alone {a:8.1} ms  beside a mapping thread {b:8.1} ms  ratio {:.3}  ({} chunks mapped and unmapped meanwhile)",
        b / a,
        moves / 3
    );
    for h in handles {
        raw.release(h);
    }
    raw.address_free(va, N * CHUNK);
    raw.free(buf);
}
