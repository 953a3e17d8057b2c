//! A two-layer MLP forward pass whose every tensor is an owned
//! [`CudaTensor`] from one arena: what a Rust engine on cudarc stores where
//! it would store `CudaSlice`s. The parameters live in one tensor, split into
//! weights and biases with `split_at_mut` (views a kernel takes as
//! arguments); activations are tensors of their own, freed in stream order
//! as they drop. The output is checked against the same model on the CPU.
//!
//! Without a GPU it runs the host variant: the same model, its parameters
//! and activations stored in allocations of a host-backend arena, computed
//! on the CPU and checked the same way.
//!
//! `cargo run --release --example mlp`

use std::sync::Arc;

use cudarc::driver::{LaunchConfig, PushKernelArg};
use vmmbuf::{cuda::CudaArena, host::HostStream, Arena, ArenaDesc, CudaBackend, HostBackend};

const BATCH: usize = 64;
const D_IN: usize = 256;
const HIDDEN: usize = 512;
const D_OUT: usize = 128;

/// `y[b][n] = act(sum_k x[b][k] * w[k][n] + bias[n])`, one thread per output.
const SRC: &str = r#"
extern "C" __global__ void linear(const float* x, const float* w, const float* bias,
                                  float* y, int batch, int k_dim, int n_dim, int relu) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= batch * n_dim) return;
    int b = i / n_dim, n = i % n_dim;
    float acc = 0.0f;
    for (int k = 0; k < k_dim; ++k) acc += x[b * k_dim + k] * w[k * n_dim + n];
    acc += bias[n];
    y[i] = (relu && acc < 0.0f) ? 0.0f : acc;
}
"#;

/// Deterministic, varied values in about [-0.5, 0.5).
fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect()
}

/// The same layer on the CPU (the reference).
fn linear(x: &[f32], w: &[f32], bias: &[f32], k_dim: usize, n_dim: usize, relu: bool) -> Vec<f32> {
    let batch = x.len() / k_dim;
    let mut y = vec![0f32; batch * n_dim];
    for b in 0..batch {
        for n in 0..n_dim {
            let mut acc = 0f32;
            for k in 0..k_dim {
                acc += x[b * k_dim + k] * w[k * n_dim + n];
            }
            acc += bias[n];
            y[b * n_dim + n] = if relu && acc < 0.0 { 0.0 } else { acc };
        }
    }
    y
}

struct Model {
    x: Vec<f32>,
    w1: Vec<f32>,
    b1: Vec<f32>,
    w2: Vec<f32>,
    b2: Vec<f32>,
}

impl Model {
    fn new() -> Self {
        Self {
            x: values(1, BATCH * D_IN),
            w1: values(2, D_IN * HIDDEN),
            b1: values(3, HIDDEN),
            w2: values(4, HIDDEN * D_OUT),
            b2: values(5, D_OUT),
        }
    }
    fn params(&self) -> Vec<f32> {
        [&self.w1[..], &self.b1, &self.w2, &self.b2].concat()
    }
    fn reference(&self) -> Vec<f32> {
        let h = linear(&self.x, &self.w1, &self.b1, D_IN, HIDDEN, true);
        linear(&h, &self.w2, &self.b2, HIDDEN, D_OUT, false)
    }
}

/// ‖got − want‖ / ‖want‖.
fn relative_error(got: &[f32], want: &[f32]) -> f64 {
    let (mut d, mut n) = (0f64, 0f64);
    for (g, w) in got.iter().zip(want) {
        d += (f64::from(*g) - f64::from(*w)).powi(2);
        n += f64::from(*w).powi(2);
    }
    (d / n).sqrt()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let model = Model::new();
    let want = model.reference();
    let got = match CudaBackend::new(0) {
        Ok(gpu) => {
            println!("backend: CUDA VMM on GPU 0");
            on_the_gpu(&gpu, &model)?
        }
        Err(e) => {
            println!(
                "backend: host virtual memory, model computed on the CPU (no usable GPU: {e})"
            );
            on_the_host(&model)?
        }
    };
    let err = relative_error(&got, &want);
    println!(
        "output {BATCH}x{D_OUT}: relative error {err:.2e} against the CPU reference; first values {:?}",
        &got[..4]
    );
    if err.is_nan() || err > 1e-5 {
        return Err(format!("relative error {err:.2e} is over 1e-5").into());
    }
    println!("mlp: checked");
    Ok(())
}

fn on_the_gpu(
    gpu: &Arc<CudaBackend>,
    model: &Model,
) -> Result<Vec<f32>, Box<dyn std::error::Error>> {
    let ctx = gpu.context();
    let stream = ctx.new_stream()?;
    let module = ctx.load_module(cudarc::nvrtc::compile_ptx(SRC)?)?;
    let kernel = module.load_function("linear")?;
    let arena: CudaArena = Arena::new(gpu.clone(), ArenaDesc::new(16 << 30))?;

    // Owned tensors: every parameter in one, the input in another, both
    // activations in a third (zeroed on the stream).
    let mut params = arena.alloc_tensor::<f32>(model.params().len(), &stream)?;
    stream.memcpy_htod(&model.params(), &mut params)?;
    let mut x = arena.alloc_tensor::<f32>(BATCH * D_IN, &stream)?;
    stream.memcpy_htod(&model.x, &mut x)?;
    let mut acts = arena.alloc_zeros::<f32>(BATCH * (HIDDEN + D_OUT), &stream)?;
    println!(
        "tensors: params {} floats at {:#x}, x {}, activations {} (one arena at {:#x})",
        params.len(),
        params.device_address(),
        x.len(),
        acts.len(),
        arena.base()
    );
    let (batch, d_in, hidden, d_out) = (BATCH as i32, D_IN as i32, HIDDEN as i32, D_OUT as i32);
    let out = {
        // Weights and biases: read-only views of parts of `params`; the two
        // activations: the halves of `acts`, split mutably.
        let (o1, o2, o3) = (
            D_IN * HIDDEN,
            D_IN * HIDDEN + HIDDEN,
            D_IN * HIDDEN + HIDDEN + HIDDEN * D_OUT,
        );
        let (w1, b1) = (params.slice(..o1)?, params.slice(o1..o2)?);
        let (w2, b2) = (params.slice(o2..o3)?, params.slice(o3..)?);
        let (mut h, mut y) = acts.split_at_mut(BATCH * HIDDEN)?;
        let mut l = stream.launch_builder(&kernel);
        l.arg(&x).arg(&w1).arg(&b1).arg(&mut h);
        l.arg(&batch).arg(&d_in).arg(&hidden).arg(&1i32);
        // SAFETY: reads BATCH*D_IN of x, D_IN*HIDDEN of w1, HIDDEN of b1 and
        // writes BATCH*HIDDEN of h: the lengths of the tensor and views.
        unsafe { l.launch(LaunchConfig::for_num_elems((BATCH * HIDDEN) as u32)) }?;
        let mut l = stream.launch_builder(&kernel);
        l.arg(&h).arg(&w2).arg(&b2).arg(&mut y);
        l.arg(&batch).arg(&hidden).arg(&d_out).arg(&0i32);
        // SAFETY: as above, for the second layer.
        unsafe { l.launch(LaunchConfig::for_num_elems((BATCH * D_OUT) as u32)) }?;
        stream.clone_dtoh(&y)?
    };
    // The input is done with: freed in stream order (reusable by this
    // stream at once, by others once the kernels have finished).
    drop(x);
    let st = arena.stats();
    println!(
        "arena: allocated {} B now (peak {} B), reserved {} B, device syncs {}",
        st.allocated_bytes.current,
        st.allocated_bytes.peak,
        st.reserved_bytes.current,
        st.num_device_syncs
    );
    Ok(out)
}

fn on_the_host(model: &Model) -> Result<Vec<f32>, Box<dyn std::error::Error>> {
    let backend = HostBackend::new();
    let arena: Arena<HostBackend, HostStream> = Arena::new(backend, ArenaDesc::new(16 << 30))?;
    let s = HostStream(0);
    let store = |v: &[f32]| -> Result<vmmbuf::Allocation<HostBackend, HostStream>, vmmbuf::Error> {
        let mut a = arena.alloc(v.len() * 4, &s)?;
        a.write(0, bytemuck::cast_slice(v))?;
        Ok(a)
    };
    let load =
        |a: &vmmbuf::Allocation<HostBackend, HostStream>| -> Result<Vec<f32>, vmmbuf::Error> {
            let mut v = vec![0f32; a.len() / 4];
            a.read(0, bytemuck::cast_slice_mut(&mut v))?;
            Ok(v)
        };
    let params = store(&model.params())?;
    let x = store(&model.x)?;
    let p = load(&params)?;
    let (w1, rest) = p.split_at(D_IN * HIDDEN);
    let (b1, rest) = rest.split_at(HIDDEN);
    let (w2, b2) = rest.split_at(HIDDEN * D_OUT);
    let h = store(&linear(&load(&x)?, w1, b1, D_IN, HIDDEN, true))?;
    drop(x);
    let y = store(&linear(&load(&h)?, w2, b2, HIDDEN, D_OUT, false))?;
    drop(h);
    let st = arena.stats();
    println!(
        "arena at {:#x}: allocated {} B now (peak {} B)",
        arena.base(),
        st.allocated_bytes.current,
        st.allocated_bytes.peak
    );
    Ok(load(&y)?)
}
