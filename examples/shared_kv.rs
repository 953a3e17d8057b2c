//! A KV cache shared by two processes while it grows: this process (the
//! exporter) grows a shareable buffer token by token and publishes each
//! growth; a second process (this program again, started with `--importer`)
//! imports the buffer at an address of its own, follows every generation and
//! checks every token with a kernel (or the CPU, without a GPU), answering
//! after each. With `--importer-device N` the importer runs on GPU N (peer
//! access to GPU 0).
//!
//!     cargo run --release --example shared_kv [-- --importer-device 1]

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Arc;

use vmmbuf::{
    ipc::Exporter, ipc::SharedBuffer, stats::Bytes, Access, Backend, BufferDesc, CudaBackend,
    GrowableBuffer, HostBackend,
};

/// Bytes per token (one layer's K and V of a small model, say).
const TOKEN: usize = 64 << 10;
/// Tokens per step, and steps.
const PER_STEP: usize = 48;
const STEPS: usize = 24;

const SRC: &str = r#"
extern "C" __global__ void check(const unsigned int* p, unsigned long long n, unsigned int* bad) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n; i += (unsigned long long)gridDim.x * blockDim.x) {
        unsigned int v = (unsigned int)i * 2654435761u ^ 0x9E3779B9u;
        if (p[i] != v) atomicAdd(bad, 1u);
    }
}
"#;

/// The word the exporter writes at word index `i` (never all zeros).
fn word(i: usize) -> u32 {
    (i as u32).wrapping_mul(2_654_435_761) ^ 0x9E37_79B9
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--importer") {
        return importer(&args[i + 1], &args[i + 2]);
    }
    let device: Option<u32> = args
        .iter()
        .position(|a| a == "--importer-device")
        .map(|i| args[i + 1].parse())
        .transpose()?;
    match CudaBackend::new(0) {
        Ok(cuda) => {
            let spec = format!("cuda:{}", device.unwrap_or(0));
            println!("exporter: CUDA VMM on GPU 0; importer on {spec}");
            exporter(cuda, &spec)
        }
        Err(why) => {
            println!("exporter: host virtual memory (no usable GPU: {why}); importer on the host");
            exporter(HostBackend::new(), "host")
        }
    }
}

fn exporter<B: Backend>(backend: Arc<B>, spec: &str) -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::temp_dir().join(format!("vmmbuf-shared-kv-{}", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path)?;
    let mut child = std::process::Command::new(std::env::current_exe()?)
        .args(["--importer", path.to_str().ok_or("temp path")?, spec])
        .spawn()?;
    let (socket, _) = listener.accept()?;
    let _ = std::fs::remove_file(&path);
    let mut answers = BufReader::new(socket.try_clone()?);
    let mut ex = Exporter::new(socket);
    let cache = GrowableBuffer::new(backend.clone(), BufferDesc::new(8 << 30).shareable(true))?;
    let mut cache = cache;
    let base = cache.base();
    for step in 1..=STEPS {
        let (old, new) = (cache.len(), step * PER_STEP * TOKEN);
        cache.grow_to(new)?;
        let words: Vec<u8> = (old / 4..new / 4)
            .flat_map(|i| word(i).to_le_bytes())
            .collect();
        cache.write(old, &words)?;
        let generation = cache.publish(&mut ex)?;
        let mut line = String::new();
        answers.read_line(&mut line)?;
        if step == 1 || step % 8 == 0 || !line.starts_with("ok") {
            println!(
                "exporter: {} tokens ({}, {} chunks), generation {generation}; importer: {}",
                new / TOKEN,
                Bytes(new),
                cache.chunk_count(),
                line.trim()
            );
        }
        if !line.starts_with("ok") {
            let _ = child.wait();
            return Err(format!("the importer found bad tokens: {line}").into());
        }
    }
    // A shrink while the importer still maps everything: the chunks past the
    // cut are released here, and their memory lives on until the importer
    // syncs past them.
    cache.truncate(cache.len() / 2);
    cache.shrink_to_fit()?;
    let generation = cache.publish(&mut ex)?;
    let mut line = String::new();
    answers.read_line(&mut line)?;
    println!(
        "exporter: shrank to {} tokens, generation {generation}; importer: {}",
        cache.len() / TOKEN,
        line.trim()
    );
    assert_eq!(cache.base(), base, "the base never moved");
    // Both ends of our socket closed: the importer's next sync finds us gone.
    drop((ex, answers));
    let status = child.wait()?;
    if !status.success() || !line.starts_with("ok") {
        return Err(format!("the importer failed: {status}, {line}").into());
    }
    println!("exporter: the importer checked every token of every generation");
    Ok(())
}

fn importer(path: &str, spec: &str) -> Result<(), Box<dyn std::error::Error>> {
    let socket = UnixStream::connect(path)?;
    let mut answer = socket.try_clone()?;
    match spec.strip_prefix("cuda:") {
        Some(d) => {
            let backend = CudaBackend::new(d.parse()?)?;
            let ctx = backend.context().clone();
            let stream = ctx.default_stream();
            // SAFETY: only asks whether the NVRTC library can be loaded.
            if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
                return Err("importer: NVRTC (libnvrtc) is not loadable".into());
            }
            let module = ctx.load_module(cudarc::nvrtc::compile_ptx(SRC)?)?;
            let check = module.load_function("check")?;
            follow(backend, socket, &mut answer, spec, |shared| {
                use cudarc::driver::{LaunchConfig, PushKernelArg};
                let mut bad = stream.alloc_zeros::<u32>(1)?;
                let (base, n) = (shared.base(), (shared.len() / 4) as u64);
                let mut l = stream.launch_builder(&check);
                l.arg(&base).arg(&n).arg(&mut bad);
                let cfg = LaunchConfig {
                    grid_dim: (528, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: reads n u32 words at base: the bytes in use, mapped
                // with read access for this device. The copy back below waits
                // for the kernel before the next sync can unmap anything.
                unsafe { l.launch(cfg) }?;
                Ok(stream.clone_dtoh(&bad)?[0] as usize)
            })
        }
        None => follow(
            HostBackend::new(),
            socket,
            &mut answer,
            spec,
            |shared: &mut SharedBuffer<HostBackend>| {
                let mut bytes = vec![0u8; shared.len()];
                shared.read(0, &mut bytes)?;
                Ok(bytes
                    .chunks_exact(4)
                    .enumerate()
                    .filter(|(i, w)| u32::from_le_bytes([w[0], w[1], w[2], w[3]]) != word(*i))
                    .count())
            },
        ),
    }
}

/// Imports, then after every generation counts the bad words with `check`
/// and answers `ok` or `bad N`.
fn follow<B: Backend>(
    backend: Arc<B>,
    socket: UnixStream,
    answer: &mut UnixStream,
    spec: &str,
    mut check: impl FnMut(&mut SharedBuffer<B>) -> Result<usize, Box<dyn std::error::Error>>,
) -> Result<(), Box<dyn std::error::Error>> {
    let mut shared = SharedBuffer::import(backend, socket, Access::Read)?;
    let mut generations = 0;
    loop {
        let bad = check(&mut shared)?;
        generations += 1;
        if bad == 0 {
            writeln!(
                answer,
                "ok: generation {}, {} tokens checked on {spec}",
                shared.generation(),
                shared.len() / TOKEN
            )?;
        } else {
            writeln!(
                answer,
                "bad {bad} words in generation {}",
                shared.generation()
            )?;
            return Err("bad tokens".into());
        }
        match shared.sync() {
            Ok(_) => {}
            Err(vmmbuf::Error::PeerGone { .. }) => break,
            Err(e) => return Err(e.into()),
        }
    }
    println!(
        "importer ({spec}): followed {generations} generations at base {:#x}; the exporter is gone",
        shared.base()
    );
    Ok(())
}
