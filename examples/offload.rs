//! Placement and access: offload cold KV-cache blocks to host memory, read
//! them from a kernel at the very same addresses, bring them back. Shows the
//! device memory the driver reports free at each stage.
//!
//!     cargo run --release --example offload

use cudarc::driver::{LaunchConfig, PushKernelArg};
use vmmbuf::{
    migration::MigrationPlan, stats::Bytes, BufferDesc, CudaBackend, GrowableBuffer, GrowthPolicy,
    Location,
};

const SRC: &str = r#"
__device__ unsigned int value(unsigned long long i) { unsigned int v = (unsigned int)i * 2246822519u; return v ^ (v >> 13); }
extern "C" __global__ void fill(unsigned int* p, unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n; i += (unsigned long long)gridDim.x * blockDim.x)
        p[i] = value(i);
}
extern "C" __global__ void sum(const unsigned int* p, unsigned long long n, unsigned long long* out) {
    unsigned long long acc = 0;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n; i += (unsigned long long)gridDim.x * blockDim.x)
        acc += p[i];
    atomicAdd(out, acc);
}
"#;

const BLOCK: usize = 64 << 20;
const BLOCKS: usize = 16;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let backend = match CudaBackend::new(0) {
        Ok(b) => b,
        Err(e) => {
            println!("offload: needs a GPU, none usable here ({e}); nothing to do");
            return Ok(());
        }
    };
    // SAFETY: only asks whether the NVRTC library can be loaded.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err("offload: a GPU is here but NVRTC (libnvrtc) is not loadable".into());
    }
    let ctx = backend.context().clone();
    let stream = ctx.default_stream();
    let module = ctx.load_module(cudarc::nvrtc::compile_ptx(SRC)?)?;
    let (fill, sum) = (module.load_function("fill")?, module.load_function("sum")?);
    let cfg = LaunchConfig {
        grid_dim: (1056, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };

    // One chunk per 64 MiB block, so blocks move one by one.
    let desc = BufferDesc::new(16 << 30).growth(GrowthPolicy::Fixed { chunk_bytes: BLOCK });
    let mut cache = GrowableBuffer::new(backend.clone(), desc)?;
    cache.grow_to(BLOCKS * BLOCK)?;
    let (base, n) = (cache.base(), (BLOCKS * BLOCK / 4) as u64);
    let mut l = stream.launch_builder(&fill);
    l.arg(&base).arg(&n);
    // SAFETY: writes n u32s at base, all mapped read-write.
    unsafe { l.launch(cfg) }?;
    // The kernel reaches the cache by address: record it, so migration waits.
    cache.record_stream(&stream)?;
    let expected = (0..n).fold(0u64, |s, i| {
        let v = (i as u32).wrapping_mul(2_246_822_519);
        s.wrapping_add((v ^ (v >> 13)) as u64)
    });
    let read_all = || -> Result<u64, Box<dyn std::error::Error>> {
        let mut out = stream.alloc_zeros::<u64>(1)?;
        let mut l = stream.launch_builder(&sum);
        l.arg(&base).arg(&n).arg(&mut out);
        // SAFETY: reads n u32s at base, all mapped and readable by the GPU.
        unsafe { l.launch(cfg) }?;
        Ok(stream.clone_dtoh(&out)?[0])
    };
    let free = || backend.mem_info().map(|(f, _)| f);
    println!(
        "{} KV cache in {BLOCKS} blocks at {base:#x}; device free {}",
        Bytes(cache.len()),
        Bytes(free()?)
    );

    // The 12 coldest blocks go to host memory, in one plan.
    let mut plan = MigrationPlan::new();
    plan.add(0..8 * BLOCK, Location::Host)
        .add(8 * BLOCK..12 * BLOCK, Location::Host);
    let rep = cache.execute(&plan)?;
    // The device chunks went to the backend's default pool, which keeps them
    // for a quick restore; hand them to the driver to free the memory.
    if let Some(pool) = cache.pool() {
        println!(
            "the default pool keeps the old device chunks: {}",
            pool.stats()
        );
        pool.trim_at(Location::Device(backend.device()))?;
    }
    println!(
        "offloaded {} blocks ({}): device free {}; {}",
        rep.chunks_moved,
        Bytes(rep.bytes_moved),
        Bytes(free()?),
        cache.stats()
    );
    let got = read_all()?;
    println!("a kernel summed all {BLOCKS} blocks through the same addresses (12 now in host memory): {}", if got == expected { "correct" } else { "WRONG" });
    if got != expected {
        return Err(format!("sum {got}, expected {expected}").into());
    }
    let host = cache.host_slice(0..16)?;
    println!(
        "the CPU reads offloaded block 0 directly: first words {:?}",
        bytemuck_words(host)
    );

    cache.restore()?;
    let got = read_all()?;
    println!(
        "restored: device free {}; sum {}; base {:#x} unchanged: {}",
        Bytes(free()?),
        if got == expected { "correct" } else { "WRONG" },
        cache.base(),
        cache.base() == base
    );
    if got != expected || cache.base() != base {
        return Err("restore changed the data or the address".into());
    }
    print!("{}", cache.report());
    Ok(())
}

fn bytemuck_words(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4)
        .map(|w| u32::from_le_bytes(w.try_into().unwrap()))
        .collect()
}
