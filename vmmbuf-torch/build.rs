//! Builds the one C++ function the plug-in needs on Linux, where PyTorch
//! loads it: throwing a failed allocation to PyTorch as an exception
//! (src/throw.cpp says why). Elsewhere the plug-in builds without it.
fn main() {
    println!("cargo:rerun-if-changed=src/throw.cpp");
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        cc::Build::new()
            .cpp(true)
            .file("src/throw.cpp")
            .compile("vmmbuf_throw");
    }
}
