//! A KV cache that grows token by token without ever moving.
//!
//! Kernels compiled with NVRTC (through cudarc) append each step's rows; an
//! "attention read" kernel that sums every row in the cache is captured ONCE
//! in a CUDA graph, with the cache's base pointer and a device-side length, and
//! replayed after every growth. Because vmmbuf never moves the base, the
//! captured pointer stays valid while the cache grows from nothing to ~100 MiB
//! in a few dozen mappings; each replay's sum is checked against the host's.
//!
//!     cargo run --release --example kv_cache

use rand::{Rng, SeedableRng};
use vmmbuf::{stats::Bytes, BufferDesc, CudaBackend, GrowableBuffer};

use cudarc::driver::{LaunchConfig, PushKernelArg};

const SRC: &str = r#"
__device__ unsigned int value(unsigned long long g) {
    unsigned int v = (unsigned int)g * 2654435761u;
    return v ^ (v >> 16);
}
// Writes rows [first_row, first_row + rows) at `rows_ptr` (the new rows).
extern "C" __global__ void append_rows(unsigned int* rows_ptr, unsigned long long first_row,
                                       unsigned long long rows, unsigned int row_elems) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i >= rows * row_elems) return;
    rows_ptr[i] = value(first_row * row_elems + i);
}
// Sums every element of the first *len_rows rows of the cache into *out.
extern "C" __global__ void attend(const unsigned int* kv, const unsigned long long* len_rows,
                                  unsigned int row_elems, unsigned long long* out) {
    unsigned long long n = *len_rows * row_elems, acc = 0;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        acc += kv[i];
    atomicAdd(out, acc);
}
"#;

fn value(g: u64) -> u64 {
    let v = (g as u32).wrapping_mul(2_654_435_761);
    (v ^ (v >> 16)) as u64
}

const ROW_ELEMS: u32 = 4096; // one token's K and V for a few heads, as u32
const ROW_BYTES: usize = ROW_ELEMS as usize * 4;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let backend = match CudaBackend::new(0) {
        Ok(b) => b,
        Err(e) => {
            println!("kv_cache: needs a GPU, none usable here ({e}); nothing to do");
            return Ok(());
        }
    };
    // SAFETY: only asks whether the NVRTC library can be loaded.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err("kv_cache: a GPU is here but NVRTC (libnvrtc) is not loadable".into());
    }
    let ctx = backend.context().clone();
    // One stream, captured into a graph: cudarc's cross-stream event tracking
    // is not needed and cannot join a capture.
    // SAFETY: all work below is on `stream` (and synchronous copies).
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream()?;
    let module = ctx.load_module(cudarc::nvrtc::compile_ptx(SRC)?)?;
    let append = module.load_function("append_rows")?;
    let attend = module.load_function("attend")?;

    let mut cache = GrowableBuffer::new(backend.clone(), BufferDesc::new(64 << 30))?;
    let base = cache.base();
    let mut len_rows = stream.alloc_zeros::<u64>(1)?;
    let mut out = stream.alloc_zeros::<u64>(1)?;

    // Capture the attention read once: base pointer and length pointer are
    // baked into the graph.
    stream.begin_capture(
        cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
    )?;
    stream.memset_zeros(&mut out)?;
    let cfg = LaunchConfig {
        grid_dim: (528, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut l = stream.launch_builder(&attend);
    l.arg(&base).arg(&len_rows).arg(&ROW_ELEMS).arg(&mut out);
    // SAFETY: argument types match the kernel; the kernel reads *len_rows rows
    // from `base`, and every replay below runs after those rows are mapped.
    unsafe { l.launch(cfg) }?;
    let graph = stream
        .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH)?
        .ok_or("capture produced no graph")?;

    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let (mut rows, mut expected) = (0u64, 0u64);
    let steps = 200;
    for step in 0..steps {
        let add = rng.gen_range(1..=64u64);
        let at = cache.claim(add as usize * ROW_BYTES)?;
        assert_eq!(at, rows as usize * ROW_BYTES, "rows are contiguous");
        {
            let mut new_rows =
                cache.view_mut::<u32>(&stream, at, add as usize * ROW_ELEMS as usize)?;
            let n = add * ROW_ELEMS as u64;
            let mut l = stream.launch_builder(&append);
            l.arg(&mut new_rows).arg(&rows).arg(&add).arg(&ROW_ELEMS);
            let cfg = LaunchConfig {
                grid_dim: (n.div_ceil(256) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: writes exactly the `n` elements of `new_rows`.
            unsafe { l.launch(cfg) }?;
        }
        expected = (rows * ROW_ELEMS as u64..(rows + add) * ROW_ELEMS as u64)
            .fold(expected, |s, g| s.wrapping_add(value(g)));
        rows += add;
        stream.memcpy_htod(&[rows], &mut len_rows)?;
        graph.launch()?;
        // The graph reads the cache by address: record its use on the stream.
        cache.record_stream(&stream)?;
        let got = stream.clone_dtoh(&out)?[0];
        if got != expected {
            return Err(format!(
                "step {step}: the captured graph summed {got}, expected {expected}"
            )
            .into());
        }
        if cache.base() != base {
            return Err("the base moved".into());
        }
        if step % 50 == 49 {
            println!(
                "step {:>3}: {:>5} tokens, {:>9} in {:>2} chunks; graph replay sum checked, base {base:#x} unchanged",
                step + 1,
                rows,
                Bytes(cache.len()).to_string(),
                cache.chunk_count()
            );
        }
    }
    println!(
        "kv_cache: {steps} growth steps, one graph captured before the first and replayed after each: all sums match; {}",
        cache.stats()
    );
    drop(cache); // waits for the recorded uses, not the device
    println!(
        "device-wide synchronisations: {}",
        vmmbuf::Backend::live(&*backend).device_syncs
    );
    Ok(())
}
