//! What this machine supports, before you start: driver version, VMM, host
//! (NUMA) placement, granularity, IPC handle types and the peer-access matrix.
//!
//!     cargo run --example probe

fn main() {
    match vmmbuf::cuda::probe() {
        Ok(p) => print!("{p}"),
        Err(e) => println!("no usable CUDA driver here ({e}); vmmbuf's HostBackend still works"),
    }
}
