//! Builds the one C++ function the plug-in needs: throwing a failed
//! allocation to PyTorch as an exception (src/throw.cpp says why).
fn main() {
    println!("cargo:rerun-if-changed=src/throw.cpp");
    cc::Build::new()
        .cpp(true)
        .file("src/throw.cpp")
        .compile("vmmbuf_throw");
}
