//! GPU-only tests: data written by kernels, and the driver's own free-memory
//! figure (cuMemGetInfo) as the leak check.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use rand::{Rng, SeedableRng};
use vmmbuf::{Backend, BufferDesc, CudaBackend, GrowableBuffer, GrowthPolicy};

use crate::common::gpu;

crate::register! {
    gpu: [a_thousand_grows_keep_the_base_and_every_device_written_byte, shrink_trim_and_drop_give_memory_back_to_the_driver, exact_and_fixed_policies_on_the_device, release_waits_for_kernels_still_reading_the_tail, kernels_reading_the_tail_survive_shrink_trim_migrate_and_drop_100_times, sixteen_threads_grow_and_write_their_own_ranges_with_kernels, probe_and_device_count_leave_the_threads_current_context, a_moved_chunk_keeps_its_old_address_for_a_kernel_still_reading_it],
}

/// `fill(ptr, first, n, seed)` writes `pattern(first + i, seed)` to the u32 at
/// `ptr[i]`; `spin_check(ptr, first, n, seed, bad, ns)` lets its last block
/// spin `ns` nanoseconds, then adds 1 to `*bad` per mismatching word.
/// Hand-written PTX: loading it needs the driver only, not NVRTC.
const PTX: &str = r#"
.version 7.0
.target sm_70
.address_size 64

.func (.reg .b32 v) pattern(.reg .b64 idx, .reg .b32 seed)
{
    .reg .b32 %t;
    cvt.u32.u64 v, idx;
    mul.lo.u32 v, v, 0x9E3779B1;
    xor.b32 v, v, seed;
    shr.u32 %t, v, 15;
    xor.b32 v, v, %t;
    ret;
}

.visible .entry fill(.param .u64 p_ptr, .param .u64 p_first, .param .u64 p_n, .param .u32 p_seed)
{
    .reg .pred %p;
    .reg .b32 %r<6>;
    .reg .b64 %rd<8>;
    ld.param.u64 %rd1, [p_ptr];
    ld.param.u64 %rd2, [p_first];
    ld.param.u64 %rd3, [p_n];
    ld.param.u32 %r1, [p_seed];
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mov.u32 %r4, %tid.x;
    mul.wide.u32 %rd4, %r2, %r3;
    cvt.u64.u32 %rd5, %r4;
    add.u64 %rd4, %rd4, %rd5;
    setp.ge.u64 %p, %rd4, %rd3;
    @%p bra DONE;
    add.u64 %rd5, %rd4, %rd2;
    call (%r5), pattern, (%rd5, %r1);
    shl.b64 %rd6, %rd4, 2;
    add.u64 %rd7, %rd1, %rd6;
    st.global.u32 [%rd7], %r5;
DONE:
    ret;
}

.visible .entry spin_check(.param .u64 p_ptr, .param .u64 p_first, .param .u64 p_n, .param .u32 p_seed, .param .u64 p_bad, .param .u64 p_ns)
{
    .reg .pred %p;
    .reg .b32 %r<8>;
    .reg .b64 %rd<12>;
    // Only the last block spins (then reads the buffer's last words), so the
    // kernel stays alive ~p_ns whatever its size.
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %nctaid.x;
    sub.u32 %r3, %r3, 1;
    setp.ne.u32 %p, %r2, %r3;
    @%p bra CHECK;
    ld.param.u64 %rd9, [p_ns];
    mov.u64 %rd10, %globaltimer;
SPIN:
    mov.u64 %rd11, %globaltimer;
    sub.u64 %rd11, %rd11, %rd10;
    setp.lt.u64 %p, %rd11, %rd9;
    @%p bra SPIN;
CHECK:
    ld.param.u64 %rd1, [p_ptr];
    ld.param.u64 %rd2, [p_first];
    ld.param.u64 %rd3, [p_n];
    ld.param.u32 %r1, [p_seed];
    ld.param.u64 %rd8, [p_bad];
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mov.u32 %r4, %tid.x;
    mul.wide.u32 %rd4, %r2, %r3;
    cvt.u64.u32 %rd5, %r4;
    add.u64 %rd4, %rd4, %rd5;
    setp.ge.u64 %p, %rd4, %rd3;
    @%p bra DONE;
    add.u64 %rd5, %rd4, %rd2;
    call (%r5), pattern, (%rd5, %r1);
    shl.b64 %rd6, %rd4, 2;
    add.u64 %rd7, %rd1, %rd6;
    ld.global.u32 %r6, [%rd7];
    setp.eq.u32 %p, %r6, %r5;
    @%p bra DONE;
    atom.global.add.u32 %r7, [%rd8], 1;
DONE:
    ret;
}
"#;

/// Waits for `stream`'s work (panicking with `what` if a kernel there
/// died) and reads the mismatch counter `bad` that a check queued on it
/// filled: 0 when every word read as written.
pub(crate) fn counted(
    stream: &Arc<CudaStream>,
    bad: &cudarc::driver::CudaSlice<u32>,
    what: &str,
) -> u32 {
    stream
        .synchronize()
        .unwrap_or_else(|e| panic!("{what}: a kernel on the stream died: {e:?}"));
    stream.clone_dtoh(bad).unwrap()[0]
}

pub(crate) fn pattern(idx: u64, seed: u32) -> u32 {
    let v = (idx as u32).wrapping_mul(0x9E37_79B1) ^ seed;
    v ^ (v >> 15)
}

pub(crate) struct Kernels {
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) fill: CudaFunction,
    pub(crate) spin_check: CudaFunction,
}

impl Kernels {
    pub(crate) fn load(b: &CudaBackend) -> Self {
        let ctx = b.context();
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(PTX))
            .expect("loading the PTX module");
        Self {
            stream: ctx.default_stream(),
            fill: module.load_function("fill").unwrap(),
            spin_check: module.load_function("spin_check").unwrap(),
        }
    }

    pub(crate) fn cfg(n: u64) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (n.div_ceil(256) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// The device writes words `[first, first + n)` at `ptr`.
    pub(crate) fn fill(&self, ptr: u64, first: u64, n: u64, seed: u32) {
        let mut l = self.stream.launch_builder(&self.fill);
        l.arg(&ptr).arg(&first).arg(&n).arg(&seed);
        // SAFETY: test code; the kernel writes n u32s from ptr, which the
        // caller has mapped read-write; argument types match the PTX.
        unsafe { l.launch(Self::cfg(n)) }.expect("fill launch");
    }

    /// On `stream`: the device writes words `[first, first + n)` at `ptr`.
    pub(crate) fn fill_on(
        &self,
        stream: &Arc<CudaStream>,
        ptr: u64,
        first: u64,
        n: u64,
        seed: u32,
    ) {
        let mut l = stream.launch_builder(&self.fill);
        l.arg(&ptr).arg(&first).arg(&n).arg(&seed);
        // SAFETY: test code; as in `fill`.
        unsafe { l.launch(Self::cfg(n)) }.expect("fill launch");
    }

    /// On the view's stream `stream`: `spin_check` through `view` (its drop
    /// then records the use there): the last block spins `ns` nanoseconds,
    /// all count mismatches of the view's first `n` words into the returned
    /// counter.
    pub(crate) fn spin_check_view(
        &self,
        stream: &Arc<CudaStream>,
        view: vmmbuf::cuda::View<'_, u32>,
        n: u64,
        seed: u32,
        ns: u64,
    ) -> cudarc::driver::CudaSlice<u32> {
        let mut bad = stream.alloc_zeros::<u32>(1).unwrap();
        let zero = 0u64;
        let mut l = stream.launch_builder(&self.spin_check);
        l.arg(&view)
            .arg(&zero)
            .arg(&n)
            .arg(&seed)
            .arg(&mut bad)
            .arg(&ns);
        // SAFETY: test code; reads `n` u32s of the view.
        unsafe { l.launch(Self::cfg(n)) }.expect("spin_check launch");
        bad
    }

    /// The device counts words of `[first, first + n)` at `ptr` that differ.
    pub(crate) fn mismatches(&self, ptr: u64, first: u64, n: u64, seed: u32) -> u32 {
        let bad = self.spin_then_check(&self.stream, ptr, first, n, seed, 0);
        self.stream.clone_dtoh(&bad).unwrap()[0]
    }

    /// On `stream`: its last block spins for `ns` nanoseconds; all count mismatches of words
    /// `[first, first + n)` at `ptr` into the returned counter.
    pub(crate) fn spin_then_check(
        &self,
        stream: &Arc<CudaStream>,
        ptr: u64,
        first: u64,
        n: u64,
        seed: u32,
        ns: u64,
    ) -> cudarc::driver::CudaSlice<u32> {
        let mut bad = stream.alloc_zeros::<u32>(1).unwrap();
        let mut l = stream.launch_builder(&self.spin_check);
        l.arg(&ptr)
            .arg(&first)
            .arg(&n)
            .arg(&seed)
            .arg(&mut bad)
            .arg(&ns);
        // SAFETY: test code; reads n mapped u32s after spinning, adds to one counter.
        unsafe { l.launch(Self::cfg(n)) }.expect("spin_check launch");
        bad
    }
}

fn a_thousand_grows_keep_the_base_and_every_device_written_byte() {
    let backend = gpu();
    let k = Kernels::load(&backend);
    let buf = GrowableBuffer::new(backend.clone(), BufferDesc::new(16 << 30)).unwrap();
    let base = buf.base();
    let seed = 0x5eed_1234;
    let mut rng = rand::rngs::StdRng::seed_from_u64(42);
    let mut words = 0u64;
    for step in 0..1000 {
        let add = rng.gen_range(1..=64 * 1024u64); // up to 256 KiB per step
        buf.grow_to(((words + add) * 4) as usize).unwrap();
        assert_eq!(buf.base(), base, "step {step}: the base moved");
        k.fill(base + words * 4, words, add, seed);
        buf.record_stream(&k.stream).unwrap(); // raw-address work: recorded
        words += add;
        let bad = k.mismatches(base, 0, words, seed);
        assert_eq!(bad, 0, "step {step}: {bad} words differ after growth");
        if step % 250 == 249 {
            // And once in a while, every byte through the host.
            let mut host = vec![0u8; (words * 4) as usize];
            buf.read(0, &mut host).unwrap();
            for (i, w) in host.chunks_exact(4).enumerate() {
                assert_eq!(
                    u32::from_le_bytes(w.try_into().unwrap()),
                    pattern(i as u64, seed),
                    "word {i}"
                );
            }
        }
    }
    let s = buf.stats();
    eprintln!(
        "1000 grows to {} in {} chunks ({} grows mapped)",
        vmmbuf::stats::Bytes(s.in_use_bytes),
        s.chunks,
        s.grows
    );
    assert!(s.chunks < 80, "mappings stay logarithmic: {}", buf.report());
}

fn shrink_trim_and_drop_give_memory_back_to_the_driver() {
    let backend = gpu();
    let k = Kernels::load(&backend);
    let start = backend.mem_info().unwrap().0;
    let mut buf = GrowableBuffer::new(backend.clone(), BufferDesc::new(64 << 30)).unwrap();
    for i in 1..=12 {
        buf.grow_to(i << 27).unwrap(); // 128 MiB steps to 1.5 GiB
    }
    let base = buf.base();
    let words = (buf.len() / 4) as u64;
    k.fill(base, 0, words, 7);
    buf.record_stream(&k.stream).unwrap(); // raw-address work: recorded
    let mapped = buf.capacity();
    let (free_full, _) = backend.mem_info().unwrap();
    assert!(
        start - free_full >= mapped,
        "the driver sees {} used for {mapped} mapped",
        start - free_full
    );

    let keep = 300usize << 20;
    buf.truncate(keep);
    buf.shrink_to_fit().unwrap();
    let (free_shrunk, _) = backend.mem_info().unwrap();
    let largest = buf.report().chunks.iter().map(|c| c.bytes).max().unwrap();
    let held = start - free_shrunk;
    eprintln!(
        "start free {start}, after 1.5 GiB {free_full}, after shrink to 300 MiB {free_shrunk} \
         (capacity {}, largest chunk {largest})",
        buf.capacity()
    );
    assert!(
        held <= keep + largest,
        "after shrink the driver holds {held} bytes for {keep} in use"
    );
    assert_eq!(
        k.mismatches(base, 0, (keep / 4) as u64, 7),
        0,
        "kept bytes intact"
    );

    buf.truncate(0);
    buf.shrink_to_fit().unwrap();
    assert_eq!(buf.capacity(), 0);
    // cudarc's stream-ordered allocations (the kernels' counters) go back to
    // the driver's pool at a synchronisation of their stream, not ours.
    k.stream.synchronize().unwrap();
    let (free_trimmed, _) = backend.mem_info().unwrap();
    assert_eq!(
        free_trimmed, start,
        "after trimming to zero, all memory is back"
    );
    buf.grow_to(1 << 20).unwrap();
    drop(buf);
    assert_eq!(
        backend.mem_info().unwrap().0,
        start,
        "after drop, free memory is back to the start"
    );
    crate::common::assert_holds_nothing(backend.live());
}

fn exact_and_fixed_policies_on_the_device() {
    let backend = gpu();
    let k = Kernels::load(&backend);
    for policy in [
        GrowthPolicy::Exact,
        GrowthPolicy::Fixed {
            chunk_bytes: 6 << 20,
        },
    ] {
        let mut buf =
            GrowableBuffer::new(backend.clone(), BufferDesc::new(1 << 30).growth(policy)).unwrap();
        let mut words = 0u64;
        for add in [1u64, 1 << 18, 777_777, 3, 1 << 20] {
            buf.grow_to(((words + add) * 4) as usize).unwrap();
            k.fill(buf.base() + words * 4, words, add, 99);
            buf.record_stream(&k.stream).unwrap(); // raw-address work: recorded
            words += add;
            assert_eq!(k.mismatches(buf.base(), 0, words, 99), 0, "{policy:?}");
        }
        buf.truncate(1 << 20);
        buf.shrink_to_fit().unwrap();
        assert_eq!(
            k.mismatches(buf.base(), 0, 1 << 18, 99),
            0,
            "{policy:?} after shrink"
        );
    }
}

fn release_waits_for_kernels_still_reading_the_tail() {
    let backend = gpu();
    let k = Kernels::load(&backend);
    let side = backend.context().new_stream().unwrap();
    let mut buf = GrowableBuffer::new(
        backend.clone(),
        BufferDesc::new(8 << 30).growth(GrowthPolicy::Exact),
    )
    .unwrap();
    let (keep, end) = (16usize << 20, 256usize << 20);
    for round in 0..5u32 {
        buf.grow_to(end).unwrap();
        let words = (end / 4) as u64;
        k.fill(buf.base(), 0, words, round);
        buf.record_stream(&k.stream).unwrap(); // raw-address work: recorded
        k.stream.synchronize().unwrap();
        let tail = (keep / 4) as u64;

        // Stream-ordered: the fence is recorded after a kernel that still
        // reads the tail for ~300 ms; shrink_to_after must not unmap yet.
        let bad = k.spin_then_check(
            &side,
            buf.base() + keep as u64,
            tail,
            words - tail,
            round,
            300_000_000,
        );
        let fence = backend.fence(&side).unwrap();
        buf.truncate(keep);
        buf.shrink_to_fit_after(fence).unwrap();
        assert_eq!(buf.len(), keep);
        assert_eq!(
            buf.capacity(),
            end,
            "round {round}: unmapped under a running kernel"
        );
        buf.reclaim().unwrap();
        assert_eq!(
            side.clone_dtoh(&bad).unwrap()[0],
            0,
            "round {round}: the kernel read wrong data"
        );
        buf.reclaim().unwrap();
        assert_eq!(
            buf.capacity(),
            keep,
            "round {round}: released once the fence passed"
        );

        // Blocking: trim under a running kernel waits for it.
        buf.grow_to(end).unwrap();
        k.fill(buf.base() + keep as u64, tail, words - tail, round);
        buf.record_stream(&k.stream).unwrap(); // raw-address work: recorded
        k.stream.synchronize().unwrap();
        let bad = k.spin_then_check(
            &side,
            buf.base() + keep as u64,
            tail,
            words - tail,
            round,
            200_000_000,
        );
        buf.record_stream(&side).unwrap(); // the kernel reaches the buffer by address
        buf.truncate(keep);
        buf.shrink_to_fit().unwrap();
        assert_eq!(
            side.clone_dtoh(&bad).unwrap()[0],
            0,
            "round {round}: trim unmapped under a kernel"
        );
        assert_eq!(
            k.mismatches(buf.base(), 0, tail, round),
            0,
            "the context is still usable"
        );
    }
    drop(buf);
    // (The counters, not cuMemGetInfo: cudarc's stream-ordered allocations on
    // `side` come from a driver pool with its own retention.)
    crate::common::assert_holds_nothing(backend.live());
}

fn kernels_reading_the_tail_survive_shrink_trim_migrate_and_drop_100_times() {
    let backend = gpu();
    let k = Kernels::load(&backend);
    let side = backend.context().new_stream().unwrap();
    let g = 2usize << 20;
    let (keep, end) = (4 * g, 16 * g);
    let (tail, words) = ((keep / 4) as u64, (end / 4) as u64);
    for round in 0..100u32 {
        let mut buf = GrowableBuffer::new(
            backend.clone(),
            BufferDesc::new(64 * g).growth(GrowthPolicy::Exact),
        )
        .unwrap();
        buf.grow_to(end).unwrap();
        k.fill(buf.base(), 0, words, round);
        buf.record_stream(&k.stream).unwrap(); // raw-address work: recorded
        k.stream.synchronize().unwrap();
        // A kernel that spins ~20 ms, then reads the tail.
        let bad = k.spin_then_check(
            &side,
            buf.base() + keep as u64,
            tail,
            words - tail,
            round,
            20_000_000,
        );
        buf.record_stream(&side).unwrap(); // the kernel reaches the buffer by address
        match round % 4 {
            0 => {
                buf.truncate(keep);
                buf.shrink_to_fit().unwrap()
            }
            1 => {
                buf.truncate(keep);
                buf.shrink_to_fit().unwrap();
            }
            2 => {
                buf.migrate(keep..end, vmmbuf::Location::Host).unwrap();
            }
            _ => drop(buf),
        }
        assert_eq!(
            side.clone_dtoh(&bad).unwrap()[0],
            0,
            "round {round}: the kernel read wrong data"
        );
    }
    // The context is still usable.
    let buf = GrowableBuffer::new(backend.clone(), BufferDesc::new(g)).unwrap();
    buf.grow_to(g).unwrap();
    k.fill(buf.base(), 0, (g / 4) as u64, 1);
    buf.record_stream(&k.stream).unwrap(); // raw-address work: recorded
    assert_eq!(k.mismatches(buf.base(), 0, (g / 4) as u64, 1), 0);
}

fn sixteen_threads_grow_and_write_their_own_ranges_with_kernels() {
    let backend = gpu();
    let k = Kernels::load(&backend);
    let buf = GrowableBuffer::new(backend.clone(), BufferDesc::new(8 << 30)).unwrap();
    let base = buf.base();
    let done = std::sync::atomic::AtomicBool::new(false);
    let claims: Vec<(usize, u64, u32)> = std::thread::scope(|s| {
        let readers: Vec<_> = (0..4)
            .map(|_| {
                let (buf, done) = (&buf, &done);
                s.spawn(move || {
                    let (mut last, mut reads) = (0usize, 0u64);
                    while !done.load(std::sync::atomic::Ordering::Relaxed) {
                        assert_eq!(buf.base(), base, "the base moved under a reader");
                        let len = buf.len();
                        assert!(len >= last, "len went backwards: {last} -> {len}");
                        last = len;
                        reads += 1;
                    }
                    reads
                })
            })
            .collect();
        let growers: Vec<_> = (0..12u32)
            .map(|t| {
                let (buf, k) = (&buf, &k);
                s.spawn(move || {
                    let mut rng = rand::rngs::StdRng::seed_from_u64(t as u64);
                    (0..40)
                        .map(|_| {
                            let n = rng.gen_range(1..=200_000u64);
                            let at = buf.claim(n as usize * 4).unwrap();
                            k.fill(base + at as u64, at as u64 / 4, n, t);
                            buf.record_stream(&k.stream).unwrap(); // raw-address work: recorded
                            (at, n, t)
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let claims = growers
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect();
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        for r in readers {
            assert!(r.join().unwrap() > 0);
        }
        claims
    });
    k.stream.synchronize().unwrap();
    let mut sorted = claims.clone();
    sorted.sort();
    for w in sorted.windows(2) {
        assert!(w[0].0 + w[0].1 as usize * 4 <= w[1].0, "claims overlap");
    }
    for &(at, n, t) in &claims {
        assert_eq!(
            k.mismatches(base + at as u64, at as u64 / 4, n, t),
            0,
            "thread {t}'s range at {at}"
        );
    }
    assert_eq!(claims.len(), 12 * 40, "no growth lost");
}

/// The context current on this thread (null for none).
fn current_context() -> cudarc::driver::sys::CUcontext {
    let mut c = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    let r = unsafe { cudarc::driver::sys::cuCtxGetCurrent(&mut c) };
    assert_eq!(r, cudarc::driver::sys::CUresult::CUDA_SUCCESS);
    c
}

/// `probe` makes every GPU's context on the way and `device_count` none;
/// neither may change the calling thread's current context (PyTorch's
/// current device: a rank of a multi-GPU job that asked vmmbuf for its
/// statistics once found its FSDP tensors on the last GPU). Checked with
/// no context current and with each GPU's current in turn.
fn probe_and_device_count_leave_the_threads_current_context() {
    let g = gpu();
    // SAFETY: null unbinds this thread's context; nothing of this thread
    // uses it until it is bound again below.
    let r = unsafe { cudarc::driver::sys::cuCtxSetCurrent(std::ptr::null_mut()) };
    assert_eq!(r, cudarc::driver::sys::CUresult::CUDA_SUCCESS);
    let p = vmmbuf::cuda::probe().unwrap();
    assert!(current_context().is_null(), "probe left a context current");
    let n = vmmbuf::cuda::device_count().unwrap();
    assert_eq!(n as usize, p.devices.len());
    assert!(
        current_context().is_null(),
        "device_count made a context current"
    );
    for d in 0..n as usize {
        let ctx = cudarc::driver::CudaContext::new(d).unwrap();
        ctx.bind_to_thread().unwrap();
        let mine = current_context();
        assert!(!mine.is_null());
        vmmbuf::cuda::probe().unwrap();
        assert_eq!(
            current_context(),
            mine,
            "device {d}: probe changed the current context"
        );
        vmmbuf::cuda::device_count().unwrap();
        assert_eq!(
            current_context(),
            mine,
            "device {d}: device_count changed it"
        );
    }
    g.context().bind_to_thread().unwrap();
}

/// `ArenaDesc::move_free_chunks` on CUDA: a chunk freed under a kernel that
/// still reads it for ~300 ms moves, with two more freed chunks, to a
/// growth on the same stream. The kernel reads its data to the end through
/// the old address (unmapped early, it would fault), the moved memory takes
/// new data after it, the live allocations keep theirs, no new memory is
/// mapped, and everything goes back at the drop.
fn a_moved_chunk_keeps_its_old_address_for_a_kernel_still_reading_it() {
    let backend = gpu();
    let k = Kernels::load(&backend);
    let s = k.stream.clone();
    let g = 2usize << 20;
    let mut desc = vmmbuf::ArenaDesc::new(1 << 30)
        .max_chunk_bytes(g)
        .move_free_chunks(true);
    desc.release_before_map = false;
    let arena: vmmbuf::Arena<CudaBackend, Arc<CudaStream>> =
        vmmbuf::Arena::new(backend.clone(), desc).unwrap();
    let words = (g / 4) as u64;
    let (mut live, mut freed) = (Vec::new(), Vec::new());
    for i in 0..8u32 {
        let a = arena.alloc(g, &s).unwrap();
        k.fill_on(&s, a.address(), 0, words, i);
        if i % 2 == 0 {
            freed.push((a, i));
        } else {
            live.push((a, i));
        }
    }
    let bad = k.spin_then_check(&s, freed[0].0.address(), 0, words, freed[0].1, 300_000_000);
    drop(freed);
    let before = arena.stats().reserved_bytes.current;
    let big = arena.alloc(3 * g, &s).unwrap();
    let st = arena.stats();
    assert_eq!(
        st.num_chunks_moved, 3,
        "three of the four freed chunks moved"
    );
    assert_eq!(st.reserved_bytes.current, before, "no new memory");
    k.fill_on(&s, big.address(), 0, 3 * words, 77);
    // Their mark has no cover yet: the old addresses stay.
    arena.release_cached().unwrap();
    assert_eq!(
        s.clone_dtoh(&bad).unwrap()[0],
        0,
        "the kernel read its data through the old address"
    );
    assert_eq!(
        k.mismatches(big.address(), 0, 3 * words, 77),
        0,
        "the moved memory"
    );
    for (a, seed) in &live {
        assert_eq!(
            k.mismatches(a.address(), 0, words, *seed),
            0,
            "a live allocation"
        );
    }
    assert_eq!(
        backend.live().mapped_bytes,
        arena.stats().reserved_bytes.current + 3 * g,
        "the old addresses are mapped until their mark passes"
    );
    // A call on the stream records the cover (this one takes the fourth
    // freed chunk: no growth, no move); once it has passed, a release
    // unmaps the old addresses (no device synchronisation).
    drop(arena.alloc(g, &s).unwrap());
    assert_eq!(arena.stats().num_chunks_moved, 3);
    s.synchronize().unwrap();
    arena.release_cached().unwrap();
    assert_eq!(
        backend.live().mapped_bytes,
        arena.stats().reserved_bytes.current,
        "the old addresses went"
    );
    drop((big, live));
    drop(arena);
    crate::common::assert_holds_nothing(backend.live());
}
