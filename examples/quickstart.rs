//! vmmbuf in one page: reserve once, grow in steps (writing and checking data
//! each time), show that the base never moved, shrink, print the stats.
//!
//! Runs on GPU 0 through CUDA VMM when a usable GPU is there, and otherwise on
//! the host backend (the OS's own virtual memory), saying which.
//!
//!     cargo run --example quickstart

use std::sync::Arc;

use vmmbuf::{stats::Bytes, Backend, BufferDesc, CudaBackend, GrowableBuffer, HostBackend};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    match CudaBackend::new(0) {
        Ok(cuda) => {
            println!(
                "backend: CUDA VMM on GPU 0 (granularity {})",
                Bytes(cuda.granularity(cuda.home())?)
            );
            run(cuda)
        }
        Err(why) => {
            println!("backend: host virtual memory (no usable GPU: {why})");
            run(HostBackend::new())
        }
    }
}

/// Deterministic, varied bytes (never all zeros) for `[offset, offset +
/// len)`, both multiples of 8: made a word at a time, so that even a debug
/// build checks 748 MiB in seconds.
fn pattern(offset: usize, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    for (k, w) in v.chunks_exact_mut(8).enumerate() {
        let i = (offset / 8 + k) as u64;
        let x = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (i >> 7) ^ 0x5A5A;
        w.copy_from_slice(&x.to_le_bytes());
    }
    v
}

/// `[from, from + len)` in windows of at most 16 MiB: `(offset, bytes)`.
fn windows(from: usize, len: usize) -> impl Iterator<Item = (usize, usize)> {
    const W: usize = 16 << 20;
    (from..from + len)
        .step_by(W)
        .map(move |o| (o, W.min(from + len - o)))
}

/// Whether the first `len` bytes of `buf` hold the pattern, read back a
/// window at a time.
fn intact<B: Backend>(buf: &GrowableBuffer<B>, len: usize) -> Result<bool, vmmbuf::Error> {
    let mut got = vec![0u8; 16 << 20];
    for (o, n) in windows(0, len) {
        buf.read(o, &mut got[..n])?;
        if got[..n] != pattern(o, n)[..] {
            return Ok(false);
        }
    }
    Ok(true)
}

fn run<B: Backend>(backend: Arc<B>) -> Result<(), Box<dyn std::error::Error>> {
    // 64 GiB of address space: costs nothing until it is mapped.
    let mut buf = GrowableBuffer::new(backend, BufferDesc::new(64 << 30))?;
    let base = buf.base();
    println!("reserved {} at {base:#x}", Bytes(buf.reserved()));

    for step_mib in [1usize, 7, 40, 200, 500] {
        let at = buf.grow_by(step_mib << 20)?;
        for (o, n) in windows(at, step_mib << 20) {
            buf.write(o, &pattern(o, n))?;
        }
        // Every byte so far is still there, at the same address.
        if !intact(&buf, buf.len())? {
            return Err("data changed while growing".into());
        }
        if buf.base() != base {
            return Err("the base moved".into());
        }
        println!(
            "grew by {:>9} -> len {:>9}, mapped {:>9} in {:>2} chunk{}, base {:#x} (unchanged), data checked",
            Bytes(step_mib << 20).to_string(),
            Bytes(buf.len()).to_string(),
            Bytes(buf.capacity()).to_string(),
            buf.chunk_count(),
            if buf.chunk_count() == 1 { " " } else { "s" },
            buf.base()
        );
    }

    buf.truncate(16 << 20);

    buf.shrink_to_fit()?;
    if !intact(&buf, 16 << 20)? {
        return Err("data changed while shrinking".into());
    }
    println!(
        "shrank to {}: mapped {} in {} chunk{}, data checked",
        Bytes(buf.len()),
        Bytes(buf.capacity()),
        buf.chunk_count(),
        if buf.chunk_count() == 1 { "" } else { "s" }
    );
    // The counters and the chunks, as plain data with a readable Display.
    print!("{}", buf.report());
    Ok(())
}
