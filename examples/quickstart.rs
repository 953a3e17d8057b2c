//! vmmbuf in one page: reserve once, grow in steps (writing and checking data
//! each time), show that the base never moved, shrink, print the stats.
//!
//! Runs on GPU 0 through CUDA VMM when a usable GPU is there, and otherwise on
//! the host backend (the OS's own virtual memory), saying which.
//!
//!     cargo run --example quickstart

use std::sync::Arc;

use vmmbuf::{Backend, BufferDesc, Bytes, CudaBackend, GrowableBuffer, HostBackend};

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

/// Deterministic, varied bytes: never all zeros.
fn pattern(offset: usize, len: usize) -> Vec<u8> {
    (offset..offset + len)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect()
}

fn run<B: Backend>(backend: Arc<B>) -> Result<(), Box<dyn std::error::Error>> {
    // 64 GiB of address space: costs nothing until it is mapped.
    let mut buf = GrowableBuffer::new(backend, BufferDesc::new(64 << 30))?;
    let base = buf.base();
    println!("reserved {} at {base:#x}", Bytes(buf.reserved()));

    for step_mib in [1usize, 7, 40, 200, 500] {
        let at = buf.grow_by(step_mib << 20)?;
        buf.write(at, &pattern(at, step_mib << 20))?;
        // Every byte so far is still there, at the same address.
        let mut all = vec![0u8; buf.len()];
        buf.read(0, &mut all)?;
        if all != pattern(0, buf.len()) {
            return Err("data changed while growing".into());
        }
        if buf.base() != base {
            return Err("the base moved".into());
        }
        println!(
            "grew by {:>9} -> len {:>9}, mapped {:>9} in {:>2} chunks, base {:#x} (unchanged), data checked",
            Bytes(step_mib << 20).to_string(),
            Bytes(buf.len()).to_string(),
            Bytes(buf.capacity()).to_string(),
            buf.chunk_count(),
            buf.base()
        );
    }

    buf.truncate(16 << 20);

    buf.shrink_to_fit()?;
    let mut head = vec![0u8; 16 << 20];
    buf.read(0, &mut head)?;
    if head != pattern(0, 16 << 20) {
        return Err("data changed while shrinking".into());
    }
    println!(
        "shrank to {}: mapped {} in {} chunks, data checked",
        Bytes(buf.len()),
        Bytes(buf.capacity()),
        buf.chunk_count()
    );
    println!("stats: {}", buf.stats());
    print!("{}", buf.report());
    Ok(())
}
