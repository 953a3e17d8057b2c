//! Builds, on Linux where PyTorch loads the plug-in, the two small native
//! pieces beside the Rust code:
//! - the one C++ function the plug-in needs: throwing a failed allocation to
//!   PyTorch as an exception (src/throw.cpp says why);
//! - the preload library of torch_memory_saver's preload mode (src/preload.c
//!   says what it does), a shared library of its own that the plug-in
//!   carries as bytes (`preload_library`) and writes out for LD_PRELOAD.
//!
//! Elsewhere the plug-in builds without them.
use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=src/throw.cpp");
    println!("cargo:rerun-if-changed=src/preload.c");
    println!("cargo:rerun-if-changed=include/vmmbuf.h");
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() != Ok("linux") {
        return;
    }
    cc::Build::new()
        .cpp(true)
        .file("src/throw.cpp")
        .compile("vmmbuf_throw");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let lib = out.join("libvmmbuf_preload.so");
    let cc = cc::Build::new().get_compiler();
    let status = Command::new(cc.path())
        .args([
            "-shared",
            "-fPIC",
            "-O2",
            "-fvisibility=hidden",
            "-Iinclude",
            "-o",
        ])
        .arg(&lib)
        .arg("src/preload.c")
        .arg("-ldl")
        .status()
        .expect("running the C compiler for src/preload.c");
    assert!(status.success(), "building src/preload.c failed: {status}");
}
