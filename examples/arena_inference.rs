//! A toy inference loop on an `Arena`: every tensor (weights, activations,
//! KV-cache pages) is an allocation. Sequences start and finish at random;
//! each step embeds one token per live sequence, projects it with two
//! matrix-vector kernels (NVRTC) and appends the key to the sequence's KV
//! cache, one 16-token page at a time. When a sequence finishes, its cache
//! is checked against a CPU reference and its pages are freed (stream
//! ordered). Prints the arena's statistics table at the end.
//!
//!     cargo run --release --example arena_inference
//!
//! Needs a GPU and NVRTC; without them it says so and exits 0.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use rand::{Rng, SeedableRng};
use vmmbuf::{cuda::CudaAllocation, Arena, ArenaDesc, Backend, CudaBackend};

const D: usize = 256; // model width
const VOCAB: usize = 1024;
const PAGE_TOKENS: usize = 16;

const SRC: &str = r#"
extern "C" __global__ void embed(const float* table, int token, float* out, int d) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < d) out[i] = table[token * d + i];
}
extern "C" __global__ void matvec(const float* w, const float* x, float* y, int d) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r < d) {
        float s = 0.0f;
        for (int j = 0; j < d; j++) s += w[r * d + j] * x[j];
        y[r] = s;
    }
}
extern "C" __global__ void store_row(const float* src, float* page, int slot, int d) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < d) page[slot * d + i] = tanhf(src[i]);
}
"#;

struct Kernels {
    embed: CudaFunction,
    matvec: CudaFunction,
    store_row: CudaFunction,
}

struct Sequence {
    tokens: Vec<usize>,
    pages: Vec<CudaAllocation>,
    end: usize,
}

fn cfg() -> LaunchConfig {
    LaunchConfig {
        grid_dim: (D.div_ceil(128) as u32, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let backend = match CudaBackend::new(0) {
        Ok(b) => b,
        Err(e) => {
            println!("arena_inference: needs a GPU, none usable here ({e}); nothing to do");
            return Ok(());
        }
    };
    let ptx = match cudarc::nvrtc::compile_ptx(SRC) {
        Ok(p) => p,
        Err(e) => {
            println!("arena_inference: NVRTC is not usable here ({e}); nothing to do");
            return Ok(());
        }
    };
    let ctx = backend.context().clone();
    let module = ctx.load_module(ptx)?;
    let k = Kernels {
        embed: module.load_function("embed")?,
        matvec: module.load_function("matvec")?,
        store_row: module.load_function("store_row")?,
    };
    let stream: Arc<CudaStream> = ctx.new_stream()?;
    let arena: Arena<CudaBackend, Arc<CudaStream>> =
        Arena::new(backend.clone(), ArenaDesc::new(64 << 30))?;

    // Weights, from the arena like everything else.
    let mut rng = rand::rngs::StdRng::seed_from_u64(42);
    let table_h: Vec<f32> = (0..VOCAB * D).map(|_| rng.gen_range(-1.0..1.0)).collect();
    let wq_h: Vec<f32> = (0..D * D).map(|_| rng.gen_range(-0.1..0.1)).collect();
    let wk_h: Vec<f32> = (0..D * D).map(|_| rng.gen_range(-0.1..0.1)).collect();
    let mut table = arena.alloc(VOCAB * D * 4, &stream)?;
    let mut wq = arena.alloc(D * D * 4, &stream)?;
    let mut wk = arena.alloc(D * D * 4, &stream)?;
    stream.memcpy_htod(&table_h, &mut table.view_mut::<f32>(&stream)?)?;
    stream.memcpy_htod(&wq_h, &mut wq.view_mut::<f32>(&stream)?)?;
    stream.memcpy_htod(&wk_h, &mut wk.view_mut::<f32>(&stream)?)?;

    let mut live: Vec<Sequence> = Vec::new();
    let (mut finished, mut checked_rows) = (0usize, 0usize);
    let steps = 400;
    let mut syncs_after_warmup = None;
    for step in 0..steps {
        if step == 50 {
            syncs_after_warmup = Some(backend.live().device_syncs);
        }
        // Sequences start.
        while live.len() < 24 && rng.gen_bool(0.3) {
            live.push(Sequence {
                tokens: Vec::new(),
                pages: Vec::new(),
                end: rng.gen_range(8..120),
            });
        }
        for seq in &mut live {
            let token = rng.gen_range(0..VOCAB);
            let slot = seq.tokens.len() % PAGE_TOKENS;
            if slot == 0 {
                seq.pages.push(arena.alloc(PAGE_TOKENS * D * 4, &stream)?);
            }
            seq.tokens.push(token);
            // Activations: allocated per step, freed (stream ordered) at its end.
            let mut hidden = arena.alloc(D * 4, &stream)?;
            let mut q = arena.alloc(D * 4, &stream)?;
            let mut key = arena.alloc(D * 4, &stream)?;
            let (d, t) = (D as i32, token as i32);
            {
                let tv = table.view::<f32>(&stream)?;
                let mut hv = hidden.view_mut::<f32>(&stream)?;
                let mut l = stream.launch_builder(&k.embed);
                l.arg(&tv).arg(&t).arg(&mut hv).arg(&d);
                // SAFETY: reads row `t` of the table, writes D floats.
                unsafe { l.launch(cfg()) }?;
            }
            for (w, out) in [(&wq, &mut q), (&wk, &mut key)] {
                let (wv, hv) = (w.view::<f32>(&stream)?, hidden.view::<f32>(&stream)?);
                let mut ov = out.view_mut::<f32>(&stream)?;
                let mut l = stream.launch_builder(&k.matvec);
                l.arg(&wv).arg(&hv).arg(&mut ov).arg(&d);
                // SAFETY: a D x D matrix times D floats into D floats.
                unsafe { l.launch(cfg()) }?;
            }
            {
                let kv = key.view::<f32>(&stream)?;
                let page = seq.pages.last_mut().expect("a page was just pushed");
                let mut pv = page.view_mut::<f32>(&stream)?;
                let s = slot as i32;
                let mut l = stream.launch_builder(&k.store_row);
                l.arg(&kv).arg(&mut pv).arg(&s).arg(&d);
                // SAFETY: writes row `slot` (< PAGE_TOKENS) of the page.
                unsafe { l.launch(cfg()) }?;
            }
        }
        // Sequences finish: check their cache against the CPU, free it.
        let (done, rest): (Vec<_>, Vec<_>) = live.drain(..).partition(|s| s.tokens.len() >= s.end);
        live = rest;
        for seq in done {
            for (p, page) in seq.pages.iter().enumerate() {
                let got = stream.clone_dtoh(&page.view::<f32>(&stream)?)?;
                for slot in 0..PAGE_TOKENS {
                    let Some(&token) = seq.tokens.get(p * PAGE_TOKENS + slot) else {
                        break;
                    };
                    let x = &table_h[token * D..(token + 1) * D];
                    for r in 0..D {
                        let want = (0..D)
                            .map(|j| wk_h[r * D + j] as f64 * x[j] as f64)
                            .sum::<f64>()
                            .tanh();
                        let have = got[slot * D + r] as f64;
                        if (have - want).abs() > 1e-4 {
                            return Err(format!(
                                "step {step}: page {p} row {slot} col {r}: {have} != {want}"
                            )
                            .into());
                        }
                    }
                    checked_rows += 1;
                }
            }
            finished += 1;
        }
    }
    stream.synchronize()?;
    let syncs = backend.live().device_syncs - syncs_after_warmup.unwrap_or(0);
    println!(
        "arena_inference: {steps} steps, {finished} sequences finished, {checked_rows} KV rows checked against the CPU: all match; {} live",
        live.len()
    );
    println!("device-wide synchronisations after warm-up: {syncs}");
    print!("{}", arena.stats());
    if syncs != 0 {
        return Err("device-wide synchronisations in the steady state".into());
    }
    Ok(())
}
